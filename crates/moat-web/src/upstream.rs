//! Connections to box ports: each is made in a web session the privileged
//! side opened (waking the box if it was suspended), and speaks HTTP/1.1 to
//! the box's server. For a namespace box the edge connects itself, from a
//! socket the privileged side made in the box's own network (a batch at a
//! time, so most connections cost the edge a `connect` and nothing more);
//! for a microVM guest, whose loopback is its own kernel's, the guest's agent
//! connects and carries the bytes over a stream to it.
//!
//! A connection whose answer ended is kept a moment for the next request to
//! the same port ([`Pool`]), and its session as long, whether the server kept
//! the connection or not; the session keeps the box awake meanwhile, no
//! longer.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use moat_agent::CONNECT_TRIES_MS;
use moat_api::{ApiClient, WebLease, WebReach};
use moat_core::web::{WebHost, WebRefusal, WebRequestLog, WebSecret};
use tokio::net::{TcpSocket, TcpStream, UnixStream};

use crate::body::ResBody;
use crate::yielding::{Informational, Yielding, MAX_BUFFER};

/// How long a connection whose answer ended waits for another request.
pub const POOL_IDLE: Duration = Duration::from_secs(1);
/// How long the box has to take the connection (or its agent to say whether
/// it did).
const CONNECT_ANSWER: Duration = Duration::from_secs(10);
/// How long a box held in a session may be silent before the privileged
/// side is asked to wake it (`suspend` freezes a box whatever its sessions:
/// its agent and its servers then answer nothing).
const NUDGE_AFTER: Duration = Duration::from_millis(50);
/// How many sockets in the box's network a session's opening brings; each
/// ask after doubles it, up to as many as one message carries (a busy session
/// asks rarely, a short one leaves few unused).
const FIRST_SOCKETS: u8 = 4;
/// How long after a message of log entries the next is sent: those of the
/// requests meanwhile go in it together.
const LOG_DELAY: Duration = Duration::from_millis(50);
/// Most idle connections kept per box port.
const POOL_PER_PORT: usize = 16;

/// A box port as one visitor reaches it (`who`: the account signed in, or
/// `public`). Each visitor's requests go in web sessions of its own, so that
/// taking one visitor's access away ends its tunnels, and only its.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Visit {
    /// The box port.
    pub host: WebHost,
    /// Who visits.
    pub who: String,
}

/// An HTTP/1.1 connection to a box port, and the session that keeps the box up.
pub struct BoxConn {
    /// Sends requests on it.
    pub sender: Sender,
    /// The task reading it: ended with it.
    pub driver: Driver,
    /// The session.
    pub session: Arc<Session>,
}

/// Sends requests on a connection to a box port, each allowed at most
/// [`crate::yielding::MAX_INFORMATIONAL`] informational answers.
pub struct Sender {
    inner: SendRequest<ResBody>,
    informational: Informational,
}

impl Sender {
    /// Sends `req`; resolves to the box's answer's head.
    pub fn send_request(
        &mut self,
        mut req: hyper::Request<ResBody>,
    ) -> impl std::future::Future<Output = hyper::Result<hyper::Response<hyper::body::Incoming>>> {
        self.informational.count(&mut req);
        self.inner.send_request(req)
    }

    /// Whether the connection takes a request now.
    pub fn is_ready(&self) -> bool {
        self.inner.is_ready()
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Resolves once the connection takes a request (or is gone).
    pub async fn ready(&mut self) -> hyper::Result<()> {
        self.inner.ready().await
    }
}

/// A task ended when this is dropped: a connection's (one given up on, its
/// answer late or its body cut short, is not read on) or a session's watcher.
pub struct Driver(tokio::task::AbortHandle);

impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A web session, the sockets in its box's network it has yet to use, and
/// the log entries of its requests yet to be sent.
pub struct Session {
    /// Keeps the box up, and is where the requests carried are logged.
    pub lease: WebLease,
    sockets: tokio::sync::Mutex<Sockets>,
    unlogged: Mutex<Unlogged>,
    /// Turns true when the privileged side ends the session (the visitor's
    /// access taken away): its connections and tunnels end then.
    ended: tokio::sync::watch::Receiver<bool>,
    /// The task watching the session's life line (ended with the session).
    _watcher: Option<Driver>,
}

/// Resolves once `ended` turns true (never, if its sender is gone first).
pub async fn ended(mut ended: tokio::sync::watch::Receiver<bool>) {
    if ended.wait_for(|ended| *ended).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Sockets in a box's network not used yet, or word that its agent connects.
struct Sockets {
    spare: Vec<OwnedFd>,
    asked: usize,
    through_agent: bool,
}

/// Log entries not sent yet, and whether a task is sending them.
#[derive(Default)]
struct Unlogged {
    entries: Vec<WebRequestLog>,
    sending: bool,
}

impl Session {
    /// A session reaching its box as `reach` says (a stream to its agent
    /// is returned: it is the first connection's).
    fn new(mut lease: WebLease, reach: WebReach) -> (Arc<Self>, Option<OwnedFd>) {
        let (sockets, agent) = match reach {
            WebReach::Sockets(spare) => (Sockets { spare, asked: FIRST_SOCKETS.into(), through_agent: false }, None),
            WebReach::Agent(fd) => (Sockets { spare: Vec::new(), asked: 0, through_agent: true }, Some(fd)),
        };
        let (end, ended) = tokio::sync::watch::channel(false);
        let watcher = lease
            .take_life_line()
            .map(|line| {
                tokio::spawn(async move {
                    // Nothing is ever sent on it: readable means its other end closed.
                    if let Ok(line) = moat_core::async_fd::register(line, tokio::io::Interest::READABLE) {
                        let _ = line.readable().await;
                        let _ = end.send(true);
                    }
                })
                .abort_handle()
            })
            .map(Driver);
        let session = Self {
            lease,
            sockets: tokio::sync::Mutex::new(sockets),
            unlogged: Mutex::default(),
            ended,
            _watcher: watcher,
        };
        (Arc::new(session), agent)
    }

    /// Whether the privileged side ended the session.
    pub fn is_ended(&self) -> bool {
        *self.ended.borrow()
    }

    /// Resolves once the privileged side ends the session.
    pub fn ended(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        ended(self.ended.clone())
    }

    /// Logs a request carried in this session: at once if no message went
    /// in the last few milliseconds, else with the others of those in one
    /// message when they end (a message per request cost the privileged side
    /// more than the request; one held back would be lost with the edge).
    pub fn log(self: &Arc<Self>, entry: WebRequestLog) {
        let mut unlogged = self.unlogged.lock().unwrap_or_else(PoisonError::into_inner);
        unlogged.entries.push(entry);
        if std::mem::replace(&mut unlogged.sending, true) {
            return;
        }
        let session = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                let entries = {
                    let mut unlogged = session.unlogged.lock().unwrap_or_else(PoisonError::into_inner);
                    unlogged.sending = !unlogged.entries.is_empty();
                    std::mem::take(&mut unlogged.entries)
                };
                if entries.is_empty() {
                    return;
                }
                session.lease.log(&entries).await;
                tokio::time::sleep(LOG_DELAY).await;
            }
        });
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

    /// A socket in the box's network, or `None` where its agent connects.
    async fn socket(&self) -> Result<Option<OwnedFd>, OpenError> {
        let mut sockets = self.sockets.lock().await;
        if sockets.through_agent {
            return Ok(None);
        }
        if let Some(fd) = sockets.spare.pop() {
            return Ok(Some(fd));
        }
        sockets.asked = (sockets.asked * 2).clamp(FIRST_SOCKETS.into(), moat_api::wire::MAX_FDS);
        let count = u8::try_from(sockets.asked).unwrap_or(u8::MAX);
        let mut made = self.lease.sockets(count).await.map_err(|e| OpenError::Failed(e.message))?;
        let fd = made.pop();
        sockets.through_agent = fd.is_none();
        sockets.spare = made;
        Ok(fd)
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

/// Opens a connection to a box port for a visitor with `cookie`: in the
/// web session another of the visitor's connections to that port holds, if
/// one does (with no check again); else in a new session, for which the
/// privileged side checks the cookie again and wakes the box.
pub async fn open(
    api: &ApiClient,
    pool: &Pool,
    visit: &Visit,
    cookie: Option<&WebSecret>,
) -> Result<BoxConn, OpenError> {
    let host = &visit.host;
    if let Some(session) = pool.session(visit).filter(|s| !s.is_ended()) {
        match connect(&session, None, host.port).await {
            // The session is over (the box stopped, say): a new one says why.
            Err(OpenError::Failed(_)) => {}
            opened => return opened.map(|(sender, driver)| BoxConn { sender, driver, session }),
        }
    }
    let (lease, reach) = match api.web_open(host, cookie, FIRST_SOCKETS).await {
        Ok(Ok((lease, reach, _))) => (lease, reach),
        Ok(Err(refusal)) => return Err(refusal.into()),
        Err(e) => return Err(OpenError::Failed(e.message)),
    };
    let (session, agent) = Session::new(lease, reach);
    pool.hold_session(visit, &session);
    let (sender, driver) = connect(&session, agent, host.port).await?;
    Ok(BoxConn { sender, driver, session })
}

/// A connection to `port` in `session`'s box: from a socket in its network,
/// or through its agent (over `agent`, a stream to it, if given).
async fn connect(session: &Session, agent: Option<OwnedFd>, port: u16) -> Result<(Sender, Driver), OpenError> {
    let dialled = session.nudging(CONNECT_ANSWER, dial(session, port)).await;
    if session.is_ended() {
        return Err(OpenError::Failed("the session ended".into()));
    }
    match dialled.ok_or_else(|| OpenError::Failed("the box did not take the connection".into()))?? {
        Some(tcp) => handshake(tcp, session.ended()).await,
        None => {
            let agent = match agent {
                Some(fd) => fd,
                None => session.lease.stream().await.map_err(|e| OpenError::Failed(e.message))?,
            };
            session
                .nudging(CONNECT_ANSWER, through_agent(agent, port, session.ended()))
                .await
                .unwrap_or_else(|| Err(OpenError::Failed("the box's agent did not answer".into())))
        }
    }
}

/// A connection to `port` on the box's loopback from a socket in its
/// network, 127.0.0.1 then ::1 (as its agent would); `None` where its agent
/// must connect. A try the box does not answer soon (its server's backlog
/// full: the SYN was dropped) is made again, sooner than the kernel would.
async fn dial(session: &Session, port: u16) -> Result<Option<TcpStream>, OpenError> {
    for ip in [Ipv4Addr::LOCALHOST.to_ipv6_mapped(), Ipv6Addr::LOCALHOST] {
        for ms in CONNECT_TRIES_MS {
            let Some(fd) = session.socket().await? else { return Ok(None) };
            let socket = TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
            match tokio::time::timeout(Duration::from_millis(ms), socket.connect(SocketAddr::from((ip, port)))).await {
                Ok(Ok(tcp)) => return Ok(Some(tcp)),
                Ok(Err(_)) => break,
                Err(_) => continue,
            }
        }
    }
    Err(OpenError::NoListener)
}

/// A connection to `port` that the box's agent (on `fd`) makes and carries.
async fn through_agent(
    fd: OwnedFd,
    port: u16,
    ended: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(Sender, Driver), OpenError> {
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true).map_err(failed)?;
    let mut stream = UnixStream::from_std(stream).map_err(failed)?;
    match moat_agent::client::connect(&mut stream, port).await {
        Ok(early) => handshake(moat_core::rewind::Rewind::new(early, stream), ended).await,
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Err(OpenError::NoListener),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            Err(OpenError::Failed("the box's agent closed the connection".into()))
        }
        Err(e) => Err(failed(e)),
    }
}

fn failed(e: io::Error) -> OpenError {
    OpenError::Failed(e.to_string())
}

/// An HTTP/1.1 client connection over `io`, driven by a task of its own
/// (which gives its turn back now and then, and bounds what an answer's
/// head costs: see [`Yielding`]) until the connection or its session
/// (`ended`) ends.
async fn handshake<T>(
    io: T,
    ended: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(Sender, Driver), OpenError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let informational = Informational::default();
    let (inner, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_BUFFER)
        .handshake(TokioIo::new(Yielding::new(io, informational.clone())))
        .await
        .map_err(|e| OpenError::Failed(e.to_string()))?;
    let sender = Sender { inner, informational };
    let task = tokio::spawn(async move {
        tokio::select! {
            done = conn.with_upgrades() => {
                if let Err(e) = done {
                    tracing::debug!(error = %e, "a connection to a box port ended");
                }
            }
            () = ended => tracing::debug!("a connection to a box port ended with its session"),
        }
    });
    Ok((sender, Driver(task.abort_handle())))
}

/// Connections whose answer ended, per visitor of a box port, each with
/// when it did; and the web session each visitor's connections to a port
/// share (alive while one of them is: the last to go ends it).
#[derive(Default)]
pub struct Pool {
    idle: Mutex<HashMap<Visit, Vec<(BoxConn, Instant)>>>,
    sessions: Mutex<HashMap<Visit, Weak<Session>>>,
    /// Each port's session as its last answer ended, kept as long as an idle
    /// connection would be: a server that closes every connection (`busybox
    /// httpd`, `python -m http.server`) would otherwise cost a new session,
    /// a check and a wake, a request.
    lingering: Mutex<HashMap<Visit, (Arc<Session>, Instant)>>,
}

impl Pool {
    /// The session a visitor's connections to a port hold, if one still does.
    fn session(&self, visit: &Visit) -> Option<Arc<Session>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner).get(visit)?.upgrade()
    }

    /// Notes `session` as the session of a visitor's connections to a port.
    fn hold_session(&self, visit: &Visit, session: &Arc<Session>) {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions.retain(|_, s| s.strong_count() > 0);
        sessions.insert(visit.clone(), Arc::downgrade(session));
    }

    /// A connection of the visitor's to the port ready for a request, if one waits.
    pub fn take(&self, visit: &Visit) -> Option<BoxConn> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let conns = idle.get_mut(visit)?;
        while let Some((conn, _)) = conns.pop() {
            if conn.sender.is_ready() {
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn` for the next request once it is ready for one (dropped if
    /// it never is).
    pub fn give(self: &Arc<Self>, visit: Visit, mut conn: BoxConn) {
        let now = (Arc::clone(&conn.session), Instant::now());
        self.lingering.lock().unwrap_or_else(PoisonError::into_inner).insert(visit.clone(), now);
        let pool = Arc::clone(self);
        tokio::spawn(async move {
            if tokio::time::timeout(POOL_IDLE, conn.sender.ready()).await.map_or(true, |r| r.is_err()) {
                return;
            }
            let mut idle = pool.idle.lock().unwrap_or_else(PoisonError::into_inner);
            let conns = idle.entry(visit).or_default();
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
