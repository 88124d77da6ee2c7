//! `Listen`, `ListenPath` and `Take`: a port on the box's loopback, or a
//! unix socket in the box, whose connections go to the SSH client (`ssh -R`).
//!
//! The host's `Listen` connection holds the port: it closes when that
//! connection does. Each connection a program in the box makes to it waits
//! here, told to the host as `Arrived`, until the host takes it (`Take`, on a
//! connection of its own, which then carries its bytes as `Connect`'s does).
//! What nobody takes is closed: a host that never takes (or a client that
//! refuses every channel) cannot pile connections up in the box.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use moat_agent::protocol::AgentMsg;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::unistd::{Gid, Uid};

use crate::frames::{self, FrameReader};
use crate::tcp::Carried;

/// Connections one port holds untaken at most; more are closed as they come.
const MOST_WAITING: usize = 16;

/// How long a connection waits to be taken before it is closed.
const WAIT: Duration = Duration::from_secs(10);

/// Most ports and sockets listened on at once in the box: each holds a
/// thread and a few of the agent's descriptors (whose soft limit, 1024,
/// its box's programs inherit), which 254 forwards once used up.
const MOST_LISTENING: usize = 64;

/// How many are listened on now.
static LISTENING: AtomicUsize = AtomicUsize::new(0);

/// One of [`LISTENING`], given back on drop.
struct ListenPlace;

impl ListenPlace {
    fn take() -> Result<Self, String> {
        if LISTENING.fetch_add(1, Ordering::Relaxed) >= MOST_LISTENING {
            LISTENING.fetch_sub(1, Ordering::Relaxed);
            return Err(format!("the box listens for the client on {MOST_LISTENING} ports and sockets already"));
        }
        Ok(Self)
    }
}

impl Drop for ListenPlace {
    fn drop(&mut self) {
        LISTENING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a `Listen` listens on.
enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Self::Tcp(l) => l.as_fd(),
            Self::Unix(l) => l.as_fd(),
        }
    }

    /// A waiting connection, and the port it came from (0 for a socket).
    fn accept(&self) -> io::Result<(Accepted, u16)> {
        match self {
            Self::Tcp(l) => l.accept().map(|(s, from)| (Accepted::Tcp(s), from.port())),
            Self::Unix(l) => l.accept().map(|(s, _)| (Accepted::Unix(s), 0)),
        }
    }
}

/// A connection a program in the box made to a listened port or socket.
enum Accepted {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Accepted {
    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_nonblocking(on),
            Self::Unix(s) => s.set_nonblocking(on),
        }
    }
}

impl Read for Accepted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Accepted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Carried for Accepted {
    fn clone_socket(&self) -> io::Result<Self> {
        match self {
            Self::Tcp(s) => s.try_clone().map(Self::Tcp),
            Self::Unix(s) => s.try_clone().map(Self::Unix),
        }
    }
    fn end(&self, how: Shutdown) {
        let _ = match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        };
    }
}

/// A connection made to a listened port, not taken yet.
struct Waiting {
    socket: Accepted,
    /// The `Listen` it came through.
    port: u64,
    since: Instant,
}

/// Every port's waiting connections, by id.
static WAITING: Mutex<BTreeMap<u64, Waiting>> = Mutex::new(BTreeMap::new());

/// Ids of connections, and of `Listen`s (one sequence: never reused).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn waiting() -> std::sync::MutexGuard<'static, BTreeMap<u64, Waiting>> {
    WAITING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Listens on `port` of the box's loopback (IPv4, and IPv6 on the same port
/// where it can) until the host's connection ends.
pub fn serve(port: u16, reader: FrameReader, host: UnixStream) -> io::Result<()> {
    let _place = match ListenPlace::take() {
        Ok(place) => place,
        Err(why) => return frames::send(&host, &AgentMsg::Error(why)),
    };
    let (listeners, bound) = match bind(port) {
        Ok(bound) => bound,
        Err(e) => {
            return frames::send(&host, &AgentMsg::Error(format!("cannot listen on port {port} in the box: {e}")))
        }
    };
    frames::send(&host, &AgentMsg::Listening { port: bound })?;
    listen_until_gone(&listeners, reader, &host)
}

/// Listens on a unix socket made at `path` until the host's connection ends,
/// then removes it. It is made as sshd makes one for its user: by the box's
/// sessions' user, `ids` (every directory on the way checked as that
/// user's; `None`: root), mode 0600; a path where something is already is
/// refused.
pub fn serve_path(path: &[u8], ids: Option<(u32, u32)>, reader: FrameReader, host: UnixStream) -> io::Result<()> {
    let path = match crate::unix_socket::socket_path(path) {
        Ok(path) => path,
        Err(why) => return frames::send(&host, &AgentMsg::Error(why)),
    };
    let _place = match ListenPlace::take() {
        Ok(place) => place,
        Err(why) => return frames::send(&host, &AgentMsg::Error(why)),
    };
    let shown = path.display();
    let made = as_session_user(ids, || {
        let listener = UnixListener::bind(path)?;
        // (Made under the agent's umask, 022: no one else could connect meanwhile.)
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let meta = std::fs::symlink_metadata(path)?;
        Ok((listener, (meta.dev(), meta.ino())))
    });
    let (listener, made) = match made {
        Ok(made) => made,
        Err(e) => return frames::send(&host, &AgentMsg::Error(format!("cannot listen on {shown} in the box: {e}"))),
    };
    let listeners = [Listener::Unix(listener)];
    let served = frames::send(&host, &AgentMsg::Listening { port: 0 })
        .and_then(|()| listen_until_gone(&listeners, reader, &host));
    // Only the socket made here: the box may have put something else there.
    let _ = as_session_user(ids, || match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() && (m.dev(), m.ino()) == made => std::fs::remove_file(path),
        _ => Ok(()),
    });
    served
}

/// Runs `work` with this thread's file system ids set to `ids` (as root's
/// otherwise): what it makes is theirs, and it reaches only what they may.
fn as_session_user<T>(ids: Option<(u32, u32)>, work: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    let Some((uid, gid)) = ids else { return work() };
    // The group first: once the uid is not root's, the group cannot change.
    nix::unistd::setfsgid(Gid::from_raw(gid));
    nix::unistd::setfsuid(Uid::from_raw(uid));
    let done = work();
    nix::unistd::setfsuid(Uid::from_raw(0));
    nix::unistd::setfsgid(Gid::from_raw(0));
    done
}

/// The listening sockets for `port`, and the port: IPv4's is made first, and
/// picks the port when any was asked for.
fn bind(port: u16) -> io::Result<(Vec<Listener>, u16)> {
    let v4 = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))?;
    let port = v4.local_addr()?.port();
    let mut listeners = vec![Listener::Tcp(v4)];
    // A box without IPv6 still has its IPv4 port.
    listeners.extend(TcpListener::bind(SocketAddr::from((Ipv6Addr::LOCALHOST, port))).ok().map(Listener::Tcp));
    Ok((listeners, port))
}

/// Accepts connections and tells the host of each, until the host's side of
/// the connection ends (it sends nothing after `Listen`).
fn listen_until_gone(listeners: &[Listener], reader: FrameReader, host: &UnixStream) -> io::Result<()> {
    let me = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let (_, mut host_reader) = reader.into_parts();
    let served = accept_until_gone(me, listeners, &mut host_reader, host);
    waiting().retain(|_, w| w.port != me);
    served
}

fn accept_until_gone(
    me: u64,
    listeners: &[Listener],
    host_reader: &mut UnixStream,
    host: &UnixStream,
) -> io::Result<()> {
    for listener in listeners {
        match listener {
            Listener::Tcp(l) => l.set_nonblocking(true)?,
            Listener::Unix(l) => l.set_nonblocking(true)?,
        }
    }
    loop {
        let mut fds: Vec<PollFd> = listeners.iter().map(|l| PollFd::new(l.as_fd(), PollFlags::POLLIN)).collect();
        fds.push(PollFd::new(host_reader.as_fd(), PollFlags::POLLIN));
        match poll(&mut fds, PollTimeout::from(1000u16)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<bool> = fds.iter().map(|fd| fd.revents().is_some_and(|r| !r.is_empty())).collect();
        drop(fds);
        if ready.last().copied().unwrap_or(true) {
            // The host's end (or bytes it should not send): the port closes.
            let mut byte = [0u8; 1];
            match host_reader.read(&mut byte) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                _ => return Ok(()),
            }
        }
        let now = Instant::now();
        waiting().retain(|_, w| now.duration_since(w.since) < WAIT);
        for (listener, _) in listeners.iter().zip(&ready).filter(|(_, ready)| **ready) {
            while let Ok((socket, from_port)) = listener.accept() {
                let mut table = waiting();
                if table.values().filter(|w| w.port == me).count() >= MOST_WAITING
                    || socket.set_nonblocking(false).is_err()
                {
                    continue;
                }
                let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
                table.insert(id, Waiting { socket, port: me, since: now });
                drop(table);
                frames::send(host, &AgentMsg::Arrived { id, from_port })?;
            }
        }
    }
}

/// Carries the bytes of the waiting connection `id`, or tells the host it is
/// gone (taken, closed for waiting too long, or its port closed).
pub fn take(id: u64, reader: FrameReader, host: UnixStream) -> io::Result<()> {
    let Some(taken) = waiting().remove(&id) else {
        return frames::send(&host, &AgentMsg::Error(format!("no connection {id} waits to be taken")));
    };
    frames::send(&host, &AgentMsg::Connected)?;
    crate::tcp::relay(taken.socket, reader, host)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use std::io::Write;

    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    use moat_agent::protocol::HostMsg;

    use super::*;

    /// The next message from the agent's side of `host`.
    fn next(host: &mut UnixStream) -> AgentMsg {
        let mut buf = Vec::new();
        loop {
            if let Some((msg, _)) = AgentMsg::decode(&buf).unwrap() {
                return msg;
            }
            let mut byte = [0u8; 1];
            assert_eq!(host.read(&mut byte).unwrap(), 1, "the agent closed");
            buf.push(byte[0]);
        }
    }

    /// Runs `HostMsg` `first` as the agent would, on a thread.
    fn agent(first: HostMsg) -> (UnixStream, std::thread::JoinHandle<io::Result<()>>) {
        let (host, theirs) = UnixStream::pair().unwrap();
        let reader = FrameReader::new(theirs.try_clone().unwrap());
        let run = std::thread::spawn(move || match first {
            HostMsg::Listen { port } => serve(port, reader, theirs),
            HostMsg::Take { id } => take(id, reader, theirs),
            HostMsg::ListenPath { path } => serve_path(&path, Some((65534, 65534)), reader, theirs),
            other => panic!("{other:?}"),
        });
        (host, run)
    }

    #[test]
    fn a_connection_is_told_taken_and_carried_and_the_port_closes_with_the_host() {
        let (mut listening, run) = agent(HostMsg::Listen { port: 0 });
        let AgentMsg::Listening { port } = next(&mut listening) else { panic!("not listening") };
        let mut boxed = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
        let AgentMsg::Arrived { id, from_port } = next(&mut listening) else { panic!("not told") };
        assert_eq!(from_port, boxed.local_addr().unwrap().port());
        // An id nobody was told of is no connection.
        let (mut wrong, _) = agent(HostMsg::Take { id: id + 1000 });
        assert!(matches!(next(&mut wrong), AgentMsg::Error(_)));
        let (mut taken, _) = agent(HostMsg::Take { id });
        assert_eq!(next(&mut taken), AgentMsg::Connected);
        boxed.write_all(b"from the box").unwrap();
        let mut got = [0u8; 12];
        taken.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"from the box");
        taken.write_all(b"to the box").unwrap();
        let mut got = [0u8; 10];
        boxed.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"to the box");
        // Taken once only.
        let (mut again, _) = agent(HostMsg::Take { id });
        assert!(matches!(next(&mut again), AgentMsg::Error(_)));
        drop(listening);
        run.join().unwrap().unwrap();
        let refused = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
    }

    #[test]
    fn untaken_connections_past_the_most_are_closed() {
        let (mut listening, _run) = agent(HostMsg::Listen { port: 0 });
        let AgentMsg::Listening { port } = next(&mut listening) else { panic!("not listening") };
        let mut boxed: Vec<TcpStream> =
            (0..MOST_WAITING + 4).map(|_| TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap()).collect();
        for _ in 0..MOST_WAITING {
            assert!(matches!(next(&mut listening), AgentMsg::Arrived { .. }));
        }
        // The ones past the most are closed: each reads its end.
        for extra in boxed.drain(MOST_WAITING..) {
            let mut extra = extra;
            extra.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            assert_eq!(extra.read(&mut [0u8; 1]).unwrap(), 0);
        }
    }

    #[test]
    fn a_port_in_use_is_refused() {
        let used = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let (mut listening, run) = agent(HostMsg::Listen { port: used.local_addr().unwrap().port() });
        assert!(matches!(next(&mut listening), AgentMsg::Error(why) if why.contains("cannot listen")));
        run.join().unwrap().unwrap();
    }

    /// A socket path is made as the sessions' user (here nobody), mode
    /// 0600, carried like a port, and removed when the host's connection
    /// ends; a directory that user may not write to, or a path taken, is
    /// refused.
    #[test]
    fn a_socket_path_is_the_session_users_and_goes_with_the_host() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let closed = dir.path().join("closed");
        std::fs::create_dir(&closed).unwrap();
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o755)).unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let bytes = |p: &Path| p.as_os_str().as_bytes().to_vec();

        let (mut refused, _) = agent(HostMsg::ListenPath { path: bytes(&closed.join("s.sock")) });
        assert!(matches!(next(&mut refused), AgentMsg::Error(why) if why.contains("ermission denied")));

        let path = open.join("s.sock");
        let (mut listening, run) = agent(HostMsg::ListenPath { path: bytes(&path) });
        assert_eq!(next(&mut listening), AgentMsg::Listening { port: 0 });
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o777), (65534, 65534, 0o600));
        let (mut taken_twice, _) = agent(HostMsg::ListenPath { path: bytes(&path) });
        assert!(matches!(next(&mut taken_twice), AgentMsg::Error(_)));
        let mut boxed = UnixStream::connect(&path).unwrap();
        let AgentMsg::Arrived { id, from_port: 0 } = next(&mut listening) else { panic!("not told") };
        let (mut taken, _) = agent(HostMsg::Take { id });
        assert_eq!(next(&mut taken), AgentMsg::Connected);
        boxed.write_all(b"over a socket").unwrap();
        let mut got = [0u8; 13];
        taken.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"over a socket");
        drop(listening);
        run.join().unwrap().unwrap();
        assert!(!path.exists(), "the socket outlived its forward");
    }
}
