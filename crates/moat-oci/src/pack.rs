//! One layer made from a tree's changes (the paths a diff against its base
//! found added, modified or deleted), as a gzip'd tar the OCI image spec
//! reads: what was added or modified, as it is (owner, mode with setuid,
//! `user.*` attributes and file capabilities, time, hard links among the
//! layer's own files, symlinks as links), and `.wh.NAME` for what was
//! deleted. Device nodes and sockets are left out and counted.
//!
//! The tree is a box's (a template's read-only snapshot), so hostile: every
//! path is resolved inside it with no symlink followed on the way
//! (`RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS`), and FIFOs are never opened.
//! The layer is bounded in bytes before compression.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, SFlag};
use sha2::{Digest as _, Sha256};

use crate::digest::Digest;

/// What changed at one path (below the root, `/`-separated, no leading `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changed {
    /// Added or modified: its content as it is now goes in.
    Present(String),
    /// Deleted: a whiteout goes in.
    Deleted(String),
}

/// A layer written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    /// The digest of the gzip'd bytes (the blob's).
    pub digest: Digest,
    /// The digest of the tar (the config's diff id).
    pub diff_id: Digest,
    /// The blob's size.
    pub size: u64,
    /// Device nodes and sockets left out.
    pub skipped: u64,
}

/// Writes the layer of `changes` (in tree order: a directory before what
/// it holds) of the tree `root` into `out`, at most `max` bytes of tar.
pub fn pack(root: &OwnedFd, changes: &[Changed], out: impl Write, max: u64) -> io::Result<Packed> {
    let blob = Hashing::new(out);
    let gz = flate2::write::GzEncoder::new(blob, flate2::Compression::fast());
    let tar_bytes = Hashing::new(Bounded { inner: gz, left: max });
    let mut tar = tar::Builder::new(tar_bytes);
    tar.mode(tar::HeaderMode::Complete);
    let mut whited_out: Vec<String> = Vec::new();
    let mut linked: HashMap<(u64, u64), String> = HashMap::new();
    let mut skipped = 0;
    // What the files' lengths leave of `max`: a file too long for it is
    // refused before a byte of it is read (a sparse file's holes would
    // otherwise be compressed, zero by zero, until the bound).
    let mut unpromised = max;
    for change in changes {
        match change {
            Changed::Deleted(path) => {
                // A deleted directory's whiteout covers what it held.
                if whited_out.iter().any(|d| path.strip_prefix(d.as_str()).is_some_and(|r| r.starts_with('/'))) {
                    continue;
                }
                let (dir, name) = path.rsplit_once('/').map_or(("", path.as_str()), |(d, n)| (d, n));
                let wh = if dir.is_empty() { format!(".wh.{name}") } else { format!("{dir}/.wh.{name}") };
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(0o644);
                header.set_size(0);
                tar.append_data(&mut header, &wh, io::empty())?;
                whited_out.push(path.clone());
            }
            Changed::Present(path) => {
                if !add(&mut tar, root, path, &mut linked, &mut unpromised)? {
                    skipped += 1;
                }
            }
        }
    }
    let tar_bytes = tar.into_inner()?;
    let diff_id = Digest::from_hasher(tar_bytes.hasher);
    let mut blob = tar_bytes.inner.inner.finish()?;
    blob.inner.flush()?;
    Ok(Packed { digest: Digest::from_hasher(blob.hasher), diff_id, size: blob.written, skipped })
}

/// Appends `path` as it is in `root`; false if it is of a kind a layer
/// does not carry (a device node, a socket).
fn add<W: Write>(
    tar: &mut tar::Builder<W>,
    root: &OwnedFd,
    path: &str,
    linked: &mut HashMap<(u64, u64), String>,
    unpromised: &mut u64,
) -> io::Result<bool> {
    let open = |flags: OFlag| -> io::Result<OwnedFd> {
        let how = OpenHow::new().flags(flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).resolve(
            ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
        openat2(root, path, how).map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("{path}: {e}")))
    };
    let at = open(OFlag::O_PATH)?;
    let st = fstat(&at).map_err(io::Error::from)?;
    let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
    let mut header = tar::Header::new_gnu();
    header.set_mode(st.st_mode & 0o7777);
    header.set_uid(u64::from(st.st_uid));
    header.set_gid(u64::from(st.st_gid));
    header.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    header.set_size(0);
    match kind {
        SFlag::S_IFDIR => {
            header.set_entry_type(tar::EntryType::Directory);
            tar.append_data(&mut header, format!("{path}/"), io::empty())?;
        }
        SFlag::S_IFLNK => {
            let target = nix::fcntl::readlinkat(&at, "").map_err(io::Error::from)?;
            header.set_entry_type(tar::EntryType::Symlink);
            tar.append_link(&mut header, path, OsStr::from_bytes(target.as_bytes()))?;
        }
        SFlag::S_IFIFO => {
            header.set_entry_type(tar::EntryType::Fifo);
            tar.append_data(&mut header, path, io::empty())?;
        }
        SFlag::S_IFREG => {
            let identity = (st.st_dev, st.st_ino);
            if st.st_nlink > 1 {
                if let Some(first) = linked.get(&identity) {
                    header.set_entry_type(tar::EntryType::Link);
                    tar.append_link(&mut header, path, first)?;
                    return Ok(true);
                }
                linked.insert(identity, path.to_string());
            }
            // Never blocks: it is a regular file (and the tree is read-only).
            let file = std::fs::File::from(open(OFlag::O_RDONLY | OFlag::O_NONBLOCK)?);
            let attributes = attributes(file.as_fd())?;
            if !attributes.is_empty() {
                let pax: Vec<(String, &[u8])> =
                    attributes.iter().map(|(name, value)| (format!("SCHILY.xattr.{name}"), value.as_slice())).collect();
                tar.append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), *v)))?;
            }
            let size = u64::try_from(st.st_size).unwrap_or(0);
            *unpromised = unpromised.checked_sub(size).ok_or_else(|| {
                io::Error::other(format!(
                    "{path} is {size} bytes long (a layer holds a sparse file's holes too): the layer would be \
                     over --max-image-size"
                ))
            })?;
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(size);
            // Exactly the size the header says, even if the file changed.
            let body = file.take(size).chain(io::repeat(0)).take(size);
            tar.append_data(&mut header, path, body)?;
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// The attributes a layer carries of a file: `user.*` and its capability.
fn attributes(fd: impl AsFd) -> io::Result<Vec<(String, Vec<u8>)>> {
    let mut names = vec![0u8; 64 << 10];
    let n = rustix::fs::flistxattr(&fd, &mut names)?;
    let mut out = Vec::new();
    for name in names.get(..n).unwrap_or_default().split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(name) = std::str::from_utf8(name) else { continue };
        if !(name.starts_with("user.") || name == "security.capability") {
            continue;
        }
        let mut value = vec![0u8; 64 << 10];
        let len = rustix::fs::fgetxattr(&fd, name, &mut value)?;
        value.truncate(len);
        out.push((name.to_string(), value));
    }
    Ok(out)
}

/// Counts and hashes what passes through.
struct Hashing<W> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W> Hashing<W> {
    fn new(inner: W) -> Self {
        Self { inner, hasher: Sha256::new(), written: 0 }
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        let done = buf.get(..n).unwrap_or_default();
        self.hasher.update(done);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Fails a write past its bound.
struct Bounded<W> {
    inner: W,
    left: u64,
}

impl<W: Write> Write for Bounded<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(io::Error::other("the layer is over --max-image-size"));
        }
        let n = self.inner.write(buf)?;
        self.left -= n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use crate::manifest::Compression;
    use crate::unpack::apply;

    #[test]
    fn a_packed_layer_unpacks_onto_its_base_to_the_tree() {
        let tree = tempfile::tempdir().unwrap();
        let t = tree.path();
        std::fs::create_dir_all(t.join("srv/new")).unwrap();
        std::fs::write(t.join("srv/new/file"), "added\n").unwrap();
        std::fs::hard_link(t.join("srv/new/file"), t.join("srv/twin")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", t.join("srv/link")).unwrap();
        nix::unistd::mkfifo(&t.join("srv/fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        rustix::fs::setxattr(t.join("srv/new/file"), "user.moat", b"yes", rustix::fs::XattrFlags::empty()).unwrap();
        let changes = [
            Changed::Present("srv/new".into()),
            Changed::Present("srv/new/file".into()),
            Changed::Present("srv/twin".into()),
            Changed::Present("srv/link".into()),
            Changed::Present("srv/fifo".into()),
            Changed::Deleted("gone".into()),
            Changed::Deleted("gone/inside".into()),
            Changed::Deleted("srv/old".into()),
        ];
        let root: OwnedFd = std::fs::File::open(t).unwrap().into();
        let mut blob = Vec::new();
        let packed = pack(&root, &changes, &mut blob, 1 << 20).unwrap();
        assert_eq!((packed.digest.clone(), packed.size, packed.skipped), (Digest::of(&blob), blob.len() as u64, 0));

        // Its base: what was deleted is there.
        let base = tempfile::tempdir().unwrap();
        let b = base.path();
        std::fs::create_dir_all(b.join("gone")).unwrap();
        std::fs::write(b.join("gone/inside"), "x").unwrap();
        std::fs::create_dir_all(b.join("srv")).unwrap();
        std::fs::write(b.join("srv/old"), "x").unwrap();
        let base_root: OwnedFd = std::fs::File::open(b).unwrap().into();
        let report = apply(&base_root, blob.as_slice(), Compression::Gzip, 1 << 20).unwrap();
        assert_eq!(report.diff_id.as_ref(), Some(&packed.diff_id));
        assert!(!b.join("gone").exists() && !b.join("srv/old").exists());
        assert_eq!(std::fs::read_to_string(b.join("srv/new/file")).unwrap(), "added\n");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            std::fs::metadata(b.join("srv/twin")).unwrap().ino(),
            std::fs::metadata(b.join("srv/new/file")).unwrap().ino()
        );
        assert_eq!(std::fs::read_link(b.join("srv/link")).unwrap(), std::path::Path::new("/etc/passwd"));
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(b.join("srv/fifo")).unwrap().file_type().is_fifo());
        assert_eq!(rustix::fs::getxattr(b.join("srv/new/file"), "user.moat", &mut [0u8; 8]).unwrap(), 3);
    }

    #[test]
    fn no_path_leads_out_of_the_tree_and_the_bound_holds() {
        let tree = tempfile::tempdir().unwrap();
        let t = tree.path();
        std::os::unix::fs::symlink("/etc", t.join("up")).unwrap();
        std::fs::write(t.join("big"), vec![7u8; 64 << 10]).unwrap();
        let root: OwnedFd = std::fs::File::open(t).unwrap().into();
        for escape in ["up/passwd", "../etc/passwd"] {
            let err = pack(&root, &[Changed::Present(escape.into())], io::sink(), 1 << 20).unwrap_err();
            assert!(err.to_string().contains(escape), "{err}");
        }
        let err = pack(&root, &[Changed::Present("big".into())], io::sink(), 4096).unwrap_err();
        assert!(err.to_string().contains("max-image-size"), "{err}");
        // A sparse file far beyond the bound is refused at once, unread.
        std::fs::File::create(t.join("sparse")).unwrap().set_len(1 << 40).unwrap();
        let started = std::time::Instant::now();
        let err = pack(&root, &[Changed::Present("sparse".into())], io::sink(), 1 << 30).unwrap_err();
        assert!(err.to_string().contains("sparse is 1099511627776 bytes long"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }
}
