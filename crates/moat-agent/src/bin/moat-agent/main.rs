//! moat-agent: PID 1 of a box.
//!
//! It inherits a listening unix socket as fd 3 from the host, serves one operation
//! per connection (see `moat_agent::protocol`), and reaps every orphan in the box.
//! It is built as a static binary so it runs in any image, libc or not.

// `unsafe` lives in seven places: fork and exec (spawn), the terminal size
// ioctl (exec), the seccomp listener's ioctls (statfs), a guest's network
// and file system ioctls (guest_net, guest), giving memory back (rest), and
// taking the inherited listening socket (here).
mod box_file;
mod drain;
#[allow(unsafe_code)]
mod exec;
mod frames;
#[allow(unsafe_code)]
mod guest;
#[allow(unsafe_code)]
mod guest_net;
mod host_files;
mod listen;
mod login;
mod reaper;
#[allow(unsafe_code)]
mod rest;
mod service;
mod sftp;
#[allow(unsafe_code)]
mod spawn;
#[allow(unsafe_code)]
mod statfs;
mod stdin;
mod tcp;
mod unix_socket;
mod walk;

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use moat_agent::protocol::{AgentMsg, HostMsg};

use frames::FrameReader;
use reaper::Reaper;

/// The fd on which the host hands over the listening socket.
const LISTEN_FD: i32 = 3;

#[allow(unsafe_code)]
fn main() {
    // Not PID 1: the SFTP server a session asked for, in a box without one.
    if std::env::args_os().next().is_some_and(|a| a == sftp::ARGV0) {
        std::process::exit(sftp::serve_stdio());
    }
    // Box root shares PID 1's uid: dumpable, PID 1 could be ptraced, its memory
    // read through /proc/1/mem and its door to the host taken over. Not dumpable,
    // that needs CAP_SYS_PTRACE, which no box has. (What PID 1 execs is dumpable
    // again, so debuggers work on the box's own programs.)
    let _ = nix::sys::prctl::set_dumpable(false);
    spawn::raise_own_file_limit();
    // The kernel runs an initramfs's init as `/init`: a microVM guest.
    if std::env::args_os().next().is_some_and(|a| a == "/init") {
        let reaper = Arc::new(Reaper::start());
        guest::run(move |stream| serve(stream, &reaper));
    }
    // SAFETY: the host passes fd 3 as a listening unix socket and nothing else in
    // this process has claimed it; we take sole ownership here, once.
    let listener = UnixListener::from(unsafe { OwnedFd::from_raw_fd(LISTEN_FD) });
    // Commands the box runs must not inherit the host's door.
    let _ = nix::fcntl::fcntl(&listener, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC));
    login::alias_root_as_host_name();
    idle_loop(listener);
}

/// PID 1's one thread while the box is idle: it accepts the host's
/// connections (each served on a thread of its own), reaps children when
/// SIGCHLD comes, and answers the box's statfs calls. Idle, a box is then one
/// thread: ten thousand suspended boxes are ten thousand host pids, not thirty
/// thousand (`kernel.pid_max` is 32,768 on hosts that leave it alone).
fn idle_loop(listener: UnixListener) -> ! {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use nix::sys::signal::{SigSet, Signal};
    use nix::sys::signalfd::{SfdFlags, SignalFd};
    use std::os::fd::AsFd;

    // Blocked before any thread is made, so that every thread has it blocked
    // and it waits for the signalfd; what the box runs starts with every
    // signal unblocked (spawn resets the mask).
    let mut sigchld = SigSet::empty();
    sigchld.add(Signal::SIGCHLD);
    let children = sigchld
        .thread_block()
        .and_then(|()| SignalFd::with_flags(&sigchld, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK));
    let (reaper, children) = match children {
        Ok(fd) => (Arc::new(Reaper::driven()), Some(fd)),
        Err(_) => {
            let _ = sigchld.thread_unblock();
            (Arc::new(Reaper::start()), None)
        }
    };
    let statfs = statfs::Statfs::open();
    // Readiness says a connection waits; accept must not then wait for
    // another if that one went away meanwhile.
    let _ = listener.set_nonblocking(true);
    // Statuses reaped but not yet handed over: look again soon.
    let mut behind = false;
    let mut sessions = rest::Sessions::default();
    loop {
        let readable = |fd: Option<&PollFd>| fd.and_then(PollFd::revents).is_some_and(|r| !r.is_empty());
        let (connection, signalled, call) = {
            let listening = PollFd::new(listener.as_fd(), PollFlags::POLLIN);
            let child_fd = children.as_ref().map(|c| PollFd::new(c.as_fd(), PollFlags::POLLIN));
            let statfs_fd = statfs.as_ref().map(|s| PollFd::new(s.fd(), PollFlags::POLLIN));
            let (has_children, has_statfs) = (child_fd.is_some(), statfs_fd.is_some());
            let mut fds: Vec<PollFd> = [Some(listening), child_fd, statfs_fd].into_iter().flatten().collect();
            // A second's timeout reaps what a lost wake-up would leave.
            let _ = poll(&mut fds, PollTimeout::from(if behind { 10u16 } else { 1000 }));
            let mut fds = fds.iter();
            let connection = readable(fds.next());
            let signalled = has_children && readable(fds.next());
            (connection, signalled, has_statfs && readable(fds.next()))
        };
        if let Some(children) = &children {
            if signalled {
                while let Ok(Some(_)) = children.read_signal() {}
            }
            behind = !reaper.reap();
        }
        if call {
            if let Some(statfs) = &statfs {
                statfs.answer_one();
            }
        }
        if connection {
            sessions.add(accept_one(&listener, &reaper));
        }
        sessions.reclaim();
    }
}

/// Accepts one connection and serves it on a thread of its own.
fn accept_one(listener: &UnixListener, reaper: &Arc<Reaper>) -> Option<std::thread::JoinHandle<()>> {
    match listener.accept() {
        Ok((stream, _)) => {
            let reaper = Arc::clone(reaper);
            let told = stream.try_clone();
            // At pids.max a thread cannot be made; PID 1 must not panic (the
            // box would die with it): say why and drop this connection. (The
            // answer fits the socket's buffer: written without waiting.)
            let session = std::thread::Builder::new().spawn(move || serve(stream, &reaper));
            if let (Err(e), Ok(told)) = (&session, told) {
                let _ = told.set_nonblocking(true);
                let _ = frames::send(&told, &AgentMsg::Error(no_room(e)));
            }
            session.ok()
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
        // A transient accept error (EMFILE, ECONNABORTED) must not kill PID 1.
        Err(_) => {
            std::thread::sleep(std::time::Duration::from_millis(10));
            None
        }
    }
}

/// Why a session found no thread to run on: nearly always the box's process
/// limit, which its own processes fill.
pub(crate) fn no_room(e: &io::Error) -> String {
    format!(
        "no room for another process or thread ({e}): the box's processes fill its --pids limit; \
         end some, or `stop` and `start` the box"
    )
}

/// Serves one connection: its first message decides what it is.
fn serve(stream: UnixStream, reaper: &Arc<Reaper>) {
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = FrameReader::new(read_half);
    let result = match reader.next() {
        Ok(Some(HostMsg::Exec(req))) => exec::run(req, reader, stream, reaper),
        Ok(Some(HostMsg::Connect { port })) => tcp::splice(port, reader, stream),
        Ok(Some(HostMsg::ConnectPath { path })) => unix_socket::splice(&path, reader, stream),
        Ok(Some(HostMsg::Listen { port })) => listen::serve(port, reader, stream),
        Ok(Some(HostMsg::ListenPath { path })) => listen::serve_path(&path, exec::session_ids(), reader, stream),
        Ok(Some(HostMsg::Take { id })) => listen::take(id, reader, stream),
        Ok(Some(HostMsg::Ping)) => frames::send(&stream, &AgentMsg::Pong),
        Ok(Some(HostMsg::Walk)) => walk::run(&stream),
        Ok(Some(HostMsg::Service { argv })) => service::set(argv, reaper, &stream),
        Ok(Some(HostMsg::ServiceLog)) => service::send_log(&stream),
        Ok(Some(HostMsg::Sync)) => {
            nix::unistd::sync();
            frames::send(&stream, &AgentMsg::Pong)
        }
        Ok(Some(first @ HostMsg::PutFile { .. })) => host_files::serve(first, &mut reader, &stream),
        Ok(Some(HostMsg::Present { paths })) => {
            frames::send(&stream, &AgentMsg::Present(host_files::present(std::path::Path::new("/"), &paths)))
        }
        Ok(Some(HostMsg::Resumed { unix_ns, entropy })) => match guest::resumed(unix_ns, &entropy) {
            Ok(()) => frames::send(&stream, &AgentMsg::Pong),
            Err(e) => frames::send(&stream, &AgentMsg::Error(e.to_string())),
        },
        Ok(Some(HostMsg::Disk { limit, used })) => {
            statfs::set(limit, used);
            Ok(())
        }
        Ok(Some(other)) => frames::send(&stream, &AgentMsg::Error(format!("unexpected first message {other:?}"))),
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    // The host may be gone already; there is nobody left to tell.
    let _: io::Result<()> = result;
}
