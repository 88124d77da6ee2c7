//! The host's side of a VM box's files: a mini-root kept beside its disk
//! (`files/` in the box's subvolume) holding what moat writes into a box
//! (host name, machine-id, host keys, the CA it trusts, `/etc/environment`,
//! where to ask for names). Only the host writes it, so the same code that
//! writes a namespace box's root writes it, and nothing the guest did is
//! ever read back: the guest gets these files in its initramfs at boot and
//! by `PutFile` while it runs, and writes them onto its own disk. (The one
//! thing asked of a guest is which of its own identity files it holds
//! ([`present`]), for a copy's first run: a flag per path.)

// Reads what a box or its QEMU sends, as root: it cannot panic.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]

use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moat_agent::protocol::{AgentMsg, HostMsg};

use crate::agent_call::{ask, connect, Answers};
use crate::in_root::{dir_in_root, parents_in_root, read_in_root, write_in_root};

/// The files of an image a box's mini-root starts from: those that moat
/// edits rather than writes whole.
const SEEDED: &[&str] = &[
    "etc/environment",
    "etc/ssl/certs/ca-certificates.crt",
    "var/lib/systemd/random-seed",
    "etc/ssh/ssh_host_rsa_key",
    "etc/ssh/ssh_host_ecdsa_key",
    "etc/ssh/ssh_host_ed25519_key",
];

/// The largest seeded file read from an image.
const MAX_SEED: u64 = 1 << 20;

/// The mini-root in a VM box's directory.
pub fn dir(box_dir: &Path) -> PathBuf {
    box_dir.join("files")
}

/// Makes `files` (a new directory) the mini-root of a box of the image
/// whose tree is `image`: the image's copies of the files moat edits, and a
/// resolver at the guest's router (where every name is asked for anyway).
pub fn seed(files: &Path, image: &Path) -> io::Result<()> {
    std::fs::create_dir(files)?;
    let from: OwnedFd = std::fs::File::open(image)?.into();
    let to: OwnedFd = std::fs::File::open(files)?.into();
    for rel in SEEDED {
        let Some(data) = read_in_root(&from, rel, MAX_SEED)? else { continue };
        parents_in_root(&to, rel)?;
        let mode = if rel.ends_with("_key") || rel.ends_with("random-seed") { 0o600 } else { 0o644 };
        write_in_root(&to, rel, &data, mode)?;
    }
    dir_in_root(&to, "etc")?;
    let resolver = format!("nameserver {}\n", moat_agent::GUEST_ROUTER);
    write_in_root(&to, "etc/resolv.conf", resolver.as_bytes(), 0o644)
}

/// Hands `paths` of the mini-root `files` to the running guest whose agent
/// is at `socket`, over one connection, within `timeout` in all.
pub fn push(socket: &Path, files: &Path, paths: &[&str], timeout: Duration) -> io::Result<()> {
    let root: OwnedFd = std::fs::File::open(files)?.into();
    let deadline = Instant::now() + timeout;
    let mut conn = connect(socket, timeout)?;
    let mut sent = Vec::new();
    for rel in paths {
        let Some(data) = read_in_root(&root, rel, moat_agent::protocol::MAX_FRAME as u64 / 2)? else { continue };
        let mode =
            std::fs::metadata(files.join(rel)).map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()))?;
        conn.write_all(&HostMsg::PutFile { path: rel.to_string(), mode: mode & 0o7777, data }.encode())?;
        sent.push(*rel);
    }
    conn.shutdown(std::net::Shutdown::Write)?;
    let mut answers = Answers::default();
    for rel in sent {
        answers.pong(&mut conn, deadline).map_err(|e| io::Error::new(e.kind(), format!("write /{rel}: {e}")))?;
    }
    Ok(())
}

/// Hands every file of the mini-root `files` to the guest (a copy's whole
/// identity is new).
pub fn push_all(socket: &Path, files: &Path, timeout: Duration) -> io::Result<()> {
    let mut paths = Vec::new();
    let mut dirs = vec![files.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if kind.is_file() {
                let path = entry.path();
                if let Some(rel) = path.strip_prefix(files).ok().and_then(Path::to_str) {
                    paths.push(rel.to_string());
                }
            }
        }
    }
    let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
    push(socket, files, &paths, timeout)
}

/// Tells a guest it runs again (after a pause its clock stands where it
/// stopped; a copy's random number generator is its parent's): the host's
/// time and fresh random bytes.
pub fn resumed(socket: &Path, timeout: Duration) -> io::Result<()> {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_err(io::Error::other)?;
    let unix_ns = u64::try_from(since.as_nanos()).map_err(io::Error::other)?;
    let mut entropy = vec![0u8; 64];
    getrandom::fill(&mut entropy).map_err(|e| io::Error::other(e.to_string()))?;
    ask(socket, &HostMsg::Resumed { unix_ns, entropy }, timeout)
}

/// Has the guest write its file systems' dirty data to its disk.
pub fn sync(socket: &Path, timeout: Duration) -> io::Result<()> {
    ask(socket, &HostMsg::Sync, timeout)
}

/// Which of `paths` (relative to the root) are regular files in the
/// running guest's root, as its agent says (a guest may lie: what it says
/// decides only which of its own files the host replaces).
pub fn present(socket: &Path, paths: &[&str], timeout: Duration) -> io::Result<Vec<bool>> {
    let deadline = Instant::now() + timeout;
    let mut conn = connect(socket, timeout)?;
    conn.write_all(&HostMsg::Present { paths: paths.iter().map(|p| p.to_string()).collect() }.encode())?;
    match Answers::default().next(&mut conn, deadline)? {
        AgentMsg::Present(present) if present.len() == paths.len() => Ok(present),
        AgentMsg::Error(e) => Err(io::Error::other(e)),
        other => Err(io::Error::other(format!("unexpected answer {other:?}"))),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_mini_root_takes_only_the_edited_files_of_its_image() {
        let image = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(image.path().join("etc/ssh")).unwrap();
        std::fs::write(image.path().join("etc/environment"), "PATH=/bin\n").unwrap();
        std::fs::write(image.path().join("etc/ssh/ssh_host_ed25519_key"), "old").unwrap();
        std::fs::write(image.path().join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        let files = out.path().join("files");
        seed(&files, image.path()).unwrap();
        assert_eq!(std::fs::read_to_string(files.join("etc/environment")).unwrap(), "PATH=/bin\n");
        assert!(files.join("etc/ssh/ssh_host_ed25519_key").exists());
        assert!(!files.join("etc/passwd").exists());
        assert!(std::fs::read_to_string(files.join("etc/resolv.conf")).unwrap().contains("169.254.0.1"));
    }
}
