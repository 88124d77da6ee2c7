//! What a process does to itself or its child before running something it
//! does not trust: descriptors placed and closed, capabilities dropped, and a
//! child's death signal, no_new_privs, seccomp and Landlock set before exec.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

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

/// Has `cmd`'s child start with at most `bytes` of private memory mapped
/// (`RLIMIT_DATA`): past it, its allocations fail.
pub fn limit_data(cmd: &mut std::process::Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook runs in the child between fork and exec and calls only
    // setrlimit, which is async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_DATA, bytes, bytes)
                .map_err(io::Error::from)
        });
    }
}

/// Has `cmd`'s child die with the thread that spawns it (SIGKILL), and not
/// start at all if that one is gone already: a helper that would otherwise
/// outlive a daemon killed while it waited (a probe's QEMU, its guest hung,
/// lived on for good).
pub fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the hook runs in the child between fork and exec and calls only
    // prctl and getppid, which are async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                return Err(io::Error::from(io::ErrorKind::BrokenPipe));
            }
            Ok(())
        });
    }
}

/// Has `cmd`'s child, before it execs: die with its parent (the thread that
/// spawned it), never gain privileges, run under seccomp `filter` and the
/// Landlock `ruleset` (see [`super::landlock`]), and find each `(fd, n)` as
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

/// `prctl(PR_SET_SECUREBITS)`'s bit that keeps capabilities across a change
/// of ids (`<linux/securebits.h>`).
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;

/// Makes a user namespace mapping ids 0..n to a host range (`id_map`, as `uid_map` takes it),
/// owned by host uid and gid `owner`, and returns an fd that keeps it alive. A throwaway child
/// creates it; we (root in the host namespace) write its maps, then let the child go.
///
/// The owner is whoever creates it, and the kernel counts what a namespace's
/// processes hold (inotify instances and watches, message queues, queued
/// signals) against its owner too: owned by root, every box drew on host
/// root's allowance, and one box could leave root (and every other box)
/// without inotify. The child takes `owner` as its effective ids, keeping its
/// capabilities (creating a namespace may need them), before creating it.
pub fn make_userns(id_map: &str, owner: u32) -> io::Result<OwnedFd> {
    use std::fs::File;
    use std::io::{Read, Write};

    use nix::fcntl::OFlag;
    use nix::sched::{unshare, CloneFlags};
    use nix::unistd::{fork, pipe2, setresgid, setresuid, ForkResult, Gid, Uid};
    let (ready_r, ready_w) = pipe2(OFlag::O_CLOEXEC)?;
    let (done_r, done_w) = pipe2(OFlag::O_CLOEXEC)?;
    // SAFETY: only single-threaded helpers call this (fork in a threaded
    // process could leave locks held in the child).
    match unsafe { fork() }? {
        ForkResult::Child => {
            drop((ready_r, done_w));
            let (root, owner_uid, owner_gid) = (Uid::from_raw(0), Uid::from_raw(owner), Gid::from_raw(owner));
            // SAFETY: prctl with integer arguments only.
            let ok = unsafe { libc::prctl(libc::PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP) } == 0
                && setresgid(Gid::from_raw(0), owner_gid, Gid::from_raw(0)).is_ok()
                && setresuid(root, owner_uid, root).is_ok()
                && unshare(CloneFlags::CLONE_NEWUSER).is_ok();
            let _ = File::from(ready_w).write_all(&[u8::from(ok)]);
            let _ = File::from(done_r).read(&mut [0u8; 1]);
            std::process::exit(0);
        }
        ForkResult::Parent { child } => {
            drop((ready_w, done_r));
            let result = (|| {
                let mut ok = [0u8; 1];
                File::from(ready_r).read_exact(&mut ok)?;
                if ok[0] != 1 {
                    return Err(io::Error::other("unshare(CLONE_NEWUSER) as the namespace's owner failed"));
                }
                let proc = format!("/proc/{child}");
                std::fs::write(format!("{proc}/uid_map"), id_map)?;
                std::fs::write(format!("{proc}/gid_map"), id_map)?;
                Ok(File::open(format!("{proc}/ns/user"))?.into())
            })();
            drop(done_w);
            let _ = nix::sys::wait::waitpid(child, None);
            result
        }
    }
}

/// Gives the host back the free memory of this process's heaps (glibc keeps
/// what its threads freed in their arenas, for good); a no-op elsewhere.
pub fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes no pointers; it only returns free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}
