//! The storage pool: a btrfs filesystem holding images (read-only subvolumes)
//! and box roots (writable snapshots of them).
//!
//! Where the state dir is already on btrfs the pool lives there; otherwise a
//! sparse image file in the state dir is formatted once and loop-mounted, as
//! LXD does. Snapshots are O(1) whatever the data size, which is what makes
//! `new` and `dup` instant.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use moat_core::{AccountId, BoxId, Name};

use crate::sys;

/// How the pool got its btrfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolKind {
    /// The state dir is on btrfs.
    Native,
    /// A loop-mounted image file.
    Loop {
        /// The backing file.
        image: PathBuf,
    },
}

/// A pool failure.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A filesystem operation failed.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// What the pool cannot do.
    #[error("{0}")]
    Unsupported(&'static str),
    /// Too little free space for a pool image.
    #[error("only {} MiB free for a storage pool under {} (at least 2 GiB, nine tenths of the free space)", room >> 20, dir.display())]
    NoRoom {
        /// The state directory.
        dir: PathBuf,
        /// Nine tenths of its file system's free bytes.
        room: u64,
    },
    /// An external tool failed.
    #[error("{tool} failed: {stderr}")]
    Tool {
        /// The command.
        tool: &'static str,
        /// What it printed.
        stderr: String,
    },
}

pub(crate) fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> PoolError + 'a {
    move |source| PoolError::Io { what, path: path.to_path_buf(), source }
}

/// The mounted pool.
#[derive(Debug)]
pub struct Pool {
    root: PathBuf,
    kind: PoolKind,
    /// The filesystem's directory in /sys/fs/btrfs (quota numbers live there).
    sysfs: Option<PathBuf>,
}

impl Pool {
    /// Opens the pool under `state_dir`, formatting and mounting a loop image of
    /// `loop_size` bytes (sparse) if the state dir is not on btrfs.
    pub fn open(state_dir: &Path, loop_size: u64) -> Result<Self, PoolError> {
        let root = state_dir.join("pool");
        fs::create_dir_all(&root).map_err(io_err("create", &root))?;
        let kind = if sys::is_btrfs(&root).map_err(io_err("statfs", &root))? {
            if sys::is_btrfs(state_dir).map_err(io_err("statfs", state_dir))? {
                PoolKind::Native
            } else {
                PoolKind::Loop { image: state_dir.join("pool.img") }
            }
        } else {
            let image = state_dir.join("pool.img");
            if image.exists() {
                warn_if_overcommitted(&image, state_dir);
            } else {
                format_image(&image, loop_size.min(room_for_image(state_dir)?))?;
            }
            run(Command::new("mount").args(["-o", MOUNT_OPTIONS]).arg(&image).arg(&root), "mount")?;
            PoolKind::Loop { image }
        };
        if let PoolKind::Loop { .. } = kind {
            // A pool mounted by an older moat gets the options now.
            run(Command::new("mount").args(["-o", "remount,discard=async"]).arg(&root), "mount -o remount")?;
        }
        let sysfs = sysfs_dir(&root);
        let pool = Self { root, kind, sysfs };
        for dir in [pool.images_dir(), pool.boxes_dir()] {
            fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        }
        pool.ensure_quotas()?;
        // Image files keep their owners and setuid bits; no host user may reach them.
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&pool.root, fs::Permissions::from_mode(0o700)).map_err(io_err("chmod", &pool.root))?;
        Ok(pool)
    }

    /// Turns quotas on (they cap each box's disk use) and keeps them exact.
    ///
    /// Simple quotas (Linux 6.7+) charge each extent to the subvolume that
    /// wrote it, which is exactly a box's own disk use; snapshots and deletions
    /// cost nothing and never make the numbers inconsistent. Full qgroups (older
    /// kernels, or a pool made before) mark every number inconsistent when a
    /// snapshot or a large deletion is too costly to account, and then enforce
    /// no limit until a rescan: there the pool accounts every drop and rescans
    /// when it finds the numbers inconsistent.
    pub fn ensure_quotas(&self) -> Result<(), PoolError> {
        let qgroups = self.sysfs.as_ref().map(|d| d.join("qgroups"));
        let enabled =
            qgroups.as_ref().is_some_and(|q| fs::read_to_string(q.join("enabled")).is_ok_and(|s| s.trim() == "1"));
        if !enabled && sys::quota_enable_simple(&self.root).is_err() {
            run(Command::new("btrfs").args(["quota", "enable"]).arg(&self.root), "btrfs quota enable")?;
        }
        let Some(qgroups) = qgroups else { return Ok(()) };
        if fs::read_to_string(qgroups.join("mode")).is_ok_and(|m| m.trim() == "squota") {
            return Ok(());
        }
        let _ = fs::write(qgroups.join("drop_subtree_threshold"), "8");
        if fs::read_to_string(qgroups.join("inconsistent")).is_ok_and(|s| s.trim() == "1") {
            run(Command::new("btrfs").args(["quota", "rescan", "-w"]).arg(&self.root), "btrfs quota rescan")?;
        }
        Ok(())
    }

    /// Whether quotas are simple ones (each extent charged to the subvolume that
    /// wrote it, for as long as it exists, even after that subvolume is deleted).
    pub fn simple_quotas(&self) -> bool {
        self.qgroup_file("mode").is_some_and(|m| m.trim() == "squota")
    }

    /// What the pool's file system holds in all, in bytes.
    pub fn capacity(&self) -> Option<u64> {
        let fs = nix::sys::statvfs::statvfs(&self.root).ok()?;
        Some(fs.blocks().saturating_mul(fs.fragment_size()))
    }

    fn qgroup_file(&self, name: &str) -> Option<String> {
        fs::read_to_string(self.sysfs.as_ref()?.join("qgroups").join(name)).ok()
    }

    /// Where the pool is mounted.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// How the pool got its btrfs.
    pub fn kind(&self) -> &PoolKind {
        &self.kind
    }

    /// The directory holding image subvolumes.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }

    /// The directory holding box root subvolumes.
    pub fn boxes_dir(&self) -> PathBuf {
        self.root.join("boxes")
    }

    /// The read-only subvolume of `image`.
    pub fn image_path(&self, image: &Name) -> PathBuf {
        self.images_dir().join(image.as_str())
    }

    /// The root filesystem of box `id`.
    pub fn box_path(&self, id: &BoxId) -> PathBuf {
        self.boxes_dir().join(id.as_str())
    }

    /// Whether `image` has been built.
    pub fn has_image(&self, image: &Name) -> bool {
        self.image_path(image).is_dir()
    }

    /// Makes box `id`'s root a writable snapshot of `image`.
    pub fn snapshot_image(&self, image: &Name, id: &BoxId) -> Result<PathBuf, PoolError> {
        let src = self.image_path(image);
        sys::subvolume_snapshot(&src, &self.boxes_dir(), id.as_str(), false).map_err(io_err("snapshot", &src))?;
        Ok(self.box_path(id))
    }

    /// Snapshots `image` as a spare root named `name` (see `ns::spare`), and
    /// returns the image's device number, which identifies this build of it.
    pub fn snapshot_spare_root(&self, image: &Name, name: &str) -> Result<u64, PoolError> {
        let src = self.image_path(image);
        let dev = std::os::unix::fs::MetadataExt::dev(&fs::metadata(&src).map_err(io_err("stat", &src))?);
        sys::subvolume_snapshot(&src, &self.boxes_dir(), name, false).map_err(io_err("snapshot", &src))?;
        Ok(dev)
    }

    /// The device number of `image`'s subvolume; a rebuilt image gets a new one.
    pub fn image_dev(&self, image: &Name) -> Option<u64> {
        fs::metadata(self.image_path(image)).ok().map(|m| std::os::unix::fs::MetadataExt::dev(&m))
    }

    /// Gives spare root `name` to box `id` (a rename: no data moves).
    pub fn adopt_spare_root(&self, name: &str, id: &BoxId) -> Result<PathBuf, PoolError> {
        let from = self.boxes_dir().join(name);
        fs::rename(&from, self.box_path(id)).map_err(io_err("rename", &from))?;
        Ok(self.box_path(id))
    }

    /// Deletes a spare root (or any subvolume under `boxes/` by name).
    pub fn delete_spare_root(&self, name: &str) -> Result<(), PoolError> {
        let path = self.boxes_dir().join(name);
        sys::subvolume_delete(&self.boxes_dir(), name).map_err(io_err("delete subvolume", &path))
    }

    /// Names of the subvolumes under `boxes/` that start with `prefix`.
    pub fn boxes_named_with_prefix(&self, prefix: &str) -> Vec<String> {
        names_with_prefix(&self.boxes_dir(), prefix)
    }

    /// Makes box `id`'s directory a new, empty subvolume (a VM box's: its
    /// disk file and the host's files for it go there).
    pub fn create_box(&self, id: &BoxId) -> Result<PathBuf, PoolError> {
        let path = self.box_path(id);
        sys::subvolume_create(&self.boxes_dir(), id.as_str()).map_err(io_err("create subvolume", &path))?;
        Ok(path)
    }

    /// Where VM disks made from images are kept (one per build of an image).
    pub fn vm_bases_dir(&self) -> PathBuf {
        self.root.join("vm-bases")
    }

    /// Where saved VM machines are kept (outside the boxes' subvolumes: a
    /// machine's memory is not its box's disk use).
    pub fn vm_states_dir(&self) -> PathBuf {
        self.root.join("vm-states")
    }

    /// Where box `id`'s machine is kept while it is saved (a parked VM box,
    /// or a copy of a running one until its first session): its devices'
    /// state, with its memory beside it in [`Pool::vm_memory`] (or within, for
    /// a machine booted before memory files). It belongs to the disk it was
    /// saved with, and goes with it.
    pub fn saved_machine(&self, id: &BoxId) -> PathBuf {
        self.vm_states_dir().join(format!("{id}.state"))
    }

    /// Box `id`'s guest memory: a file its QEMU maps as the guest's RAM
    /// while the machine runs, and which stays as the memory of its saved
    /// machine (the saved state then holds only the devices'), so a save
    /// writes no memory and a copy of one is a reflink.
    pub fn vm_memory(&self, id: &BoxId) -> PathBuf {
        self.vm_states_dir().join(format!("{id}.mem"))
    }

    /// Removes box `id`'s saved machine, any save of it cut short, and its
    /// guest memory (only ever called when no QEMU of it runs).
    pub fn forget_saved_machine(&self, id: &BoxId) -> std::io::Result<()> {
        let saved = self.saved_machine(id);
        for path in [saved.with_extension("partial"), saved, self.vm_memory(id)] {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// Where the VM guests' kernel is kept unpacked.
    pub fn vm_kernels_dir(&self) -> PathBuf {
        self.root.join("vm-kernels")
    }

    /// Makes box `dst`'s root a writable snapshot of box `src`'s root.
    pub fn snapshot_box(&self, src: &BoxId, dst: &BoxId) -> Result<PathBuf, PoolError> {
        let from = self.box_path(src);
        sys::subvolume_snapshot(&from, &self.boxes_dir(), dst.as_str(), false).map_err(io_err("snapshot", &from))?;
        Ok(self.box_path(dst))
    }

    /// Caps what box `id` may write beyond what it shares with its image or
    /// parent (its exclusive bytes); writes past it fail with EDQUOT.
    pub fn set_disk_limit(&self, id: &BoxId, bytes: u64) -> Result<(), PoolError> {
        let path = self.box_path(id);
        sys::qgroup_limit_exclusive(&path, 0, bytes).map_err(io_err("set disk limit on", &path))
    }

    /// Bytes box `id` holds that no other subvolume shares (what it wrote,
    /// including what only its checkpoints still hold).
    pub fn exclusive_bytes(&self, id: &BoxId) -> Option<u64> {
        let of_box = self.qgroup_exclusive(box_qgroup(id));
        of_box.or_else(|| self.qgroup_exclusive(sys::subvolume_id(&self.box_path(id)).ok()?))
    }

    /// Charges box `id`'s writes to `account`'s qgroup too, whose total is
    /// capped at `budget`.
    ///
    /// With simple quotas, data stays charged to the subvolume that wrote it
    /// after that subvolume is deleted; without an account group, `dup` then
    /// `rm` of the parent would leave it charged to nobody and let one box hold
    /// any amount. The account group keeps counting it. (Full qgroups move such
    /// data onto the copies' own numbers instead, where their per-box limits
    /// hold; assigning there would make every number inconsistent, so it is
    /// not done and the account budget is not enforced.)
    pub fn charge_account(&self, id: &BoxId, account: &AccountId, budget: u64) -> Result<(), PoolError> {
        if !self.simple_quotas() {
            return Ok(());
        }
        let path = self.box_path(id);
        let group = account_qgroup(account);
        sys::qgroup_create(&self.root, group).map_err(io_err("create account qgroup on", &self.root))?;
        sys::qgroup_limit_exclusive(&self.root, group, budget)
            .map_err(io_err("limit account qgroup on", &self.root))?;
        let subvolume = sys::subvolume_id(&path).map_err(io_err("look up subvolume", &path))?;
        sys::qgroup_assign(&self.root, subvolume, group).map_err(io_err("charge account for", &path))
    }

    /// Charges box `id`'s writes to `to` instead of `from` (a box booted
    /// ahead of demand, given to its owner).
    pub fn move_charge(&self, id: &BoxId, from: &AccountId, to: &AccountId, budget: u64) -> Result<(), PoolError> {
        if !self.simple_quotas() {
            return Ok(());
        }
        let path = self.box_path(id);
        let subvolume = sys::subvolume_id(&path).map_err(io_err("look up subvolume", &path))?;
        sys::qgroup_unassign(&self.root, subvolume, account_qgroup(from))
            .map_err(io_err("stop charging the account for", &path))?;
        self.charge_account(id, to, budget)
    }

    /// Bytes written by `account`'s boxes, including removed boxes' data their
    /// copies still share (simple quotas only).
    pub fn account_bytes(&self, account: &AccountId) -> Option<u64> {
        self.qgroup_exclusive(account_qgroup(account))
    }

    /// The exclusive bytes of qgroup `qgroupid` (level in the top 16 bits; a
    /// bare subvolume id is level 0), from sysfs.
    pub(crate) fn qgroup_exclusive(&self, qgroupid: u64) -> Option<u64> {
        self.qgroup_number(qgroupid, "exclusive")
    }

    /// The exclusive bytes qgroup `qgroupid` may count, if it exists and is
    /// limited.
    pub(crate) fn qgroup_limit(&self, qgroupid: u64) -> Option<u64> {
        self.qgroup_number(qgroupid, "max_exclusive").filter(|limit| *limit > 0)
    }

    fn qgroup_number(&self, qgroupid: u64, field: &str) -> Option<u64> {
        let (level, id) = (qgroupid >> 48, qgroupid & ((1 << 48) - 1));
        self.qgroup_file(&format!("{level}_{id}/{field}"))?.trim().parse().ok()
    }

    /// Gives the pool's free space back to the host's disk now (a loop pool's
    /// image would otherwise keep every block that was ever written, metadata
    /// churn included; `discard=async` alone leaves some of it).
    pub fn trim(&self) -> Result<u64, PoolError> {
        sys::trim(&self.root).map_err(io_err("trim", &self.root))
    }

    /// Where the host keeps the private key of box `id`'s TLS CA (outside
    /// every box's tree; only root reads it).
    pub fn ca_key_path(&self, id: &BoxId) -> PathBuf {
        self.root.join("keys").join(format!("{id}.ca.pem"))
    }

    /// Stores box `id`'s CA key (mode 0600, replaced whole). Not synced: a
    /// key lost to a power cut leaves a box whose looked-inside hosts are
    /// refused until it is duplicated, which a create's latency is not
    /// worth paying a disk flush to prevent.
    pub fn store_ca_key(&self, id: &BoxId, pem: &str) -> Result<(), PoolError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let path = self.ca_key_path(id);
        let dir = self.root.join("keys");
        fs::DirBuilder::new().mode(0o700).recursive(true).create(&dir).map_err(io_err("make key directory", &dir))?;
        let tmp = path.with_extension("tmp");
        let _ = fs::remove_file(&tmp);
        let write = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| io::Write::write_all(&mut f, pem.as_bytes()))
            .and_then(|()| fs::rename(&tmp, &path));
        write.map_err(io_err("store CA key", &path))
    }

    /// Deletes box `id`'s root, checkpoints and CA key, if they exist; what
    /// they hold that copies of it keep alive is charged to those copies
    /// ([`crate::lineage`]).
    pub fn delete_box(&self, id: &BoxId) -> Result<(), PoolError> {
        let path = self.box_path(id);
        if path.exists() {
            self.bequeath(id)?;
        }
        self.delete_checkpoints(id)?;
        let _ = fs::remove_file(self.ca_key_path(id));
        if path.exists() {
            sys::subvolume_delete(&self.boxes_dir(), id.as_str()).map_err(io_err("delete subvolume", &path))?;
        }
        self.forget_copy(id)
    }
}

/// Loop pools: boxes get nosuid and nodev on their own mounts (debootstrap
/// makes device nodes here); space a box frees goes back to the host's disk.
const MOUNT_OPTIONS: &str = "loop,nosuid,discard=async";

/// The level-1 qgroup holding every root box `id` has had.
pub fn box_qgroup(id: &BoxId) -> u64 {
    level1_qgroup("box", id.as_str())
}

/// The level-1 qgroup of `account`: a stable 48-bit hash of its name (FNV-1a;
/// two accounts sharing one would share a budget, at odds of 2^-48 a pair).
pub fn account_qgroup(account: &AccountId) -> u64 {
    level1_qgroup("", &account.0)
}

/// A level-1 qgroup named by a stable 48-bit hash (FNV-1a) of `kind` and
/// `key` (an account's group hashes its name alone, as it always has).
pub(crate) fn level1_qgroup(kind: &str, key: &str) -> u64 {
    let tagged = if kind.is_empty() { key.to_string() } else { format!("{kind}/{key}") };
    let hash =
        tagged.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    (1 << 48) | (hash & ((1 << 48) - 1))
}

/// The btrfs filesystem's directory in /sys/fs/btrfs.
fn sysfs_dir(root: &Path) -> Option<PathBuf> {
    let out = Command::new("btrfs").args(["filesystem", "show"]).arg(root).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let uuid = text.split("uuid: ").nth(1)?.split_whitespace().next()?;
    Some(PathBuf::from("/sys/fs/btrfs").join(uuid))
}

/// Names of the entries of `dir` that start with `prefix` (none if it is unreadable).
pub(crate) fn names_with_prefix(dir: &Path, prefix: &str) -> Vec<String> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// The least pool worth making.
const SMALLEST_POOL: u64 = 2 << 30;

/// How large a pool image the file system under `dir` can hold: nine tenths
/// of its free space, the rest left to the host. A sparse image larger than
/// that would let boxes (each under its own limit) fill the host's disk, and
/// the host's own files (the state database among them) with it.
fn room_for_image(dir: &Path) -> Result<u64, PoolError> {
    let room = free_bytes(dir).map_err(|e| io_err("statvfs", dir)(e.into()))? / 10 * 9;
    if room < SMALLEST_POOL {
        return Err(PoolError::NoRoom { dir: dir.to_path_buf(), room });
    }
    Ok(room)
}

/// Says so in the log when the pool's image can grow beyond what its file
/// system has free (made before pools were sized by it, or the host's own
/// files grew since).
fn warn_if_overcommitted(image: &Path, dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let (Ok(meta), Ok(free)) = (fs::metadata(image), free_bytes(dir)) else { return };
    let can_hold = meta.blocks().saturating_mul(512).saturating_add(free);
    if meta.len() > can_hold {
        tracing::warn!(
            image = %image.display(),
            size_gib = meta.len() >> 30,
            room_gib = can_hold >> 30,
            "the pool's image can grow beyond its file system's free space: boxes could fill the host's disk; \
             free space there, or move the state directory to a larger disk or to btrfs"
        );
    }
}

/// What the file system under `dir` has free (for an unprivileged writer).
fn free_bytes(dir: &Path) -> nix::Result<u64> {
    let fs = nix::sys::statvfs::statvfs(dir)?;
    Ok(fs.blocks_available().saturating_mul(fs.fragment_size()))
}

fn format_image(image: &Path, size: u64) -> Result<(), PoolError> {
    let tmp = image.with_extension("img.new");
    let file = fs::File::create(&tmp).map_err(io_err("create", &tmp))?;
    file.set_len(size).map_err(io_err("size", &tmp))?;
    drop(file);
    // One copy of metadata, as of data: quotas charge a tree block once, so
    // with two (mkfs's default) a box that fills its limit with empty files
    // costs the host twice its limit (and both copies are on the one host
    // disk the loop image is on, which they would not survive the loss of).
    run(Command::new("mkfs.btrfs").args(["-q", "-f", "-m", "single"]).arg(&tmp), "mkfs.btrfs")?;
    // Only a fully formatted image gets the real name.
    fs::rename(&tmp, image).map_err(io_err("rename", &tmp))
}

/// Runs an external tool, turning a failure into an error that says what it printed.
pub(crate) fn run(cmd: &mut Command, tool: &'static str) -> Result<(), PoolError> {
    let out = cmd.output().map_err(|e| PoolError::Tool { tool, stderr: e.to_string() })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(PoolError::Tool { tool, stderr: String::from_utf8_lossy(&out.stderr).trim().to_string() })
    }
}

impl Pool {
    /// Unmounts a loop-backed pool (the loop device goes with the last user).
    /// Boxes must be stopped first: each holds a reference to the filesystem.
    pub fn unmount(self) -> Result<(), PoolError> {
        match self.kind {
            PoolKind::Native => Ok(()),
            PoolKind::Loop { .. } => run(Command::new("umount").arg(&self.root), "umount"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_image_is_no_larger_than_its_file_system_can_hold() {
        // A small file system of its own (root, as the suite runs).
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"]).arg(dir.path()).status();
        if !mounted.is_ok_and(|s| s.success()) {
            eprintln!("skipped: cannot mount a tmpfs (not root?)");
            return;
        }
        let refused = room_for_image(dir.path());
        let _ = Command::new("umount").arg(dir.path()).status();
        let Err(PoolError::NoRoom { room, .. }) = refused else { panic!("{refused:?}") };
        assert!(room < 64 << 20 && room > 50 << 20, "{room}");
        assert!(refused.unwrap_err().to_string().contains("MiB free for a storage pool"));
    }
}
