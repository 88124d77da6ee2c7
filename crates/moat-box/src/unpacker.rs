//! The confinement of the layer unpacker (`moat image-unpack`), which
//! applies a registry's layer (hostile bytes) onto the subvolume it goes
//! into. Started as root by the daemon, single-threaded, it takes this on
//! before it reads a byte of the layer:
//!
//! - a mount namespace of its own, where the layer's subvolume is mounted
//!   over itself idmapped: what it writes as uid N of its user namespace is
//!   stored as uid N, as the image says, and nothing of the host's shows
//!   through it with an owner it holds;
//! - a user namespace mapping 0..65535 to [`UNPACK_UID_BASE`] (a range like a
//!   box's, owning nothing on the host): it is root there, to set owners,
//!   setuid bits and file capabilities, and nowhere else;
//! - a network namespace of its own (no interface but a down `lo`);
//! - Landlock: file access beneath the layer's tree only;
//! - no_new_privs, and the seccomp allow list [`filter`]: file calls, memory,
//!   nothing that execs, dials, mounts or traces.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use libc::sock_filter;
use nix::fcntl::OFlag;
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid};

use crate::bpf::*;
use crate::sys;

/// First host uid of the unpacker's range: below the front door's and the
/// gateway's ids, above every system uid, and below every box's range.
pub const UNPACK_UID_BASE: u32 = moat_core::record::UID_BASE - 2 * 65536;

/// Ids mapped: what an image may own.
const IDS: u32 = 65536;

/// Calls the unpacker makes, whatever their arguments.
const ALLOWED: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_lseek,
    libc::SYS_close,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_mkdirat,
    libc::SYS_symlinkat,
    libc::SYS_linkat,
    libc::SYS_unlinkat,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fsetxattr,
    libc::SYS_utimensat,
    libc::SYS_getdents64,
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_futex,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigaction,
    libc::SYS_sigaltstack,
    libc::SYS_getrandom,
    libc::SYS_clock_gettime,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// The unpacker's allow list; anything else kills it. `mknodat` is allowed
/// for FIFOs alone (the kernel refuses devices in a user namespace anyway).
pub fn filter() -> Vec<sock_filter> {
    let mut prog = prologue();
    for nr in ALLOWED {
        if_syscall(&mut prog, *nr, &[stmt(BPF_RET_K, SECCOMP_RET_ALLOW)]);
    }
    // mknodat(dirfd, path, mode, dev): the mode's type must be S_IFIFO.
    if_syscall(
        &mut prog,
        libc::SYS_mknodat,
        &[
            stmt(BPF_LD_W_ABS, off_arg(2)),
            // No type bit but the FIFO's (S_IFMT is 0xf000, S_IFIFO 0x1000).
            jump(BPF_JSET_K, libc::S_IFMT & !libc::S_IFIFO, 2, 0),
            jump(BPF_JSET_K, libc::S_IFIFO, 0, 1),
            stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
            ret_errno(libc::EPERM),
        ],
    );
    if_syscall(
        &mut prog,
        libc::SYS_fcntl,
        &arg_one_of(
            1,
            &[libc::F_GETFD as u32, libc::F_SETFD as u32, libc::F_GETFL as u32, libc::F_DUPFD_CLOEXEC as u32],
            libc::EPERM,
        ),
    );
    prog.push(stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS));
    prog
}

/// Confines the calling process (root, single-threaded) to unpacking into
/// `tree`, as the module says; returns the tree, open, to write through.
pub fn enter(tree: &Path) -> io::Result<OwnedFd> {
    let ctx = |what: &'static str| move |e: nix::Error| io::Error::other(format!("{what}: {e}"));
    let ctx_io = |what: &'static str| move |e: io::Error| io::Error::other(format!("{what}: {e}"));
    unshare(CloneFlags::CLONE_NEWNS).map_err(ctx("unshare the mount namespace"))?;
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .map_err(ctx("make mounts private"))?;
    let userns =
        sys::make_userns(&format!("0 {UNPACK_UID_BASE} {IDS}\n"), UNPACK_UID_BASE).map_err(ctx_io("user namespace"))?;
    let path = CString::new(tree.as_os_str().as_bytes()).map_err(|_| io::Error::other("a NUL in the tree's path"))?;
    let clone = sys::open_tree_clone(&path).map_err(ctx_io("open_tree"))?;
    sys::mount_set_idmap(clone.as_fd(), userns.as_fd()).map_err(ctx_io("idmapped mount"))?;
    sys::move_mount_to(clone.as_fd(), &path).map_err(ctx_io("move_mount"))?;
    drop(clone);
    let root = nix::fcntl::open(tree, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(ctx("open the tree"))?;
    setns(&userns, CloneFlags::CLONE_NEWUSER).map_err(ctx("enter the user namespace"))?;
    unshare(CloneFlags::CLONE_NEWNET).map_err(ctx("unshare the network"))?;
    nix::unistd::setgroups(&[]).map_err(ctx("setgroups"))?;
    nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0)).map_err(ctx("setresgid"))?;
    nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).map_err(ctx("setresuid"))?;
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(ctx("pdeathsig"))?;
    nix::sys::prctl::set_dumpable(false).map_err(ctx("dumpable"))?;
    nix::sys::prctl::set_no_new_privs().map_err(ctx("no_new_privs"))?;
    if !sys::landlock_only_beneath(root.as_fd()).map_err(ctx_io("landlock"))? {
        tracing::warn!("this kernel has no Landlock: the unpacker runs without it");
    }
    sys::install_seccomp(&filter()).map_err(ctx_io("seccomp"))?;
    Ok(root)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::bpf::test::run;

    #[test]
    fn the_unpacker_writes_files_and_nothing_else() {
        let prog = filter();
        let call = |n: libc::c_long, a: [u64; 3]| run(&prog, n as u32, [a[0], a[1], a[2], 0, 0, 0]);
        for ok in [libc::SYS_openat2, libc::SYS_linkat, libc::SYS_fsetxattr, libc::SYS_fchownat, libc::SYS_getdents64] {
            assert_eq!(call(ok, [0; 3]), SECCOMP_RET_ALLOW, "{ok}");
        }
        assert_eq!(call(libc::SYS_mknodat, [0, 0, u64::from(libc::S_IFIFO | 0o600)]), SECCOMP_RET_ALLOW);
        assert_eq!(
            call(libc::SYS_mknodat, [0, 0, u64::from(libc::S_IFCHR | 0o600)]),
            SECCOMP_RET_ERRNO | libc::EPERM as u32
        );
        for kill in [
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_mount,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_setuid,
            libc::SYS_io_uring_setup,
            libc::SYS_kill,
        ] {
            assert_eq!(call(kill, [0; 3]), SECCOMP_RET_KILL_PROCESS, "{kill}");
        }
        assert_eq!(call(libc::SYS_fcntl, [3, libc::F_SETLK as u64, 0]), SECCOMP_RET_ERRNO | libc::EPERM as u32);
    }
}
