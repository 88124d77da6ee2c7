//! `moat nodes` and `moat node cordon|uncordon` (and `drain`, in `drain.rs`): the fleet's nodes as the
//! store has them, for operators (they read and write the store directly:
//! no node needs to be up to tell which are down).

use std::fmt::Write as _;

use anyhow::Result;
use clap::Subcommand;
use moat_core::limits::format_measured;
use moat_core::store::nodes::NodeRow;
use serde::Serialize;

use crate::fleet::StoreAt;

/// `moat node ...`
#[derive(Subcommand)]
pub enum NodeCmd {
    /// Place no new box on NAME (its boxes stay and are served).
    Cordon {
        /// The node.
        name: String,
        #[command(flatten)]
        store: StoreAt,
    },
    /// Place new boxes on NAME again.
    Uncordon {
        /// The node.
        name: String,
        #[command(flatten)]
        store: StoreAt,
    },
    /// Cordon NAME and move every box off it (through the object store, onto
    /// the nodes with the most memory free); waits until each has moved or
    /// failed, and says which. NAME must be up: it sends its boxes (a lost
    /// node's boxes are re-homed after --node-grace instead).
    Drain {
        /// The node.
        name: String,
        /// Give up waiting after this many seconds (moves under way go on).
        #[arg(long, default_value_t = 1800)]
        timeout: u64,
        #[command(flatten)]
        store: StoreAt,
    },
}

/// One node as `moat nodes` shows it.
#[derive(Serialize)]
struct Shown {
    name: String,
    address: String,
    /// `live`, `lapsed` or `cordoned`.
    state: &'static str,
    /// Seconds since the lease was last renewed.
    lease_age_secs: u64,
    boxes: u32,
    max_boxes: u32,
    cpus_used: u64,
    cpus: u32,
    memory_used: u64,
    memory: u64,
    /// Boxes waiting for an upload to the object store.
    upload_backlog: u32,
    /// Boxes moving off it.
    moving: u32,
}

fn shown(n: NodeRow, now: u64) -> Shown {
    let state = match (n.is_live(now), n.cordoned) {
        (false, _) => "lapsed",
        (true, true) => "cordoned",
        (true, false) => "live",
    };
    Shown {
        state,
        lease_age_secs: now.saturating_sub(n.renewed_at_ms) / 1000,
        boxes: n.boxes,
        max_boxes: n.offer.max_boxes,
        cpus_used: n.cpus_used,
        cpus: n.offer.cpus,
        memory_used: n.memory_used,
        memory: n.offer.memory,
        upload_backlog: n.upload_backlog,
        moving: n.moving,
        address: n.offer.address,
        name: n.offer.name,
    }
}

/// Prints every node of the fleet.
pub fn list(store: &StoreAt, json: bool) -> Result<()> {
    let now = moat_core::clock::now_ms();
    let nodes: Vec<Shown> = store.open()?.nodes()?.into_iter().map(|n| shown(n, now)).collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&nodes)?);
        return Ok(());
    }
    let mut out = format!(
        "{:<16} {:<22} {:<8} {:>6} {:>9} {:>7} {:>17} {:>8} {:>7}\n",
        "NAME", "ADDRESS", "STATE", "LEASE", "BOXES", "CPUS", "MEMORY", "BACKLOG", "MOVING"
    );
    for n in &nodes {
        let _ = writeln!(
            out,
            "{:<16} {:<22} {:<8} {:>5}s {:>9} {:>7} {:>17} {:>8} {:>7}",
            n.name,
            n.address,
            n.state,
            n.lease_age_secs,
            format!("{}/{}", n.boxes, n.max_boxes),
            format!("{}/{}", n.cpus_used, n.cpus),
            format!("{}/{}", format_measured(n.memory_used), format_measured(n.memory)),
            n.upload_backlog,
            n.moving,
        );
    }
    print!("{out}");
    Ok(())
}

/// Cordons, uncordons or drains a node.
pub fn run(cmd: NodeCmd) -> Result<()> {
    let (name, store, cordoned) = match cmd {
        NodeCmd::Cordon { name, store } => (name, store, true),
        NodeCmd::Uncordon { name, store } => (name, store, false),
        NodeCmd::Drain { name, timeout, store } => {
            return crate::drain::run(&store.open()?, &name, std::time::Duration::from_secs(timeout))
        }
    };
    if !store.open()?.set_cordoned(&name, cordoned)? {
        anyhow::bail!("no node named {name} in the fleet (see: moat nodes)");
    }
    println!("node {name} {}", if cordoned { "cordoned: no new box goes there" } else { "uncordoned" });
    Ok(())
}
