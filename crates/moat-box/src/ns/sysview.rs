//! One /sys for every box.
//!
//! Every superblock on the host gives every memory cgroup a slot in its
//! shrinker map (see `enforce.rs`), so each file system a box mounts of its
//! own makes every box cost more. A sysfs differs from the host's only in the
//! network devices of the namespace it was mounted from, and a box has only
//! `lo`: so one sysfs, mounted from a network namespace holding only `lo`
//! (up, as a box's is), is bound read-only into every box. It stays mounted
//! in the state dir across daemon restarts, as LXCFS's does (boxes keep their
//! binds), and `moat purge` unmounts it. A sysfs holds its network namespace
//! only passively (once the namespace's last process is gone, its devices go
//! from the sysfs too), so the namespace is kept by a bind of its file beside
//! the mount, as `ip netns add` keeps one.

use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::statfs::{statfs, FsType, NSFS_MAGIC, SYSFS_MAGIC};

/// Whether `path` is on a file system of type `fs`.
fn is(path: &Path, fs: FsType) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == fs)
}

/// The shared sysfs at `dir`, mounted if it is not already. `None` (and a
/// warning) where it cannot be: boxes then mount a sysfs each.
pub fn ensure(dir: &Path) -> Option<PathBuf> {
    if serving(dir) {
        return Some(dir.to_path_buf());
    }
    // Something else mounted there (or a sysfs showing other devices): not ours.
    stop(dir);
    let mounted = std::fs::create_dir_all(dir).and_then(|()| mount_from_empty_network(dir));
    match mounted {
        Ok(()) if serving(dir) => Some(dir.to_path_buf()),
        Ok(()) => {
            tracing::warn!(dir = %dir.display(), "the shared /sys shows network devices: boxes mount their own");
            let _ = umount2(dir, MntFlags::MNT_DETACH);
            None
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "no shared /sys: boxes mount their own");
            None
        }
    }
}

/// Whether `dir` is a sysfs whose only network device is `lo`.
fn serving(dir: &Path) -> bool {
    let sysfs = is(dir, SYSFS_MAGIC);
    let devices = std::fs::read_dir(dir.join("class/net"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.file_name())).collect::<Vec<_>>())
        .unwrap_or_default();
    sysfs && devices == ["lo"]
}

/// Where the network namespace of the sysfs at `dir` is kept.
fn network_file(dir: &Path) -> PathBuf {
    dir.with_extension("net")
}

/// Mounts sysfs at `dir` from a new network namespace, on a thread of its own
/// (a network namespace is a thread's), and keeps the namespace.
fn mount_from_empty_network(dir: &Path) -> io::Result<()> {
    let dir = dir.to_path_buf();
    std::fs::File::create(network_file(&dir))?;
    std::thread::spawn(move || {
        let failed = |what: &str, e: nix::Error| io::Error::other(format!("{what}: {e}"));
        unshare(CloneFlags::CLONE_NEWNET).map_err(|e| failed("unshare network", e))?;
        crate::sys::loopback_up().map_err(|e| io::Error::other(format!("loopback up: {e}")))?;
        mount(Some("/proc/thread-self/ns/net"), &network_file(&dir), None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .map_err(|e| failed("keep the network namespace", e))?;
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY;
        mount(Some("sysfs"), &dir, Some("sysfs"), flags, None::<&str>).map_err(|e| failed("mount sysfs", e))
    })
    .join()
    .map_err(|_| io::Error::other("the mounting thread panicked"))?
}

/// Unmounts the shared sysfs at `dir` and lets its network namespace go
/// (for `moat purge`, and before mounting afresh).
pub fn stop(dir: &Path) {
    if is(dir, SYSFS_MAGIC) {
        let _ = umount2(dir, MntFlags::MNT_DETACH);
    }
    let _ = std::fs::remove_dir(dir);
    let net = network_file(dir);
    // Only ever a bind of a namespace file, never what else is there.
    if is(&net, NSFS_MAGIC) {
        let _ = umount2(&net, MntFlags::MNT_DETACH);
    }
    let _ = std::fs::remove_file(net);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// One superblock, whoever asks; only `lo`; removed by `stop`.
    #[test]
    fn one_sysfs_showing_only_lo_is_mounted_once_and_unmounted() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        // Unmounted even when an assertion fails, before the directory goes.
        struct Unmount(PathBuf);
        impl Drop for Unmount {
            fn drop(&mut self) {
                stop(&self.0);
            }
        }
        let _unmount = Unmount(sys.clone());
        let first = ensure(&sys).unwrap();
        let dev = std::fs::metadata(&first).unwrap().dev();
        assert_ne!(dev, std::fs::metadata("/sys").unwrap().dev(), "not the host's /sys");
        assert!(first.join("kernel").is_dir());
        // The namespace outlives the thread that made it: lo is still there
        // once the kernel has had time to dismantle an unheld namespace.
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert!(first.join("class/net/lo").exists());
        let again = ensure(&sys).unwrap();
        assert_eq!(std::fs::metadata(&again).unwrap().dev(), dev, "mounted once");
        assert!(std::fs::write(sys.join("kernel/uevent_helper"), "x").is_err(), "read-only");
        stop(&sys);
        assert!(!sys.exists() && !network_file(&sys).exists());
    }
}
