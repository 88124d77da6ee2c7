//! `statfs` of the box's own root answered with the box's disk limit and use,
//! and of its /dev and /run with its memory.
//!
//! The box's root is a btrfs subvolume of the host's pool, and btrfs reports
//! the whole pool to statfs, so `df /` in a 16G box said 256G. Its /dev and
//! /run are directories of a tmpfs every box shares (the host's `boxtmp`),
//! whose totals are every box's together. The box's seccomp filter sends
//! every `statfs` and `fstatfs` here (fd 4, a seccomp listener). A call about
//! a file on the box's root filesystem is answered from the limit and use the
//! host last told us (`HostMsg::Disk`; until then it goes on to the kernel);
//! one about its /dev or /run as a tmpfs of its own would be, its size the
//! box's memory and its use the box's shared memory (from /proc/meminfo,
//! the box's own where the host shows it its totals); anything else (proc,
//! devpts, a path that does not resolve) goes on to the kernel unchanged.
//!
//! The caller's path is read, and the answer written, through
//! `/proc/PID/mem`, and resolved through `/proc/PID/{root,cwd,fd}`, so it
//! means what it means to the caller. The thread answering must never call
//! statfs itself: the call would wait for that thread.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicU64, Ordering};

/// The fd on which the host hands over the seccomp listener.
const LISTENER_FD: i32 = 4;
const BTRFS_SUPER_MAGIC: u64 = 0x9123_683e;
const TMPFS_MAGIC: u64 = 0x0102_1994;
const BLOCK: u64 = 4096;

static LIMIT: AtomicU64 = AtomicU64::new(0);
static USED: AtomicU64 = AtomicU64::new(0);

/// Records the box's disk limit and use, as the host measured them.
pub fn set(limit: u64, used: u64) {
    USED.store(used, Ordering::Relaxed);
    LIMIT.store(limit, Ordering::Relaxed);
}

/// The host's seccomp listener, answered by PID 1's one thread.
pub struct Statfs {
    listener: BorrowedFd<'static>,
    root_dev: u64,
    /// The device of /dev and /run (`None` if it is the root's).
    tmp_dev: Option<u64>,
}

impl Statfs {
    /// The listener, if the host passed one.
    pub fn open() -> Option<Self> {
        // SAFETY: fd 4 was set up by the host for us alone and nothing else in
        // this process uses it; it stays open for the life of the process.
        let listener = unsafe { BorrowedFd::borrow_raw(LISTENER_FD) };
        nix::fcntl::fcntl(listener, nix::fcntl::FcntlArg::F_GETFD).ok()?;
        // What the box runs must not hold it: it could take PID 1's calls
        // (stalling its loop) or answer root's statfs, or put descriptors into it.
        nix::fcntl::fcntl(listener, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC)).ok()?;
        let root_dev = std::fs::metadata("/").ok()?.dev();
        let tmp_dev = std::fs::metadata("/dev/shm").ok().map(|m| m.dev()).filter(|dev| *dev != root_dev);
        Some(Self { listener, root_dev, tmp_dev })
    }

    /// What to poll for a call waiting.
    pub fn fd(&self) -> BorrowedFd<'static> {
        self.listener
    }

    /// Answers the call waiting. Called when the listener polls readable:
    /// the receive then does not wait (a caller that died meanwhile makes it
    /// fail with ENOENT at once).
    pub fn answer_one(&self) {
        // SAFETY: seccomp_notif is plain data; the kernel wants it zeroed.
        let mut req: libc::seccomp_notif = unsafe { std::mem::zeroed() };
        // SAFETY: `req` is a seccomp_notif the kernel fills in; the listener is open.
        if unsafe { libc::ioctl(self.listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_RECV, &mut req) } < 0 {
            return;
        }
        let mut resp = answer(self.listener, &req, self.root_dev, self.tmp_dev);
        // SAFETY: `resp` is a filled seccomp_notif_resp; a caller that died
        // meanwhile makes this fail with ENOENT, which changes nothing.
        let _ = unsafe { libc::ioctl(self.listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_SEND, &mut resp) };
    }
}

/// The answer to one call: written into the caller, or "let the kernel do it".
fn answer(
    listener: BorrowedFd<'_>,
    req: &libc::seccomp_notif,
    root_dev: u64,
    tmp_dev: Option<u64>,
) -> libc::seccomp_notif_resp {
    let pass =
        libc::seccomp_notif_resp { id: req.id, val: 0, error: 0, flags: libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32 };
    let (pid, args) = (req.pid, req.data.args);
    let Ok(mem) = File::options().read(true).write(true).open(format!("/proc/{pid}/mem")) else { return pass };
    // The caller may have died and its pid gone to another process between
    // the receive and the open: the call must still be waiting for this to
    // be the caller's memory (seccomp_unotify(2)).
    if !still_waiting(listener, req.id) {
        return pass;
    }
    // The file as the caller names it (its root, its cwd, its descriptor),
    // then what it is from here.
    let (named, path) = match i64::from(req.data.nr) {
        libc::SYS_statfs => match read_path(&mem, args[0]) {
            Some(p) if p.starts_with('/') => (p.clone(), format!("/proc/{pid}/root{p}")),
            Some(p) => (format!("{}/{p}", link(&format!("/proc/{pid}/cwd"))), format!("/proc/{pid}/cwd/{p}")),
            None => return pass,
        },
        libc::SYS_fstatfs => {
            let fd = format!("/proc/{pid}/fd/{}", args[0] as i32);
            (link(&fd), fd)
        }
        _ => return pass,
    };
    let Ok(dev) = std::fs::metadata(&path).map(|m| m.dev()) else { return pass };
    let bytes = if dev == root_dev {
        match LIMIT.load(Ordering::Relaxed) {
            0 => return pass,
            limit => statfs_of(BTRFS_SUPER_MAGIC, limit, USED.load(Ordering::Relaxed), ROOT_FLAGS),
        }
    } else if Some(dev) == tmp_dev {
        let Some((memory, shared)) = memory_and_shared() else { return pass };
        // /dev is bound noexec, /run is not.
        let under_dev = named == "/dev" || named.starts_with("/dev/");
        statfs_of(TMPFS_MAGIC, memory, shared, if under_dev { DEV_FLAGS } else { RUN_FLAGS })
    } else {
        return pass;
    };
    match mem.write_at(&bytes, args[1]) {
        Ok(n) if n == bytes.len() => libc::seccomp_notif_resp { id: req.id, val: 0, error: 0, flags: 0 },
        _ => libc::seccomp_notif_resp { id: req.id, val: 0, error: -libc::EFAULT, flags: 0 },
    }
}

/// Whether call `id` still waits on `listener` for its answer.
fn still_waiting(listener: BorrowedFd<'_>, id: u64) -> bool {
    let mut id = id;
    // SAFETY: the ioctl reads one u64 from a valid pointer; the listener is open.
    unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_ID_VALID, &mut id) == 0 }
}

/// Where a /proc link points ("" if it cannot be read).
fn link(path: &str) -> String {
    std::fs::read_link(path).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default()
}

/// The box's memory and the part of it that is shared memory (tmpfs among
/// it), in bytes, from /proc/meminfo.
fn memory_and_shared() -> Option<(u64, u64)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| {
        meminfo.lines().find_map(|line| {
            let value = line.strip_prefix(key)?.strip_prefix(':')?.trim().strip_suffix("kB")?;
            value.trim().parse::<u64>().ok()
        })
    };
    Some((kib("MemTotal")? * 1024, kib("Shmem")? * 1024))
}

/// The NUL-terminated path at `addr` in the caller (at most PATH_MAX).
fn read_path(mem: &File, addr: u64) -> Option<String> {
    let mut path = Vec::new();
    let mut chunk = [0u8; 256];
    while path.len() < 4096 {
        let n = mem.read_at(&mut chunk, addr + path.len() as u64).ok().filter(|n| *n > 0)?;
        let got = chunk.get(..n)?;
        if let Some(end) = got.iter().position(|b| *b == 0) {
            path.extend_from_slice(got.get(..end)?);
            return String::from_utf8(path).ok();
        }
        path.extend_from_slice(got);
    }
    None
}

const ROOT_FLAGS: u64 = libc::ST_NOSUID | libc::ST_NODEV | libc::ST_RELATIME;
const DEV_FLAGS: u64 = libc::ST_NOSUID | libc::ST_NOEXEC | libc::ST_RELATIME;
const RUN_FLAGS: u64 = libc::ST_NOSUID | libc::ST_NODEV | libc::ST_RELATIME;

/// What statfs says of a file system of type `magic`, `limit` bytes with
/// `used` written, mounted with `flags` (no count of inodes): the bytes of
/// the kernel's x86_64 `struct statfs` (120 of them).
fn statfs_of(magic: u64, limit: u64, used: u64, flags: u64) -> Vec<u8> {
    let free = limit.saturating_sub(used) / BLOCK;
    let words: [u64; 7] = [magic, BLOCK, limit / BLOCK, free, free, 0, 0];
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    out.extend_from_slice(&[0; 8]); // f_fsid
    for word in [255, BLOCK, flags, 0, 0, 0, 0] {
        out.extend_from_slice(&word.to_ne_bytes()); // f_namelen, f_frsize, f_flags, f_spare
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_answer_is_the_kernels_statfs_layout() {
        let bytes = super::statfs_of(super::BTRFS_SUPER_MAGIC, 2 << 30, 1 << 30, super::ROOT_FLAGS);
        assert_eq!(bytes.len(), 120);
        let word = |i: usize| u64::from_ne_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!((word(1), word(2), word(3), word(4)), (4096, 524_288, 262_144, 262_144));
    }
}
