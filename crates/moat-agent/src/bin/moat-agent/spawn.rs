//! fork + exec for a multithreaded PID 1.
//!
//! `std::process::Command` would race our reaper (on a failed exec it waits for
//! the child itself, and panics if the reaper got there first), so the agent forks
//! by hand. Everything the child needs is allocated before the fork; after it the
//! child makes only async-signal-safe calls.

use std::ffi::CString;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr;

use nix::unistd::{pipe2, Pid};

/// A program with its arguments and environment, ready for `execve`.
pub struct Program {
    pub path: CString,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
    pub cwd: CString,
    /// The uid and gid it runs as, if not the agent's (root's): an image's `User`.
    pub ids: Option<(u32, u32)>,
}

/// The descriptor limit the agent was started with, which what it runs gets
/// back (see [`raise_own_file_limit`]).
static CHILD_NOFILE: std::sync::OnceLock<libc::rlimit> = std::sync::OnceLock::new();

/// Raises the agent's own descriptor limit to the hard one: each forward and
/// session it carries holds a few, and 254 `-L` forwards used up the usual
/// soft 1024 (the box's sessions and forwards then hung). What the box runs
/// starts with the limit the agent was given, as a program expects (select()
/// cannot take a descriptor past 1023).
pub fn raise_own_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    let _ = CHILD_NOFILE.set(libc::rlimit { rlim_cur: soft, rlim_max: hard });
    let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
}

/// The fds a child gets as 0, 1 and 2; `controlling_tty` makes fd 0 its terminal.
pub struct ChildIo<'a> {
    pub stdin: &'a OwnedFd,
    pub stdout: &'a OwnedFd,
    pub stderr: &'a OwnedFd,
    pub controlling_tty: bool,
}

/// The kernel's signals: 1 to 64, as many as its signal sets have bits.
const SIGNALS: libc::c_int = 64;
/// The size of the kernel's signal set (not libc's `sigset_t`, which is larger).
const SIGSET_BYTES: usize = std::mem::size_of::<u64>();

/// `struct sigaction` as the kernel's `rt_sigaction` takes it (x86-64 and
/// arm64), not libc's: no restorer is needed to set the default.
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// Forks and execs `program` in a new session; returns once the exec succeeded.
pub fn spawn(program: &Program, io: &ChildIo<'_>) -> io::Result<Pid> {
    let argv: Vec<*const libc::c_char> = program.argv.iter().map(|a| a.as_ptr()).chain([ptr::null()]).collect();
    let envp: Vec<*const libc::c_char> = program.envp.iter().map(|e| e.as_ptr()).chain([ptr::null()]).collect();
    let (err_read, err_write) = pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let fds = [io.stdin.as_raw_fd(), io.stdout.as_raw_fd(), io.stderr.as_raw_fd()];
    let default = KernelSigaction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
    let unblocked: u64 = 0;
    let nofile = CHILD_NOFILE.get().copied();

    // SAFETY: after fork the child runs only async-signal-safe libc calls on
    // memory prepared above (argv/envp arrays and C strings that outlive the call
    // in the parent and are copied into the child), then execs or _exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: see above; this block never returns.
        unsafe {
            libc::setsid();
            for (target, fd) in fds.iter().enumerate() {
                libc::dup2(*fd, target as libc::c_int);
            }
            if io.controlling_tty {
                libc::ioctl(0, libc::TIOCSCTTY, 0);
            }
            // A program starts as sshd's sessions do: every signal at its default
            // and none blocked, whatever the agent (Rust ignores SIGPIPE) or the
            // daemon that started the box (`moat serve &` ignores SIGINT and
            // SIGQUIT; nohup, SIGHUP) left behind. Ignored dispositions survive
            // exec, so without this Ctrl-C would reach no job in the box. The
            // raw calls, because libc's refuse the signals it reserves for
            // itself (32 to 34), which would stay ignored.
            for signo in (1..=SIGNALS).filter(|s| *s != libc::SIGKILL && *s != libc::SIGSTOP) {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    signo,
                    &default,
                    ptr::null_mut::<KernelSigaction>(),
                    SIGSET_BYTES,
                );
            }
            // The OOM killer must pick what the box runs before PID 1 (whose
            // death restarts the box). Raising the score needs no privilege, so
            // this holds even where the host could not lower the agent's.
            let adj = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if adj >= 0 {
                libc::write(adj, c"500".as_ptr().cast(), 3);
                libc::close(adj);
            }
            if let Some(nofile) = &nofile {
                libc::setrlimit(libc::RLIMIT_NOFILE, nofile);
            }
            // Nothing of the agent's above stdio survives exec, whatever a
            // caller forgot to mark (the error pipe is already close-on-exec).
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
            libc::syscall(
                libc::SYS_rt_sigprocmask,
                libc::SIG_SETMASK,
                &unblocked,
                ptr::null_mut::<u64>(),
                SIGSET_BYTES,
            );
            if let Some((uid, gid)) = program.ids {
                if libc::setgroups(0, ptr::null()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                    let errno = *libc::__errno_location();
                    let bytes = errno.to_ne_bytes();
                    libc::write(err_write.as_raw_fd(), bytes.as_ptr().cast(), bytes.len());
                    libc::_exit(127);
                }
            }
            if libc::chdir(program.cwd.as_ptr()) != 0 {
                libc::chdir(c"/".as_ptr());
            }
            libc::execve(program.path.as_ptr(), argv.as_ptr(), envp.as_ptr());
            let errno = *libc::__errno_location();
            let bytes = errno.to_ne_bytes();
            libc::write(err_write.as_raw_fd(), bytes.as_ptr().cast(), bytes.len());
            libc::_exit(127);
        }
    }
    drop(err_write);
    let mut errno = [0u8; 4];
    let mut pipe = std::fs::File::from(err_read);
    match pipe.read(&mut errno)? {
        0 => Ok(Pid::from_raw(pid)),
        _ => Err(io::Error::from_raw_os_error(i32::from_ne_bytes(errno))),
    }
}
