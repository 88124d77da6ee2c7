//! `moat serve` as a node of a fleet: the flags that make it one, its lease
//! in the shared store (renewed every two seconds with the capacity it
//! offers), and the fence that keeps it off its boxes from the moment its
//! lease may have lapsed until it has renewed it. (A restarted node recovers
//! its boxes as the store has them before it serves any.)

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use moat_core::manager::{LEASE, LEASE_RENEW};
use moat_core::store::fleet::MemberRole;
use moat_core::store::nodes::NodeOffer;
use moat_core::BoxManager;
use moat_fleet::join::FleetDir;

/// The flags of `moat serve` that concern a fleet.
#[derive(Args)]
pub struct NodeArgs {
    /// The state store: a PostgreSQL DSN, `postgres://USER:PASSWORD@HOST:PORT/DB`
    /// (also `$MOAT_STORE`, which keeps the password off the command line)
    /// [default: a joined node's fleet.json, else STATE_DIR/moat.db (SQLite)].
    #[arg(long, env = "MOAT_STORE", hide_env_values = true)]
    pub store: Option<String>,
    /// Serve as this node of a fleet: the name its join token was issued for
    /// [default: the member STATE_DIR joined as, if it joined as a node].
    #[arg(long)]
    pub node: Option<String>,
    /// Where front doors reach this node (HOST:PORT on this host; port 0 picks
    /// one, which the lease tells the fleet). Needed on a node.
    #[arg(long)]
    pub advertise: Option<SocketAddr>,
    /// Most boxes this node holds.
    #[arg(long, default_value_t = 1000)]
    pub node_max_boxes: u32,
    /// Memory the limits of this node's boxes may add up to, e.g. 256G
    /// [default: 4 times this host's].
    #[arg(long, value_parser = parse_size)]
    pub node_memory: Option<u64>,
    /// CPUs the limits of this node's boxes may add up to [default: 8 times this host's].
    #[arg(long)]
    pub node_cpus: Option<u32>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    moat_core::limits::parse_size(s).map_err(|e| e.to_string())
}

/// A node's setup: the member it joined as and where it answers.
pub struct Node {
    /// Its member state (certificate, fleet key, the store's DSN).
    pub dir: FleetDir,
    /// Its name.
    pub name: String,
    /// Where it listens for front doors.
    pub advertise: SocketAddr,
}

impl NodeArgs {
    /// The node this serve is, if it is one: the state dir joined the fleet
    /// as a node (and `--node`, if given, names that member).
    pub fn node(&self, state_dir: &Path) -> Result<Option<Node>> {
        let joined = state_dir.join("fleet.json").exists();
        if !joined {
            if let Some(name) = &self.node {
                bail!(
                    "{} has not joined a fleet as node {name}: run `moat fleet join TOKEN --state-dir {}` with a token \
                     from `moat fleet token --role node --name {name}`",
                    state_dir.display(),
                    state_dir.display()
                );
            }
            return Ok(None);
        }
        let dir =
            FleetDir::load(state_dir).with_context(|| format!("read {}'s fleet membership", state_dir.display()))?;
        if dir.member.role != MemberRole::Node {
            bail!("{} joined the fleet as a {}, not a node", state_dir.display(), dir.member.role.as_str());
        }
        let name = dir.member.name.clone();
        if let Some(asked) = self.node.as_ref().filter(|n| **n != name) {
            bail!("--node {asked}: {} joined the fleet as node {name}", state_dir.display());
        }
        let Some(advertise) = self.advertise else {
            bail!("node {name} needs --advertise HOST:PORT: where front doors reach it");
        };
        Ok(Some(Node { dir, name, advertise }))
    }

    /// What a node on this host offers the fleet, answering at `address`.
    pub fn offer(&self, name: &str, address: SocketAddr, (host_cpus, host_memory): (u32, u64), disk: u64) -> NodeOffer {
        NodeOffer {
            name: name.to_string(),
            address: address.to_string(),
            cpus: self.node_cpus.unwrap_or(host_cpus.saturating_mul(8)),
            memory: self.node_memory.unwrap_or(host_memory.saturating_mul(4)),
            disk,
            max_boxes: self.node_max_boxes,
        }
    }
}

/// Keeps this node's lease for as long as the process lives.
///
/// Each renewal runs on the blocking pool and is waited for no longer than
/// a renewal period: a store that hangs (answers TCP, never the query) must
/// close the fence as surely as one that refuses, before another node may
/// be given this node's boxes.
pub async fn keep_lease(manager: Arc<BoxManager>, offer: NodeOffer) {
    // Act as lapsed a little before the store would call it lapsed: the
    // renewal's own time counts against it.
    let margin = LEASE - LEASE_RENEW;
    let mut renewed = Instant::now();
    let mut ticks = tokio::time::interval(LEASE_RENEW);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A renewal under way, and when it was sent: the lease it makes runs
    // from then (the store stamps it), however late the answer comes.
    let mut in_flight: Option<(tokio::task::JoinHandle<Result<(), String>>, Instant)> = None;
    loop {
        ticks.tick().await;
        let (mut renewal, sent) = match in_flight.take() {
            Some(hung) => hung,
            None => {
                let (manager, offer) = (Arc::clone(&manager), offer.clone());
                let sent = Instant::now();
                (tokio::task::spawn_blocking(move || manager.renew_lease(&offer).map_err(|e| e.to_string())), sent)
            }
        };
        let outcome = match tokio::time::timeout(LEASE_RENEW, &mut renewal).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(e)) => Err(format!("the renewal failed: {e}")),
            Err(_) => {
                // Still waiting on the store: the next tick looks again
                // rather than piling up renewals behind it.
                in_flight = Some((renewal, sent));
                Err("the state store has not answered".to_string())
            }
        };
        // Answered too late to count: the lease it made may have lapsed
        // already, and another node may have this node's boxes.
        let outcome = match outcome {
            Ok(()) if sent.elapsed() >= margin => Err(format!("the renewal answered too late ({:?})", sent.elapsed())),
            outcome => outcome,
        };
        match outcome {
            Ok(()) => {
                renewed = sent;
                let (manager, name) = (Arc::clone(&manager), offer.name.clone());
                let after = tokio::task::spawn_blocking(move || after_renewal(&manager, &name, sent, margin));
                if let Err(e) = after.await {
                    tracing::warn!(error = %e, "the work after a renewal failed");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, node = %offer.name, "cannot renew this node's lease");
                if renewed.elapsed() >= margin {
                    let manager = Arc::clone(&manager);
                    if let Err(e) = tokio::task::spawn_blocking(move || manager.close_fence()).await {
                        tracing::error!(error = %e, "cannot close the fence");
                    }
                }
            }
        }
    }
}

/// What follows each renewal: the reports the fleet reads, and after a
/// lapse the fence opened again once the copies of boxes given to other
/// nodes meanwhile are gone. Blocking.
fn after_renewal(manager: &Arc<BoxManager>, name: &str, sent: Instant, margin: std::time::Duration) {
    if let Err(e) = manager.report_backlog() {
        tracing::debug!(error = %e, "cannot report the upload backlog");
    }
    if let Err(e) = manager.report_disk() {
        tracing::debug!(error = %e, "cannot report the accounts' disk use");
    }
    if manager.serving() {
        return;
    }
    let discarded = tokio::runtime::Handle::current().block_on(manager.discard_stale());
    // The boxes run again only under a lease still good now (discarding
    // took time): else the next renewal opens the fence.
    if sent.elapsed() >= margin {
        return;
    }
    match discarded.and_then(|n| manager.open_fence().map(|()| n)) {
        Ok(n) => tracing::warn!(discarded = n, node = %name, "lease renewed after a lapse"),
        Err(e) => tracing::warn!(error = %e, "cannot discard stale copies or thaw: staying fenced"),
    }
}
