//! The package files every box shares: kept on the host once their hash
//! matched what the index promised, named by that hash, bounded in bytes,
//! the least recently used out first. A file is written under a temporary
//! name and renamed into place only once checked, so a half-written or
//! unchecked file is never served. The last index read of each package is
//! kept beside them (named by what it was read as), so that a gateway
//! started while a registry is down still lets boxes reinstall. Every call is relative to the open
//! directory (the gateway cannot walk the private state dir above it, and
//! Landlock holds it to this one). File work is plain blocking I/O on the
//! page cache, in small pieces.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::sync::{Mutex, PoisonError};

use rustix::fs::{Mode, OFlags};

use moat_core::policy::packages::FileHash;

/// Prefix of files being written.
const SPOOL: &str = "tmp-";
/// Prefix of kept indexes.
const INDEX: &str = "index-";

/// The cache.
pub struct FileCache {
    dir: OwnedFd,
    max: u64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Key to (size, last use).
    files: HashMap<String, (u64, u64)>,
    total: u64,
    tick: u64,
}

/// A file being written, removed unless kept.
pub struct Spool<'a> {
    /// The open file.
    pub file: File,
    dir: &'a OwnedFd,
    name: String,
    kept: bool,
}

impl Drop for Spool<'_> {
    fn drop(&mut self) {
        if !self.kept {
            let _ = rustix::fs::unlinkat(self.dir, self.name.as_str(), rustix::fs::AtFlags::empty());
        }
    }
}

impl FileCache {
    /// The cache in the open directory `dir`, at most `max` bytes: what an
    /// earlier run kept is kept, oldest first to go; half-written files go.
    pub fn open(dir: OwnedFd, max: u64) -> io::Result<Self> {
        let mut found = Vec::new();
        for entry in rustix::fs::Dir::read_from(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == "." || name == ".." {
                continue;
            }
            let stat = rustix::fs::statat(&dir, name.as_str(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW)?;
            let is_file = rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::RegularFile;
            let known = key_hash(&name).is_some() || is_index_name(&name);
            if name.starts_with(SPOOL) || !is_file || !known {
                let _ = rustix::fs::unlinkat(&dir, name.as_str(), rustix::fs::AtFlags::empty());
                continue;
            }
            found.push((stat.st_mtime, name, stat.st_size as u64));
        }
        found.sort();
        let mut state = State::default();
        for (_, name, size) in found {
            state.tick += 1;
            state.total += size;
            state.files.insert(name, (size, state.tick));
        }
        let cache = Self { dir, max, state: Mutex::new(state) };
        cache.evict();
        Ok(cache)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The kept file with `hash`, opened, and its size.
    pub fn get(&self, hash: &FileHash) -> Option<(File, u64)> {
        self.open_kept(&key(hash))
    }

    /// The entry `name`, opened, and its size (now its most recent use).
    fn open_kept(&self, name: &str) -> Option<(File, u64)> {
        let mut state = self.state();
        state.tick += 1;
        let tick = state.tick;
        let (size, used) = state.files.get_mut(name)?;
        *used = tick;
        let size = *size;
        drop(state);
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        rustix::fs::openat(&self.dir, name, flags, Mode::empty()).ok().map(|fd| (File::from(fd), size))
    }

    /// Keeps `body` (answered as `content_type`) as the index read as
    /// `key`, in place of the one kept before.
    pub fn keep_index(&self, key: &str, content_type: &str, body: &[u8]) -> io::Result<()> {
        if key.contains(['\t', '\n']) || content_type.contains(['\t', '\n']) {
            return Err(io::Error::other("an index key or type with a tab or newline"));
        }
        let mut spool = self.spool()?;
        let head = format!("{key}\t{content_type}\n");
        spool.file.write_all(head.as_bytes())?;
        spool.file.write_all(body)?;
        self.keep_as(spool, index_name(key), (head.len() + body.len()) as u64, true)
    }

    /// The index kept as `key`, if there is one: its content type and body.
    pub fn index(&self, key: &str) -> Option<(String, Vec<u8>)> {
        let (mut file, size) = self.open_kept(&index_name(key))?;
        if size > (super::index::MAX_INDEX as u64) << 1 {
            return None;
        }
        let mut kept = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut kept).ok()?;
        let end = kept.iter().position(|b| *b == b'\n')?;
        let head = std::str::from_utf8(kept.get(..end)?).ok()?;
        let (kept_key, content_type) = head.split_once('\t')?;
        // A name is a hash of the key: the head says it is this key's.
        (kept_key == key).then(|| (content_type.to_string(), kept.get(end + 1..).unwrap_or_default().to_vec()))
    }

    /// A new file to write a download into.
    pub fn spool(&self) -> io::Result<Spool<'_>> {
        let mut id = [0u8; 8];
        getrandom::fill(&mut id).map_err(|e| io::Error::other(e.to_string()))?;
        let name = format!("{SPOOL}{}", crate::git::pack::hex(&id));
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.dir, name.as_str(), flags, Mode::from_raw_mode(0o600))?;
        Ok(Spool { file: File::from(fd), dir: &self.dir, name, kept: false })
    }

    /// Keeps `spool` (`size` bytes, checked to have `hash`), then makes room.
    pub fn keep(&self, spool: Spool<'_>, hash: &FileHash, size: u64) -> io::Result<()> {
        self.keep_as(spool, key(hash), size, false)
    }

    /// Keeps `spool` (`size` bytes) as `name` (`replace`: in place of an
    /// entry of that name; else such an entry stays), then makes room.
    fn keep_as(&self, mut spool: Spool<'_>, name: String, size: u64, replace: bool) -> io::Result<()> {
        if !replace && self.state().files.contains_key(&name) {
            return Ok(());
        }
        spool.file.flush()?;
        rustix::fs::renameat(&self.dir, spool.name.as_str(), &self.dir, name.as_str())?;
        spool.kept = true;
        {
            let mut state = self.state();
            state.tick += 1;
            let tick = state.tick;
            state.total += size;
            if let Some((old, _)) = state.files.insert(name, (size, tick)) {
                state.total -= old;
            }
        }
        self.evict();
        Ok(())
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> u64 {
        self.state().total
    }

    /// Removes the least recently used files until the rest fit.
    fn evict(&self) {
        let mut state = self.state();
        while state.total > self.max {
            let Some(oldest) = state.files.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone()) else {
                break;
            };
            if let Some((size, _)) = state.files.remove(&oldest) {
                state.total -= size;
            }
            let _ = rustix::fs::unlinkat(&self.dir, oldest.as_str(), rustix::fs::AtFlags::empty());
        }
    }
}

/// A file's name in the cache: `sha256-HEX`.
fn key(hash: &FileHash) -> String {
    format!("{}-{}", hash.algorithm.name(), hash.hex)
}

fn key_hash(name: &str) -> Option<FileHash> {
    let (algorithm, hex) = name.split_once('-')?;
    FileHash::new(algorithm, hex)
}

/// A kept index's name: `index-` and the SHA-256 of what it was read as.
fn index_name(key: &str) -> String {
    use sha2::Digest as _;
    format!("{INDEX}{}", crate::git::pack::hex(&sha2::Sha256::digest(key.as_bytes())))
}

fn is_index_name(name: &str) -> bool {
    name.strip_prefix(INDEX).is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    fn hash(byte: &str) -> FileHash {
        FileHash::new("sha256", &byte.repeat(32)).unwrap()
    }

    #[test]
    fn kept_files_come_back_and_the_least_used_go_first() {
        let dir = std::env::temp_dir().join(format!("moat-pkgcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tmp-left-by-a-crash"), b"x").unwrap();
        let open = || OwnedFd::from(File::open(&dir).unwrap());
        let cache = FileCache::open(open(), 10).unwrap();
        assert!(!dir.join("tmp-left-by-a-crash").exists());
        for (h, body) in [("aa", b"1234"), ("bb", b"5678")] {
            let mut spool = cache.spool().unwrap();
            spool.file.write_all(body).unwrap();
            cache.keep(spool, &hash(h), 4).unwrap();
        }
        assert!(cache.get(&hash("aa")).is_some(), "aa is used again: bb is now the oldest");
        let mut spool = cache.spool().unwrap();
        spool.file.write_all(b"9012").unwrap();
        cache.keep(spool, &hash("cc"), 4).unwrap();
        assert!(cache.get(&hash("bb")).is_none());
        assert!(cache.get(&hash("aa")).is_some() && cache.get(&hash("cc")).is_some());
        assert_eq!(cache.bytes(), 8);
        // A spool dropped unkept leaves nothing.
        drop(cache.spool().unwrap());
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // Another run finds what this one kept.
        assert_eq!(FileCache::open(open(), 10).unwrap().bytes(), 8);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_index_is_kept_in_place_of_the_last_and_found_by_another_run() {
        let dir = std::env::temp_dir().join(format!("moat-pkgindex-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let open = || OwnedFd::from(File::open(&dir).unwrap());
        let cache = FileCache::open(open(), 1 << 20).unwrap();
        let key = "pypi.org/simple/demo/ text/html";
        assert_eq!(cache.index(key), None);
        cache.keep_index(key, "text/html", b"<a>1</a>").unwrap();
        cache.keep_index(key, "text/html; charset=utf-8", b"<a>2</a>").unwrap();
        let want = Some(("text/html; charset=utf-8".to_string(), b"<a>2</a>".to_vec()));
        assert_eq!(cache.index(key), want);
        assert_eq!(cache.index("pypi.org/simple/other/ text/html"), None);
        assert_eq!(cache.bytes(), (key.len() + "text/html; charset=utf-8".len() + 2 + 8) as u64, "replaced, not added");
        assert!(cache.keep_index("a\nb", "text/html", b"x").is_err());
        drop(cache);
        let again = FileCache::open(open(), 1 << 20).unwrap();
        assert_eq!(again.index(key), want, "a gateway started later finds it");
        // An index past the bound goes, as files do.
        let small = FileCache::open(open(), 4).unwrap();
        assert_eq!(small.index(key), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
