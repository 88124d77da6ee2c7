//! `moat node drain NAME`: cordons a node and asks every box on it to move
//! to another (the store picks each target, in one transaction with the
//! cordon's effect), then follows the moves in the store, a line per box as
//! it lands or fails, until none is left.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use moat_core::backend::BackendKind;
use moat_core::store::moves::BoxMove;
use moat_core::{BoxId, Store};

/// Drains node `name`, waiting up to `timeout` for its boxes to move.
pub fn run(store: &Store, name: &str, timeout: Duration) -> Result<()> {
    let now = moat_core::clock::now_ms();
    let Some(node) = store.node(name)? else { bail!("no node named {name} in the fleet (see: moat nodes)") };
    if !node.is_live(now) {
        bail!(
            "node {name} is not answering (its lease lapsed): it cannot send its boxes; they are re-homed from \
             the object store once its lease has lapsed for the nodes' --node-grace"
        );
    }
    let (asked, stuck) = store.ask_drain(name, now)?;
    println!("node {name} cordoned: no new box goes there");
    for id in &stuck {
        println!("{}: no other node has room for it; it stays", label(store, id));
    }
    // Boxes already moving (asked before) are followed too.
    let mut waiting: Vec<BoxMove> = store.moves(Some(name), None)?;
    println!("moving {} boxes off {name} ({} asked now)", waiting.len(), asked.len());
    let deadline = Instant::now() + timeout;
    let mut failed = 0;
    while !waiting.is_empty() {
        std::thread::sleep(Duration::from_millis(300));
        let mut still = Vec::new();
        for mv in waiting {
            match store.box_move(&mv.box_id)? {
                Some(now) if now.error.is_some() => {
                    failed += 1;
                    store.cancel_move(&mv.box_id)?;
                    let why = now.error.unwrap_or_default();
                    println!("{}: failed, it stays on {name}: {why}", label(store, &mv.box_id));
                }
                Some(now) => still.push(now),
                None => match store.get_by_id(&mv.box_id)? {
                    Some(rec) if rec.node != name => {
                        let ended = match rec.backend {
                            BackendKind::Ns => "its processes ended (a namespace box keeps its files only)",
                            BackendKind::Vm => "a running VM box's processes go on there (its saved machine moved)",
                        };
                        println!("{}: moved to {}; {ended}", rec.name, rec.node);
                    }
                    Some(rec) => {
                        failed += 1;
                        println!("{}: the move was called off; it stays on {name}", rec.name);
                    }
                    None => println!("{}: removed while moving", mv.box_id),
                },
            }
        }
        waiting = still;
        if !waiting.is_empty() && Instant::now() > deadline {
            bail!(
                "{} boxes are still moving after {} s (they go on; see: moat nodes)",
                waiting.len(),
                timeout.as_secs()
            );
        }
    }
    if failed + stuck.len() > 0 {
        bail!("node {name} still holds {} boxes", failed + stuck.len());
    }
    println!("node {name} is empty");
    Ok(())
}

fn label(store: &Store, id: &BoxId) -> String {
    match store.get_by_id(id) {
        Ok(Some(rec)) => rec.name.to_string(),
        _ => id.to_string(),
    }
}
