//! `statfs` of the box's own root answered with the box's disk limit and use.
//!
//! The box's root is a btrfs subvolume of the host's pool, and btrfs reports
//! the whole pool to statfs, so `df /` in a 16G box said 256G. The box's
//! seccomp filter sends every `statfs` and `fstatfs` here (fd 4, a seccomp
//! listener). A call about a file on the box's root filesystem is answered
//! from the limit and use the host last told us (`HostMsg::Disk`); anything
//! else (proc, tmpfs, a path that does not resolve) goes on to the kernel
//! unchanged, as does everything until the host has told us the limit.
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
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
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
        Some(Self { listener, root_dev })
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
        let mut resp = answer(&req, self.root_dev);
        // SAFETY: `resp` is a filled seccomp_notif_resp; a caller that died
        // meanwhile makes this fail with ENOENT, which changes nothing.
        let _ = unsafe { libc::ioctl(self.listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_SEND, &mut resp) };
    }
}

/// The answer to one call: written into the caller, or "let the kernel do it".
fn answer(req: &libc::seccomp_notif, root_dev: u64) -> libc::seccomp_notif_resp {
    let pass =
        libc::seccomp_notif_resp { id: req.id, val: 0, error: 0, flags: libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32 };
    let limit = LIMIT.load(Ordering::Relaxed);
    if limit == 0 {
        return pass;
    }
    let (pid, args) = (req.pid, req.data.args);
    let Ok(mem) = File::options().read(true).write(true).open(format!("/proc/{pid}/mem")) else { return pass };
    let path = match i64::from(req.data.nr) {
        libc::SYS_statfs => match read_path(&mem, args[0]) {
            Some(p) if p.starts_with('/') => format!("/proc/{pid}/root{p}"),
            Some(p) => format!("/proc/{pid}/cwd/{p}"),
            None => return pass,
        },
        libc::SYS_fstatfs => format!("/proc/{pid}/fd/{}", args[0] as i32),
        _ => return pass,
    };
    match std::fs::metadata(&path) {
        Ok(meta) if meta.dev() == root_dev => {}
        _ => return pass,
    }
    let bytes = statfs_of(limit, USED.load(Ordering::Relaxed));
    match mem.write_at(&bytes, args[1]) {
        Ok(n) if n == bytes.len() => libc::seccomp_notif_resp { id: req.id, val: 0, error: 0, flags: 0 },
        _ => libc::seccomp_notif_resp { id: req.id, val: 0, error: -libc::EFAULT, flags: 0 },
    }
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

/// What statfs says of a btrfs root of `limit` bytes with `used` written: the
/// bytes of the kernel's x86_64 `struct statfs` (120 of them).
fn statfs_of(limit: u64, used: u64) -> Vec<u8> {
    let free = limit.saturating_sub(used) / BLOCK;
    let flags = libc::ST_NOSUID | libc::ST_NODEV | libc::ST_RELATIME;
    let words: [u64; 7] = [BTRFS_SUPER_MAGIC as u64, BLOCK, limit / BLOCK, free, free, 0, 0];
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
        let bytes = super::statfs_of(2 << 30, 1 << 30);
        assert_eq!(bytes.len(), 120);
        let word = |i: usize| u64::from_ne_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!((word(1), word(2), word(3), word(4)), (4096, 524_288, 262_144, 262_144));
    }
}
