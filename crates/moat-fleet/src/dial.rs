//! The router's side of the fleet connection: dials a node (its certificate
//! must name the node and be a member's of role node) and forwards one
//! front-door connection over it, a request out and its events back.
//!
//! A session's outcome comes as a session frame: the router makes a socket
//! pair, hands the front door one end with the outcome (where a node on the
//! same host would hand the agent's stream), and relays the other end over
//! the connection, so the front door cannot tell the two apart.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use moat_api::proto::{ApiError, Event, MAX_EVENT};
use moat_api::Packets;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::frame::{self, Kind};
use crate::peer::{PeerError, Peers};
use crate::pki::Role;

/// Why a node could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// No TCP connection.
    #[error("node {node} ({addr}) does not answer: {source}")]
    Connect {
        /// The node.
        node: String,
        /// Its address.
        addr: String,
        /// Why.
        source: io::Error,
    },
    /// The handshake failed or its certificate is not the node's.
    #[error("node {node} ({addr}) failed the fleet handshake: {detail}")]
    Handshake {
        /// The node.
        node: String,
        /// Its address.
        addr: String,
        /// Why.
        detail: String,
    },
    /// The handshake succeeded, but the certificate is no member node's.
    #[error("node {node} ({addr}) is refused: {source}")]
    Peer {
        /// The node.
        node: String,
        /// Its address.
        addr: String,
        /// Why.
        source: PeerError,
    },
}

impl DialError {
    /// Why, without which node (for a message that names it already).
    pub fn reason(&self) -> String {
        match self {
            DialError::Connect { addr, source, .. } => format!("{addr}: {source}"),
            DialError::Handshake { detail, .. } => format!("fleet handshake failed: {detail}"),
            DialError::Peer { source, .. } => source.to_string(),
        }
    }
}

/// Dials nodes as a member of the fleet.
pub struct Dialer {
    tls: TlsConnector,
    peers: Arc<Peers>,
    /// How long a connect and handshake may take.
    pub timeout: Duration,
}

/// One connection to a node, for one request.
pub struct Link {
    tls: TlsStream<TcpStream>,
}

/// How a forwarded request ended.
#[derive(Debug)]
pub enum Forwarded {
    /// Its outcome went to the front door (and its session, if it was one,
    /// has ended).
    Answered,
    /// The node declined (see [`Link::forward`]); the front door has heard
    /// nothing of the outcome, and may be answered by another node.
    Declined(ApiError),
}

impl Dialer {
    /// Dials with `tls` ([`crate::tls::Identity::client_config`]), checking nodes against `peers`.
    pub fn new(tls: Arc<rustls::ClientConfig>, peers: Arc<Peers>) -> Self {
        Self { tls: TlsConnector::from(tls), peers, timeout: Duration::from_secs(2) }
    }

    /// A connection to node `node` at `addr` (`HOST:PORT`).
    pub async fn dial(&self, node: &str, addr: &str) -> Result<Link, DialError> {
        let at = || addr.to_string();
        let handshake = |detail: String| DialError::Handshake { node: node.to_string(), addr: at(), detail };
        let name = ServerName::try_from(node.to_string()).map_err(|e| handshake(e.to_string()))?;
        let refused = |source| DialError::Connect { node: node.to_string(), addr: at(), source };
        let connect = async {
            let tcp = TcpStream::connect(addr).await.map_err(refused)?;
            tcp.set_nodelay(true).map_err(refused)?;
            let tls = self.tls.connect(name, tcp).await.map_err(|e| handshake(e.to_string()))?;
            let (_, session) = tls.get_ref();
            if session.alpn_protocol() != Some(crate::tls::ALPN) {
                return Err(handshake("it speaks another protocol".into()));
            }
            self.peers
                .admit(session.peer_certificates(), Role::Node, Some(node))
                .await
                .map_err(|source| DialError::Peer { node: node.to_string(), addr: at(), source })?;
            Ok(Link { tls })
        };
        let timed_out = io::Error::new(io::ErrorKind::TimedOut, "timed out");
        tokio::time::timeout(self.timeout, connect).await.map_err(|_| refused(timed_out))?
    }
}

impl Link {
    /// Asks the node (as a node of the fleet) for `ask`; the connection
    /// then carries the answer, read by the caller.
    pub async fn ask_node(mut self, ask: &crate::listen::NodeAsk) -> io::Result<TlsStream<TcpStream>> {
        let bytes = serde_json::to_vec(ask).map_err(io::Error::other)?;
        frame::write(&mut self.tls, Kind::Message, &bytes).await?;
        Ok(self.tls)
    }

    /// Sends `request` (one answered by messages only) and returns the
    /// node's events, to be read here rather than passed on as they are.
    pub async fn request(self, request: &[u8]) -> io::Result<Events> {
        let (reader, mut writer) = tokio::io::split(self.tls);
        frame::write(&mut writer, Kind::Message, request).await?;
        Ok(Events { reader, _writer: writer })
    }

    /// Sends `request` (a request's bytes, as the front door sent them) and
    /// passes every event back to the front door on `conn`, until the
    /// outcome (and, for a session, the session's end) or the front door's
    /// close. An outcome that is an error `decline` accepts is not passed
    /// on but returned: the caller may ask another node.
    pub async fn forward(
        self,
        conn: &Packets,
        request: &[u8],
        decline: impl Fn(&ApiError) -> bool,
    ) -> io::Result<Forwarded> {
        let (mut reader, mut writer) = tokio::io::split(self.tls);
        frame::write(&mut writer, Kind::Message, request).await?;
        let events = async {
            loop {
                let Some((kind, bytes)) = frame::read(&mut reader, MAX_EVENT).await? else {
                    return Ok(None);
                };
                if let Some(err) = declined(&bytes, &decline) {
                    return Ok(Some(Err(err)));
                }
                match kind {
                    Kind::Message => conn.send(&bytes, &[]).await?,
                    Kind::Session => return Ok(Some(Ok(bytes))),
                }
            }
        };
        // A front door says nothing after its request but its close.
        let closed = async { while let Ok(Some(_)) = conn.recv(1).await {} };
        let session: io::Result<_> = tokio::select! {
            ended = events => ended,
            () = closed => return Ok(Forwarded::Answered),
        };
        let outcome = match session? {
            None => return Ok(Forwarded::Answered),
            Some(Err(declined)) => return Ok(Forwarded::Declined(declined)),
            Some(Ok(outcome)) => outcome,
        };
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        conn.send(&outcome, &[std::os::fd::AsFd::as_fd(&theirs)]).await?;
        drop(theirs);
        let ours = crate::relay::unix_stream(ours.into())?;
        tokio::select! {
            () = crate::relay::relay(ours, &mut reader, &mut writer) => {}
            // The front door dropped the session's lease.
            () = async { while let Ok(Some(_)) = conn.recv(1).await {} } => {}
        }
        Ok(Forwarded::Answered)
    }
}

/// A node's events for a request answered without a session.
pub struct Events {
    reader: tokio::io::ReadHalf<TlsStream<TcpStream>>,
    /// Held so that the node sees no close before this is dropped.
    _writer: tokio::io::WriteHalf<TlsStream<TcpStream>>,
}

impl Events {
    /// The next event; `None` once the node has closed the connection.
    pub async fn next(&mut self) -> io::Result<Option<Event>> {
        let malformed = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        match frame::read(&mut self.reader, MAX_EVENT).await? {
            None => Ok(None),
            Some((Kind::Message, bytes)) => {
                serde_json::from_slice(&bytes).map(Some).map_err(|e| malformed(e.to_string()))
            }
            Some((Kind::Session, _)) => Err(malformed("a session nobody asked for".into())),
        }
    }
}

/// The error of an outcome `decline` accepts. Only outcomes are decoded
/// (a diff's batches can be large), and only when they fail.
fn declined(bytes: &[u8], decline: &impl Fn(&ApiError) -> bool) -> Option<ApiError> {
    if !bytes.starts_with(b"{\"outcome\":{\"Err\"") {
        return None;
    }
    match serde_json::from_slice::<Event>(bytes).ok()? {
        Event::Outcome(Err(err)) if decline(&err) => Some(err),
        _ => None,
    }
}
