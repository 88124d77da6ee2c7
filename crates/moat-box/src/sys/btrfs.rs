//! btrfs: subvolumes (create, snapshot, read-only, delete), qgroups and
//! simple quotas, trim, and reflinked files: the storage pool's kernel calls.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;

/// `BTRFS_SUPER_MAGIC` from `statfs(2)`.
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
const BTRFS_IOCTL_MAGIC: u8 = 0x94;
const BTRFS_SUBVOL_NAME_MAX: usize = 4039;
const BTRFS_PATH_NAME_MAX: usize = 4087;
const BTRFS_SUBVOL_RDONLY: u64 = 1 << 1;

/// `struct btrfs_ioctl_vol_args_v2` (linux/btrfs.h), 4096 bytes.
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; BTRFS_SUBVOL_NAME_MAX + 1],
}

/// `struct btrfs_ioctl_vol_args` (linux/btrfs.h), 4096 bytes.
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; BTRFS_PATH_NAME_MAX + 1],
}

nix::ioctl_write_ptr!(
    /// BTRFS_IOC_SNAP_CREATE_V2
    btrfs_snap_create_v2, BTRFS_IOCTL_MAGIC, 23, VolArgsV2);
nix::ioctl_write_ptr!(
    /// BTRFS_IOC_SUBVOL_CREATE_V2
    btrfs_subvol_create_v2, BTRFS_IOCTL_MAGIC, 24, VolArgsV2);
nix::ioctl_write_ptr!(
    /// BTRFS_IOC_SNAP_DESTROY
    btrfs_snap_destroy, BTRFS_IOCTL_MAGIC, 15, VolArgs);

/// `struct btrfs_qgroup_limit` (linux/btrfs.h).
#[repr(C)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_qgroup_limit_args` (linux/btrfs.h).
#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}

const BTRFS_QGROUP_LIMIT_MAX_EXCL: u64 = 1 << 1;

nix::ioctl_read!(
    /// BTRFS_IOC_QGROUP_LIMIT
    btrfs_qgroup_limit,
    BTRFS_IOCTL_MAGIC,
    43,
    QgroupLimitArgs
);

/// Limits the exclusive bytes of qgroup `qgroupid` on the filesystem at `path`
/// (quotas must be on); qgroupid 0 means the subvolume `path` is in.
pub fn qgroup_limit_exclusive(path: &Path, qgroupid: u64, bytes: u64) -> io::Result<()> {
    let dir = open_dir(path)?;
    let mut args = QgroupLimitArgs {
        qgroupid,
        lim: QgroupLimit { flags: BTRFS_QGROUP_LIMIT_MAX_EXCL, max_rfer: 0, max_excl: bytes, rsv_rfer: 0, rsv_excl: 0 },
    };
    // SAFETY: `args` is a fully initialised btrfs_ioctl_qgroup_limit_args that
    // outlives the call; `dir` is an open directory on the filesystem.
    unsafe { btrfs_qgroup_limit(dir.as_raw_fd(), &mut args) }?;
    Ok(())
}

/// `struct btrfs_ioctl_qgroup_create_args` (linux/btrfs.h).
#[repr(C)]
struct QgroupCreateArgs {
    create: u64,
    qgroupid: u64,
}

/// `struct btrfs_ioctl_qgroup_assign_args` (linux/btrfs.h).
#[repr(C)]
struct QgroupAssignArgs {
    assign: u64,
    src: u64,
    dst: u64,
}

/// `struct btrfs_ioctl_ino_lookup_args` (linux/btrfs.h), 4096 bytes.
#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

nix::ioctl_write_ptr!(
    /// BTRFS_IOC_QGROUP_ASSIGN
    btrfs_qgroup_assign, BTRFS_IOCTL_MAGIC, 41, QgroupAssignArgs);
nix::ioctl_write_ptr!(
    /// BTRFS_IOC_QGROUP_CREATE
    btrfs_qgroup_create, BTRFS_IOCTL_MAGIC, 42, QgroupCreateArgs);
nix::ioctl_readwrite!(
    /// BTRFS_IOC_INO_LOOKUP
    btrfs_ino_lookup, BTRFS_IOCTL_MAGIC, 18, InoLookupArgs);

/// Creates qgroup `qgroupid` on the filesystem at `path`; one that exists already is fine.
pub fn qgroup_create(path: &Path, qgroupid: u64) -> io::Result<()> {
    let dir = open_dir(path)?;
    let args = QgroupCreateArgs { create: 1, qgroupid };
    // SAFETY: `args` is a fully initialised btrfs_ioctl_qgroup_create_args that
    // outlives the call; `dir` is an open directory on the filesystem.
    match unsafe { btrfs_qgroup_create(dir.as_raw_fd(), &args) } {
        Ok(_) | Err(Errno::EEXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Destroys qgroup `qgroupid` (refused while it has members or counts bytes).
pub fn qgroup_destroy(path: &Path, qgroupid: u64) -> io::Result<()> {
    let dir = open_dir(path)?;
    let args = QgroupCreateArgs { create: 0, qgroupid };
    // SAFETY: as for `qgroup_create`.
    unsafe { btrfs_qgroup_create(dir.as_raw_fd(), &args) }?;
    Ok(())
}

/// Makes qgroup `child` a member of `parent` (whose numbers then include the
/// child's); already being one is fine.
pub fn qgroup_assign(path: &Path, child: u64, parent: u64) -> io::Result<()> {
    qgroup_relation(path, child, parent, true)
}

/// Takes qgroup `child` out of `parent`; not being a member is fine.
pub fn qgroup_unassign(path: &Path, child: u64, parent: u64) -> io::Result<()> {
    qgroup_relation(path, child, parent, false)
}

fn qgroup_relation(path: &Path, child: u64, parent: u64, member: bool) -> io::Result<()> {
    let dir = open_dir(path)?;
    let args = QgroupAssignArgs { assign: u64::from(member), src: child, dst: parent };
    // SAFETY: `args` is a fully initialised btrfs_ioctl_qgroup_assign_args that
    // outlives the call; `dir` is an open directory on the filesystem.
    match unsafe { btrfs_qgroup_assign(dir.as_raw_fd(), &args) } {
        Ok(_) => Ok(()),
        // Already as asked.
        Err(Errno::EEXIST) if member => Ok(()),
        Err(Errno::ENOENT) if !member => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The id of the subvolume whose root is `path`.
pub fn subvolume_id(path: &Path) -> io::Result<u64> {
    const BTRFS_FIRST_FREE_OBJECTID: u64 = 256;
    let dir = open_dir(path)?;
    let mut args = InoLookupArgs { treeid: 0, objectid: BTRFS_FIRST_FREE_OBJECTID, name: [0; 4080] };
    // SAFETY: `args` is a fully initialised btrfs_ioctl_ino_lookup_args that
    // outlives the call; treeid 0 asks for the tree `dir` is in.
    unsafe { btrfs_ino_lookup(dir.as_raw_fd(), &mut args) }?;
    Ok(args.treeid)
}

/// `struct btrfs_ioctl_quota_ctl_args` (linux/btrfs.h).
#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

const BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA: u64 = 4;

nix::ioctl_readwrite!(
    /// BTRFS_IOC_QUOTA_CTL
    btrfs_quota_ctl,
    BTRFS_IOCTL_MAGIC,
    40,
    QuotaCtlArgs
);

/// Turns on simple quotas (Linux 6.7+) for the filesystem at `path`.
pub fn quota_enable_simple(path: &Path) -> io::Result<()> {
    let dir = open_dir(path)?;
    let mut args = QuotaCtlArgs { cmd: BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, status: 0 };
    // SAFETY: `args` is a fully initialised btrfs_ioctl_quota_ctl_args that
    // outlives the call; `dir` is an open directory on the filesystem.
    unsafe { btrfs_quota_ctl(dir.as_raw_fd(), &mut args) }?;
    Ok(())
}

/// The ioctl numbers a box must not use (they would let it nest subvolumes the
/// host then cannot delete with the box).
pub const BTRFS_SUBVOLUME_IOCTLS: [u64; 4] = [
    nix::request_code_write!(BTRFS_IOCTL_MAGIC, 1, std::mem::size_of::<VolArgs>()) as u64, // SNAP_CREATE
    nix::request_code_write!(BTRFS_IOCTL_MAGIC, 14, std::mem::size_of::<VolArgs>()) as u64, // SUBVOL_CREATE
    nix::request_code_write!(BTRFS_IOCTL_MAGIC, 23, std::mem::size_of::<VolArgsV2>()) as u64,
    nix::request_code_write!(BTRFS_IOCTL_MAGIC, 24, std::mem::size_of::<VolArgsV2>()) as u64,
];

fn name_bytes<const N: usize>(name: &str) -> io::Result<[u8; N]> {
    let mut out = [0u8; N];
    if name.is_empty() || name.len() >= N || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad subvolume name {name:?}")));
    }
    out.get_mut(..name.len()).ok_or(io::ErrorKind::InvalidInput)?.copy_from_slice(name.as_bytes());
    Ok(out)
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(std::fs::File::open(path)?.into())
}

/// Whether `path` is on btrfs.
pub fn is_btrfs(path: &Path) -> io::Result<bool> {
    let st = nix::sys::statfs::statfs(path)?;
    Ok(st.filesystem_type().0 as i64 == BTRFS_SUPER_MAGIC)
}

/// Creates an empty subvolume `parent/name`.
pub fn subvolume_create(parent: &Path, name: &str) -> io::Result<()> {
    let dir = open_dir(parent)?;
    let args = VolArgsV2 { fd: 0, transid: 0, flags: 0, unused: [0; 4], name: name_bytes(name)? };
    // SAFETY: `args` is a fully initialised btrfs_ioctl_vol_args_v2 that lives across
    // the call, and `dir` is an open directory fd.
    unsafe { btrfs_subvol_create_v2(dir.as_raw_fd(), &args) }?;
    Ok(())
}

/// Snapshots subvolume `source` as `parent/name`, read-only if asked. O(1) in the
/// amount of data: btrfs shares every extent until one side writes.
pub fn subvolume_snapshot(source: &Path, parent: &Path, name: &str, readonly: bool) -> io::Result<()> {
    let src = open_dir(source)?;
    let dir = open_dir(parent)?;
    let flags = if readonly { BTRFS_SUBVOL_RDONLY } else { 0 };
    let args = VolArgsV2 { fd: i64::from(src.as_raw_fd()), transid: 0, flags, unused: [0; 4], name: name_bytes(name)? };
    // SAFETY: as above; `src` stays open for the duration of the call.
    unsafe { btrfs_snap_create_v2(dir.as_raw_fd(), &args) }?;
    Ok(())
}

nix::ioctl_read!(
    /// BTRFS_IOC_SUBVOL_GETFLAGS
    btrfs_subvol_getflags, BTRFS_IOCTL_MAGIC, 25, u64);
nix::ioctl_write_ptr!(
    /// BTRFS_IOC_SUBVOL_SETFLAGS
    btrfs_subvol_setflags, BTRFS_IOCTL_MAGIC, 26, u64);

/// Makes the subvolume whose root is `path` read-only (nothing can change
/// in it after this returns).
pub fn subvolume_set_readonly(path: &Path) -> io::Result<()> {
    let dir = open_dir(path)?;
    let mut flags = 0u64;
    // SAFETY: BTRFS_IOC_SUBVOL_GETFLAGS writes one u64, which `flags` is.
    unsafe { btrfs_subvol_getflags(dir.as_raw_fd(), &mut flags) }?;
    if flags & BTRFS_SUBVOL_RDONLY != 0 {
        return Ok(());
    }
    let flags = flags | BTRFS_SUBVOL_RDONLY;
    // SAFETY: BTRFS_IOC_SUBVOL_SETFLAGS reads one u64, which `flags` is.
    unsafe { btrfs_subvol_setflags(dir.as_raw_fd(), &flags) }?;
    Ok(())
}

/// Deletes subvolume `parent/name` (its data is freed in the background).
pub fn subvolume_delete(parent: &Path, name: &str) -> io::Result<()> {
    let dir = open_dir(parent)?;
    let args = VolArgs { fd: 0, name: name_bytes(name)? };
    // SAFETY: `args` is a fully initialised btrfs_ioctl_vol_args for the call.
    unsafe { btrfs_snap_destroy(dir.as_raw_fd(), &args) }?;
    // The cleaner frees a deleted subvolume's data after the next commit, which
    // by default is up to 30 s away; start one now (without waiting for it) so
    // the space, and the quota it was charged to, come back promptly.
    let mut transid = 0u64;
    // SAFETY: BTRFS_IOC_START_SYNC writes one u64, which `transid` is.
    let _ = unsafe { btrfs_start_sync(dir.as_raw_fd(), &mut transid) };
    Ok(())
}

nix::ioctl_read!(
    /// BTRFS_IOC_START_SYNC
    btrfs_start_sync, BTRFS_IOCTL_MAGIC, 24, u64);

/// `struct fstrim_range` (linux/fs.h).
#[repr(C)]
struct TrimRange {
    start: u64,
    len: u64,
    minlen: u64,
}

nix::ioctl_readwrite!(
    /// FITRIM
    fitrim, b'X', 121, TrimRange);

/// Discards the free space of the filesystem at `path` (for a loop-mounted
/// one, holes are punched in its image file); returns the bytes trimmed.
pub fn trim(path: &Path) -> io::Result<u64> {
    let dir = open_dir(path)?;
    let mut range = TrimRange { start: 0, len: u64::MAX, minlen: 0 };
    // SAFETY: `range` is a fully initialised fstrim_range that outlives the call;
    // the kernel writes the trimmed length back into it.
    unsafe { fitrim(dir.as_raw_fd(), &mut range) }?;
    Ok(range.len)
}

/// `FICLONE`: `_IOW(0x94, 9, int)`.
const FICLONE: libc::Ioctl = 0x4004_9409;

/// Makes `dst` share every extent of `src` (a reflink: no data is copied;
/// both files are on one btrfs).
pub fn reflink(src: &std::fs::File, dst: &std::fs::File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source descriptor as an integer; both files
    // are open for the call.
    if unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE, src.as_raw_fd()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
