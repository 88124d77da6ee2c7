//! Connections to box ports: each is a web session the privileged side
//! opened (waking the box if it was suspended), whose agent stream was asked
//! for the port, speaking HTTP/1.1 to the box's server: over the TCP socket
//! the agent handed over (a namespace box), or over the stream (a microVM
//! guest's agent carries the bytes). A connection whose
//! answer ended is kept a moment for the next request to the same port
//! ([`Pool`]); its session keeps the box awake meanwhile, no longer.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use moat_agent::client::{hand_answer, send, HandAnswer};
use moat_agent::protocol::{AgentMsg, HostMsg};
use moat_api::{ApiClient, WebLease};
use moat_core::web::{WebHost, WebRefusal, WebSecret};
use tokio::net::{TcpStream, UnixStream};

use crate::body::ResBody;

/// How long a connection whose answer ended waits for another request.
pub const POOL_IDLE: Duration = Duration::from_secs(1);
/// How long the box's agent has to say whether the port took the connection.
const AGENT_ANSWER: Duration = Duration::from_secs(10);
/// Most idle connections kept per box port.
const POOL_PER_PORT: usize = 16;

/// An HTTP/1.1 connection to a box port, and the session that keeps the box up.
pub struct BoxConn {
    /// Sends requests on it.
    pub sender: SendRequest<ResBody>,
    /// The session (and where the requests carried are logged).
    pub lease: Arc<WebLease>,
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
/// the web session another connection to that port holds, if one does (a
/// new stream to the agent, no new session); else in a new session, for
/// which the privileged side checks the cookie again and wakes the box.
pub async fn open(
    api: &ApiClient,
    pool: &Pool,
    host: &WebHost,
    cookie: Option<&WebSecret>,
) -> Result<BoxConn, OpenError> {
    let held = match pool.session(host) {
        Some(lease) => lease.stream().await.ok().map(|fd| (fd, lease)),
        None => None,
    };
    let (fd, lease) = match held {
        Some(held) => held,
        None => match api.web_open(host, cookie).await {
            Ok(Ok((fd, lease, _))) => {
                let lease = Arc::new(lease);
                pool.hold_session(host, &lease);
                (fd, lease)
            }
            Ok(Err(refusal)) => return Err(refusal.into()),
            Err(e) => return Err(OpenError::Failed(e.message)),
        },
    };
    let failed = |e: io::Error| OpenError::Failed(e.to_string());
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true).map_err(failed)?;
    let mut stream = UnixStream::from_std(stream).map_err(failed)?;
    send(&mut stream, &HostMsg::Hand { port: host.port }).await.map_err(failed)?;
    let answer = tokio::time::timeout(AGENT_ANSWER, hand_answer(&stream)).await;
    let sender = match answer.map_err(|_| OpenError::Failed("the box's agent did not answer".into()))? {
        // A namespace box's socket: the edge speaks to the box's server itself.
        Ok(HandAnswer::Socket(tcp)) => handshake(TcpStream::from_std(tcp).map_err(failed)?).await?,
        // A microVM guest's agent carries the bytes over the stream.
        Ok(HandAnswer::Carried(early)) => handshake(moat_core::rewind::Rewind::new(early, stream)).await?,
        Ok(HandAnswer::Other(AgentMsg::Error(_))) => return Err(OpenError::NoListener),
        Ok(HandAnswer::Other(other)) => return Err(OpenError::Failed(format!("the box's agent answered {other:?}"))),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(OpenError::Failed("the box's agent closed the connection".into()))
        }
        Err(e) => return Err(failed(e)),
    };
    Ok(BoxConn { sender, lease })
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
    sessions: Mutex<HashMap<WebHost, Weak<WebLease>>>,
}

impl Pool {
    /// The session `host`'s connections hold, if one still does.
    fn session(&self, host: &WebHost) -> Option<Arc<WebLease>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner).get(host)?.upgrade()
    }

    /// Notes `lease` as the session of `host`'s connections.
    fn hold_session(&self, host: &WebHost, lease: &Arc<WebLease>) {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions.retain(|_, s| s.strong_count() > 0);
        sessions.insert(host.clone(), Arc::downgrade(lease));
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

    /// Drops connections idle longer than [`POOL_IDLE`] (their sessions end,
    /// and with the last the box's idle grace begins).
    pub fn sweep(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        for conns in idle.values_mut() {
            conns.retain(|(conn, since)| now.duration_since(*since) < POOL_IDLE && !conn.sender.is_closed());
        }
        idle.retain(|_, conns| !conns.is_empty());
    }
}
