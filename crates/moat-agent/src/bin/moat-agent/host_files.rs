//! The host's files in a microVM guest's root: its host name, machine-id,
//! SSH host keys, the CA it trusts, `/etc/environment`. The host never
//! mounts a guest's disk, so it hands these over: in the initramfs at boot,
//! and by `PutFile` while the guest runs. Each is written only if the host
//! changed it since it last wrote it (a hash of each is kept in the guest),
//! so what the guest's user edits survives a reboot until the host has
//! something new to say.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Component, Path};
use std::sync::Mutex;

use moat_agent::protocol::{AgentMsg, HostMsg};

/// Hash and path of every file the host wrote, one per line, in the guest's root.
const WRITTEN: &str = "var/lib/moat/host-files";

/// Largest file the host hands over.
const MAX_FILE: usize = 1 << 20;

/// One writer at a time: the record is read, changed and written whole.
static LOCK: Mutex<()> = Mutex::new(());

/// Serves a connection of `PutFile`s (`first` read already), answering each.
pub fn serve(first: HostMsg, reader: &mut crate::frames::FrameReader, stream: &UnixStream) -> io::Result<()> {
    let mut next = Some(first);
    while let Some(HostMsg::PutFile { path, mode, data }) = next {
        let answer = match put(Path::new("/"), &path, mode, &data) {
            Ok(()) => AgentMsg::Pong,
            Err(e) => AgentMsg::Error(format!("write /{path}: {e}")),
        };
        crate::frames::send(stream, &answer)?;
        next = reader.next()?;
    }
    match next {
        None => Ok(()),
        Some(other) => crate::frames::send(stream, &AgentMsg::Error(format!("unexpected {other:?} among files"))),
    }
}

/// Writes every regular file below `tree` (a mini-root) into `root`.
pub fn put_tree(tree: &Path, root: &Path) {
    let mut dirs = vec![tree.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().filter_map(Result::ok) {
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                dirs.push(path);
                continue;
            }
            let Some(rel) = path.strip_prefix(tree).ok().and_then(Path::to_str) else { continue };
            let written = std::fs::read(&path).and_then(|data| put(root, rel, meta.permissions().mode(), &data));
            if let Err(e) = written {
                eprintln!("moat-agent: write /{rel}: {e}");
            }
        }
    }
}

/// Writes `data` at `rel` below `root` with `mode`, unless the host wrote
/// exactly this there last time.
pub fn put(root: &Path, rel: &str, mode: u32, data: &[u8]) -> io::Result<()> {
    let rel_path = Path::new(rel);
    if !plain(rel) {
        return Err(io::Error::other(format!("{rel:?} is not a plain relative path")));
    }
    if data.len() > MAX_FILE {
        return Err(io::Error::other(format!("{rel}: larger than {MAX_FILE} bytes")));
    }
    let _held = LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut written = read_written(root);
    let hash = format!("{:016x}", fnv1a(data));
    let target = root.join(rel_path);
    if written.get(rel) == Some(&hash) && target.exists() {
        return Ok(());
    }
    replace(&target, mode & 0o7777, data)?;
    written.insert(rel.to_string(), hash);
    let record: String = written.iter().map(|(path, hash)| format!("{hash} {path}\n")).collect();
    replace(&root.join(WRITTEN), 0o600, record.as_bytes())?;
    if rel == "etc/hostname" {
        let name = String::from_utf8_lossy(data);
        nix::unistd::sethostname(name.trim()).map_err(io::Error::from)?;
    }
    Ok(())
}

/// For each of `paths` below `root`, whether it is a regular file (not
/// through a symlink at its end; a path that is not plain relative is not).
pub fn present(root: &Path, paths: &[String]) -> Vec<bool> {
    paths
        .iter()
        .map(|rel| plain(rel) && std::fs::symlink_metadata(root.join(rel)).is_ok_and(|meta| meta.file_type().is_file()))
        .collect()
}

/// Whether `rel` is a plain relative path (no `..`, no leading `/`).
fn plain(rel: &str) -> bool {
    !rel.is_empty() && Path::new(rel).components().all(|c| matches!(c, Component::Normal(_)))
}

/// The record of what the host wrote (empty if missing or unreadable).
fn read_written(root: &Path) -> BTreeMap<String, String> {
    let text = crate::box_file::read_text(root.join(WRITTEN)).unwrap_or_default();
    text.lines().filter_map(|l| l.split_once(' ')).map(|(hash, path)| (path.to_string(), hash.to_string())).collect()
}

/// Puts a new file with `data` in place of `path` (its parents made).
fn replace(path: &Path, mode: u32, data: &[u8]) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension("moat-new");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
    file.write_all(data)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    // No fsync (tens of ms each under TCG, on the way up): ext4 writes a
    // file's data before a rename over another commits.
    std::fs::rename(&tmp, path)
}

/// FNV-1a, 64 bits: enough to tell whether the host changed a file.
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_once_then_only_when_the_host_changes_it() {
        let root = tempfile_dir();
        put(&root, "etc/environment", 0o644, b"A=1\n").unwrap();
        assert_eq!(std::fs::read(root.join("etc/environment")).unwrap(), b"A=1\n");
        // The guest's user edits it; the same file from the host leaves the edit.
        std::fs::write(root.join("etc/environment"), "A=1\nMINE=1\n").unwrap();
        put(&root, "etc/environment", 0o644, b"A=1\n").unwrap();
        assert_eq!(std::fs::read(root.join("etc/environment")).unwrap(), b"A=1\nMINE=1\n");
        // A new one from the host replaces it.
        put(&root, "etc/environment", 0o644, b"A=2\n").unwrap();
        assert_eq!(std::fs::read(root.join("etc/environment")).unwrap(), b"A=2\n");
        assert!(put(&root, "../escape", 0o644, b"x").is_err());
        assert!(put(&root, "/etc/passwd", 0o644, b"x").is_err());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn present_tells_regular_files_only() {
        let root = std::env::temp_dir().join(format!("moat-present-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("etc/ssh")).unwrap();
        std::fs::write(root.join("etc/ssh/ssh_host_rsa_key"), "k").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("etc/ssh/ssh_host_ed25519_key")).unwrap();
        let asked: Vec<String> = [
            "etc/ssh/ssh_host_rsa_key",
            "etc/ssh/ssh_host_ed25519_key",
            "etc/ssh",
            "etc/none",
            "../present/etc/ssh/ssh_host_rsa_key",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(present(&root, &asked), [true, false, false, false, false]);
        let _ = std::fs::remove_dir_all(&root);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("moat-host-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
