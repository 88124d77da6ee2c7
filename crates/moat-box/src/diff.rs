//! What changed between two box filesystems: the paths added, modified and
//! deleted in `b` relative to `a`.
//!
//! Both trees may belong to running boxes, which can swap a directory for a
//! symlink at any moment, so the walk goes by directory fds (`openat` with
//! `O_NOFOLLOW`, `fstatat` without following) and never resolves a path that
//! could lead out of the tree. Files count as modified when their type, mode,
//! owner, size, modification time, device or link target differ; content is not
//! read (a write that restores size and mtime is not seen).

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, OsString};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use moat_core::{Change, ChangeKind};
use nix::dir::Dir;
use nix::fcntl::{openat, readlinkat, AtFlags, OFlag};
use nix::sys::stat::{fstatat, Mode, SFlag};

/// What is compared about one directory entry.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    kind: u32,
    mode: u32,
    uid: u32,
    gid: u32,
    size: i64,
    mtime: (i64, i64),
    rdev: u64,
    target: Option<OsString>,
}

impl Entry {
    fn is_dir(&self) -> bool {
        self.kind == SFlag::S_IFDIR.bits()
    }

    /// Directories change mtime whenever an entry does; that is reported
    /// through the entries themselves.
    fn differs(&self, other: &Entry) -> bool {
        if self.is_dir() && other.is_dir() {
            (self.mode, self.uid, self.gid) != (other.mode, other.uid, other.gid)
        } else {
            self != other
        }
    }
}

/// Deepest directory nesting compared (each level holds two fds open).
const MAX_DEPTH: usize = 256;
/// Most directory entries read, over both trees.
const MAX_ENTRIES: usize = 4_000_000;

/// Compares the trees rooted at `a` and `b`. Trees deeper or larger than the
/// limits above (a box can build them to exhaust the daemon) are an error.
pub fn diff(a: &Path, b: &Path) -> io::Result<Vec<Change>> {
    let open_root = |p: &Path| -> io::Result<OwnedFd> { Ok(std::fs::File::open(p)?.into()) };
    let mut walk = Walk { out: Vec::new(), entries: 0 };
    walk.dir(Some(&open_root(a)?), Some(&open_root(b)?), "", 0)?;
    walk.out.sort();
    Ok(walk.out)
}

struct Walk {
    out: Vec<Change>,
    entries: usize,
}

impl Walk {
    fn dir(&mut self, a: Option<&OwnedFd>, b: Option<&OwnedFd>, prefix: &str, depth: usize) -> io::Result<()> {
        if depth > MAX_DEPTH {
            return Err(io::Error::other(format!("{prefix}: directories nest deeper than {MAX_DEPTH} levels")));
        }
        let left = match a {
            Some(fd) => list(fd)?,
            None => BTreeMap::new(),
        };
        let right = match b {
            Some(fd) => list(fd)?,
            None => BTreeMap::new(),
        };
        self.entries += left.len() + right.len();
        if self.entries > MAX_ENTRIES {
            return Err(io::Error::other(format!("more than {MAX_ENTRIES} files to compare")));
        }
        let names: std::collections::BTreeSet<&CString> = left.keys().chain(right.keys()).collect();
        for name in names {
            let path = format!("{prefix}/{}", String::from_utf8_lossy(name.as_bytes()));
            let (l, r) = (left.get(name), right.get(name));
            let change = match (l, r) {
                (Some(_), None) => Some(ChangeKind::Deleted),
                (None, Some(_)) => Some(ChangeKind::Added),
                (Some(l), Some(r)) if l.differs(r) => Some(ChangeKind::Modified),
                _ => None,
            };
            if let Some(change) = change {
                self.out.push(Change { path: path.clone(), change });
            }
            // Descend where either side is a directory; a side that is not one
            // contributes nothing, so its contents count as added or deleted.
            let sub_a = match (a, l) {
                (Some(fd), Some(e)) if e.is_dir() => Some(open_subdir(fd, name)?),
                _ => None,
            };
            let sub_b = match (b, r) {
                (Some(fd), Some(e)) if e.is_dir() => Some(open_subdir(fd, name)?),
                _ => None,
            };
            if sub_a.is_some() || sub_b.is_some() {
                self.dir(sub_a.as_ref(), sub_b.as_ref(), &path, depth + 1)?;
            }
        }
        Ok(())
    }
}

fn open_subdir(dir: &OwnedFd, name: &CStr) -> io::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    Ok(openat(dir, name, flags, Mode::empty())?)
}

fn list(dir: &OwnedFd) -> io::Result<BTreeMap<CString, Entry>> {
    let mut entries = BTreeMap::new();
    let mut listing = Dir::from_fd(dir.try_clone()?)?;
    // The listing fd shares its offset with `dir`; start from the top.
    for item in listing.iter() {
        let item = item?;
        let name = item.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let st = match fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            // Removed while we looked: a running box's files come and go.
            Err(nix::errno::Errno::ENOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        let kind = st.st_mode & SFlag::S_IFMT.bits();
        let target = if kind == SFlag::S_IFLNK.bits() { readlinkat(dir.as_fd(), name).ok() } else { None };
        entries.insert(
            name.to_owned(),
            Entry {
                kind,
                mode: st.st_mode & 0o7777,
                uid: st.st_uid,
                gid: st.st_gid,
                size: st.st_size,
                mtime: (st.st_mtime, st.st_mtime_nsec),
                rdev: st.st_rdev,
                target,
            },
        );
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_added_modified_deleted_and_never_follows_links() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("host-secret"), "x").unwrap();
        for root in [a.path(), b.path()] {
            std::fs::create_dir_all(root.join("etc/sub")).unwrap();
            std::fs::write(root.join("etc/same"), "same").unwrap();
            std::fs::write(root.join("etc/gone"), "old").unwrap();
            std::fs::write(root.join("etc/sub/edit"), "v1").unwrap();
        }
        let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        for root in [a.path(), b.path()] {
            std::fs::File::options().write(true).open(root.join("etc/same")).unwrap().set_modified(t).unwrap();
        }
        std::fs::remove_file(b.path().join("etc/gone")).unwrap();
        std::fs::write(b.path().join("etc/sub/edit"), "version 2").unwrap();
        std::fs::create_dir(b.path().join("new")).unwrap();
        std::fs::write(b.path().join("new/file"), "n").unwrap();
        // A symlink to a host directory is a change, and is not descended into.
        std::os::unix::fs::symlink(outside.path(), b.path().join("escape")).unwrap();
        let changes = diff(a.path(), b.path()).unwrap();
        let got: Vec<(ChangeKind, &str)> = changes.iter().map(|c| (c.change, c.path.as_str())).collect();
        assert_eq!(
            got,
            vec![
                (ChangeKind::Added, "/escape"),
                (ChangeKind::Deleted, "/etc/gone"),
                (ChangeKind::Modified, "/etc/sub/edit"),
                (ChangeKind::Added, "/new"),
                (ChangeKind::Added, "/new/file"),
            ]
        );
        assert!(diff(a.path(), a.path()).unwrap().is_empty());
    }

    #[test]
    fn a_hostile_depth_is_an_error_not_a_crash() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let deep: std::path::PathBuf = (0..MAX_DEPTH + 2).map(|_| "d").collect();
        std::fs::create_dir_all(b.path().join(deep)).unwrap();
        let err = diff(a.path(), b.path()).unwrap_err();
        assert!(err.to_string().contains("deeper than"), "{err}");
    }
}
