//! The package files every box shares: kept on the host once their hash
//! matched what the index promised, named by that hash, bounded in bytes,
//! the least recently used out first. A file is written under a temporary
//! name and renamed into place only once checked, so a half-written or
//! unchecked file is never served. Every call is relative to the open
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
            if name.starts_with(SPOOL) || !is_file || key_hash(&name).is_none() {
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
        let key = key(hash);
        let mut state = self.state();
        state.tick += 1;
        let tick = state.tick;
        let (size, used) = state.files.get_mut(&key)?;
        *used = tick;
        let size = *size;
        drop(state);
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        rustix::fs::openat(&self.dir, key.as_str(), flags, Mode::empty()).ok().map(|fd| (File::from(fd), size))
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
    pub fn keep(&self, mut spool: Spool<'_>, hash: &FileHash, size: u64) -> io::Result<()> {
        let key = key(hash);
        if self.state().files.contains_key(&key) {
            return Ok(());
        }
        spool.file.flush()?;
        rustix::fs::renameat(&self.dir, spool.name.as_str(), &self.dir, key.as_str())?;
        spool.kept = true;
        {
            let mut state = self.state();
            state.tick += 1;
            let tick = state.tick;
            state.total += size;
            state.files.insert(key, (size, tick));
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
}
