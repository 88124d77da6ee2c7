//! Connections to box ports: each is a web session the privileged side
//! opened (waking the box if it was suspended), whose agent stream was asked
//! for the port, speaking HTTP/1.1 to the box's server: over the TCP socket
//! the agent handed over (a namespace box), or over the stream (a microVM
//! guest's agent carries the bytes).
//!
//! Asking the privileged side for a stream, and the agent for a thread, is
//! most of a connection's cost, so a session keeps each stream whose agent
//! handed a socket over, for the next `Hand`. A connection whose answer
//! ended is kept a moment for the next request to the same port ([`Pool`]),
//! and its session as long, whether the server kept the connection or not;
//! the session keeps the box awake meanwhile, no longer.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use moat_agent::client::{hand, HandAnswer};
use moat_agent::protocol::AgentMsg;
use moat_api::{ApiClient, WebLease};
use moat_core::web::{WebHost, WebRefusal, WebSecret};
use tokio::net::{TcpStream, UnixStream};

use crate::body::ResBody;

/// How long a connection whose answer ended waits for another request.
pub const POOL_IDLE: Duration = Duration::from_secs(1);
/// How long the box's agent has to say whether the port took the connection.
const AGENT_ANSWER: Duration = Duration::from_secs(10);
/// How long a box held in a session may be silent before the privileged
/// side is asked to wake it (`suspend` freezes a box whatever its sessions:
/// its agent and its servers then answer nothing).
const NUDGE_AFTER: Duration = Duration::from_millis(50);
/// Most streams a session keeps.
const STREAMS_KEPT: usize = 16;
/// Most idle connections kept per box port.
const POOL_PER_PORT: usize = 16;

/// An HTTP/1.1 connection to a box port, and the session that keeps the box up.
pub struct BoxConn {
    /// Sends requests on it.
    pub sender: SendRequest<ResBody>,
    /// The session.
    pub session: Arc<Session>,
}

/// A web session, and the streams to the box's agent it keeps, each ready
/// for another `Hand`.
pub struct Session {
    /// Keeps the box up, and is where the requests carried are logged.
    pub lease: WebLease,
    streams: Mutex<Vec<UnixStream>>,
}

impl Session {
    fn kept(&self) -> Option<UnixStream> {
        self.streams.lock().unwrap_or_else(PoisonError::into_inner).pop()
    }

    /// `answer` within `limit`, the box woken if it is silent a while.
    pub async fn nudging<F: std::future::Future>(&self, limit: Duration, answer: F) -> Option<F::Output> {
        let deadline = tokio::time::Instant::now() + limit;
        tokio::pin!(answer);
        if let Ok(answered) = tokio::time::timeout(NUDGE_AFTER.min(limit), &mut answer).await {
            return Some(answered);
        }
        // Not woken (the privileged side is gone), the answer may still come.
        let _ = tokio::time::timeout_at(deadline, self.lease.wake()).await;
        tokio::time::timeout_at(deadline, answer).await.ok()
    }

    fn keep(&self, stream: UnixStream) {
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        if streams.len() < STREAMS_KEPT {
            streams.push(stream);
        }
    }
}

/// Why no connection to the box port was made.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The privileged side refused (a page for the visitor).
    #[error(transparent)]
    Refused(#[from] WebRefusal),
    /// Nothing listens on the port in the box.
    #[error("nothing listens on the port")]
    NoListener,
    /// The box, its agent or the privileged side failed.
    #[error("{0}")]
    Failed(String),
}

/// Opens a connection to `host`'s box port for a visitor with `cookie`: in
/// the web session another connection to that port holds, if one does
/// (over a stream it kept, or a new stream to the agent, with no check
/// again); else in a new session, for which the privileged side checks the
/// cookie again and wakes the box.
pub async fn open(
    api: &ApiClient,
    pool: &Pool,
    host: &WebHost,
    cookie: Option<&WebSecret>,
) -> Result<BoxConn, OpenError> {
    if let Some(session) = pool.session(host) {
        if let Some(mut stream) = session.kept() {
            // Lost (the agent went away), a fresh stream is asked for.
            let answer = session.nudging(AGENT_ANSWER, hand(&mut stream, host.port)).await;
            if let Some(Ok(HandAnswer::Socket(tcp))) = answer {
                session.keep(stream);
                let sender = handshake(TcpStream::from_std(tcp).map_err(failed)?).await?;
                return Ok(BoxConn { sender, session });
            }
        }
        if let Ok(fd) = session.lease.stream().await {
            return connect(session, fd, host.port).await;
        }
        // The session is over (the box stopped, say): a new one says why.
    }
    let (fd, lease) = match api.web_open(host, cookie).await {
        Ok(Ok((fd, lease, _))) => (fd, lease),
        Ok(Err(refusal)) => return Err(refusal.into()),
        Err(e) => return Err(OpenError::Failed(e.message)),
    };
    let session = Arc::new(Session { lease, streams: Mutex::default() });
    pool.hold_session(host, &session);
    connect(session, fd, host.port).await
}

/// A connection to `port` through `fd`, a new stream to the box's agent
/// (kept in `session` after, if the agent handed the socket over).
async fn connect(session: Arc<Session>, fd: OwnedFd, port: u16) -> Result<BoxConn, OpenError> {
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true).map_err(failed)?;
    let mut stream = UnixStream::from_std(stream).map_err(failed)?;
    let answer = tokio::time::timeout(AGENT_ANSWER, hand(&mut stream, port)).await;
    let sender = match answer.map_err(|_| OpenError::Failed("the box's agent did not answer".into()))? {
        // A namespace box's socket: the edge speaks to the box's server itself.
        Ok(HandAnswer::Socket(tcp)) => {
            session.keep(stream);
            handshake(TcpStream::from_std(tcp).map_err(failed)?).await?
        }
        // A microVM guest's agent carries the bytes over the stream.
        Ok(HandAnswer::Carried(early)) => handshake(moat_core::rewind::Rewind::new(early, stream)).await?,
        Ok(HandAnswer::Other(AgentMsg::Error(_))) => return Err(OpenError::NoListener),
        Ok(HandAnswer::Other(other)) => return Err(OpenError::Failed(format!("the box's agent answered {other:?}"))),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(OpenError::Failed("the box's agent closed the connection".into()))
        }
        Err(e) => return Err(failed(e)),
    };
    Ok(BoxConn { sender, session })
}

fn failed(e: io::Error) -> OpenError {
    OpenError::Failed(e.to_string())
}

/// An HTTP/1.1 client connection over `io`, driven by a task of its own.
async fn handshake<T>(io: T) -> Result<SendRequest<ResBody>, OpenError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| OpenError::Failed(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "a connection to a box port ended");
        }
    });
    Ok(sender)
}

/// Connections whose answer ended, per box port, each with when it did;
/// and the web session each port's connections share (alive while one of
/// them is: the last to go ends it).
#[derive(Default)]
pub struct Pool {
    idle: Mutex<HashMap<WebHost, Vec<(BoxConn, Instant)>>>,
    sessions: Mutex<HashMap<WebHost, Weak<Session>>>,
    /// Each port's session as its last answer ended, kept as long as an idle
    /// connection would be: a server that closes every connection (`busybox
    /// httpd`, `python -m http.server`) would otherwise cost a new session,
    /// a check and a wake, a request.
    lingering: Mutex<HashMap<WebHost, (Arc<Session>, Instant)>>,
}

impl Pool {
    /// The session `host`'s connections hold, if one still does.
    fn session(&self, host: &WebHost) -> Option<Arc<Session>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner).get(host)?.upgrade()
    }

    /// Notes `lease` as the session of `host`'s connections.
    fn hold_session(&self, host: &WebHost, session: &Arc<Session>) {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions.retain(|_, s| s.strong_count() > 0);
        sessions.insert(host.clone(), Arc::downgrade(session));
    }

    /// A connection to `host` ready for a request, if one waits.
    pub fn take(&self, host: &WebHost) -> Option<BoxConn> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let conns = idle.get_mut(host)?;
        while let Some((conn, _)) = conns.pop() {
            if conn.sender.is_ready() {
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn` for the next request once it is ready for one (dropped if
    /// it never is).
    pub fn give(self: &Arc<Self>, host: WebHost, mut conn: BoxConn) {
        let now = (Arc::clone(&conn.session), Instant::now());
        self.lingering.lock().unwrap_or_else(PoisonError::into_inner).insert(host.clone(), now);
        let pool = Arc::clone(self);
        tokio::spawn(async move {
            if tokio::time::timeout(POOL_IDLE, conn.sender.ready()).await.map_or(true, |r| r.is_err()) {
                return;
            }
            let mut idle = pool.idle.lock().unwrap_or_else(PoisonError::into_inner);
            let conns = idle.entry(host).or_default();
            if conns.len() < POOL_PER_PORT {
                conns.push((conn, Instant::now()));
            }
        });
    }

    /// Drops connections and sessions idle longer than [`POOL_IDLE`] (with
    /// a box's last session its idle grace begins).
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut lingering = self.lingering.lock().unwrap_or_else(PoisonError::into_inner);
        lingering.retain(|_, (_, since)| now.duration_since(*since) < POOL_IDLE);
        drop(lingering);
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        for conns in idle.values_mut() {
            conns.retain(|(conn, since)| now.duration_since(*since) < POOL_IDLE && !conn.sender.is_closed());
        }
        idle.retain(|_, conns| !conns.is_empty());
    }
}
