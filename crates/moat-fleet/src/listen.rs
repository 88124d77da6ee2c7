//! The node's side of the fleet connection: a TCP listener whose every
//! connection, once its TLS handshake proves a front door of this fleet,
//! carries one request to the node's own request handling.
//!
//! The connection is bridged to a unix packet pair whose other end is
//! answered exactly as a local front door's dial is (`moat_api::server`'s
//! [`Answer`]), so there is one copy of that logic. Each message the answer
//! sends goes back as a frame; the one carrying a descriptor (a session's
//! stream to the box's agent) goes as a session frame, and the connection
//! then carries the session's bytes until either side ends it.
//!
//! Another node of the fleet may ask one thing ([`NodeAsk`]): a box moving
//! to it, streamed by the node's [`BoxSource`].

use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use moat_api::proto::{MAX_EVENT, MAX_REQUEST};
use moat_api::server::Answer;
use moat_api::Packets;
use tokio::io::{AsyncReadExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::frame::{self, Kind};
use crate::join::FleetDir;
use crate::peer::Peers;
use crate::pki::Role;
use crate::store::{StoreFailure, StoreMembers};

/// How long a peer has for its handshake and its request, on a node.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most fleet connections open at once (every session through a front door holds one).
const MAX_CONNECTIONS: usize = 16 << 10;

/// What a node may ask another node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum NodeAsk {
    /// The files of box `box_id`, moving to the asking node.
    SendBox {
        /// The box.
        box_id: String,
    },
}

/// Sends a box's files to the node it is moving to (the durable boxes').
pub trait BoxSource: Send + Sync {
    /// Writes box `box_id`'s files to `out`, for its move to node `to`
    /// (refused unless it is moving there).
    fn send_box<'a>(
        &'a self,
        to: &'a str,
        box_id: &'a str,
        out: &'a mut (dyn tokio::io::AsyncWrite + Unpin + Send),
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = io::Result<()>> + Send + 'a>>;
}

/// What a node answers fleet connections with.
pub struct NodeListener<A> {
    /// Its TLS setup ([`crate::tls::Identity::server_config`]).
    pub tls: Arc<rustls::ServerConfig>,
    /// Who may connect (front doors of the fleet).
    pub peers: Arc<Peers>,
    /// The node's request handling.
    pub answerer: Arc<A>,
    /// How long a peer has for its handshake and its request.
    pub handshake_timeout: Duration,
    /// What sends boxes to the nodes they move to (`None`: other nodes are
    /// refused).
    pub boxes: Option<Arc<dyn BoxSource>>,
}

/// Why a node could not answer the fleet.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The state dir is not a node's.
    #[error("this state dir is {} {name}, not a node", role.as_str())]
    NotNode {
        /// What it is.
        role: Role,
        /// Its name.
        name: String,
    },
    /// The store did not answer.
    #[error(transparent)]
    Store(#[from] StoreFailure),
    /// Its TLS setup.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// The listener.
    #[error("listen for the fleet on {addr}: {source}")]
    Listen {
        /// Where.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
}

/// A node's side of the fleet, for `moat serve` on a node: answers front
/// doors' routers on `listener` (bound by the caller, so that the lease it
/// renews names the port bound) as the member `dir` holds (a node), with
/// `answerer` (the daemon's `Privileged`), until the listener fails. Peers
/// are checked with a store connection of its own.
pub async fn serve_node<A: Answer>(
    dir: &FleetDir,
    listener: TcpListener,
    answerer: Arc<A>,
    boxes: Option<Arc<dyn BoxSource>>,
) -> Result<(), NodeError> {
    if dir.member.role != Role::Node {
        return Err(NodeError::NotNode { role: dir.member.role, name: dir.member.name.clone() });
    }
    let dsn = dir.config.store.clone();
    let store = tokio::task::spawn_blocking(move || moat_core::Store::connect(&dsn))
        .await
        .map_err(|e| StoreFailure(e.to_string()))?
        .map_err(StoreFailure::from)?;
    let peers = Peers::new(Arc::new(StoreMembers(Arc::new(store))));
    let addr = listener.local_addr().map_err(|source| NodeError::Listen { addr: ([0, 0, 0, 0], 0).into(), source })?;
    let listen = |source| NodeError::Listen { addr, source };
    let node = Arc::new(NodeListener {
        tls: dir.identity.server_config()?,
        peers,
        answerer,
        handshake_timeout: HANDSHAKE_TIMEOUT,
        boxes,
    });
    tracing::info!(%addr, node = %dir.member.name, "answering the fleet");
    node.serve(listener).await.map_err(listen)
}

impl<A: Answer> NodeListener<A> {
    /// Answers connections on `listener` until it fails.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let permit = Arc::clone(&open).acquire_owned().await.map_err(io::Error::other)?;
            let (tcp, from) = match listener.accept().await {
                Ok(accepted) => accepted,
                // Out of descriptors, a connection reset before accept: not the listener's end.
                Err(e) => {
                    tracing::warn!(error = %e, "fleet listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let node = Arc::clone(&self);
            tokio::spawn(async move {
                if let Err(e) = node.connection(tcp).await {
                    tracing::debug!(%from, error = %e, "fleet connection refused or failed");
                }
                drop(permit);
            });
        }
    }

    async fn connection(&self, tcp: TcpStream) -> io::Result<()> {
        tcp.set_nodelay(true)?;
        let acceptor = TlsAcceptor::from(Arc::clone(&self.tls));
        let (tls, request, node) = tokio::time::timeout(self.handshake_timeout, async {
            let mut tls = acceptor.accept(tcp).await?;
            let (_, session) = tls.get_ref();
            if session.alpn_protocol() != Some(crate::tls::ALPN) {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "the peer speaks another protocol"));
            }
            let certs = session.peer_certificates();
            // A front door, or (where boxes are sent) another node.
            let node = match self.peers.admit(certs, Role::Front, None).await {
                Ok(_) => None,
                Err(front) if self.boxes.is_none() => return Err(io::Error::other(front)),
                Err(_) => Some(self.peers.admit(certs, Role::Node, None).await.map_err(io::Error::other)?.name),
            };
            let request = frame::read(&mut tls, MAX_REQUEST).await?;
            Ok((tls, request, node))
        })
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the peer took too long to ask"))??;
        let Some((Kind::Message, request)) = request else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "no request"));
        };
        if let (Some(node), Some(boxes)) = (node, &self.boxes) {
            return node_request(boxes.as_ref(), &node, &request, tls).await;
        }
        let (ours, theirs) = Packets::pair()?;
        let (ours, theirs) = (Packets::new(ours)?, Packets::new(theirs)?);
        let answerer = Arc::clone(&self.answerer);
        tokio::spawn(async move {
            if let Err(e) = answerer.answer(theirs).await {
                tracing::debug!(error = %e, "api connection failed");
            }
        });
        ours.send(&request, &[]).await?;
        let (mut reader, mut writer) = tokio::io::split(tls);
        // Until the answer ends or hands over a session, or the peer goes
        // (which the answer learns from `ours` closing, as from a front door).
        let session = tokio::select! {
            back = send_back(&ours, &mut writer) => back?,
            () = peer_gone(&mut reader) => None,
        };
        if let Some(agent) = session {
            crate::relay::relay(crate::relay::unix_stream(agent)?, &mut reader, &mut writer).await;
        }
        drop(ours);
        Ok(())
    }
}

/// Answers another node's request on `tls`.
async fn node_request(
    boxes: &dyn BoxSource,
    node: &str,
    request: &[u8],
    mut tls: TlsStream<TcpStream>,
) -> io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let ask: NodeAsk =
        serde_json::from_slice(request).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    match ask {
        NodeAsk::SendBox { box_id } => {
            let sent = boxes.send_box(node, &box_id, &mut tls).await;
            if let Err(e) = &sent {
                tracing::warn!(to = node, box_id, error = %e, "cannot stream a box to the node it moves to");
            }
            let _ = tls.shutdown().await;
            sent
        }
    }
}

/// Sends the answer's messages back as frames until it ends (`None`) or
/// sends a session's stream (returned).
async fn send_back(ours: &Packets, writer: &mut WriteHalf<TlsStream<TcpStream>>) -> io::Result<Option<OwnedFd>> {
    use tokio::io::AsyncWriteExt;
    loop {
        let Some(msg) = ours.recv(MAX_EVENT).await? else {
            let _ = writer.shutdown().await;
            return Ok(None);
        };
        let mut fds = msg.fds.into_iter();
        match (fds.next(), fds.next()) {
            (None, _) => frame::write(writer, Kind::Message, &msg.bytes).await?,
            (Some(fd), None) => {
                frame::write(writer, Kind::Session, &msg.bytes).await?;
                return Ok(Some(fd));
            }
            (Some(_), Some(_)) => {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "an answer carried several descriptors"))
            }
        }
    }
}

/// Returns when the peer closes or sends anything more: after its one
/// request a peer says nothing until a session starts.
async fn peer_gone(reader: &mut ReadHalf<TlsStream<TcpStream>>) {
    let _ = reader.read(&mut [0u8; 1]).await;
}
