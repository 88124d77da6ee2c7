//! What changed between two box filesystems: the paths added, modified and
//! deleted in `b` relative to `a`.
//!
//! Both trees may belong to running boxes, which can swap a directory for a
//! symlink at any moment, so the walk goes by directory fds (`openat` with
//! `O_NOFOLLOW`, `fstatat` without following) and never resolves a path that
//! could lead out of the tree. Entries count as modified when their type,
//! mode, owner, size, modification time, device or link target differ. A
//! regular file alike in all those but its status change time, which no
//! program can set (it was written, then its size and mtime put back, as npm
//! does with every file it unpacks; or it was received from elsewhere), is
//! modified if its extended attributes or its contents differ (a `setcap`
//! changes only an attribute and the ctime): both are read then. Listings
//! from a guest carry no contents: there a changed ctime alone counts.

// Reads what a box or its QEMU sends, as root: it cannot panic.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use moat_core::{Change, ChangeKind, ChangeSink};
use nix::dir::Dir;
use nix::fcntl::{openat, readlinkat, AtFlags, OFlag};
use nix::sys::stat::{fstatat, Mode, SFlag};

/// What is compared about one directory entry.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry {
    kind: u32,
    mode: u32,
    uid: u32,
    gid: u32,
    size: i64,
    mtime: (i64, i64),
    /// None in a listing from a guest whose agent predates it.
    ctime: Option<(i64, i64)>,
    rdev: u64,
    target: Option<OsString>,
}

/// How two entries of the same name compare.
#[derive(Debug, PartialEq, Eq)]
enum Likeness {
    Same,
    Differ,
    /// Regular files alike but for their ctime: their attributes and
    /// contents decide.
    SameIfContentsAre,
}

impl From<(moat_agent::walk::Entry, Option<Vec<u8>>)> for Entry {
    fn from((e, target): (moat_agent::walk::Entry, Option<Vec<u8>>)) -> Self {
        use std::os::unix::ffi::OsStringExt;
        Self {
            kind: e.kind,
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
            size: i64::try_from(e.size).unwrap_or(i64::MAX),
            mtime: e.mtime,
            ctime: e.ctime,
            rdev: e.rdev,
            target: target.map(OsString::from_vec),
        }
    }
}

/// One entry of a listed tree: its path (`/`-separated, from the root) and
/// what is compared about it.
pub type Listed = (Vec<u8>, Entry);

impl Entry {
    fn is_dir(&self) -> bool {
        self.kind == SFlag::S_IFDIR.bits()
    }

    /// Directories change mtime whenever an entry does; that is reported
    /// through the entries themselves.
    fn likeness(&self, other: &Entry) -> Likeness {
        let alike = if self.is_dir() && other.is_dir() {
            (self.mode, self.uid, self.gid) == (other.mode, other.uid, other.gid)
        } else {
            let shown = |e: &Entry| (e.kind, e.mode, e.uid, e.gid, e.size, e.mtime, e.rdev);
            shown(self) == shown(other) && self.target == other.target
        };
        match alike {
            false => Likeness::Differ,
            true if self.ctime == other.ctime || self.kind != SFlag::S_IFREG.bits() => Likeness::Same,
            // A side that does not know its change time is taken as alike.
            true if self.ctime.is_none() || other.ctime.is_none() => Likeness::Same,
            true => Likeness::SameIfContentsAre,
        }
    }
}

/// Deepest directory nesting compared (each level holds two fds open).
const MAX_DEPTH: usize = 256;
/// Longest path reported, in bytes (PATH_MAX).
const MAX_PATH: usize = 4096;
/// Most directory entries read, over both trees.
const MAX_ENTRIES: usize = 4_000_000;
/// Most bytes of directory listings held at once (the open directories from
/// the root down to where the walk is, both trees).
const MAX_HELD: usize = 64 << 20;
/// Most bytes of paths reported.
const MAX_OUTPUT: usize = 64 << 20;
/// Longest a comparison may take.
const MAX_TIME: Duration = Duration::from_secs(120);
/// How often a long comparison looks whether its reader is still there.
const STILL_WANTED_EVERY: Duration = Duration::from_secs(1);
/// Files whose contents decide are read this many bytes at a time.
const CONTENTS_CHUNK: usize = 256 << 10;
/// Most bytes read to compare contents, over both trees (a box received
/// from another node has a new ctime on every file): past it, a file whose
/// contents would decide counts as modified (an image push then carries it,
/// which is never wrong).
const MAX_CONTENTS: u64 = 4 << 30;
/// Changes are handed over in batches of about this many bytes of paths.
const BATCH_BYTES: usize = 64 << 10;
/// Bytes a listed entry costs beyond its name (map node, metadata).
const ENTRY_OVERHEAD: usize = 128;

/// Compares the trees rooted at `a` and `b`, handing changes to `out` in
/// batches, in tree order (a directory before what it holds, names sorted
/// byte-wise within a directory), as they are found. `out` returns false to
/// stop early. Trees past the limits above (a box can build them to exhaust
/// the daemon) end in an error after what was found so far.
pub fn diff(a: &Path, b: &Path, out: &mut ChangeSink<'_>) -> io::Result<()> {
    let open_root = |p: &Path| -> io::Result<OwnedFd> { Ok(std::fs::File::open(p)?.into()) };
    let (a, b) = (open_root(a)?, open_root(b)?);
    let mut walk = Walk::new(out);
    let walked = walk.dir(Some(&a), Some(&b), "", 0);
    // What was found before a limit is still worth having.
    let flushed = walk.flush();
    walked.and(flushed)
}

/// Compares two trees given as listings in tree order (a directory before
/// what it holds, names byte-wise sorted within one), as [`diff`] compares
/// two directories, with the same limits. A listing out of order (a hostile
/// guest's) gives a wrong answer, never an unbounded one.
pub fn diff_listings(
    a: &mut dyn Iterator<Item = io::Result<Listed>>,
    b: &mut dyn Iterator<Item = io::Result<Listed>>,
    out: &mut ChangeSink<'_>,
) -> io::Result<()> {
    let mut walk = Walk::new(out);
    let merged = walk.merge(a, b);
    let flushed = walk.flush();
    merged.and(flushed)
}

/// Orders paths as tree order does: component by component.
pub(crate) fn tree_order(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    a.split(|c| *c == b'/').cmp(b.split(|c| *c == b'/'))
}

struct Walk<'a, 'b> {
    out: &'a mut ChangeSink<'b>,
    batch: Vec<Change>,
    batch_bytes: usize,
    output: usize,
    entries: usize,
    held: usize,
    contents_read: u64,
    started: Instant,
    /// When whoever reads the changes was last seen to be there.
    asked: Instant,
}

impl<'a, 'b> Walk<'a, 'b> {
    fn new(out: &'a mut ChangeSink<'b>) -> Self {
        let now = Instant::now();
        Walk {
            out,
            batch: Vec::new(),
            batch_bytes: 0,
            output: 0,
            entries: 0,
            held: 0,
            contents_read: 0,
            started: now,
            asked: now,
        }
    }
}

impl Walk<'_, '_> {
    fn dir(&mut self, a: Option<&OwnedFd>, b: Option<&OwnedFd>, prefix: &str, depth: usize) -> io::Result<()> {
        if depth > MAX_DEPTH {
            // The box names the path: quoted, its newlines and controls escaped.
            return Err(io::Error::other(format!("{prefix:?}: directories nest deeper than {MAX_DEPTH} levels")));
        }
        self.in_time()?;
        self.still_wanted()?;
        let left = self.list(a)?;
        let right = match self.list(b) {
            Ok(right) => right,
            Err(e) => {
                self.held -= left.1;
                return Err(e);
            }
        };
        let result = self.compare(a, b, &left.0, &right.0, prefix, depth);
        self.held -= left.1 + right.1;
        result
    }

    /// Lists a directory (none if that side has no such directory), counting
    /// what it costs against the limits; returns the listing and its size.
    fn list(&mut self, dir: Option<&OwnedFd>) -> io::Result<(BTreeMap<CString, Entry>, usize)> {
        let Some(dir) = dir else { return Ok((BTreeMap::new(), 0)) };
        let mut size = 0;
        let listing = list(dir, &mut |name| {
            size += name.to_bytes().len() + ENTRY_OVERHEAD;
            self.entries += 1;
            if self.entries > MAX_ENTRIES {
                return Err(io::Error::other(format!("more than {MAX_ENTRIES} files to compare")));
            }
            if self.held + size > MAX_HELD {
                return Err(io::Error::other(format!(
                    "directories too large to compare (over {} MiB of listings)",
                    MAX_HELD >> 20
                )));
            }
            Ok(())
        })?;
        self.held += size;
        Ok((listing, size))
    }

    fn compare(
        &mut self,
        a: Option<&OwnedFd>,
        b: Option<&OwnedFd>,
        left: &BTreeMap<CString, Entry>,
        right: &BTreeMap<CString, Entry>,
        prefix: &str,
        depth: usize,
    ) -> io::Result<()> {
        let names: std::collections::BTreeSet<&CString> = left.keys().chain(right.keys()).collect();
        for name in names {
            let path = format!("{prefix}/{}", String::from_utf8_lossy(name.as_bytes()));
            if path.len() > MAX_PATH {
                return Err(io::Error::other(format!(
                    "a path is longer than {MAX_PATH} bytes: {:?}...",
                    prefix.chars().take(64).collect::<String>()
                )));
            }
            let (l, r) = (left.get(name), right.get(name));
            let change = match (l, r) {
                (Some(_), None) => Some(ChangeKind::Deleted),
                (None, Some(_)) => Some(ChangeKind::Added),
                (Some(l), Some(r)) => match l.likeness(r) {
                    Likeness::Same => None,
                    Likeness::Differ => Some(ChangeKind::Modified),
                    Likeness::SameIfContentsAre => match (a, b) {
                        (Some(a), Some(b)) if self.same_file(a, b, name)? => None,
                        _ => Some(ChangeKind::Modified),
                    },
                },
                (None, None) => None,
            };
            if let Some(change) = change {
                self.emit(Change { path: path.clone(), change })?;
            }
            // Descend where either side is a directory; a side that is not one
            // contributes nothing, so its contents count as added or deleted.
            let sub_a = match (a, l) {
                (Some(fd), Some(e)) if e.is_dir() => open_subdir(fd, name)?,
                _ => None,
            };
            let sub_b = match (b, r) {
                (Some(fd), Some(e)) if e.is_dir() => open_subdir(fd, name)?,
                _ => None,
            };
            if sub_a.is_some() || sub_b.is_some() {
                self.dir(sub_a.as_ref(), sub_b.as_ref(), &path, depth + 1)?;
            }
        }
        Ok(())
    }

    fn merge(
        &mut self,
        a: &mut dyn Iterator<Item = io::Result<Listed>>,
        b: &mut dyn Iterator<Item = io::Result<Listed>>,
    ) -> io::Result<()> {
        use std::cmp::Ordering;
        let (mut left, mut right) = (a.next().transpose()?, b.next().transpose()?);
        loop {
            self.entries += 1;
            if self.entries > MAX_ENTRIES {
                return Err(io::Error::other(format!("more than {MAX_ENTRIES} files to compare")));
            }
            self.in_time()?;
            let order = match (&left, &right) {
                (None, None) => return Ok(()),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (Some((l, _)), Some((r, _))) => tree_order(l, r),
            };
            let (path, change) = match (order, &left, &right) {
                (Ordering::Less, Some((l, _)), _) => (l.clone(), Some(ChangeKind::Deleted)),
                (Ordering::Greater, _, Some((r, _))) => (r.clone(), Some(ChangeKind::Added)),
                (_, Some((l, le)), Some((_, re))) => {
                    (l.clone(), (le.likeness(re) != Likeness::Same).then_some(ChangeKind::Modified))
                }
                _ => return Ok(()),
            };
            if path.len() > MAX_PATH {
                return Err(io::Error::other(format!("a path is longer than {MAX_PATH} bytes")));
            }
            if let Some(change) = change {
                self.emit(Change { path: String::from_utf8_lossy(&path).into_owned(), change })?;
            }
            if order != Ordering::Greater {
                left = a.next().transpose()?;
            }
            if order != Ordering::Less {
                right = b.next().transpose()?;
            }
        }
    }

    /// Whether file `name` holds the same attributes and bytes in
    /// directories `a` and `b`. Either gone, or no longer a regular file,
    /// since it was listed (a running box's files change) counts as different.
    fn same_file(&mut self, a: &OwnedFd, b: &OwnedFd, name: &CStr) -> io::Result<bool> {
        use std::io::Read;
        let (Some(a), Some(b)) = (open_file(a, name)?, open_file(b, name)?) else { return Ok(false) };
        if !same_xattrs(&a, &b)? {
            return Ok(false);
        }
        let (mut a, mut b) = (std::fs::File::from(a), std::fs::File::from(b));
        let (mut left, mut right) = (vec![0; CONTENTS_CHUNK], vec![0; CONTENTS_CHUNK]);
        loop {
            self.in_time()?;
            if self.contents_read > MAX_CONTENTS {
                return Ok(false);
            }
            self.still_wanted()?;
            let got = read_full(&mut a, &mut left)?;
            self.contents_read += 2 * got as u64;
            if read_full(&mut b, &mut right)? != got || left.get(..got) != right.get(..got) {
                return Ok(false);
            }
            if got < CONTENTS_CHUNK {
                // Both ended together (a file growing meanwhile is read to where
                // this saw it end; its next comparison sees the rest).
                return Ok(true);
            }
        }

        /// Fills `buf` unless the file ends first; returns how much it holds.
        fn read_full(file: &mut std::fs::File, buf: &mut [u8]) -> io::Result<usize> {
            let mut filled = 0;
            while let Some(rest) = buf.get_mut(filled..).filter(|rest| !rest.is_empty()) {
                match file.read(rest) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(filled)
        }
    }

    /// Ends the comparison past [`MAX_TIME`].
    fn in_time(&self) -> io::Result<()> {
        match self.started.elapsed() > MAX_TIME {
            true => Err(io::Error::other(format!("the comparison took longer than {} s", MAX_TIME.as_secs()))),
            false => Ok(()),
        }
    }

    /// Ends the comparison once nobody reads it (the client went away: a
    /// long one would otherwise hold its turn and a core to the end). Asks
    /// with an empty batch, at most once a second.
    fn still_wanted(&mut self) -> io::Result<()> {
        if self.asked.elapsed() < STILL_WANTED_EVERY {
            return Ok(());
        }
        self.asked = Instant::now();
        match (self.out)(Vec::new()) {
            true => Ok(()),
            false => Err(io::Error::new(io::ErrorKind::BrokenPipe, "nobody is reading the comparison")),
        }
    }

    fn emit(&mut self, change: Change) -> io::Result<()> {
        self.output += change.path.len();
        if self.output > MAX_OUTPUT {
            return Err(io::Error::other(format!(
                "more than {} MiB of changed paths; compare less at once",
                MAX_OUTPUT >> 20
            )));
        }
        self.batch_bytes += change.path.len();
        self.batch.push(change);
        if self.batch_bytes >= BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.batch_bytes = 0;
        let batch = std::mem::take(&mut self.batch);
        if batch.is_empty() || (self.out)(batch) {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::BrokenPipe, "nobody is reading the comparison"))
        }
    }
}

/// Opens directory `name` of `dir`; `None` where it is no longer one: a
/// running box removed it, or swapped it for a file or a symlink, since it
/// was listed (it is reported as listed; what it held is not compared).
fn open_subdir(dir: &OwnedFd, name: &CStr) -> io::Result<Option<OwnedFd>> {
    use nix::errno::Errno;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Opens file `name` of `dir` to read; `None` where it is no longer a
/// regular file. What the name leads to is looked at before it is opened
/// (through an `O_PATH` fd), so a FIFO or a device put there meanwhile is
/// never opened, nor a symlink followed.
fn open_file(dir: &OwnedFd, name: &CStr) -> io::Result<Option<OwnedFd>> {
    let flags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let place = match openat(dir, name, flags, Mode::empty()) {
        Ok(place) => place,
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if nix::sys::stat::fstat(&place)?.st_mode & SFlag::S_IFMT.bits() != SFlag::S_IFREG.bits() {
        return Ok(None);
    }
    // Without waiting on a lease the box holds on it (45 s to break one):
    // a file held so counts as different.
    let reopen = format!("/proc/self/fd/{}", place.as_raw_fd());
    let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    match nix::fcntl::open(reopen.as_str(), flags, Mode::empty()) {
        Ok(file) => Ok(Some(file)),
        Err(nix::errno::Errno::EWOULDBLOCK) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Whether open files `a` and `b` carry the same extended attributes,
/// names and values (all of them: an image push carries some, and a change
/// shown that was none is never wrong). Attributes changed while they are
/// read count as different.
fn same_xattrs(a: &OwnedFd, b: &OwnedFd) -> io::Result<bool> {
    let compared = || -> io::Result<bool> {
        let sorted = |fd: &OwnedFd| -> io::Result<Vec<Vec<u8>>> {
            let list = crate::sys::xattr_names(fd.as_fd())?;
            let mut names: Vec<Vec<u8>> =
                list.split(|c| *c == 0).filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect();
            names.sort();
            Ok(names)
        };
        let names = sorted(a)?;
        if names != sorted(b)? {
            return Ok(false);
        }
        for name in names {
            let name = CString::new(name).map_err(io::Error::other)?;
            let value = |fd: &OwnedFd| crate::sys::xattr_value(fd.as_fd(), &name);
            match (value(a)?, value(b)?) {
                (Some(x), Some(y)) if x == y => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    };
    match compared() {
        Err(e) if e.raw_os_error() == Some(libc::ERANGE) => Ok(false),
        other => other,
    }
}

/// Reads a directory; `admit` is asked before each entry is kept.
fn list(dir: &OwnedFd, admit: &mut dyn FnMut(&CStr) -> io::Result<()>) -> io::Result<BTreeMap<CString, Entry>> {
    let mut entries = BTreeMap::new();
    let mut listing = Dir::from_fd(dir.try_clone()?)?;
    // The listing fd shares its offset with `dir`; start from the top.
    for item in listing.iter() {
        let item = item?;
        let name = item.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        admit(name)?;
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
                ctime: Some((st.st_ctime, st.st_ctime_nsec)),
                rdev: st.st_rdev,
                target,
            },
        );
    }
    Ok(entries)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]
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
        let changes = collect(a.path(), b.path()).unwrap();
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
        assert!(collect(a.path(), a.path()).unwrap().is_empty());
    }

    /// A file written, then given back its size and mtime (npm unpacks
    /// every file with a 1985 mtime: a package upgraded in place can keep a
    /// file's size), is modified; one whose ctime alone moved (a mode
    /// changed and put back) is not; one swapped for a FIFO is, and the
    /// FIFO is not opened (that would wait for a writer).
    #[test]
    fn a_rewrite_that_keeps_size_and_mtime_is_seen_by_its_contents() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(499_162_500);
        for root in [a.path(), b.path()] {
            for name in ["package.json", "touched", "fifo"] {
                std::fs::write(root.join(name), r#"{"version": "1.2.3"}"#).unwrap();
            }
        }
        std::fs::write(b.path().join("package.json"), r#"{"version": "1.2.4"}"#).unwrap();
        let perms = std::fs::metadata(b.path().join("touched")).unwrap().permissions();
        std::fs::set_permissions(b.path().join("touched"), std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        std::fs::set_permissions(b.path().join("touched"), perms).unwrap();
        for root in [a.path(), b.path()] {
            for name in ["package.json", "touched", "fifo"] {
                std::fs::File::options().write(true).open(root.join(name)).unwrap().set_modified(t).unwrap();
            }
            // Past the kernel's clock tick: b's ctimes all differ from a's.
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let changes = collect(a.path(), b.path()).unwrap();
        let got: Vec<(ChangeKind, &str)> = changes.iter().map(|c| (c.change, c.path.as_str())).collect();
        assert_eq!(got, vec![(ChangeKind::Modified, "/package.json")]);
        // Swapped for a FIFO after it was listed.
        let dir: OwnedFd = std::fs::File::open(b.path()).unwrap().into();
        std::fs::remove_file(b.path().join("fifo")).unwrap();
        nix::unistd::mkfifo(&b.path().join("fifo"), Mode::from_bits_truncate(0o644)).unwrap();
        assert!(open_file(&dir, c"fifo").unwrap().is_none());
        std::os::unix::fs::symlink(a.path().join("fifo"), b.path().join("link")).unwrap();
        assert!(open_file(&dir, c"link").unwrap().is_none(), "a symlink is not followed");
        assert!(open_file(&dir, c"gone").unwrap().is_none());
        assert!(open_file(&dir, c"touched").unwrap().is_some());
    }

    /// A file whose only change is an extended attribute (`setcap` writes
    /// `security.capability`; here a `user.` one, which needs no privilege)
    /// is modified; one whose attributes were set to the same again is not.
    #[test]
    fn a_change_of_attributes_alone_is_a_change() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let set = |path: &Path, value: &[u8]| {
            let file = std::fs::File::open(path).unwrap();
            crate::sys::set_xattr(file.as_fd(), c"user.moat", value).unwrap();
        };
        let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(499_162_500);
        for root in [a.path(), b.path()] {
            for name in ["tagged", "same", "plain"] {
                std::fs::write(root.join(name), "bytes").unwrap();
                std::fs::File::options().write(true).open(root.join(name)).unwrap().set_modified(t).unwrap();
            }
            set(&root.join("same"), b"1");
            set(&root.join("tagged"), b"1");
            // Past the kernel's clock tick: b's ctimes all differ from a's.
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        set(&b.path().join("tagged"), b"2");
        set(&b.path().join("same"), b"1");
        set(&b.path().join("plain"), b"new");
        let changes = collect(a.path(), b.path()).unwrap();
        let got: Vec<(ChangeKind, &str)> = changes.iter().map(|c| (c.change, c.path.as_str())).collect();
        assert_eq!(got, vec![(ChangeKind::Modified, "/plain"), (ChangeKind::Modified, "/tagged")]);
    }

    /// A running box swaps a listed directory for a symlink or a file, or
    /// removes it, while the walk goes: that one is not descended into, and
    /// the comparison goes on (it failed, naming no path).
    #[test]
    fn a_directory_gone_since_listed_is_skipped() {
        let root = tempfile::tempdir().unwrap();
        let dir: OwnedFd = std::fs::File::open(root.path()).unwrap().into();
        std::fs::create_dir(root.path().join("d")).unwrap();
        assert!(open_subdir(&dir, c"d").unwrap().is_some());
        std::fs::remove_dir(root.path().join("d")).unwrap();
        assert!(open_subdir(&dir, c"d").unwrap().is_none(), "removed");
        std::os::unix::fs::symlink("/", root.path().join("d")).unwrap();
        assert!(open_subdir(&dir, c"d").unwrap().is_none(), "a symlink");
        std::fs::remove_file(root.path().join("d")).unwrap();
        std::fs::write(root.path().join("d"), "f").unwrap();
        assert!(open_subdir(&dir, c"d").unwrap().is_none(), "a file");
    }

    #[test]
    fn listings_compare_as_trees_do() {
        // The same trees as listings: the same changes, in the same order.
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for root in [a.path(), b.path()] {
            std::fs::create_dir_all(root.join("a/b")).unwrap();
            std::fs::write(root.join("a/b/f"), "1").unwrap();
            std::fs::write(root.join("a.c"), "1").unwrap();
        }
        std::fs::write(b.path().join("a/b/f"), "22").unwrap();
        std::fs::remove_file(b.path().join("a.c")).unwrap();
        std::fs::create_dir(b.path().join("a/new")).unwrap();
        std::fs::write(b.path().join("a/new/g"), "n").unwrap();
        let listing = |root: &Path| -> Vec<io::Result<Listed>> {
            let mut all = Vec::new();
            let mut stack = vec![root.to_path_buf()];
            let mut paths = Vec::new();
            while let Some(dir) = stack.pop() {
                for e in std::fs::read_dir(&dir).unwrap() {
                    let p = e.unwrap().path();
                    if p.is_dir() {
                        stack.push(p.clone());
                    }
                    paths.push(p);
                }
            }
            let rel = |p: &Path| p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            paths.sort_by(|x, y| tree_order(rel(x).as_bytes(), rel(y).as_bytes()));
            for p in paths {
                let dir = std::fs::File::open(p.parent().unwrap()).unwrap().into();
                let name = CString::new(p.file_name().unwrap().as_encoded_bytes()).unwrap();
                let entry = list(&dir, &mut |_| Ok(())).unwrap().remove(&name).unwrap();
                all.push(Ok((format!("/{}", rel(&p)).into_bytes(), entry)));
            }
            all
        };
        let mut got = Vec::new();
        diff_listings(&mut listing(a.path()).into_iter(), &mut listing(b.path()).into_iter(), &mut |batch| {
            got.extend(batch);
            true
        })
        .unwrap();
        assert_eq!(got, collect(a.path(), b.path()).unwrap());
        assert_eq!(got.len(), 4, "{got:?}");
    }

    #[test]
    fn a_hostile_depth_is_an_error_not_a_crash() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // Under a name that would print a line of its own.
        let deep: std::path::PathBuf =
            std::iter::once("x\nA /etc/shadow").chain((0..MAX_DEPTH + 2).map(|_| "d")).collect();
        std::fs::create_dir_all(b.path().join(deep)).unwrap();
        let err = collect(a.path(), b.path()).unwrap_err();
        assert!(err.to_string().contains("deeper than") && !err.to_string().contains('\n'), "{err}");
    }

    fn collect(a: &Path, b: &Path) -> io::Result<Vec<Change>> {
        let mut all = Vec::new();
        diff(a, b, &mut |batch| {
            all.extend(batch);
            true
        })?;
        Ok(all)
    }

    #[test]
    fn long_paths_are_refused_and_output_comes_in_batches_that_can_be_stopped() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // 20 levels of 250-byte names: a 5 KB path, made a level at a time
        // (the kernel refuses such a path whole, as a box would too).
        let mut dir: OwnedFd = std::fs::File::open(b.path()).unwrap().into();
        for i in 0..20 {
            let name = format!("{i:0>250}");
            nix::sys::stat::mkdirat(&dir, name.as_str(), Mode::from_bits_truncate(0o755)).unwrap();
            dir = openat(&dir, name.as_str(), OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        }
        let err = collect(a.path(), b.path()).unwrap_err();
        assert!(err.to_string().contains("longer than 4096 bytes"), "{err}");
        // The same with names of 2-byte characters, so that the message's
        // cut at 64 falls inside one (it panicked the daemon's diff).
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut dir: OwnedFd = std::fs::File::open(b.path()).unwrap().into();
        for i in 0..20 {
            let name = format!("{i:02}{}", "é".repeat(120));
            nix::sys::stat::mkdirat(&dir, name.as_str(), Mode::from_bits_truncate(0o755)).unwrap();
            dir = openat(&dir, name.as_str(), OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        }
        let err = collect(a.path(), b.path()).unwrap_err();
        assert!(err.to_string().contains("longer than 4096 bytes"), "{err}");
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for i in 0..3000 {
            std::fs::write(b.path().join(format!("{i:0>40}")), "").unwrap();
        }
        let mut batches = 0;
        let err = diff(a.path(), b.path(), &mut |_| {
            batches += 1;
            false
        })
        .unwrap_err();
        assert_eq!((err.kind(), batches), (io::ErrorKind::BrokenPipe, 1));
    }
}
