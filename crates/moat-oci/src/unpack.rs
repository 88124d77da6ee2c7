//! One layer applied onto a tree that already holds its parent (a snapshot
//! of the parent's subvolume), as the OCI image spec says: entries replace
//! what was there, `.wh.NAME` removes NAME from the layers below, and
//! `.wh..wh..opq` empties its directory of what the layers below put there.
//! Owners, modes (setuid included), extended attributes (`user.*` and file
//! capabilities) and times are kept; hard links and symlinks are made as
//! they are.
//!
//! The tree is hostile as much as the layer: every path is resolved inside
//! it (`RESOLVE_IN_ROOT`, no magic links), so a symlink an earlier entry or
//! layer made, absolute or full of `..`, cannot carry a later write out of
//! it; a final component is replaced, never followed. Entries naming `..`
//! are refused; device nodes are skipped and reported. Bytes are bounded
//! before and after decompression (a bomb stops at the bound). This runs in
//! the confined unpack helper, where Landlock, an unprivileged user
//! namespace and seccomp bound it again.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{openat, openat2, AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{Mode, SFlag};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::digest::Digest;
use crate::manifest::Compression;

/// Most entries one layer may have.
pub const MAX_ENTRIES: u64 = 1 << 21;
/// Longest path an entry may name.
const MAX_PATH: usize = 4096;
/// Device nodes named in a report, at most (the count is whole).
const MAX_NAMED: usize = 32;
/// The marker that empties a directory of the layers below.
const OPAQUE: &[u8] = b".wh..wh..opq";
/// The prefix of a whiteout.
const WHITEOUT: &[u8] = b".wh.";

/// What applying a layer did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The digest of the uncompressed tar (the config's diff id for it).
    pub diff_id: Option<Digest>,
    /// Entries applied.
    pub entries: u64,
    /// Bytes of file contents written.
    pub bytes: u64,
    /// Device nodes skipped (a box makes none of its own).
    pub devices_skipped: u64,
    /// The first few of them.
    pub devices: Vec<String>,
    /// Extended attributes dropped (other than `user.*` and file capabilities).
    pub xattrs_dropped: u64,
}

/// Why a layer could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The tar (or its compression) is malformed.
    #[error("the layer is not a readable tar: {0}")]
    Tar(String),
    /// An entry's path leaves the tree.
    #[error("entry {0:?} escapes the image (a path with ..)")]
    Escape(String),
    /// Past the size bound (a decompression bomb, or just too big).
    #[error("the layer unpacks to more than {0} bytes")]
    TooLarge(u64),
    /// More entries than any real layer has.
    #[error("the layer has more than {MAX_ENTRIES} entries")]
    TooManyEntries,
    /// An entry whose kind no image needs.
    #[error("entry {path:?}: {why}")]
    Entry {
        /// The entry.
        path: String,
        /// Why.
        why: String,
    },
}

/// Reads the decompressed tar, hashing it and stopping at a bound.
struct Bounded<R> {
    inner: R,
    hasher: Sha256,
    read: u64,
    limit: u64,
    over: bool,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read = self.read.saturating_add(n as u64);
        if self.read > self.limit {
            self.over = true;
            return Err(io::Error::other("over the bound"));
        }
        self.hasher.update(buf.get(..n).unwrap_or_default());
        Ok(n)
    }
}

/// Applies the layer read from `blob` (compressed as `compression`) onto the
/// tree at `root`, writing at most `max_bytes` (before and after decompression).
pub fn apply(root: &OwnedFd, blob: impl Read, compression: Compression, max_bytes: u64) -> Result<Report, UnpackError> {
    let tar: Box<dyn Read> = match compression {
        Compression::None => Box::new(blob.take(max_bytes.saturating_add(1))),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(blob.take(max_bytes.saturating_add(1)))),
        Compression::Zstd => {
            Box::new(zstd::stream::read::Decoder::new(blob.take(max_bytes.saturating_add(1))).map_err(tar_err)?)
        }
    };
    let mut bounded = Bounded { inner: tar, hasher: Sha256::new(), read: 0, limit: max_bytes, over: false };
    let mut layer = Layer { root, report: Report::default(), created: HashSet::new(), budget: max_bytes };
    let result = layer.apply_all(&mut bounded);
    if bounded.over {
        return Err(UnpackError::TooLarge(max_bytes));
    }
    result?;
    // The tar's padding after its end counts towards its digest.
    match io::copy(&mut bounded, &mut io::sink()) {
        Err(_) if bounded.over => return Err(UnpackError::TooLarge(max_bytes)),
        Err(e) => return Err(tar_err(e)),
        Ok(_) => {}
    }
    let mut report = layer.report;
    report.diff_id = Some(Digest::from_hasher(bounded.hasher));
    Ok(report)
}

fn tar_err(e: io::Error) -> UnpackError {
    UnpackError::Tar(e.to_string())
}

struct Layer<'a> {
    root: &'a OwnedFd,
    report: Report,
    /// Paths this layer made (an opaque marker or a whiteout spares them).
    created: HashSet<PathBuf>,
    /// File bytes it may still write.
    budget: u64,
}

/// An entry's path inside the tree: a leading `/` or `./` is dropped; `..`
/// is refused. `None` for the tree itself.
fn clean(path: &Path) -> Result<Option<PathBuf>, UnpackError> {
    let shown = || path.to_string_lossy().chars().take(200).collect::<String>();
    if path.as_os_str().len() > MAX_PATH {
        return Err(UnpackError::Entry { path: shown(), why: "path too long".into() });
    }
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => return Err(UnpackError::Escape(shown())),
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

fn shown(path: &Path) -> String {
    path.to_string_lossy().chars().take(200).collect()
}

fn entry_err(path: &Path) -> impl Fn(nix::Error) -> UnpackError + '_ {
    move |e| UnpackError::Entry { path: shown(path), why: e.desc().to_lowercase() }
}

fn in_root() -> ResolveFlag {
    ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS
}

impl Layer<'_> {
    fn apply_all(&mut self, tar: &mut dyn Read) -> Result<(), UnpackError> {
        let mut archive = tar::Archive::new(tar);
        for entry in archive.entries().map_err(tar_err)? {
            let mut entry = entry.map_err(tar_err)?;
            self.report.entries += 1;
            if self.report.entries > MAX_ENTRIES {
                return Err(UnpackError::TooManyEntries);
            }
            let raw = entry.path().map_err(tar_err)?.into_owned();
            let Some(path) = clean(&raw)? else { continue };
            self.entry(&mut entry, &path)?;
        }
        Ok(())
    }

    /// The directory `path` is in (made if missing), and its last part.
    fn parent(&self, path: &Path) -> Result<(OwnedFd, OsString), UnpackError> {
        let name = path.file_name().ok_or_else(|| UnpackError::Escape(shown(path)))?.to_os_string();
        let parent = path.parent().unwrap_or(Path::new(""));
        let dir = self.dir(parent)?;
        Ok((dir, name))
    }

    /// The directory `rel` inside the tree, making what is missing of it.
    fn dir(&self, rel: &Path) -> Result<OwnedFd, UnpackError> {
        let how = || OpenHow::new().flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC).resolve(in_root());
        let target = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
        match openat2(self.root, target, how()) {
            Ok(fd) => return Ok(fd),
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(entry_err(rel)(e)),
        }
        let mut dir = openat2(self.root, ".", how()).map_err(entry_err(rel))?;
        let mut walked = PathBuf::new();
        for part in rel.components() {
            let Component::Normal(part) = part else { return Err(UnpackError::Escape(shown(rel))) };
            match nix::sys::stat::mkdirat(&dir, part, Mode::from_bits_truncate(0o755)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(entry_err(rel)(e)),
            }
            // Resolved from the image's root each time: a symlink on the way
            // (`var/run -> /run`) means what it means in the image, not
            // relative to the directory it sits in.
            walked.push(part);
            dir = openat2(self.root, &walked, how()).map_err(entry_err(rel))?;
        }
        Ok(dir)
    }

    fn entry(&mut self, entry: &mut tar::Entry<'_, &mut dyn Read>, path: &Path) -> Result<(), UnpackError> {
        let (dir, name) = self.parent(path)?;
        let bytes = name.as_bytes();
        if bytes == OPAQUE {
            let parent = path.parent().unwrap_or(Path::new("")).to_path_buf();
            return self.opaque(&dir, &parent);
        }
        if let Some(hidden) = bytes.strip_prefix(WHITEOUT) {
            let hidden = OsStr::from_bytes(hidden);
            if hidden.is_empty() || hidden == "." || hidden == ".." {
                return Err(UnpackError::Escape(shown(path)));
            }
            let target = path.with_file_name(hidden);
            if !self.created.contains(&target) {
                remove_all(&dir, hidden).map_err(entry_err(path))?;
            }
            return Ok(());
        }
        let header = entry.header();
        let kind = header.entry_type();
        let mode = Mode::from_bits_truncate(header.mode().map_err(tar_err)? & 0o7777);
        let owner = (header.uid().map_err(tar_err)?, header.gid().map_err(tar_err)?);
        let mtime = header.mtime().unwrap_or(0);
        let xattrs = xattrs(entry, &mut self.report)?;
        let owner = (
            u32::try_from(owner.0)
                .map_err(|_| UnpackError::Entry { path: shown(path), why: "uid out of range".into() })?,
            u32::try_from(owner.1)
                .map_err(|_| UnpackError::Entry { path: shown(path), why: "gid out of range".into() })?,
        );
        let err = entry_err(path);
        match kind {
            tar::EntryType::Directory => {
                let existing = nix::sys::stat::fstatat(&dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW);
                match existing {
                    Ok(st) if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR => {}
                    Ok(_) => remove_all(&dir, &name).map_err(&err)?,
                    Err(Errno::ENOENT) => {}
                    Err(e) => return Err(err(e)),
                }
                match nix::sys::stat::mkdirat(&dir, name.as_os_str(), Mode::from_bits_truncate(0o700)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err(err(e)),
                }
                let fd = openat(
                    &dir,
                    name.as_os_str(),
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(&err)?;
                set_meta(&fd, owner, mode, &xattrs, None).map_err(&err)?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                // A file larger than what is left is refused before a byte of it is written.
                if entry.size() > self.budget {
                    return Err(UnpackError::TooLarge(self.report.bytes + self.budget));
                }
                remove_all(&dir, &name).map_err(&err)?;
                let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
                let fd = openat(&dir, name.as_os_str(), flags, Mode::from_bits_truncate(0o600)).map_err(&err)?;
                let mut file = std::fs::File::from(fd);
                self.copy(entry, &mut file, path)?;
                set_meta(file.as_fd(), owner, mode, &xattrs, Some(mtime)).map_err(&err)?;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(tar_err)?
                    .ok_or_else(|| UnpackError::Entry { path: shown(path), why: "a symlink with no target".into() })?;
                remove_all(&dir, &name).map_err(&err)?;
                nix::unistd::symlinkat(target.as_ref(), &dir, name.as_os_str()).map_err(&err)?;
                nix::unistd::fchownat(
                    &dir,
                    name.as_os_str(),
                    Some(Uid::from_raw(owner.0)),
                    Some(Gid::from_raw(owner.1)),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(&err)?;
                let t = TimeSpec::new(mtime as i64, 0);
                let _ = nix::sys::stat::utimensat(
                    &dir,
                    name.as_os_str(),
                    &t,
                    &t,
                    nix::sys::stat::UtimensatFlags::NoFollowSymlink,
                );
            }
            tar::EntryType::Link => {
                let target = entry.link_name().map_err(tar_err)?.ok_or_else(|| UnpackError::Entry {
                    path: shown(path),
                    why: "a hard link with no target".into(),
                })?;
                let target = clean(&target)?.ok_or_else(|| UnpackError::Escape(shown(path)))?;
                let (target_dir, target_name) = self.parent(&target)?;
                if target == path {
                    return Ok(());
                }
                remove_all(&dir, &name).map_err(&err)?;
                // Without AT_SYMLINK_FOLLOW: a link to a symlink is to the symlink.
                nix::unistd::linkat(&target_dir, target_name.as_os_str(), &dir, name.as_os_str(), AtFlags::empty())
                    .map_err(&err)?;
            }
            tar::EntryType::Fifo => {
                remove_all(&dir, &name).map_err(&err)?;
                nix::sys::stat::mknodat(&dir, name.as_os_str(), SFlag::S_IFIFO, Mode::from_bits_truncate(0o600), 0)
                    .map_err(&err)?;
                let fd =
                    openat(&dir, name.as_os_str(), OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
                        .map_err(&err)?;
                nix::unistd::fchownat(
                    &fd,
                    "",
                    Some(Uid::from_raw(owner.0)),
                    Some(Gid::from_raw(owner.1)),
                    AtFlags::AT_EMPTY_PATH,
                )
                .map_err(&err)?;
                nix::sys::stat::fchmodat(&dir, name.as_os_str(), mode, nix::sys::stat::FchmodatFlags::FollowSymlink)
                    .map_err(&err)?;
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                self.report.devices_skipped += 1;
                if self.report.devices.len() < MAX_NAMED {
                    self.report.devices.push(shown(path));
                }
                return Ok(());
            }
            other => {
                return Err(UnpackError::Entry {
                    path: shown(path),
                    why: format!("tar entry type {other:?} is not a file"),
                });
            }
        }
        self.created.insert(path.to_path_buf());
        Ok(())
    }

    /// Copies an entry's contents, within the layer's byte budget (a sparse
    /// entry's holes count: they are written out).
    fn copy(&mut self, from: &mut dyn Read, to: &mut std::fs::File, path: &Path) -> Result<(), UnpackError> {
        let mut buf = vec![0u8; 128 << 10];
        loop {
            let n = from.read(&mut buf).map_err(tar_err)?;
            if n == 0 {
                return Ok(());
            }
            let n64 = n as u64;
            if n64 > self.budget {
                return Err(UnpackError::TooLarge(self.report.bytes + self.budget));
            }
            self.budget -= n64;
            self.report.bytes += n64;
            to.write_all(buf.get(..n).unwrap_or_default())
                .map_err(|e| UnpackError::Entry { path: shown(path), why: e.to_string() })?;
        }
    }

    /// Empties the directory at `rel` (open as `dir`) of what the layers
    /// below made; what this layer made stays.
    fn opaque(&self, dir: &OwnedFd, rel: &Path) -> Result<(), UnpackError> {
        let err = entry_err(rel);
        let fd =
            openat(dir, ".", OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty()).map_err(&err)?;
        for name in names(fd).map_err(&err)? {
            if !self.created.contains(&rel.join(&name)) {
                remove_all(dir, &name).map_err(&err)?;
            }
        }
        Ok(())
    }
}

/// The names in an open directory (but `.` and `..`).
fn names(fd: OwnedFd) -> nix::Result<Vec<OsString>> {
    let mut dir = nix::dir::Dir::from_fd(fd)?;
    let mut out = Vec::new();
    for entry in dir.iter() {
        let entry = entry?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name != "." && name != ".." {
            out.push(name.to_os_string());
        }
    }
    Ok(out)
}

/// Removes `name` in `dir` and, if it is a directory, all beneath it,
/// following no symlink. Nothing there is not an error.
fn remove_all(dir: &impl AsFd, name: &OsStr) -> nix::Result<()> {
    match nix::unistd::unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::EISDIR) => {}
        Err(e) => return Err(e),
    }
    let fd =
        openat(dir, name, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())?;
    let inner = fd.try_clone().map_err(|_| Errno::EMFILE)?;
    for child in names(fd)? {
        remove_all(&inner, &child)?;
    }
    nix::unistd::unlinkat(dir, name, UnlinkatFlags::RemoveDir)
}

/// Extended attributes a box may have: its own (`user.*`) and file
/// capabilities. Others (`trusted.*`, `security.selinux`...) are dropped.
fn xattrs(
    entry: &mut tar::Entry<'_, &mut dyn Read>,
    report: &mut Report,
) -> Result<Vec<(OsString, Vec<u8>)>, UnpackError> {
    let mut out = Vec::new();
    let Some(exts) = entry.pax_extensions().map_err(tar_err)? else { return Ok(out) };
    for ext in exts {
        let ext = ext.map_err(tar_err)?;
        let Some(name) = ext.key_bytes().strip_prefix(b"SCHILY.xattr.") else { continue };
        if name.starts_with(b"user.") || name == b"security.capability" {
            out.push((OsStr::from_bytes(name).to_os_string(), ext.value_bytes().to_vec()));
        } else {
            report.xattrs_dropped += 1;
        }
    }
    Ok(out)
}

/// Owner, then mode (a change of owner clears setuid), then attributes (a
/// change of owner clears a file capability), then the time.
fn set_meta(
    fd: impl AsFd,
    owner: (u32, u32),
    mode: Mode,
    xattrs: &[(OsString, Vec<u8>)],
    mtime: Option<u64>,
) -> nix::Result<()> {
    let fd = fd.as_fd();
    nix::unistd::fchown(fd, Some(Uid::from_raw(owner.0)), Some(Gid::from_raw(owner.1)))?;
    nix::sys::stat::fchmod(fd, mode)?;
    for (name, value) in xattrs {
        rustix::fs::fsetxattr(fd, name.as_os_str(), value, rustix::fs::XattrFlags::empty())
            .map_err(|e| Errno::from_raw(e.raw_os_error()))?;
    }
    if let Some(mtime) = mtime {
        let t = TimeSpec::new(mtime as i64, 0);
        nix::sys::stat::futimens(fd, &t, &t)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    /// A tar written entry by entry, names set raw (so hostile ones can be).
    struct Tar(tar::Builder<Vec<u8>>);

    impl Tar {
        fn new() -> Self {
            Self(tar::Builder::new(Vec::new()))
        }

        fn add(&mut self, kind: tar::EntryType, name: &str, data: &[u8], mode: u32, link: Option<&str>) -> &mut Self {
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(kind);
            let raw = &mut h.as_old_mut().name;
            raw.fill(0);
            raw[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(link) = link {
                let raw = &mut h.as_old_mut().linkname;
                raw.fill(0);
                raw[..link.len()].copy_from_slice(link.as_bytes());
            }
            h.set_size(data.len() as u64);
            h.set_mode(mode);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_700_000_000);
            h.set_cksum();
            self.0.append(&h, data).unwrap();
            self
        }

        fn file(&mut self, name: &str, data: &str) -> &mut Self {
            self.add(tar::EntryType::Regular, name, data.as_bytes(), 0o644, None)
        }

        fn dir(&mut self, name: &str) -> &mut Self {
            self.add(tar::EntryType::Directory, name, b"", 0o755, None)
        }

        fn bytes(&mut self) -> Vec<u8> {
            std::mem::replace(&mut self.0, tar::Builder::new(Vec::new())).into_inner().unwrap()
        }
    }

    fn tree() -> (tempfile::TempDir, OwnedFd) {
        let dir = tempfile::tempdir().unwrap();
        let fd = std::fs::File::open(dir.path()).unwrap().into();
        (dir, fd)
    }

    fn apply_tar(root: &OwnedFd, tar: &[u8]) -> Result<Report, UnpackError> {
        apply(root, tar, Compression::None, 1 << 30)
    }

    #[test]
    fn a_layer_applies_onto_its_parent() {
        let (dir, root) = tree();
        let p = dir.path();
        let lower = Tar::new()
            .dir("etc")
            .file("etc/gone", "x")
            .dir("cache")
            .file("cache/old", "x")
            .file("keep", "lower")
            .bytes();
        apply_tar(&root, &lower).unwrap();
        let mut upper = Tar::new();
        upper
            .add(tar::EntryType::Regular, "./usr/bin/su", b"#!", 0o4755, None)
            .add(tar::EntryType::Symlink, "usr/bin/sh", b"", 0o777, Some("/bin/busybox"))
            .add(tar::EntryType::Link, "usr/bin/su2", b"", 0o644, Some("usr/bin/su"))
            .file("etc/.wh.gone", "")
            .file("cache/new", "made here")
            .file("cache/.wh..wh..opq", "")
            .file("keep", "upper");
        // An attribute of the box's own, and one it may not have.
        let mut h = tar::Header::new_ustar();
        h.set_size(1);
        h.set_mode(0o600);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_path("tagged").unwrap();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_cksum();
        upper
            .0
            .append_pax_extensions([("SCHILY.xattr.user.moat", &b"yes"[..]), ("SCHILY.xattr.trusted.x", &b"no"[..])])
            .unwrap();
        upper.0.append(&h, &b"t"[..]).unwrap();
        let report = apply_tar(&root, &upper.bytes()).unwrap();
        let diff_id = report.diff_id.clone().unwrap();
        assert_eq!(report.xattrs_dropped, 1);
        let su = std::fs::metadata(p.join("usr/bin/su")).unwrap();
        assert_eq!(su.permissions().mode() & 0o7777, 0o4755, "setuid kept");
        assert_eq!(std::fs::read_link(p.join("usr/bin/sh")).unwrap(), Path::new("/bin/busybox"));
        assert_eq!(std::fs::metadata(p.join("usr/bin/su2")).unwrap().ino(), su.ino(), "a hard link");
        assert!(!p.join("etc/gone").exists(), "whiteout");
        assert!(p.join("etc").is_dir());
        assert!(!p.join("cache/old").exists(), "opaque directory");
        assert_eq!(std::fs::read_to_string(p.join("cache/new")).unwrap(), "made here", "what the layer made stays");
        assert_eq!(std::fs::read_to_string(p.join("keep")).unwrap(), "upper");
        assert_eq!(rustix::fs::getxattr(p.join("tagged"), "user.moat", &mut [0u8; 8]).unwrap(), 3);
        assert_eq!(su.mtime(), 1_700_000_000);
        // The digest is the uncompressed tar's, as a config's diff id is.
        let mut again = Tar::new();
        again.file("x", "y");
        let bytes = again.bytes();
        let (_d2, root2) = tree();
        assert_eq!(apply_tar(&root2, &bytes).unwrap().diff_id.unwrap(), Digest::of(&bytes));
        assert_ne!(diff_id, Digest::of(&bytes));
    }

    #[test]
    fn every_escape_stays_inside_or_is_refused() {
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("victim");
        std::fs::write(&target, "host file").unwrap();
        let abs = outside.path().display().to_string();
        let (dir, root) = tree();
        let p = dir.path();
        for bad in ["../x", "a/../../x", "./../x"] {
            let tar = Tar::new().file(bad, "pwned").bytes();
            assert!(matches!(apply_tar(&root, &tar), Err(UnpackError::Escape(_))), "{bad}");
        }
        // A hard link to a file outside: refused, or resolved inside the tree.
        let tar = Tar::new().add(tar::EntryType::Link, "l", b"", 0o644, Some("../../victim")).bytes();
        assert!(matches!(apply_tar(&root, &tar), Err(UnpackError::Escape(_))));
        let tar = Tar::new().add(tar::EntryType::Link, "l", b"", 0o644, Some(&format!("{abs}/victim"))).bytes();
        assert!(apply_tar(&root, &tar).is_err(), "linked the host's file");
        // Writes through symlinks an earlier entry made land inside the tree.
        let tar = Tar::new()
            .add(tar::EntryType::Symlink, "abs", b"", 0o777, Some(&abs))
            .add(tar::EntryType::Symlink, "up", b"", 0o777, Some("../../../../../../../.."))
            .file("abs/victim", "pwned")
            .dir("up/deep")
            .file("up/deep/f", "inside")
            .bytes();
        apply_tar(&root, &tar).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "host file");
        assert_eq!(std::fs::read_to_string(p.join(abs.trim_start_matches('/')).join("victim")).unwrap(), "pwned");
        assert_eq!(std::fs::read_to_string(p.join("deep/f")).unwrap(), "inside");
        // A final symlink is replaced, not followed.
        let tar = Tar::new()
            .add(tar::EntryType::Symlink, "last", b"", 0o777, Some(&format!("{abs}/victim")))
            .file("last", "mine")
            .bytes();
        apply_tar(&root, &tar).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "host file");
        assert!(std::fs::symlink_metadata(p.join("last")).unwrap().is_file());
        // A whiteout cannot name the tree's parent.
        let tar = Tar::new().file(".wh..", "").bytes();
        assert!(apply_tar(&root, &tar).is_err());
        assert!(outside.path().exists() && dir.path().exists());
    }

    /// A later layer writes under a symlink an earlier one made (`var/run ->
    /// /run`, as Debian's images have): the directories it needs are made
    /// where the link points inside the image.
    #[test]
    fn directories_are_made_through_the_images_own_symlinks() {
        let (dir, root) = tree();
        let p = dir.path();
        let lower = Tar::new()
            .dir("run")
            .dir("run/lock")
            .dir("var")
            .add(tar::EntryType::Symlink, "var/run", b"", 0o777, Some("/run"))
            .add(tar::EntryType::Symlink, "var/lock", b"", 0o777, Some("../run/lock"))
            .bytes();
        apply_tar(&root, &lower).unwrap();
        let upper = Tar::new().file("var/run/nginx/nginx.pid", "1").file("var/lock/sub/x", "2").bytes();
        apply_tar(&root, &upper).unwrap();
        assert_eq!(std::fs::read_to_string(p.join("run/nginx/nginx.pid")).unwrap(), "1");
        assert_eq!(std::fs::read_to_string(p.join("run/lock/sub/x")).unwrap(), "2");
        assert!(std::fs::symlink_metadata(p.join("var/run")).unwrap().file_type().is_symlink());
    }

    #[test]
    fn devices_are_skipped_and_bombs_stop() {
        let (dir, root) = tree();
        let tar = Tar::new().add(tar::EntryType::Char, "dev/kmem", b"", 0o600, None).file("ok", "1").bytes();
        let report = apply_tar(&root, &tar).unwrap();
        assert_eq!((report.devices_skipped, report.devices.clone()), (1, vec!["dev/kmem".to_string()]));
        assert!(!dir.path().join("dev/kmem").exists());
        // 64 MiB of zeros is a few KiB of gzip.
        let big = vec![0u8; 64 << 20];
        let tar = Tar::new().add(tar::EntryType::Regular, "bomb", &big, 0o644, None).bytes();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&tar).unwrap();
        let gz = gz.finish().unwrap();
        assert!(gz.len() < 1 << 20);
        let (_d, root) = tree();
        assert!(matches!(apply(&root, &gz[..], Compression::Gzip, 8 << 20), Err(UnpackError::TooLarge(_))));
        let zst = zstd::encode_all(&tar[..], 3).unwrap();
        let (_d, root) = tree();
        assert!(matches!(apply(&root, &zst[..], Compression::Zstd, 8 << 20), Err(UnpackError::TooLarge(_))));
        let (_d, root) = tree();
        assert!(apply(&root, &zst[..], Compression::Zstd, 128 << 20).is_ok());
        let (_d, root) = tree();
        assert!(matches!(
            apply(&root, &b"not a tar at all, not at all"[..], Compression::Gzip, 1 << 20),
            Err(UnpackError::Tar(_))
        ));
    }
}
