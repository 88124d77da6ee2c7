//! Confines the calling process for facing hostile bytes: the front door,
//! the gateway and a VM box's supervisor drop to an unprivileged uid, keep no
//! capability, can gain none (no_new_privs), and may make only the system
//! calls a server that was handed its sockets needs. They open no files and
//! (but the gateway, which dials the internet) create no sockets.
//!
//! Call it before any thread exists: the filter is per thread, and threads
//! made later inherit it.

use std::io;

use libc::sock_filter;
use nix::sys::signal::Signal;
use nix::unistd::{Gid, Uid};

use crate::bpf::*;

/// Allowed whatever the arguments: memory, threads' housekeeping, time,
/// readiness, and I/O on descriptors it already holds.
const ALLOWED: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    // russh keeps key material in locked pages.
    libc::SYS_mlock,
    libc::SYS_munlock,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sigaltstack,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigaction,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_getrandom,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_restart_syscall,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_eventfd2,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_fstat,
    libc::SYS_statx,
];

/// Failed with EACCES rather than killing: probes a library may make and
/// cope with (a config file, the CPU count from cgroup files).
const REFUSED: &[libc::c_long] =
    &[libc::SYS_open, libc::SYS_openat, libc::SYS_newfstatat, libc::SYS_readlink, libc::SYS_access];

/// `fcntl` commands allowed: flags and close-on-exec, nothing that takes locks
/// or leases.
const FCNTL_COMMANDS: [u32; 5] = [
    libc::F_GETFL as u32,
    libc::F_SETFL as u32,
    libc::F_GETFD as u32,
    libc::F_SETFD as u32,
    libc::F_DUPFD_CLOEXEC as u32,
];

/// `ioctl` requests allowed: non-blocking mode and close-on-exec.
const IOCTL_REQUESTS: [u32; 2] = [libc::FIONBIO as u32, libc::FIOCLEX as u32];

/// `prctl` options allowed: naming threads.
const PRCTL_OPTIONS: [u32; 2] = [libc::PR_SET_NAME as u32, libc::PR_GET_NAME as u32];

/// A block allowing the call when the low half of argument `arg` is one of
/// `allowed`; EPERM otherwise.
fn arg_one_of(arg: u32, allowed: &[u32]) -> Vec<sock_filter> {
    crate::bpf::arg_one_of(arg, allowed, libc::EPERM)
}

/// The front door's allow list; anything else kills the process.
pub fn front_door_filter() -> Vec<sock_filter> {
    parser_filter(false)
}

/// The HTTP edge's allow list: the front door's, and it may also connect
/// the sockets it is handed (it can make none): those the privileged side
/// made in a box's own network, connected to the box's port; a socket of a
/// box's network reaches only what the box itself may.
pub fn edge_filter() -> Vec<sock_filter> {
    let mut prog = prologue();
    if_syscall(&mut prog, libc::SYS_connect, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
    parser_rules(prog, false, &IOCTL_REQUESTS)
}

/// The egress gateway's allow list: the front door's, and it may also make
/// IPv4 and IPv6 sockets (never unix, netlink, packet or vsock ones), bind
/// them (to dial from) and connect them (to the internet).
pub fn gateway_filter() -> Vec<sock_filter> {
    parser_filter(true)
}

/// [`gateway_filter`], and files too: for a gateway that Landlock already
/// holds to its package cache ([`crate::sys::landlock_only_beneath`]),
/// opening, writing,
/// renaming and removing files there.
pub fn gateway_files_filter() -> Vec<sock_filter> {
    let mut prog = prologue();
    for nr in FILE_CALLS {
        if_syscall(&mut prog, *nr, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
    }
    parser_rules(prog, true, &IOCTL_REQUESTS)
}

/// What a gateway with files may do to them (beneath its Landlock trees).
const FILE_CALLS: &[libc::c_long] = &[
    libc::SYS_openat,
    libc::SYS_getdents64,
    libc::SYS_lseek,
    libc::SYS_pread64,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
];

/// A VM box's supervisor's allow list, once QEMU (pid `qemu`) runs: the
/// front door's, and it may also wait for QEMU to end, kill it (a boot that
/// failed), read its logs back, and ask how much of what it wrote to the
/// guest's link QEMU has not taken yet (`SIOCOUTQ`).
pub fn supervisor_filter(qemu: u32) -> Vec<sock_filter> {
    let mut prog = prologue();
    if_syscall(&mut prog, libc::SYS_wait4, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
    // SIGKILL to its own QEMU alone (a hijacked supervisor gains nothing: its
    // death kills QEMU too); any other kill is the process's end.
    if_syscall(
        &mut prog,
        libc::SYS_kill,
        &[
            stmt(BPF_LD_W_ABS, off_arg(0)),
            jump(BPF_JEQ_K, qemu, 0, 3),
            stmt(BPF_LD_W_ABS, off_arg(1)),
            jump(BPF_JEQ_K, libc::SIGKILL as u32, 0, 1),
            stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
            stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        ],
    );
    // The tail of a log it holds open, to explain a failed boot.
    if_syscall(&mut prog, libc::SYS_pread64, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
    let [nonblocking, cloexec] = IOCTL_REQUESTS;
    parser_rules(prog, false, &[nonblocking, cloexec, libc::TIOCOUTQ as u32])
}

fn parser_filter(dials: bool) -> Vec<sock_filter> {
    parser_rules(prologue(), dials, &IOCTL_REQUESTS)
}

/// The rules every process facing hostile bytes shares, after `prog`: the
/// gateway's dialling if it `dials`, and `ioctls` the requests it may make.
fn parser_rules(mut prog: Vec<sock_filter>, dials: bool, ioctls: &[u32]) -> Vec<sock_filter> {
    if dials {
        if_syscall(&mut prog, libc::SYS_socket, &arg_one_of(0, &[libc::AF_INET as u32, libc::AF_INET6 as u32]));
        if_syscall(&mut prog, libc::SYS_connect, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
        if_syscall(&mut prog, libc::SYS_bind, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
        // Splicing between sockets through a pipe, for bytes it never reads.
        if_syscall(&mut prog, libc::SYS_pipe2, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
        if_syscall(&mut prog, libc::SYS_splice, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
    }
    for nr in ALLOWED {
        if_syscall(&mut prog, *nr, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
    }
    for nr in REFUSED {
        if_syscall(&mut prog, *nr, &[ret_errno(libc::EACCES)]);
    }
    // Threads, never processes: clone must share the address space as a
    // thread; clone3 hides its flags from seccomp, so libc falls back to clone.
    if_syscall(&mut prog, libc::SYS_clone3, &[ret_errno(libc::ENOSYS)]);
    if_syscall(
        &mut prog,
        libc::SYS_clone,
        &[
            stmt(BPF_LD_W_ABS, off_arg(0)),
            // (flags & thread) == thread, in two tests.
            jump(BPF_JSET_K, libc::CLONE_THREAD as u32, 0, 2),
            jump(BPF_JSET_K, libc::CLONE_VM as u32, 0, 1),
            stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
            ret_errno(libc::EPERM),
        ],
    );
    // tokio's runtime makes one unix socket pair (its signal driver's).
    if_syscall(&mut prog, libc::SYS_socketpair, &arg_one_of(0, &[libc::AF_UNIX as u32]));
    if_syscall(&mut prog, libc::SYS_fcntl, &arg_one_of(1, &FCNTL_COMMANDS));
    if_syscall(&mut prog, libc::SYS_ioctl, &arg_one_of(1, ioctls));
    if_syscall(&mut prog, libc::SYS_prctl, &arg_one_of(0, &PRCTL_OPTIONS));
    prog.push(stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS));
    prog
}

/// Drops the calling (single-threaded, root) process to `uid`:`gid` with no
/// supplementary groups, no capabilities (bounding set included),
/// no_new_privs, not dumpable, dying with its parent, and under
/// [`front_door_filter`].
pub fn front_door(uid: u32, gid: u32) -> io::Result<()> {
    drop_to(uid, gid, &front_door_filter())
}

/// As [`front_door`], under [`edge_filter`].
pub fn edge(uid: u32, gid: u32) -> io::Result<()> {
    drop_to(uid, gid, &edge_filter())
}

/// As [`front_door`], under [`gateway_filter`] (or, with `files`,
/// [`gateway_files_filter`]: only once Landlock holds it).
pub fn gateway(uid: u32, gid: u32, files: bool) -> io::Result<()> {
    drop_to(uid, gid, &if files { gateway_files_filter() } else { gateway_filter() })
}

/// As [`front_door`], under [`supervisor_filter`], for a VM box's
/// supervisor once it has handed QEMU (pid `qemu`) everything: it then reads only the
/// guest's link and console and QEMU's answers, all hostile once a guest owns
/// its kernel or QEMU. Unlike the front door it outlives its parent (the
/// helper that started it exits once the guest is up). Threads made before
/// this call keep their privileges: call it before any.
pub fn supervisor(uid: u32, gid: u32, qemu: u32) -> io::Result<()> {
    drop_ids(uid, gid)?;
    nix::sys::prctl::set_no_new_privs()?;
    crate::sys::install_seccomp(&supervisor_filter(qemu))
}

/// The environment variable in which the daemon tells a confined child its
/// pid (see [`drop_to`]).
pub const PARENT_VAR: &str = "MOAT_PARENT";

fn drop_to(uid: u32, gid: u32, filter: &[sock_filter]) -> io::Result<()> {
    drop_ids(uid, gid)?;
    // Changing ids resets it; set it after.
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
    // A parent gone before that line sends nothing: a process the daemon
    // started (it says whose child it is) ends rather than live on as an
    // orphan holding its socket (seen once in a full test run: a front door
    // whose daemon a test killed as it started).
    if let Some(parent) = std::env::var(PARENT_VAR).ok().and_then(|p| p.parse::<i32>().ok()) {
        if nix::unistd::getppid().as_raw() != parent {
            return Err(io::Error::other(format!("the daemon that started this process (pid {parent}) is gone")));
        }
    }
    nix::sys::prctl::set_no_new_privs()?;
    crate::sys::install_seccomp(filter)
}

/// Becomes `uid`:`gid` with no supplementary groups and no capability
/// (bounding set included), not dumpable (so another process of that uid
/// cannot ptrace it), in `/`.
fn drop_ids(uid: u32, gid: u32) -> io::Result<()> {
    if uid == 0 || gid == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a process facing hostile bytes may not run as root"));
    }
    let (uid, gid) = (Uid::from_raw(uid), Gid::from_raw(gid));
    crate::sys::drop_bounding_set(&[])?;
    nix::unistd::setgroups(&[])?;
    nix::unistd::setresgid(gid, gid, gid)?;
    // From root to a non-zero uid with every id changed, the kernel clears the
    // permitted, effective and ambient capability sets.
    nix::unistd::setresuid(uid, uid, uid)?;
    // Changing ids resets it; set it after.
    nix::sys::prctl::set_dumpable(false)?;
    Ok(nix::unistd::chdir("/")?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::bpf::test::run;

    const EPERM: u32 = SECCOMP_RET_ERRNO | libc::EPERM as u32;

    #[test]
    fn verdicts() {
        let prog = front_door_filter();
        let nr = |n: libc::c_long| n as u32;
        let call = |n: libc::c_long, a0: u64, a1: u64| run(&prog, nr(n), [a0, a1, 0, 0, 0, 0]);
        for ok in [libc::SYS_read, libc::SYS_sendmsg, libc::SYS_accept4, libc::SYS_epoll_wait, libc::SYS_futex] {
            assert_eq!(call(ok, 0, 0), SECCOMP_RET_ALLOW, "{ok}");
        }
        // What a hijacked front door would want first: never there.
        for kill in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_bind,
            libc::SYS_ptrace,
            libc::SYS_mount,
            libc::SYS_setuid,
            libc::SYS_unshare,
            libc::SYS_kill,
            libc::SYS_memfd_create,
            libc::SYS_io_uring_setup,
        ] {
            assert_eq!(call(kill, 0, 0), SECCOMP_RET_KILL_PROCESS, "{kill}");
        }
        assert_eq!(call(libc::SYS_openat, 0, 0), SECCOMP_RET_ERRNO | libc::EACCES as u32);
        assert_eq!(call(libc::SYS_socketpair, libc::AF_UNIX as u64, 0), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_socketpair, libc::AF_VSOCK as u64, 0), EPERM);
        // Threads yes, processes no.
        let thread =
            (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_SIGHAND | libc::CLONE_THREAD) as u64;
        assert_eq!(call(libc::SYS_clone, thread, 0), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_clone, libc::SIGCHLD as u64, 0), EPERM);
        assert_eq!(call(libc::SYS_clone, (libc::CLONE_VM | libc::SIGCHLD) as u64, 0), EPERM);
        assert_eq!(call(libc::SYS_clone3, 0, 0), SECCOMP_RET_ERRNO | libc::ENOSYS as u32);
        // Arguments: only the harmless commands.
        assert_eq!(call(libc::SYS_fcntl, 3, libc::F_SETFL as u64), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_fcntl, 3, libc::F_SETLK as u64), EPERM);
        assert_eq!(call(libc::SYS_ioctl, 3, libc::FIONBIO), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_ioctl, 3, libc::TIOCSTI), EPERM);
        assert_eq!(call(libc::SYS_prctl, libc::PR_SET_NAME as u64, 0), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_prctl, libc::PR_SET_DUMPABLE as u64, 1), EPERM);
        assert!(prog.len() < 4096);
    }

    #[test]
    fn the_supervisor_waits_for_qemu_and_nothing_more() {
        let prog = supervisor_filter(4242);
        let call = |n: libc::c_long, a0: u64, a1: u64| run(&prog, n as u32, [a0, a1, 0, 0, 0, 0]);
        assert_eq!(call(libc::SYS_wait4, 0, 0), SECCOMP_RET_ALLOW);
        // A boot that failed ends its QEMU (std's Child::kill), and only it.
        assert_eq!(call(libc::SYS_kill, 4242, libc::SIGKILL as u64), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_kill, 4243, libc::SIGKILL as u64), SECCOMP_RET_KILL_PROCESS);
        assert_eq!(call(libc::SYS_kill, 4242, libc::SIGSTOP as u64), SECCOMP_RET_KILL_PROCESS);
        assert_eq!(call(libc::SYS_kill, u64::MAX, libc::SIGKILL as u64), SECCOMP_RET_KILL_PROCESS);
        assert_eq!(call(libc::SYS_ioctl, 3, libc::TIOCOUTQ), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_ioctl, 3, libc::FIONBIO), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_ioctl, 3, libc::TIOCSTI), EPERM);
        assert_eq!(call(libc::SYS_accept4, 3, 0), SECCOMP_RET_ALLOW);
        // What a supervisor a guest took over would want: never there.
        for kill in [
            libc::SYS_execve,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_ptrace,
            libc::SYS_kill,
            libc::SYS_setuid,
            libc::SYS_unlink,
            libc::SYS_mount,
        ] {
            assert_eq!(call(kill, libc::AF_VSOCK as u64, 0), SECCOMP_RET_KILL_PROCESS, "{kill}");
        }
        assert_eq!(call(libc::SYS_openat, 0, 0), SECCOMP_RET_ERRNO | libc::EACCES as u32);
        assert_eq!(run(&front_door_filter(), libc::SYS_wait4 as u32, [0; 6]), SECCOMP_RET_KILL_PROCESS);
    }

    #[test]
    fn the_edge_connects_what_it_is_handed_and_makes_no_socket() {
        let prog = edge_filter();
        let call = |n: libc::c_long, a0: u64| run(&prog, n as u32, [a0, 0, 0, 0, 0, 0]);
        assert_eq!(call(libc::SYS_connect, 3), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_accept4, 3), SECCOMP_RET_ALLOW);
        for kill in [libc::SYS_socket, libc::SYS_bind, libc::SYS_execve, libc::SYS_splice, libc::SYS_kill] {
            assert_eq!(call(kill, libc::AF_INET as u64), SECCOMP_RET_KILL_PROCESS, "{kill}");
        }
        assert_eq!(call(libc::SYS_socketpair, libc::AF_VSOCK as u64), EPERM);
        assert_eq!(call(libc::SYS_openat, 0), SECCOMP_RET_ERRNO | libc::EACCES as u32);
    }

    #[test]
    fn the_gateway_dials_only_the_internet() {
        let prog = gateway_filter();
        let call = |n: libc::c_long, a0: u64| run(&prog, n as u32, [a0, 0, 0, 0, 0, 0]);
        assert_eq!(call(libc::SYS_socket, libc::AF_INET as u64), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_socket, libc::AF_INET6 as u64), SECCOMP_RET_ALLOW);
        for family in [libc::AF_UNIX, libc::AF_NETLINK, libc::AF_PACKET, libc::AF_VSOCK] {
            assert_eq!(call(libc::SYS_socket, family as u64), EPERM, "{family}");
        }
        assert_eq!(call(libc::SYS_connect, 3), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_splice, 3), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_pipe2, 0), SECCOMP_RET_ALLOW);
        assert_eq!(call(libc::SYS_execve, 0), SECCOMP_RET_KILL_PROCESS);
        assert_eq!(call(libc::SYS_openat, 0), SECCOMP_RET_ERRNO | libc::EACCES as u32);
        // With its files (Landlock holds it to them), it opens and renames.
        let files = gateway_files_filter();
        for nr in [libc::SYS_openat, libc::SYS_renameat2, libc::SYS_unlink, libc::SYS_socket] {
            assert_eq!(run(&files, nr as u32, [libc::AF_INET as u64, 0, 0, 0, 0, 0]), SECCOMP_RET_ALLOW, "{nr}");
        }
        assert_eq!(run(&files, libc::SYS_execve as u32, [0; 6]), SECCOMP_RET_KILL_PROCESS);
        assert_eq!(run(&files, libc::SYS_socket as u32, [libc::AF_VSOCK as u64, 0, 0, 0, 0, 0]), EPERM);
        // The front door still may not.
        for nr in [libc::SYS_socket, libc::SYS_splice] {
            assert_eq!(run(&front_door_filter(), nr as u32, [2, 0, 0, 0, 0, 0]), SECCOMP_RET_KILL_PROCESS);
        }
    }
}
