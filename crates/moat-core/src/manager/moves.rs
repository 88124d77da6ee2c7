//! The manager's side of boxes changing node (see `store::moves`): asking a
//! move, holding a box still while it leaves (sessions are refused with a
//! line that says where it goes), making a received box one of this node's,
//! and discarding the copies this node holds of boxes that are now another
//! node's (after a move, or after this node was lost and its boxes re-homed)
//! before it serves again.
//!
//! The work between (the last upload, the receive) is moat-durable's mover;
//! the manager wakes it when a move is asked.

use std::collections::HashMap;
use std::sync::PoisonError;

use super::{BoxManager, ManagerError};
use crate::clock::now_ms;
use crate::ids::{AccountId, BoxId, Name};
use crate::record::{BoxRecord, BoxState};
use crate::store::moves::{Arrival, BoxMove, MoveReason};

/// The longest a move may take before it is called off.
const MOVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Boxes leaving this node, and the node each goes to.
#[derive(Debug, Default)]
pub(super) struct Leaving {
    boxes: std::sync::Mutex<HashMap<BoxId, String>>,
}

impl Leaving {
    /// Where box `id` is going, if it is leaving.
    pub(super) fn to(&self, id: &BoxId) -> Option<String> {
        self.boxes.lock().unwrap_or_else(PoisonError::into_inner).get(id).cloned()
    }
}

impl BoxManager {
    /// Asks for the account's box `name` to move to node `to`, for the
    /// mover to carry out.
    pub async fn ask_move(&self, account: &AccountId, name: &Name, to: &str) -> Result<BoxMove, ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        if self.durable.get().is_none() {
            return Err(ManagerError::CannotMove(format!(
                "boxes move through the object store, and node {} has none (moat serve --object-store)",
                self.node
            )));
        }
        if to == self.node {
            return Err(ManagerError::CannotMove(format!("box {name} is on node {to} already")));
        }
        let now = now_ms();
        let target = self
            .db(|s| s.node(to))?
            .ok_or_else(|| ManagerError::CannotMove(format!("no node named {to} in the fleet")))?;
        if !target.is_live(now) || target.cordoned {
            return Err(ManagerError::CannotMove(format!(
                "node {to} takes no boxes now ({})",
                if target.cordoned { "cordoned" } else { "not answering" }
            )));
        }
        // Asked before the box's processes end for it (the take checks again).
        if let Err(what) = target.room_for(&rec.limits) {
            return Err(ManagerError::CannotMove(format!("node {to} is full ({what}); {name} stays here as it is")));
        }
        if rec.state == BoxState::Creating {
            return Err(ManagerError::Busy(rec.name));
        }
        let mv = BoxMove {
            box_id: rec.id.clone(),
            from: self.node.clone(),
            to: to.to_string(),
            epoch: rec.epoch,
            reason: MoveReason::Move,
            ready: false,
            as_of_ms: None,
            asked_at_ms: now,
            error: None,
            failures: 0,
            failed_at_ms: None,
        };
        if !self.db(|s| s.ask_move(&mv))? {
            return Err(ManagerError::CannotMove(format!("box {name} is moving already")));
        }
        self.mover_wake.notify_one();
        Ok(mv)
    }

    /// Waits for move `mv` (asked here) to end, saying how it goes: `Ok` once
    /// the box is its target's, the reason it failed otherwise (the box then
    /// stays here).
    pub async fn await_move(&self, mv: &BoxMove, mut progress: super::ProgressSink) -> Result<(), ManagerError> {
        let rec = self.box_by_id(&mv.box_id)?.ok_or_else(|| ManagerError::CannotMove("the box is gone".into()))?;
        let ends = match rec.backend {
            crate::backend::BackendKind::Ns => "its processes end (a namespace box keeps its files, not its processes)",
            crate::backend::BackendKind::Vm => {
                "a running VM box's saved machine moves with its disk: its processes go on there"
            }
        };
        progress(&format!("moving {} to node {}: {ends}", rec.name, mv.to));
        let deadline = tokio::time::Instant::now() + MOVE_TIMEOUT;
        let mut said_ready = false;
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            match self.box_move(&mv.box_id)? {
                Some(now) if now.error.is_some() => {
                    self.cancel_move(&mv.box_id)?;
                    let why = now.error.unwrap_or_default();
                    return Err(ManagerError::CannotMove(format!(
                        "moving {} failed: {why}; it stays on {}",
                        rec.name, mv.from
                    )));
                }
                Some(now) if now.ready && !said_ready => {
                    said_ready = true;
                    let age = |ms: u64| crate::clock::now_ms().saturating_sub(ms).div_ceil(1000);
                    let as_of = now.as_of_ms.map(|ms| format!(" (as it was {}s ago)", age(ms))).unwrap_or_default();
                    progress(&format!("uploaded{as_of}; node {} is receiving it", mv.to));
                }
                Some(_) if tokio::time::Instant::now() > deadline => {
                    self.cancel_move(&mv.box_id)?;
                    self.stay(&mv.box_id);
                    return Err(ManagerError::CannotMove(format!(
                        "moving {} took over {} s: called off, it stays on {}",
                        rec.name,
                        MOVE_TIMEOUT.as_secs(),
                        mv.from
                    )));
                }
                Some(_) => {}
                None => {
                    let now = self.box_by_id(&mv.box_id)?;
                    return match now {
                        Some(now) if now.node == mv.to => {
                            progress(&format!("{} answers on node {} now", rec.name, mv.to));
                            Ok(())
                        }
                        _ => Err(ManagerError::CannotMove(format!("the move of {} was called off", rec.name))),
                    };
                }
            }
        }
    }

    /// What the mover waits on: woken when a move is asked here.
    pub fn mover_wake(&self) -> &tokio::sync::Notify {
        &self.mover_wake
    }

    /// Moves off this node, and moves onto it that are ready to receive.
    pub fn moves_here(&self) -> Result<(Vec<BoxMove>, Vec<BoxMove>), ManagerError> {
        let leaving = self.db(|s| s.moves(Some(&self.node), None))?;
        let arriving = self.db(|s| s.moves(None, Some(&self.node)))?;
        Ok((leaving, arriving.into_iter().filter(|m| m.ready).collect()))
    }

    /// As the fleet's reconciler (if no other node is): asks the boxes of
    /// nodes lost for `grace_ms` onto live nodes.
    pub fn reconcile_lost(&self, grace_ms: u64) -> Result<Vec<BoxMove>, ManagerError> {
        Ok(self.db(|s| s.reconcile_lost(grace_ms, now_ms()))?)
    }

    /// Holds box `id` still for its move to `to`: sessions are refused from
    /// now, and its processes end (a namespace box's for good; a running VM
    /// box's are saved and travel). The box record as it is now, stopped.
    pub async fn leave(&self, id: &BoxId, to: &str) -> Result<BoxRecord, ManagerError> {
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let rec = self.db(|s| s.get_by_id(id))?.ok_or_else(|| ManagerError::CannotMove(format!("no box {id}")))?;
        self.here(&rec)?;
        self.leaving.boxes.lock().unwrap_or_else(PoisonError::into_inner).insert(id.clone(), to.to_string());
        if matches!(rec.state, BoxState::Running | BoxState::Suspended) {
            if let Err(e) = self.pack_for_move(&rec).await {
                self.stay(id);
                return Err(e);
            }
        }
        let rec = self.db(|s| s.get_by_id(id))?.ok_or_else(|| ManagerError::CannotMove(format!("no box {id}")))?;
        Ok(rec)
    }

    /// Ends box `rec`'s processes for its move (a VM box's saved, to travel).
    async fn pack_for_move(&self, rec: &BoxRecord) -> Result<(), ManagerError> {
        self.meter_box(rec).await?;
        let r = rec.clone();
        let travels = self
            .blocking(move |b| {
                // A suspended box is thawed to be saved (its vCPUs stay paused).
                b.thaw(&r)?;
                b.pack_for_move(&r)
            })
            .await??;
        self.network_down(&rec.id);
        self.db(|s| s.set_state(&rec.id, BoxState::Stopped, None))?;
        tracing::info!(box_id = %rec.id, name = %rec.name, processes_travel = travels, "box packed to move");
        Ok(())
    }

    /// Box `id` did not leave after all (its move failed or was called off):
    /// sessions reach it again, here.
    pub fn stay(&self, id: &BoxId) {
        self.leaving.boxes.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
    }

    /// Makes box `rec`'s root, just received here as `received`, a box of
    /// this host (limits, charges, checkpoints, a new CA).
    pub fn adopt_received(&self, rec: &BoxRecord, received: &crate::backend::Received) -> Result<(), ManagerError> {
        Ok(super::in_place(|| self.backend.received(rec, received))?)
    }

    /// Takes box `mv`'s record onto this node (it was received here).
    pub fn take_box(&self, mv: &BoxMove, grace_ms: u64) -> Result<bool, ManagerError> {
        let taken = self.db(|s| s.take_box(mv, grace_ms, now_ms()))?;
        if taken {
            tracing::info!(box_id = %mv.box_id, from = %mv.from, reason = mv.reason.as_str(), "box taken onto this node");
        }
        Ok(taken)
    }

    /// Removes this node's files of box `id` (a copy that is not, or no
    /// longer, the box's).
    pub async fn discard_local(&self, id: &BoxId) -> Result<(), ManagerError> {
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        self.network_down(id);
        let i = id.clone();
        self.blocking(move |b| b.discard(&i)).await??;
        self.leaving.boxes.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        Ok(())
    }

    /// Discards every copy this node holds of a box the store says is another
    /// node's (moved away, or re-homed while this node was lost); their
    /// processes, if any still run, end. Before a node serves again. How many.
    pub async fn discard_stale(&self) -> Result<usize, ManagerError> {
        if self.node.is_empty() {
            return Ok(0);
        }
        let local = self.blocking(|b| b.local_boxes()).await?;
        // One query for the usual case (every local box is this node's); a
        // record is read only for a box the store does not list here.
        let here: std::collections::HashSet<BoxId> =
            self.db(crate::store::Store::list_here)?.into_iter().map(|r| r.id).collect();
        let mut discarded = 0;
        for id in local.into_iter().filter(|id| !here.contains(id)) {
            let Some(rec) = self.db(|s| s.get_by_id(&id))? else { continue };
            if rec.node == self.node {
                continue;
            }
            tracing::warn!(box_id = %id, name = %rec.name, now_on = %rec.node, "discarding this node's stale copy of a box");
            self.discard_local(&id).await?;
            discarded += 1;
        }
        Ok(discarded)
    }

    /// Box `id`'s record, wherever it is.
    pub fn box_by_id(&self, id: &BoxId) -> Result<Option<BoxRecord>, ManagerError> {
        Ok(self.db(|s| s.get_by_id(id))?)
    }

    /// Keeps the boxes of moves off this node held (after a restart too),
    /// and lets go of those whose move is gone while the box stayed here.
    pub fn settle_leaving(&self, moves: &[BoxMove]) {
        let mut boxes = self.leaving.boxes.lock().unwrap_or_else(PoisonError::into_inner);
        let live = |m: &&BoxMove| m.error.is_none();
        for mv in moves.iter().filter(live) {
            boxes.entry(mv.box_id.clone()).or_insert_with(|| mv.to.clone());
        }
        boxes.retain(|id, _| moves.iter().filter(live).any(|m| &m.box_id == id));
    }

    /// Where box `id` came from, if it moved.
    pub fn arrival(&self, id: &BoxId) -> Result<Option<Arrival>, ManagerError> {
        Ok(self.db(|s| s.arrival(id))?)
    }

    /// Box `id`'s move under way, if one is.
    pub fn box_move(&self, id: &BoxId) -> Result<Option<BoxMove>, ManagerError> {
        Ok(self.db(|s| s.box_move(id))?)
    }

    /// Notes that box `id`'s move failed: the box stays where it was. A
    /// move asked by a user or a drain keeps its row, with the reason, for
    /// whoever waits on it (the next ask replaces it); a lost node's box is
    /// asked again by the reconciler once it has waited
    /// (`store::moves::retry_after_ms`).
    pub fn move_failed(&self, mv: &BoxMove, error: &str) -> Result<(), ManagerError> {
        tracing::warn!(box_id = %mv.box_id, from = %mv.from, to = %mv.to, error, "a move failed");
        Ok(self.db(|s| s.move_failed(&mv.box_id, error, now_ms()))?)
    }

    /// Calls off box `id`'s move (false: it is taken already, or was never
    /// asked).
    pub fn cancel_move(&self, id: &BoxId) -> Result<bool, ManagerError> {
        Ok(self.db(|s| s.cancel_move(id))?)
    }

    /// The source is done with box `id`: it is durable as of `as_of_ms`.
    pub fn move_ready(&self, id: &BoxId, as_of_ms: u64) -> Result<bool, ManagerError> {
        Ok(self.db(|s| s.move_ready(id, as_of_ms))?)
    }
}
