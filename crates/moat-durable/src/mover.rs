//! The mover: every node's background task that carries out boxes' moves
//! between nodes (see `moat_core::store::moves`): streamed from the source
//! node while it is up, else through the object store.
//! Each round, on a node whose fence is open:
//!
//! - as the fleet's one reconciler (if no other node is), it asks the boxes
//!   of nodes lost for longer than the grace onto live nodes with room;
//! - for each box leaving this node: it holds the box still (sessions are
//!   refused), uploads what changed since its last upload, and marks the
//!   move ready;
//! - for each box arriving here: it receives the box from its node (a
//!   drain's or a `move`'s, while that node is up: [`crate::node_stream`]),
//!   else the box's chain from the object store (every object checked
//!   before `btrfs receive` sees a byte), makes it a box of this
//!   host, and takes its record (epoch plus one) in one transaction; a copy
//!   that could not be taken is deleted again;
//! - it discards this node's copies of boxes that are now another node's.
//!
//! A failed move leaves the box where it was; the epoch flips only once the
//! copy is complete.

use std::sync::Arc;
use std::time::Duration;

use moat_core::ids::BoxId;
use moat_core::store::durable::DurableLink;
use moat_core::store::moves::{BoxMove, MoveReason};
use moat_core::BoxManager;

use crate::node_stream::NodeLinks;
use crate::restore::restore_box;
use crate::worker::DurableWorker;
use crate::DurableError;

/// How the mover paces itself, and reaches other nodes.
#[derive(Clone)]
pub struct MoverSettings {
    /// How long a node's lease stays lapsed before its boxes are re-homed.
    pub grace: Duration,
    /// How often a round runs when nothing wakes it sooner.
    pub every: Duration,
    /// How a box moving here is streamed from its node while that node is
    /// up (`None`: always through the object store).
    pub links: Option<Arc<dyn NodeLinks>>,
}

/// Starts the mover over `manager`, moving boxes through `worker`'s object store.
pub fn start(manager: Arc<BoxManager>, worker: Arc<DurableWorker>, settings: MoverSettings) {
    // What a receive killed midway left (nothing of it was taken).
    crate::restore::clear_staging(&worker.dirs().staging);
    tokio::spawn(async move {
        loop {
            let _ = tokio::time::timeout(settings.every, manager.mover_wake().notified()).await;
            if manager.serving() {
                round(&manager, &worker, &settings).await;
            }
        }
    });
}

async fn round(manager: &Arc<BoxManager>, worker: &Arc<DurableWorker>, settings: &MoverSettings) {
    let grace_ms = settings.grace.as_millis() as u64;
    match manager.reconcile_lost(grace_ms) {
        Ok(asked) => {
            for mv in asked {
                tracing::warn!(box_id = %mv.box_id, lost = %mv.from, to = %mv.to, "re-homing a lost node's box");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot reconcile lost nodes"),
    }
    let (leaving, arriving) = match manager.moves_here() {
        Ok(moves) => moves,
        Err(e) => return tracing::warn!(error = %e, "cannot read the moves of this node's boxes"),
    };
    manager.settle_leaving(&leaving);
    for mv in leaving.iter().filter(|m| !m.ready && m.error.is_none()) {
        if let Err(e) = send(manager, worker, mv).await {
            manager.stay(&mv.box_id);
            let _ = manager.move_failed(mv, &e.to_string());
        }
    }
    for mv in arriving.into_iter().filter(|m| m.error.is_none()) {
        if let Err(e) = receive(manager, worker, &mv, grace_ms, settings.links.as_deref()).await {
            let _ = manager.move_failed(&mv, &e.to_string());
        }
    }
    if let Err(e) = manager.discard_stale().await {
        tracing::warn!(error = %e, "cannot discard stale copies of boxes");
    }
    prune_snapshots_of_boxes_elsewhere(manager, worker);
}

/// Drops the uploader's snapshots of every box this node does not hold
/// (moved away, re-homed while this node was lost, received and not
/// taken): each pins a whole box's data, and under simple quotas a
/// received one stays charged to its account. (Run between the round's
/// receives, never during one: a box received and not yet taken is not
/// this node's.)
fn prune_snapshots_of_boxes_elsewhere(manager: &BoxManager, worker: &DurableWorker) {
    let Ok(here) = manager.boxes_here() else { return };
    let here: std::collections::HashSet<BoxId> = here.into_iter().map(|r| r.id).collect();
    let Ok(entries) = std::fs::read_dir(&worker.uploader().snapshots) else { return };
    for entry in entries.flatten() {
        let Some(id) = BoxId::parse(&entry.file_name().to_string_lossy()) else { continue };
        if !here.contains(&id) {
            tracing::info!(box_id = %id, "dropping the upload snapshots of a box not on this node");
            worker.uploader().prune(&id, None);
        }
    }
}

fn is_empty_dir(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none())
}

fn config(e: impl ToString) -> DurableError {
    DurableError::Config(e.to_string())
}

/// Receives box `mv` streamed from its source node, through `links`.
async fn stream_from(
    manager: &BoxManager,
    links: &dyn NodeLinks,
    mv: &BoxMove,
    staging: &std::path::Path,
    into: (&std::path::Path, &str),
    keep: Option<(&std::path::Path, &DurableLink)>,
    adopt: impl FnOnce(&moat_core::Received) -> Result<(), DurableError>,
) -> Result<crate::restore::Restored, DurableError> {
    let nodes = manager.nodes().map_err(config)?;
    let now = moat_core::clock::now_ms();
    let Some(source) = nodes.iter().find(|n| n.offer.name == mv.from && n.lease_until_ms > now) else {
        return Err(config(format!("node {} is not up", mv.from)));
    };
    let mut input = links
        .open(&mv.from, &source.offer.address, &mv.box_id)
        .await
        .map_err(crate::io_err(format!("reach node {}", mv.from)))?;
    crate::node_stream::receive_parts(&mut input, staging, into, keep, adopt).await
}

/// The source's side: the box held still, its last change uploaded, the move ready.
async fn send(manager: &Arc<BoxManager>, worker: &DurableWorker, mv: &BoxMove) -> Result<(), DurableError> {
    let rec = manager.leave(&mv.box_id, &mv.to).await.map_err(config)?;
    worker.upload_now(manager, &rec.id).await?;
    let head = manager.durable_links(&rec.id).map_err(config)?.pop();
    let Some(head) = head else { return Err(config(format!("box {} has nothing in the object store", rec.name))) };
    moat_core::fault::point("move-before-ready");
    if !manager.move_ready(&rec.id, head.taken_at_ms).map_err(config)? {
        // Called off meanwhile.
        manager.stay(&rec.id);
    }
    tracing::info!(box_id = %rec.id, name = %rec.name, to = %mv.to, "box ready to move");
    moat_core::fault::point("move-after-ready");
    Ok(())
}

/// The target's side: received, made this host's, taken (or deleted again).
async fn receive(
    manager: &Arc<BoxManager>,
    worker: &DurableWorker,
    mv: &BoxMove,
    grace_ms: u64,
    nodes: Option<&dyn NodeLinks>,
) -> Result<(), DurableError> {
    let staging = &worker.dirs().staging;
    let Some(rec) = manager.box_by_id(&mv.box_id).map_err(config)? else { return Ok(()) };
    // Whatever this node holds of the box is of an older epoch.
    manager.discard_local(&rec.id).await.map_err(config)?;
    std::fs::create_dir_all(staging).map_err(crate::io_err(format!("create {}", staging.display())))?;
    let started = std::time::Instant::now();
    let into = (worker.dirs().roots.as_path(), rec.id.as_str());
    let adopt = |received: &moat_core::Received| manager.adopt_received(&rec, received).map_err(config);
    let links = manager.durable_links(&rec.id).map_err(config)?;
    // The box's newest link is received where its uploader keeps its
    // snapshots, emptied first (what it held is of an older epoch): the
    // box's next upload here is an incremental against it.
    let keep_in = worker.uploader().box_dir(&rec.id);
    worker.uploader().prune(&rec.id, None);
    let keep_in = (std::fs::create_dir_all(&keep_in).is_ok() && is_empty_dir(&keep_in)).then_some(keep_in);
    // From the source node while it is up (a lost node's box: from the
    // object store alone), else from the object store.
    let streamed = match nodes.filter(|_| mv.reason != MoveReason::Lost) {
        Some(nodes) => match stream_from(
            manager,
            nodes,
            mv,
            staging,
            into,
            keep_in.as_deref().zip(links.last().filter(|head| head.checkpoint.is_none())),
            adopt,
        )
        .await
        {
            Ok(restored) => Some(restored),
            Err(e) => {
                tracing::warn!(box_id = %rec.id, from = %mv.from, error = %e,
                    "cannot stream the box from its node; receiving it from the object store");
                None
            }
        },
        None => None,
    };
    let via = if streamed.is_some() { "its node" } else { "the object store" };
    let restored = match streamed {
        Some(restored) => restored,
        None => {
            let adopt = |received: &moat_core::Received| manager.adopt_received(&rec, received).map_err(config);
            // What a failed stream received there is gone (or else not kept in).
            let keep_in = keep_in.as_deref().filter(|dir| is_empty_dir(dir));
            restore_box(&worker.uploader().store, &links, staging, into, keep_in, adopt).await?
        }
    };
    // Received and charged here, the record still the source's.
    moat_core::fault::point("receive-before-take");
    let taken = manager.take_box(mv, grace_ms).map_err(config);
    if !matches!(taken, Ok(true)) {
        let _ = manager.discard_local(&rec.id).await;
        worker.uploader().prune(&rec.id, None);
        return taken.map(drop);
    }
    tracing::info!(
        box_id = %rec.id, name = %rec.name, from = %mv.from, reason = mv.reason.as_str(),
        as_of_ms = restored.as_of_ms, fetched_bytes = restored.fetched_bytes,
        took_ms = started.elapsed().as_millis() as u64, via, "box received"
    );
    if mv.reason == MoveReason::Lost {
        tracing::warn!(box_id = %rec.id, name = %rec.name, lost = %mv.from, "a lost node's box answers here now");
    }
    Ok(())
}
