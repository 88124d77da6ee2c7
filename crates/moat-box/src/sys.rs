//! The raw kernel calls moat needs that no safe wrapper offers: btrfs subvolume
//! ioctls, the new mount API (`open_tree`, `mount_setattr`, `move_mount`),
//! seccomp and interface flags. Each is a thin, typed wrapper; callers never see
//! a raw pointer.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
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

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x0000_0004;

/// `struct mount_attr` (linux/mount.h).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A detached copy of the mount tree at `path` (`open_tree(OPEN_TREE_CLONE |
/// AT_RECURSIVE)`), not yet attached anywhere.
pub fn open_tree_clone(path: &CStr) -> io::Result<OwnedFd> {
    let flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_RECURSIVE as libc::c_uint;
    // SAFETY: `path` is a valid NUL-terminated string; the syscall returns a new fd
    // or -1 and touches no memory of ours besides reading the path.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Makes the detached mount `tree` show file owners through the id mapping of
/// user namespace `userns` (an idmapped mount), and ignore device nodes and
/// setuid bits.
pub fn mount_set_idmap(tree: BorrowedFd<'_>, userns: BorrowedFd<'_>) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: `attr` is initialised and its size is passed; the empty path with
    // AT_EMPTY_PATH makes the call act on `tree` itself.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Attaches the detached mount `tree` at `target`.
pub fn move_mount_to(tree: BorrowedFd<'_>, target: &CStr) -> io::Result<()> {
    // SAFETY: both paths are valid NUL-terminated strings; the call reads them only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The kernel's view of `filter`; it borrows `filter`, which must outlive it.
fn fprog(filter: &[libc::sock_filter]) -> io::Result<libc::sock_fprog> {
    Ok(libc::sock_fprog {
        len: u16::try_from(filter.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        filter: filter.as_ptr().cast_mut(),
    })
}

/// Sets the calling thread's seccomp filter (no_new_privs must be set already).
pub fn install_seccomp(filter: &[libc::sock_filter]) -> io::Result<()> {
    let prog = fprog(filter)?;
    // SAFETY: `prog` points at `filter`, which outlives the call; the kernel copies
    // the program before returning.
    let rc = unsafe { libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Installs a seccomp filter whose `SECCOMP_RET_USER_NOTIF` verdicts go to the
/// returned listener (close-on-exec, as the kernel makes it).
pub fn install_seccomp_with_listener(filter: &[libc::sock_filter]) -> io::Result<OwnedFd> {
    let prog = fprog(filter)?;
    // SAFETY: `prog` points at `filter`, which outlives the call; the kernel copies
    // the program before returning, and returns a new fd we then own.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &prog as *const libc::sock_fprog,
        )
    };
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own, on an open
    // socket; the union member used is ifru_flags, as the ioctls define.
    unsafe {
        if libc::ioctl(sock.as_fd().as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_fd().as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Turns an errno-style result into `io::Result`.
pub fn check(r: nix::Result<()>) -> io::Result<()> {
    r.map_err(|e: Errno| io::Error::from_raw_os_error(e as i32))
}

/// Duplicates `fd` onto descriptor number `target` (without close-on-exec), for a
/// program about to be exec'd that expects it there.
pub fn dup_onto(fd: BorrowedFd<'_>, target: i32) -> io::Result<()> {
    if fd.as_raw_fd() == target {
        // dup2 onto itself would keep close-on-exec; the point is to pass it on.
        return Ok(nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty())).map(drop)?);
    }
    // SAFETY: dup2 takes two integers; `fd` is open for the call, and replacing
    // whatever `target` was is the point (the caller owns the fd table layout).
    if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Closes every descriptor from `first` up: what a parent leaked stays out.
pub fn close_from(first: u32) -> io::Result<()> {
    // SAFETY: close_range takes integers and touches only the fd table; the
    // caller owns every descriptor at or above `first` and holds none of them.
    if unsafe { libc::close_range(first, u32::MAX, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Drops every capability but `keep` from the bounding set, so that nothing
/// this thread runs could gain another, and clears the ambient set. Needs
/// CAP_SETPCAP, so it comes before dropping root.
pub fn drop_bounding_set(keep: &[u32]) -> io::Result<()> {
    for cap in (0..=u32::from(u8::MAX)).filter(|c| !keep.contains(c)) {
        // SAFETY: PR_CAPBSET_DROP takes an integer and changes only this thread's
        // bounding set.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) } < 0 {
            // EINVAL: past the kernel's last capability.
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                break;
            }
            return Err(e);
        }
    }
    // SAFETY: as above; clears the ambient set, no pointers involved.
    if unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

/// `TUNSETIFF`: `_IOW('T', 202, int)`.
const TUNSETIFF: libc::Ioctl = 0x4004_54ca;

/// Makes tap device `name` in the caller's network namespace, for as long as
/// the returned descriptor (its only queue) stays open.
pub fn open_tap(name: &str) -> io::Result<OwnedFd> {
    let tun = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun")?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(io::Error::other(format!("device name {name} too long")));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF reads the ifreq we own (name and flags), on the open
    // tun device.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tun.into())
}

/// Has `cmd`'s child, before it execs: die with its parent (the thread that
/// spawned it), never gain privileges, run under seccomp `filter` and the
/// Landlock `ruleset` (see [`landlock`]), and find each `(fd, n)` as
/// descriptor `n` (each `n` below 64).
pub fn child_setup(
    cmd: &mut std::process::Command,
    fds: &[(BorrowedFd<'_>, i32)],
    filter: Vec<libc::sock_filter>,
    ruleset: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let ruleset = ruleset.map(|fd| fd.as_raw_fd());
    let len = u16::try_from(filter.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let first_free = fds.iter().map(|(_, n)| *n + 1).max().unwrap_or(3).max(3) as u32;
    use std::os::unix::process::CommandExt;
    // Copies above every target first, so that no dup2 below overwrites a
    // descriptor another is still to be copied from. They live in the hook.
    let high = fds
        .iter()
        .map(|(fd, n)| {
            let copy = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(64))?;
            // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
            Ok((unsafe { OwnedFd::from_raw_fd(copy) }, *n))
        })
        .collect::<io::Result<Vec<_>>>()?;
    // SAFETY: the hook runs in the child between fork and exec and calls only
    // prctl, landlock_restrict_self, dup2 and close_range, which are
    // async-signal-safe; it allocates nothing (the filter is the hook's own,
    // alive across the prctl, which copies it; the ruleset is the caller's,
    // open until the child is spawned).
    unsafe {
        cmd.pre_exec(move || {
            let prog = libc::sock_fprog { len, filter: filter.as_ptr().cast_mut() };
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0
                || libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0
                || libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog) < 0
                || ruleset.is_some_and(|fd| libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) < 0)
            {
                return Err(io::Error::last_os_error());
            }
            for (fd, n) in &high {
                if libc::dup2(fd.as_raw_fd(), *n) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            // Whatever else is open stays behind at exec (close-on-exec rather
            // than closed: std's own error pipe must live until the exec).
            if libc::syscall(libc::SYS_close_range, first_free, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// Bytes written to a socket that its peer has not read yet (`SIOCOUTQ`).
pub fn unread_by_peer(sock: BorrowedFd<'_>) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int we own, on an open socket.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::TIOCOUTQ, &mut n) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Landlock's filesystem rights (ABI 3): what a ruleset of [`landlock`]
/// handles, so that anything not granted beneath one of its paths is denied.
const LANDLOCK_FS_RIGHTS: u64 = (1 << 15) - 1;
/// Reading files and directories, and executing.
const LANDLOCK_READ: u64 = 1 | (1 << 2) | (1 << 3);
/// Writing a file (and truncating it).
const LANDLOCK_WRITE: u64 = (1 << 1) | (1 << 14);

/// A Landlock ruleset allowing reads beneath each of `read` and reads and
/// writes of `read_write`, and no other file access: for a process to take
/// on before it execs ([`child_setup`]). `None` where the kernel has no
/// Landlock of ABI 3 or later.
pub fn landlock(read: &[&Path], read_write: &[&Path]) -> io::Result<Option<OwnedFd>> {
    #[repr(C)]
    struct RulesetAttr {
        handled_access_fs: u64,
    }
    #[repr(C, packed)]
    struct PathBeneath {
        allowed_access: u64,
        parent_fd: i32,
    }
    // SAFETY: with a null attribute and the VERSION flag the call only returns
    // the ABI version.
    let abi = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) };
    if abi < 3 {
        return Ok(None);
    }
    let attr = RulesetAttr { handled_access_fs: LANDLOCK_FS_RIGHTS };
    // SAFETY: `attr` is a ruleset attribute of the size passed, alive across the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0u32,
        )
    };
    let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0).ok_or_else(io::Error::last_os_error)?;
    // SAFETY: the call returned a new descriptor that nothing else owns.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd) };
    let rules =
        read.iter().map(|p| (p, LANDLOCK_READ)).chain(read_write.iter().map(|p| (p, LANDLOCK_READ | LANDLOCK_WRITE)));
    for (path, access) in rules {
        let Ok(parent) = std::fs::File::open(path) else { continue };
        // A file (not a directory) takes only the rights a file can have.
        let access = if parent.metadata()?.is_dir() { access } else { access & !(1 << 3) };
        let rule = PathBeneath { allowed_access: access, parent_fd: parent.as_raw_fd() };
        // SAFETY: `rule` is a path-beneath attribute alive across the call, on
        // the ruleset and the open `parent` we own.
        let rc = unsafe {
            libc::syscall(libc::SYS_landlock_add_rule, ruleset.as_raw_fd(), 1u32, &rule as *const PathBeneath, 0u32)
        };
        if rc < 0 {
            return Err(io::Error::other(format!(
                "landlock rule for {}: {}",
                path.display(),
                io::Error::last_os_error()
            )));
        }
    }
    Ok(Some(ruleset))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_confined_child_reads_what_it_was_given_and_writes_nothing() {
        let read = [Path::new("/usr"), Path::new("/lib"), Path::new("/lib64"), Path::new("/etc")];
        let Some(ruleset) = landlock(&read, &[Path::new("/dev/null")]).unwrap() else {
            return eprintln!("no Landlock ABI 3 here: nothing to check");
        };
        let target = std::env::temp_dir().join(format!("moat-landlock-{}", std::process::id()));
        let script = format!("cat /etc/hostname >/dev/null && echo read; echo x > {} && echo wrote", target.display());
        let mut cmd = std::process::Command::new("/usr/bin/sh");
        cmd.args(["-c", &script]).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null());
        let allow_all = vec![crate::bpf::stmt(crate::bpf::BPF_RET_K, crate::bpf::SECCOMP_RET_ALLOW)];
        child_setup(&mut cmd, &[], allow_all, Some(ruleset.as_fd())).unwrap();
        let out = cmd.output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "read\n");
        assert!(!target.exists(), "the confined child wrote {}", target.display());
    }
}
