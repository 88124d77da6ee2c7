//! A fleet node's links to the other nodes for boxes streamed node to node
//! (a move between two live nodes): [`FleetLinks`] asks the source node for
//! a box (a fleet connection, mutual TLS, the peer checked as the node it
//! should be), and [`BoxSender`] answers such asks on this node's listener.

use std::sync::Arc;

use anyhow::{Context, Result};
use moat_core::ids::BoxId;
use moat_core::BoxManager;
use moat_durable::node_stream::{parts_for_move, send_parts, NodeLinks, Opening};
use moat_durable::DurableWorker;
use moat_fleet::dial::Dialer;
use moat_fleet::join::FleetDir;
use moat_fleet::listen::{BoxSource, NodeAsk};
use moat_fleet::peer::Peers;
use moat_fleet::store::StoreMembers;

/// Dials other nodes of the fleet as this node.
pub struct FleetLinks {
    dialer: Dialer,
}

impl FleetLinks {
    /// Links for the node whose member state is `dir` (the peers it dials
    /// are checked with a store connection of its own).
    pub async fn new(dir: &FleetDir) -> Result<Arc<Self>> {
        let dsn = dir.config.store.clone();
        let store = tokio::task::spawn_blocking(move || moat_core::Store::connect(&dsn))
            .await?
            .context("connect to the fleet's store for node-to-node links")?;
        let peers = Peers::new(Arc::new(StoreMembers(Arc::new(store))));
        let dialer = Dialer::new(dir.identity.client_config()?, peers);
        Ok(Arc::new(Self { dialer }))
    }
}

impl NodeLinks for FleetLinks {
    fn open<'a>(&'a self, node: &'a str, address: &'a str, id: &'a BoxId) -> Opening<'a> {
        Box::pin(async move {
            let link = self.dialer.dial(node, address).await.map_err(|e| std::io::Error::other(e.reason()))?;
            let stream = link.ask_node(&NodeAsk::SendBox { box_id: id.to_string() }).await?;
            Ok(Box::new(stream) as Box<dyn tokio::io::AsyncRead + Unpin + Send>)
        })
    }
}

/// Sends this node's boxes to the nodes they move to.
pub struct BoxSender {
    /// The boxes.
    pub manager: Arc<BoxManager>,
    /// Where their files and last uploads are.
    pub worker: Arc<DurableWorker>,
}

impl BoxSource for BoxSender {
    fn send_box<'a>(
        &'a self,
        to: &'a str,
        box_id: &'a str,
        out: &'a mut (dyn tokio::io::AsyncWrite + Unpin + Send),
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<()>> + Send + 'a>> {
        Box::pin(async move {
            let id = BoxId::parse(box_id).ok_or_else(|| std::io::Error::other(format!("no box id {box_id:?}")))?;
            let parts = parts_for_move(&self.manager, &self.worker, to, &id).await.map_err(std::io::Error::other)?;
            let started = std::time::Instant::now();
            let bytes = send_parts(&parts, out).await.map_err(std::io::Error::other)?;
            tracing::info!(box_id = %id, to, parts = parts.len(), bytes,
                took_ms = started.elapsed().as_millis() as u64, "box streamed to the node it moves to");
            Ok(())
        })
    }
}
