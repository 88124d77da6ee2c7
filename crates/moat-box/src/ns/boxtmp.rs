//! One tmpfs for every box's /dev, /dev/shm and /run.
//!
//! A tmpfs of its own was one of the four superblocks a box made (with its
//! proc, its devpts and the mqueue of its IPC namespace), and every
//! superblock on the host gives every memory cgroup a slot in its shrinker
//! map (see `enforce.rs`): 520 bytes, rounded to 1 KiB, per 64 superblocks,
//! so at 10,000 boxes each tmpfs of its own cost every box ~156 KiB more. One tmpfs, mounted in the state dir as the shared
//! sysfs is (and kept across daemon restarts as it is), holds a directory per
//! box instead, bound in as its /dev and /run: a box sees only its own.
//!
//! Sharing loses no bound: a tmpfs's pages and inodes are charged to the
//! memory cgroup of the box that wrote them, whatever the superblock, so a
//! box's memory limit bounds what it keeps there, as it did with a tmpfs of
//! its own. The shared one counts no inodes and is as large as the host's
//! memory, so no box can fill it for the others before memory runs out.
//!
//! A tmpfs of its own went with the box's last process; a directory here is
//! removed when the box stops (and before it starts again, and for boxes a
//! daemon gone left behind), by `rm`, which removes a tree of any depth a
//! box made without following its symlinks.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::statfs::{statfs, TMPFS_MAGIC};

/// The shared tmpfs at `dir`, mounted if it is not already. `None` (and a
/// warning) where it cannot be: boxes then mount a tmpfs each.
pub fn ensure(dir: &Path) -> Option<PathBuf> {
    if mounted(dir) {
        return Some(dir.to_path_buf());
    }
    let made = std::fs::create_dir_all(dir).and_then(|()| {
        // Only root passes its root; boxes see their directories through binds.
        let options = "mode=0700,size=100%,nr_inodes=0";
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        mount(Some("moat-boxtmp"), dir, Some("tmpfs"), flags, Some(options)).map_err(io::Error::from)
    });
    match made {
        Ok(()) => Some(dir.to_path_buf()),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "no shared tmpfs: boxes mount their own");
            None
        }
    }
}

fn mounted(dir: &Path) -> bool {
    statfs(dir).is_ok_and(|s| s.filesystem_type() == TMPFS_MAGIC)
}

/// The directory of box `id` in the shared tmpfs at `shared`.
pub fn box_dir(shared: &Path, id: &str) -> PathBuf {
    shared.join(id)
}

/// Removes what box `id` left in the shared tmpfs (its processes must be
/// gone: nothing may change the tree while it goes).
pub fn clear(shared: &Path, id: &str) -> io::Result<()> {
    remove(&box_dir(shared, id))
}

/// Removes the directories of boxes not in `running` (a daemon gone left
/// them, or a box ended without its stop).
pub fn remove_stale(shared: &Path, running: &[String]) {
    let Ok(entries) = std::fs::read_dir(shared) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !running.contains(&name) {
            if let Err(e) = remove(&entry.path()) {
                tracing::warn!(dir = %entry.path().display(), error = %e, "cannot remove a box's old /dev and /run");
            }
        }
    }
}

/// `rm -rf`: std's `remove_dir_all` recurses once per level, and a box can
/// make a tree deeper than any stack.
fn remove(dir: &Path) -> io::Result<()> {
    if std::fs::symlink_metadata(dir).is_err() {
        return Ok(());
    }
    let out = Command::new("rm").args(["-rf", "--one-file-system", "--"]).arg(dir).output()?;
    if out.status.success() {
        Ok(())
    } else {
        let said = String::from_utf8_lossy(&out.stderr);
        Err(io::Error::other(format!("rm {}: {}", dir.display(), said.trim())))
    }
}

/// Unmounts the shared tmpfs at `dir` (for `moat purge`), with whatever boxes
/// left in it.
pub fn stop(dir: &Path) {
    if mounted(dir) {
        let _ = umount2(dir, MntFlags::MNT_DETACH);
    }
    let _ = std::fs::remove_dir(dir);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// The shared tmpfs in a temporary directory, unmounted however the
    /// test ends.
    struct Mounted(tempfile::TempDir);

    impl Mounted {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let shared = dir.path().join("tmp");
            assert_eq!(ensure(&shared).as_deref(), Some(shared.as_path()));
            Self(dir)
        }

        fn shared(&self) -> PathBuf {
            self.0.path().join("tmp")
        }
    }

    impl Drop for Mounted {
        fn drop(&mut self) {
            stop(&self.shared());
        }
    }

    fn root() -> bool {
        let root = nix::unistd::Uid::effective().is_root();
        if !root {
            eprintln!("skipped: needs root");
        }
        root
    }

    /// One tmpfs, mounted once; `stop` takes it away.
    #[test]
    fn one_tmpfs_is_mounted_once_and_unmounted() {
        if !root() {
            return;
        }
        let tmpfs = Mounted::new();
        let shared = tmpfs.shared();
        let dev = std::fs::metadata(&shared).unwrap().dev();
        assert_ne!(dev, std::fs::metadata(tmpfs.0.path()).unwrap().dev());
        assert_eq!(ensure(&shared).as_deref(), Some(shared.as_path()));
        stop(&shared);
        assert!(!shared.exists());
        // Mounted twice, one `stop` would have left one behind.
        assert!(!mounted(&shared));
    }

    /// A tree deeper than a stack, with a symlink out of it: removed whole,
    /// and what the link named is still there.
    #[test]
    fn a_box_tree_of_any_depth_goes_and_its_links_are_not_followed() {
        if !root() {
            return;
        }
        let tmpfs = Mounted::new();
        let shared = tmpfs.shared();
        let outside = tmpfs.0.path().join("keep");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("file"), "kept").unwrap();
        let mine = box_dir(&shared, "b1");
        std::fs::create_dir(&mine).unwrap();
        std::os::unix::fs::symlink(&outside, mine.join("link")).unwrap();
        // 20,000 levels, made relative to the last so no path is too long.
        let mut level = std::fs::File::open(&mine).unwrap();
        for _ in 0..20_000 {
            nix::sys::stat::mkdirat(&level, "d", nix::sys::stat::Mode::S_IRWXU).unwrap();
            level = std::fs::File::from(
                nix::fcntl::openat(&level, "d", nix::fcntl::OFlag::O_DIRECTORY, nix::sys::stat::Mode::empty()).unwrap(),
            );
        }
        drop(level);
        let other = box_dir(&shared, "b2");
        std::fs::create_dir(&other).unwrap();
        remove_stale(&shared, &["b2".to_string()]);
        assert!(!mine.exists());
        assert!(other.exists());
        assert_eq!(std::fs::read_to_string(outside.join("file")).unwrap(), "kept");
        clear(&shared, "b2").unwrap();
        assert!(!other.exists());
        clear(&shared, "b2").unwrap();
    }
}
