//! The front door's side: each request dials a fresh connection through the
//! one socket it inherited, sends the request, and reads events back.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use moat_core::web::{Owner, WebHost, WebRefusal, WebRequestLog, WebSecret, WebVerdict};
use moat_core::{AccountId, Name};
use tokio::sync::{mpsc, Mutex};

use crate::proto::{ApiError, Event, Op, Reply, Request, WebOp, WebSessionMsg, MAX_EVENT};
use crate::wire::Packets;

/// Byte the front door sends on the dialer to ask for a connection.
pub(crate) const DIAL: u8 = b'd';

/// A handle on the privileged side. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ApiClient {
    dialer: Arc<Mutex<Packets>>,
}

/// Keeps a box session open; dropping it ends the session.
#[derive(Debug)]
pub struct Lease {
    conn: Packets,
}

impl Lease {
    /// Resolves when the session ends from the server's side: the account's
    /// access to the box was taken away (or the daemon went).
    pub async fn ended(&self) {
        while let Ok(Some(_)) = self.conn.recv(1).await {}
    }
}

/// Most request log entries a message carries: each is at most ~1.3 KiB of
/// JSON (a logged path is at most 512 bytes, some escaped), well within a
/// request's 16 KiB.
pub const LOGS_PER_MESSAGE: usize = 8;

/// How the edge reaches a web session's box port.
#[derive(Debug)]
pub enum WebReach {
    /// From sockets in the box's own network, which it connects itself (and
    /// asks [`WebLease::sockets`] for more).
    Sockets(Vec<OwnedFd>),
    /// Through the box's agent, over this stream to it (and
    /// [`WebLease::stream`] for more).
    Agent(OwnedFd),
}

/// Keeps a web session open (dropping it ends the session), carries the log
/// of the requests made in it, and gives sockets in the box's network (or
/// streams to its agent) for more connections to its port.
#[derive(Debug)]
pub struct WebLease {
    conn: Packets,
    /// One ask for a stream at a time: its answer is the next message.
    asking: Mutex<()>,
    /// Readable (at its end) once the session is over on the privileged side.
    life: Option<OwnedFd>,
}

impl WebLease {
    /// The session's life line, once: a socket that reads its end when the
    /// privileged side ends the session (the visitor's access taken away).
    pub fn take_life_line(&mut self) -> Option<OwnedFd> {
        self.life.take()
    }

    /// Logs requests carried in this session, [`LOGS_PER_MESSAGE`] to a
    /// message (lost if the privileged side is gone).
    pub async fn log(&self, entries: &[WebRequestLog]) {
        for some in entries.chunks(LOGS_PER_MESSAGE) {
            if let Ok(bytes) = serde_json::to_vec(&WebSessionMsg::Log(some.to_vec())) {
                let _ = self.conn.send(&bytes, &[]).await;
            }
        }
    }

    /// Another stream connected to the box's agent, in this session (no
    /// check again; the box is woken if `suspend` froze it meanwhile).
    pub async fn stream(&self) -> Result<OwnedFd, ApiError> {
        match self.ask(&WebSessionMsg::Stream).await? {
            (Reply::Session, fds) => one(fds),
            (other, _) => Err(unexpected(&Event::Outcome(Ok(other)))),
        }
    }

    /// Up to `count` unconnected sockets in the box's own network, for the
    /// edge to connect to its port; none where the box's agent must connect
    /// (a microVM guest).
    pub async fn sockets(&self, count: u8) -> Result<Vec<OwnedFd>, ApiError> {
        match self.ask(&WebSessionMsg::Sockets { count }).await? {
            (Reply::WebSockets, fds) => Ok(fds),
            (other, _) => Err(unexpected(&Event::Outcome(Ok(other)))),
        }
    }

    /// Resumes the box if `suspend` froze it while this session held it.
    pub async fn wake(&self) -> Result<(), ApiError> {
        match self.ask(&WebSessionMsg::Wake).await? {
            (Reply::Done, _) => Ok(()),
            (other, _) => Err(unexpected(&Event::Outcome(Ok(other)))),
        }
    }

    /// One ask on the session's connection, and its answer.
    async fn ask(&self, ask: &WebSessionMsg) -> Result<(Reply, Vec<OwnedFd>), ApiError> {
        let _turn = self.asking.lock().await;
        let ask = serde_json::to_vec(ask).map_err(|e| lost(&e.into()))?;
        self.conn.send(&ask, &[]).await.map_err(|e| lost(&e))?;
        let msg = self.conn.recv(MAX_EVENT).await.map_err(|e| lost(&e))?;
        let msg = msg.ok_or_else(|| lost(&io::ErrorKind::UnexpectedEof.into()))?;
        match serde_json::from_slice::<Event>(&msg.bytes).map_err(|e| lost(&e.into()))? {
            Event::Outcome(Ok(reply)) => Ok((reply, msg.fds)),
            Event::Outcome(Err(e)) => Err(e),
            other => Err(unexpected(&other)),
        }
    }
}

fn unexpected(event: &Event) -> ApiError {
    ApiError { status: 255, message: format!("unexpected answer from moat's privileged side: {event:?}") }
}

fn lost(e: &io::Error) -> ApiError {
    ApiError { status: 255, message: format!("moat's privileged side is not answering: {e}") }
}

impl ApiClient {
    /// A client over the dialer socket the privileged side handed us.
    pub fn new(dialer: Packets) -> Self {
        Self { dialer: Arc::new(Mutex::new(dialer)) }
    }

    async fn dial(&self) -> io::Result<Packets> {
        let fd = {
            let dialer = self.dialer.lock().await;
            dialer.send(&[DIAL], &[]).await?;
            let msg = dialer.recv(1).await?.ok_or(io::ErrorKind::UnexpectedEof)?;
            msg.fds.into_iter().next().ok_or(io::ErrorKind::InvalidData)?
        };
        Packets::new(fd)
    }

    /// Sends `req`; passes what comes before the outcome (progress, a diff's
    /// batches) to `updates`, waiting for room there; returns the outcome, the
    /// descriptor that came with it, and the connection (still open).
    async fn exchange(
        &self,
        req: &Request,
        updates: Option<&mpsc::Sender<Event>>,
    ) -> Result<(Reply, Vec<OwnedFd>, Packets), ApiError> {
        let conn = self.dial().await.map_err(|e| lost(&e))?;
        let bytes = serde_json::to_vec(req).map_err(|e| lost(&e.into()))?;
        conn.send(&bytes, &[]).await.map_err(|e| lost(&e))?;
        loop {
            let msg = conn.recv(MAX_EVENT).await.map_err(|e| lost(&e))?;
            let msg = msg.ok_or_else(|| lost(&io::ErrorKind::UnexpectedEof.into()))?;
            let event: Event = serde_json::from_slice(&msg.bytes).map_err(|e| lost(&e.into()))?;
            match (event, updates) {
                (Event::Outcome(outcome), _) => return Ok((outcome?, msg.fds, conn)),
                (update, Some(updates)) => {
                    // The reader went away: nobody wants the rest.
                    updates.send(update).await.map_err(|_| lost(&io::ErrorKind::BrokenPipe.into()))?;
                }
                (_, None) => {}
            }
        }
    }

    /// Runs a request to its outcome, passing what comes before it (progress
    /// lines, a diff's batches) to `updates` as it arrives.
    pub async fn call_streaming(&self, req: &Request, updates: &mpsc::Sender<Event>) -> Result<Reply, ApiError> {
        self.exchange(req, Some(updates)).await.map(|(reply, _, _)| reply)
    }

    /// Runs a request to its outcome.
    pub async fn call(&self, req: &Request) -> Result<Reply, ApiError> {
        self.exchange(req, None).await.map(|(reply, _, _)| reply)
    }

    /// Opens a session on a box (resuming or booting it): a stream connected
    /// to its agent, and the lease that keeps the box up.
    pub async fn open_session(&self, account: &AccountId, name: &Name) -> Result<(OwnedFd, Lease), ApiError> {
        self.open_shared_session(account, name, None).await
    }

    /// As [`ApiClient::open_session`], on `owner`'s box `name` if it shared
    /// it with the account (`None`: the account's own).
    pub async fn open_shared_session(
        &self,
        account: &AccountId,
        name: &Name,
        owner: Option<&Owner>,
    ) -> Result<(OwnedFd, Lease), ApiError> {
        let op = Op::OpenSession { name: name.clone(), owner: owner.cloned() };
        let req = Request::Act { account: account.clone(), op };
        match self.exchange(&req, None).await? {
            (Reply::Session, fds, conn) => Ok((one(fds)?, Lease { conn })),
            (reply, _, _) => Err(ApiError::unexpected(&reply)),
        }
    }

    /// Whether a request to `host` with `cookie` may reach the box port.
    pub async fn web_check(&self, host: &WebHost, cookie: Option<&WebSecret>) -> Result<WebVerdict, ApiError> {
        let req = Request::Web(WebOp::Check { host: host.clone(), cookie: cookie.cloned() });
        match self.call(&req).await? {
            Reply::Web(verdict) => Ok(verdict),
            reply => Err(ApiError::unexpected(&reply)),
        }
    }

    /// Spends a sign-in link for `host`: the session cookie, or why not.
    pub async fn web_sign_in(
        &self,
        host: &WebHost,
        link: &WebSecret,
    ) -> Result<Result<WebSecret, WebRefusal>, ApiError> {
        let req = Request::Web(WebOp::SignIn { host: host.clone(), link: link.clone() });
        match self.call(&req).await? {
            Reply::WebCookie(cookie) => Ok(Ok(cookie)),
            Reply::Web(WebVerdict::Refuse(r)) => Ok(Err(r)),
            reply => Err(ApiError::unexpected(&reply)),
        }
    }

    /// A web session on the box `host` names (resuming it if suspended): the
    /// lease that keeps the box up (and takes the log of the requests
    /// carried), how the edge reaches the box's port (up to `sockets` sockets
    /// in its network, or a stream to its agent), and who the visitor is; or
    /// why not.
    pub async fn web_open(
        &self,
        host: &WebHost,
        cookie: Option<&WebSecret>,
        sockets: u8,
    ) -> Result<Result<(WebLease, WebReach, String), WebRefusal>, ApiError> {
        let req = Request::Web(WebOp::Open { host: host.clone(), cookie: cookie.cloned(), sockets });
        let (reach, who, conn, life) = match self.exchange(&req, None).await? {
            (Reply::WebSession { who, through_agent, life_line }, mut fds, conn) => {
                let life = if life_line {
                    Some(fds.pop().ok_or_else(|| lost(&io::ErrorKind::InvalidData.into()))?)
                } else {
                    None
                };
                let reach = if through_agent { WebReach::Agent(one(fds)?) } else { WebReach::Sockets(fds) };
                (reach, who, conn, life)
            }
            (Reply::Web(WebVerdict::Refuse(r)), _, _) => return Ok(Err(r)),
            (reply, _, _) => return Err(ApiError::unexpected(&reply)),
        };
        Ok(Ok((WebLease { conn, asking: Mutex::new(()), life }, reach, who)))
    }

    /// The account a public key (`TYPE BASE64`) is, if it may log in.
    pub async fn authorize(&self, key: &str) -> Result<Option<AccountId>, ApiError> {
        match self.call(&Request::Authorize { key: key.to_string() }).await? {
            Reply::Account(account) => Ok(account),
            reply => Err(ApiError::unexpected(&reply)),
        }
    }
}

/// The one descriptor an answer carries.
fn one(fds: Vec<OwnedFd>) -> Result<OwnedFd, ApiError> {
    let [fd] = <[OwnedFd; 1]>::try_from(fds).map_err(|_| lost(&io::ErrorKind::InvalidData.into()))?;
    Ok(fd)
}
