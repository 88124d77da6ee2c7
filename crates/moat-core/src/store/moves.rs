//! Boxes changing node. A move is a row of `box_moves` that says which box
//! goes from which node to which, at which epoch, and whether the source is
//! done with it (`ready`: it stopped the box and made it durable, or it is a
//! lost node whose boxes come back as of their last upload). The target
//! receives the box from the object store and then, in one transaction,
//! takes it: a slot of its own, the epoch plus one, the move's row gone. Until
//! that commit the box is the source's; after it, never again (a node acts on
//! a box only while its record names it, see `manager::fleet`).
//!
//! Re-homing a lost node's boxes is decided by one node at a time (the
//! reconciler lock) and re-checked at the take: the lost node's lease must
//! still be lapsed by the grace, read under the same lock its renewal takes,
//! so a node that comes back in time keeps its boxes.

use serde::{Deserialize, Serialize};

use super::sql::{args, Engine, Exec, Row};
use super::{nodes, Store, StoreError, INSERT_LOCK};
use crate::ids::BoxId;
use crate::limits::Limits;

/// Why a box is moving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoveReason {
    /// `move NAME --node N`.
    Move,
    /// `moat node drain`.
    Drain,
    /// Its node's lease lapsed beyond the grace.
    Lost,
}

impl MoveReason {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Move => "move",
            Self::Drain => "drain",
            Self::Lost => "lost",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "move" => Some(Self::Move),
            "drain" => Some(Self::Drain),
            "lost" => Some(Self::Lost),
            _ => None,
        }
    }
}

/// A box on its way to another node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoxMove {
    /// The box.
    pub box_id: BoxId,
    /// The node it is on.
    pub from: String,
    /// The node it goes to.
    pub to: String,
    /// Its epoch when the move was asked (the take requires it unchanged).
    pub epoch: u64,
    /// Why.
    pub reason: MoveReason,
    /// The source is done: the target may receive and take it.
    pub ready: bool,
    /// The box arrives as it was then (its last upload's snapshot), once ready.
    pub as_of_ms: Option<u64>,
    /// When the move was asked.
    pub asked_at_ms: u64,
    /// Why the last attempt failed, if one did.
    pub error: Option<String>,
    /// How many attempts failed.
    pub failures: u32,
    /// When the last attempt failed.
    pub failed_at_ms: Option<u64>,
}

/// Where a box came from, once it moved (for `info`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    /// The node it was on.
    pub from: String,
    /// Why it moved.
    pub reason: MoveReason,
    /// It is as it was then (ms): its last upload before the move.
    pub as_of_ms: u64,
    /// When it was taken here (ms).
    pub at_ms: u64,
}

/// Held (PostgreSQL) by the one node that decides where lost nodes' boxes go.
const RECONCILER_LOCK: i64 = 0x6d6f_6174_0004;

const COLUMNS: &str =
    "box_id, from_node, to_node, epoch, reason, ready, as_of_ms, asked_at_ms, error, failures, failed_at_ms";

/// How long a lost node's box waits after its re-homing failed `failures`
/// times before it is tried again: 10 s, doubling, at most 10 minutes. A
/// chain that cannot be received (a corrupt object) is then fetched a few
/// times an hour, not every round.
pub fn retry_after_ms(failures: u32) -> u64 {
    const FIRST_MS: u64 = 10_000;
    const MOST_MS: u64 = 600_000;
    FIRST_MS.saturating_mul(1 << failures.saturating_sub(1).min(16)).min(MOST_MS)
}

fn move_from_row(r: &Row) -> Result<BoxMove, StoreError> {
    let id: String = r.get(0)?;
    let corrupt = || StoreError::Corrupt(id.clone());
    Ok(BoxMove {
        box_id: BoxId::parse(&id).ok_or_else(corrupt)?,
        from: r.get(1)?,
        to: r.get(2)?,
        epoch: r.get(3)?,
        reason: MoveReason::parse(&r.get::<String>(4)?).ok_or_else(corrupt)?,
        ready: r.get(5)?,
        as_of_ms: r.get(6)?,
        asked_at_ms: r.get(7)?,
        error: r.get(8)?,
        failures: r.get(9)?,
        failed_at_ms: r.get(10)?,
    })
}

/// The lock a node's lease renewal and a take of its boxes both hold
/// (PostgreSQL), per node name: a renewal and a re-homing never interleave.
pub(crate) fn lock_node(tx: &mut dyn Exec, node: &str) -> Result<(), StoreError> {
    if tx.engine() == Engine::Postgres {
        tx.execute("SELECT pg_advisory_xact_lock(hashtext(?1))", &args![node])?;
    }
    Ok(())
}

impl Store {
    /// Asks for box `id` (on `from` at `epoch`) to go to `to`; false if a move
    /// of it is under way already or its record changed meanwhile.
    pub fn ask_move(&self, mv: &BoxMove) -> Result<bool, StoreError> {
        self.transaction(|tx| {
            let current = tx.query_row("SELECT node, epoch FROM boxes WHERE id = ?1", &args![mv.box_id.as_str()])?;
            let Some(current) = current else { return Ok(false) };
            if current.get::<String>(0)? != mv.from || current.get::<u64>(1)? != mv.epoch {
                return Ok(false);
            }
            // A move that failed is kept for whoever waited on it, until the next.
            tx.execute("DELETE FROM box_moves WHERE box_id = ?1 AND error IS NOT NULL", &args![mv.box_id.as_str()])?;
            let inserted = insert_move(tx, mv)?;
            Ok(inserted == 1)
        })
    }

    /// Box `id`'s move, if one is asked.
    pub fn box_move(&self, id: &BoxId) -> Result<Option<BoxMove>, StoreError> {
        let row = self.query_row(&format!("SELECT {COLUMNS} FROM box_moves WHERE box_id = ?1"), &args![id.as_str()])?;
        row.as_ref().map(move_from_row).transpose()
    }

    /// Moves off node `from` (`to`: onto node `to`), oldest first.
    pub fn moves(&self, from: Option<&str>, to: Option<&str>) -> Result<Vec<BoxMove>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM box_moves WHERE (CAST(?1 AS TEXT) IS NULL OR from_node = ?1) AND (CAST(?2 AS TEXT) IS NULL OR to_node = ?2) \
             ORDER BY asked_at_ms, box_id"
        );
        self.query(&sql, &args![from, to])?.iter().map(move_from_row).collect()
    }

    /// The source is done with box `id`: it is durable as of `as_of_ms`.
    pub fn move_ready(&self, id: &BoxId, as_of_ms: u64) -> Result<bool, StoreError> {
        let sql = "UPDATE box_moves SET ready = 1, as_of_ms = ?2, error = NULL WHERE box_id = ?1";
        Ok(self.execute(sql, &args![id.as_str(), as_of_ms])? == 1)
    }

    /// Notes why the last attempt at box `id`'s move failed, and when
    /// (`at_ms`), and counts it.
    pub fn move_failed(&self, id: &BoxId, error: &str, at_ms: u64) -> Result<(), StoreError> {
        let sql = "UPDATE box_moves SET error = ?2, failures = failures + 1, failed_at_ms = ?3 WHERE box_id = ?1";
        self.execute(sql, &args![id.as_str(), error, at_ms])?;
        Ok(())
    }

    /// Calls off box `id`'s move (false: it is taken already, or was never
    /// asked): the box stays where it is.
    pub fn cancel_move(&self, id: &BoxId) -> Result<bool, StoreError> {
        Ok(self.execute("DELETE FROM box_moves WHERE box_id = ?1", &args![id.as_str()])? == 1)
    }

    /// Takes box `mv.box_id` onto this node, which has received it: a slot of
    /// this node's, the epoch plus one, the move's row gone, all or nothing.
    /// Refused (`Ok(false)`, nothing changed) if the move was called off or
    /// the box's record changed since it was asked, or, for a lost node's
    /// box, if that node renewed its lease within the grace after all.
    /// `NodeFull` / `NodeUnavailable` if this node has no room.
    pub fn take_box(&self, mv: &BoxMove, grace_ms: u64, at_ms: u64) -> Result<bool, StoreError> {
        let limits = self.get_by_id(&mv.box_id)?.map(|r| r.limits);
        let Some(limits) = limits else { return Ok(false) };
        self.transaction(|tx| {
            if tx.engine() == Engine::Postgres {
                tx.execute("SELECT pg_advisory_xact_lock(?1)", &args![INSERT_LOCK])?;
            }
            lock_node(tx, &mv.from)?;
            let gone = tx.execute(
                "DELETE FROM box_moves WHERE box_id = ?1 AND to_node = ?2 AND ready = 1",
                &args![mv.box_id.as_str(), &self.node],
            )?;
            if gone != 1 {
                return Ok(false);
            }
            if mv.reason == MoveReason::Lost {
                let lease = tx.query_row("SELECT lease_until_ms FROM nodes WHERE name = ?1", &args![&mv.from])?;
                let until: u64 = lease.map(|r| r.get(0)).transpose()?.unwrap_or(0);
                if at_ms < until.saturating_add(grace_ms) {
                    return Err(StoreError::NodeBack(mv.from.clone()));
                }
            }
            nodes::check_room(tx, &self.node, &limits, at_ms)?;
            let slot = self.free_slot(tx)?;
            let moved = tx.execute(
                "UPDATE boxes SET node = ?2, epoch = epoch + 1, slot = ?3, state = ?4, pid = NULL, state_since = ?5, \
                 moved_from = ?6, moved_reason = ?7, moved_as_of_ms = ?8, moved_at_ms = ?9 \
                 WHERE id = ?1 AND node = ?6 AND epoch = ?10",
                &args![
                    mv.box_id.as_str(),
                    &self.node,
                    slot,
                    crate::record::BoxState::Stopped.as_str(),
                    at_ms / 1000,
                    &mv.from,
                    mv.reason.as_str(),
                    mv.as_of_ms.unwrap_or(0),
                    at_ms,
                    mv.epoch
                ],
            )?;
            if moved != 1 {
                return Err(StoreError::MoveStale(mv.box_id.to_string()));
            }
            Ok(true)
        })
        .or_else(|e| match e {
            // Rolled back, and called off: the lost node is back and keeps
            // its box, or the box is no longer what the move was asked of.
            StoreError::NodeBack(_) | StoreError::MoveStale(_) => {
                self.cancel_move(&mv.box_id)?;
                Ok(false)
            }
            e => Err(e),
        })
    }

    /// Where box `id` came from, if it moved.
    pub fn arrival(&self, id: &BoxId) -> Result<Option<Arrival>, StoreError> {
        let row = self.query_row(
            "SELECT moved_from, moved_reason, moved_as_of_ms, moved_at_ms FROM boxes \
             WHERE id = ?1 AND moved_from IS NOT NULL",
            &args![id.as_str()],
        )?;
        let Some(r) = row else { return Ok(None) };
        let reason: String = r.get(1)?;
        Ok(Some(Arrival {
            from: r.get(0)?,
            reason: MoveReason::parse(&reason).ok_or_else(|| StoreError::Corrupt(id.to_string()))?,
            as_of_ms: r.get(2)?,
            at_ms: r.get(3)?,
        }))
    }

    /// As the fleet's one reconciler (PostgreSQL: a lock held for the
    /// transaction; nothing if another node holds it, or on SQLite, a single
    /// host): asks every box of a node whose lease lapsed `grace_ms` or more
    /// before `now_ms`, that has something in the object store and no move
    /// yet, to go to the live node with the most memory free that has room
    /// for it. The moves asked (a box that fits nowhere waits for the next
    /// round).
    pub fn reconcile_lost(&self, grace_ms: u64, now_ms: u64) -> Result<Vec<BoxMove>, StoreError> {
        self.transaction(|tx| {
            if tx.engine() != Engine::Postgres {
                return Ok(Vec::new());
            }
            let got = tx.query_row("SELECT pg_try_advisory_xact_lock(?1)", &args![RECONCILER_LOCK])?;
            if !got.map(|r| r.get::<bool>(0)).transpose()?.unwrap_or(false) {
                return Ok(Vec::new());
            }
            let mut all = nodes::all_nodes(tx)?;
            let lost: Vec<String> = all
                .iter()
                .filter(|n| now_ms >= n.lease_until_ms.saturating_add(grace_ms))
                .map(|n| n.offer.name.clone())
                .collect();
            let mut moves = moves_in(tx)?;
            // Moves under way that a lost node holds up are ended, or a box
            // would wait for a node that may never come back: one whose
            // target is lost (the box is still its source's: it stays there,
            // or is re-homed below if its source is lost too), and one whose
            // source was lost before it was ready (re-homed below from the
            // object store, as the rest of its node's boxes). A target that
            // returns finds its move gone and takes nothing.
            let stale = |m: &BoxMove| {
                m.error.is_none() && (lost.contains(&m.to) || (lost.contains(&m.from) && !m.ready))
            };
            for mv in moves.iter().filter(|m| stale(m)) {
                tracing::warn!(box_id = %mv.box_id, from = %mv.from, to = %mv.to, "a move held up by a lost node is ended");
                tx.execute("DELETE FROM box_moves WHERE box_id = ?1", &args![mv.box_id.as_str()])?;
            }
            moves.retain(|m| !stale(m));
            // What moves under way will add to each target.
            for mv in moves.iter().filter(|m| m.error.is_none()) {
                if let (Some(limits), Some(n)) =
                    (limits_of(tx, &mv.box_id)?, all.iter_mut().find(|n| n.offer.name == mv.to))
                {
                    n.add(&limits);
                }
            }
            let mut asked = Vec::new();
            // Lost nodes' boxes whose re-homing failed: tried again once
            // they have waited long enough (on whichever node has room
            // now); forgotten if their node came back.
            for mv in moves.into_iter().filter(|m| m.reason == MoveReason::Lost && m.error.is_some()) {
                if !lost.contains(&mv.from) {
                    tx.execute("DELETE FROM box_moves WHERE box_id = ?1", &args![mv.box_id.as_str()])?;
                    continue;
                }
                let due = mv.failed_at_ms.unwrap_or(0).saturating_add(retry_after_ms(mv.failures));
                if now_ms < due {
                    continue;
                }
                let Some(limits) = limits_of(tx, &mv.box_id)? else { continue };
                let Some(to) = pick_node(&mut all, &limits, now_ms) else { continue };
                let sql = "UPDATE box_moves SET to_node = ?2, error = NULL, asked_at_ms = ?3 WHERE box_id = ?1";
                tx.execute(sql, &args![mv.box_id.as_str(), &to, now_ms])?;
                asked.push(BoxMove { to, error: None, asked_at_ms: now_ms, ..mv });
            }
            for from in lost {
                for (id, epoch, as_of_ms, limits) in durable_boxes_on(tx, &from)? {
                    let Some(to) = pick_node(&mut all, &limits, now_ms) else { continue };
                    let mv = BoxMove {
                        box_id: id,
                        from: from.clone(),
                        to,
                        epoch,
                        reason: MoveReason::Lost,
                        ready: true,
                        as_of_ms: Some(as_of_ms),
                        asked_at_ms: now_ms,
                        error: None,
                        failures: 0,
                        failed_at_ms: None,
                    };
                    insert_move(tx, &mv)?;
                    asked.push(mv);
                }
            }
            Ok(asked)
        })
    }
}

impl Store {
    /// Cordons node `from` and asks every box on it onto the live node with
    /// the most memory free that has room, in one transaction. The moves
    /// asked, and the boxes that fit nowhere (they stay).
    pub fn ask_drain(&self, from: &str, now_ms: u64) -> Result<(Vec<BoxMove>, Vec<BoxId>), StoreError> {
        if !self.set_cordoned(from, true)? {
            return Err(StoreError::NodeUnavailable(from.to_owned()));
        }
        self.transaction(|tx| {
            if tx.engine() == Engine::Postgres {
                tx.execute("SELECT pg_advisory_xact_lock(?1)", &args![INSERT_LOCK])?;
            }
            let mut all = nodes::all_nodes(tx)?;
            let rows = tx.query(
                "SELECT b.id, b.epoch, b.cpus, b.memory, b.pids, b.disk FROM boxes b WHERE b.node = ?1 \
                 AND b.state <> 'creating' AND NOT EXISTS (SELECT 1 FROM box_moves m WHERE m.box_id = b.id) \
                 ORDER BY b.id",
                &args![from],
            )?;
            let (mut asked, mut stuck) = (Vec::new(), Vec::new());
            for r in rows {
                let id: String = r.get(0)?;
                let id = BoxId::parse(&id).ok_or(StoreError::Corrupt(id.clone()))?;
                let limits = Limits { cpus: r.get(2)?, memory: r.get(3)?, pids: r.get(4)?, disk: r.get(5)? };
                let Some(to) = pick_node(&mut all, &limits, now_ms) else {
                    stuck.push(id);
                    continue;
                };
                let mv = BoxMove {
                    box_id: id,
                    from: from.to_owned(),
                    to,
                    epoch: r.get(1)?,
                    reason: MoveReason::Drain,
                    ready: false,
                    as_of_ms: None,
                    asked_at_ms: now_ms,
                    error: None,
                    failures: 0,
                    failed_at_ms: None,
                };
                insert_move(tx, &mv)?;
                asked.push(mv);
            }
            Ok((asked, stuck))
        })
    }
}

/// The live, uncordoned node with the most memory free that has room for
/// `limits`, charged with them.
fn pick_node(nodes: &mut [nodes::NodeRow], limits: &Limits, now_ms: u64) -> Option<String> {
    let best = nodes
        .iter_mut()
        .filter(|n| !n.cordoned && n.is_live(now_ms) && n.room_for(limits).is_ok())
        .max_by_key(|n| n.offer.memory.saturating_sub(n.memory_used))?;
    best.add(limits);
    Some(best.offer.name.clone())
}

fn moves_in(tx: &mut dyn Exec) -> Result<Vec<BoxMove>, StoreError> {
    tx.query(&format!("SELECT {COLUMNS} FROM box_moves"), &[])?.iter().map(move_from_row).collect()
}

fn limits_of(tx: &mut dyn Exec, id: &BoxId) -> Result<Option<Limits>, StoreError> {
    let row = tx.query_row("SELECT cpus, memory, pids, disk FROM boxes WHERE id = ?1", &args![id.as_str()])?;
    row.map(|r| Ok(Limits { cpus: r.get(0)?, memory: r.get(1)?, pids: r.get(2)?, disk: r.get(3)? })).transpose()
}

/// The boxes on `node` that have something in the object store and no move
/// asked: each with its epoch, its newest upload's time and its limits.
fn durable_boxes_on(tx: &mut dyn Exec, node: &str) -> Result<Vec<(BoxId, u64, u64, Limits)>, StoreError> {
    let rows = tx.query(
        "SELECT b.id, b.epoch, MAX(d.taken_at_ms), b.cpus, b.memory, b.pids, b.disk \
         FROM boxes b JOIN durable_links d ON d.box_id = b.id \
         WHERE b.node = ?1 AND b.state <> 'creating' \
         AND NOT EXISTS (SELECT 1 FROM box_moves m WHERE m.box_id = b.id) \
         GROUP BY b.id, b.epoch, b.cpus, b.memory, b.pids, b.disk ORDER BY b.id",
        &args![node],
    )?;
    rows.iter()
        .map(|r| {
            let id: String = r.get(0)?;
            let id = BoxId::parse(&id).ok_or(StoreError::Corrupt(id.clone()))?;
            let limits = Limits { cpus: r.get(3)?, memory: r.get(4)?, pids: r.get(5)?, disk: r.get(6)? };
            Ok((id, r.get(1)?, r.get(2)?, limits))
        })
        .collect()
}

fn insert_move(tx: &mut dyn Exec, mv: &BoxMove) -> Result<u64, StoreError> {
    tx.execute(
        "INSERT INTO box_moves (box_id, from_node, to_node, epoch, reason, ready, as_of_ms, asked_at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT (box_id) DO NOTHING",
        &args![
            mv.box_id.as_str(),
            &mv.from,
            &mv.to,
            mv.epoch,
            mv.reason.as_str(),
            mv.ready,
            mv.as_of_ms,
            mv.asked_at_ms
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendKind;
    use crate::ids::{AccountId, Name};
    use crate::policy::Policy;
    use crate::record::{BoxRecord, BoxState};
    use crate::store::durable::DurableLink;
    use crate::store::nodes::NodeOffer;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(a_move_is_taken_once_ready_and_flips_the_epoch, a_stale_or_cancelled_move_is_not_taken);

    const GIB: u64 = 1 << 30;

    /// What node `name` offers in these tests (its placement is
    /// `nodes`' to test: the same offer).
    fn offer(name: &str, max_boxes: u32) -> NodeOffer {
        crate::store::nodes::tests::offer(name, max_boxes)
    }

    fn new_box(store: &Store, name: &str) -> BoxRecord {
        let made =
            (&Name::new("debian").unwrap(), Limits { cpus: 1, memory: GIB, ..Limits::default() }, BackendKind::Ns);
        let rec =
            store.insert_new(&AccountId("a".into()), &Name::new(name).unwrap(), made, 1, &Policy::default()).unwrap();
        store.set_state(&rec.id, BoxState::Suspended, None).unwrap();
        rec
    }

    fn move_of(rec: &BoxRecord, to: &str, reason: MoveReason) -> BoxMove {
        BoxMove {
            box_id: rec.id.clone(),
            from: rec.node.clone(),
            to: to.into(),
            epoch: rec.epoch,
            reason,
            ready: false,
            as_of_ms: None,
            asked_at_ms: 5,
            error: None,
            failures: 0,
            failed_at_ms: None,
        }
    }

    /// Two nodes of one store (on SQLite, two names over one file, whose
    /// slots are unique table-wide: enough for what a move's rows and a take
    /// do).
    fn two_nodes(db: &TestDb) -> (Store, Store) {
        let (n1, n2) = (db.open().for_node("n1"), db.open().for_node("n2"));
        n1.renew_lease(&offer("n1", 4)).unwrap();
        n2.renew_lease(&offer("n2", 4)).unwrap();
        (n1, n2)
    }

    fn a_move_is_taken_once_ready_and_flips_the_epoch(db: &TestDb) {
        let (n1, n2) = two_nodes(db);
        let rec = new_box(&n1, "web");
        let mv = move_of(&rec, "n2", MoveReason::Move);
        assert!(n1.ask_move(&mv).unwrap());
        assert!(!n1.ask_move(&mv).unwrap(), "one move of a box at a time");
        assert_eq!(n1.node("n1").unwrap().unwrap().moving, 1, "moat nodes counts it");
        n1.set_upload_backlog("n1", 3).unwrap();
        assert_eq!(n2.node("n1").unwrap().unwrap().upload_backlog, 3);
        assert!(!n2.take_box(&mv, 0, 10).unwrap(), "not before the source is done");
        assert!(n1.move_ready(&rec.id, 4).unwrap());
        let ready = n2.box_move(&rec.id).unwrap().unwrap();
        assert_eq!((ready.ready, ready.as_of_ms, ready.reason), (true, Some(4), MoveReason::Move));
        assert_eq!(n1.moves(Some("n1"), None).unwrap(), std::slice::from_ref(&ready));
        assert!(n1.moves(None, Some("n1")).unwrap().is_empty());
        assert!(!n1.take_box(&ready, 0, 10).unwrap(), "only its target takes it");
        assert!(n2.take_box(&ready, 0, 10_000).unwrap());
        let now = n2.get_by_id(&rec.id).unwrap().unwrap();
        assert_eq!((now.node.as_str(), now.epoch, now.state), ("n2", 1, BoxState::Stopped));
        assert!(n2.box_move(&rec.id).unwrap().is_none());
        let came = n2.arrival(&rec.id).unwrap().unwrap();
        assert_eq!((came.from.as_str(), came.reason, came.as_of_ms, came.at_ms), ("n1", MoveReason::Move, 4, 10_000));
        assert!(!n2.take_box(&ready, 0, 10_000).unwrap(), "taken once");
        let other = new_box(&n2, "other");
        assert_ne!(other.slot, now.slot, "the box has a slot of its new node's");
    }

    fn a_stale_or_cancelled_move_is_not_taken(db: &TestDb) {
        let (n1, n2) = two_nodes(db);
        let rec = new_box(&n1, "web");
        let stale = BoxMove { epoch: 7, ..move_of(&rec, "n2", MoveReason::Move) };
        assert!(!n1.ask_move(&stale).unwrap(), "asked of an epoch the box is not at");
        let mv = move_of(&rec, "n2", MoveReason::Move);
        assert!(n1.ask_move(&mv).unwrap());
        assert!(n1.cancel_move(&rec.id).unwrap());
        assert!(!n1.move_ready(&rec.id, 4).unwrap());
        assert!(!n2.take_box(&BoxMove { ready: true, ..mv }, 0, 10).unwrap());
        assert_eq!(n2.get_by_id(&rec.id).unwrap().unwrap().node, "n1", "the box stays where it was");
    }

    fn link(id: &BoxId, taken_at_ms: u64) -> DurableLink {
        DurableLink {
            box_id: id.clone(),
            seq: 0,
            parent_seq: None,
            key: format!("k/{id}"),
            snapshot: "s".into(),
            sha256: String::new(),
            bytes: 1,
            taken_at_ms,
            uploaded_at_ms: taken_at_ms,
            node: "n1".into(),
            checkpoint: None,
        }
    }

    /// A lost node's durable boxes go to the live nodes with room (most free
    /// memory first); one never uploaded stays; a node back within the grace
    /// keeps its boxes.
    #[test]
    fn lost_nodes_boxes_are_re_homed_once_by_one_reconciler() {
        let db = TestDb::postgres();
        let (n1, n2) = two_nodes(&db);
        let n3 = db.open().for_node("n3");
        n3.renew_lease(&NodeOffer { memory: 2 * GIB, ..offer("n3", 4) }).unwrap();
        let (a, b, never) = (new_box(&n1, "a"), new_box(&n1, "b"), new_box(&n1, "never"));
        n1.add_durable_link(&link(&a.id, 100)).unwrap();
        n1.add_durable_link(&link(&b.id, 200)).unwrap();
        let now = crate::clock::now_ms();
        assert!(n2.reconcile_lost(60_000, now).unwrap().is_empty(), "n1's lease is live");
        n1.execute("UPDATE nodes SET lease_until_ms = ?1 WHERE name = 'n1'", &args![now - 61_000]).unwrap();
        assert!(n2.reconcile_lost(60_000, now - 2_000).unwrap().is_empty(), "lapsed, but not by the grace");
        let asked = n2.reconcile_lost(60_000, now).unwrap();
        let mut got: Vec<(String, &str, Option<u64>)> =
            asked.iter().map(|m| (m.box_id.to_string(), m.to.as_str(), m.as_of_ms)).collect();
        got.sort();
        let mut want = vec![(a.id.to_string(), "n2", Some(100)), (b.id.to_string(), "n2", Some(200))];
        want.sort();
        // n2 has 8 GiB free and n3 2: n3 gets one only when n2 has less free.
        assert_eq!(got, want);
        assert!(asked.iter().all(|m| m.ready && m.reason == MoveReason::Lost && m.from == "n1"));
        assert!(n3.reconcile_lost(60_000, now).unwrap().is_empty(), "asked once");
        assert!(n2.box_move(&never.id).unwrap().is_none(), "nothing uploaded: nothing to re-home from");

        // The take, while n1 stays lost.
        let first = &asked[0];
        assert!(n2.take_box(first, 60_000, now).unwrap());
        let taken = n2.get_by_id(&first.box_id).unwrap().unwrap();
        assert_eq!((taken.node.as_str(), taken.epoch), ("n2", 1));
        // n1 back before the second is taken: it keeps it, the move is off.
        n1.renew_lease(&offer("n1", 4)).unwrap();
        let second = &asked[1];
        assert!(!n2.take_box(second, 60_000, crate::clock::now_ms()).unwrap());
        assert_eq!(n2.get_by_id(&second.box_id).unwrap().unwrap().node, "n1");
        assert!(n2.box_move(&second.box_id).unwrap().is_none());
    }

    /// Nodes n1 and n2, n1 lost a minute ago (now: the time returned) with
    /// box `a`, uploaded.
    fn lost_node_with_a_durable_box(db: &TestDb) -> (Store, Store, BoxRecord, u64) {
        let (n1, n2) = two_nodes(db);
        let a = new_box(&n1, "a");
        n1.add_durable_link(&link(&a.id, 100)).unwrap();
        let now = crate::clock::now_ms();
        n1.execute("UPDATE nodes SET lease_until_ms = ?1 WHERE name = 'n1'", &args![now - 61_000]).unwrap();
        (n1, n2, a, now)
    }

    /// A lost node's box whose re-homing failed is not asked again until it
    /// has waited (longer each time), then on a node with room; a failed
    /// re-homing of a node that came back is forgotten.
    #[test]
    fn a_failed_re_homing_is_tried_again_after_a_growing_wait() {
        let db = TestDb::postgres();
        let (n1, n2, a, now) = lost_node_with_a_durable_box(&db);
        // n2 stays live across the minute this test's clock runs on.
        n2.execute("UPDATE nodes SET lease_until_ms = ?1 WHERE name = 'n2'", &args![now + 3_600_000]).unwrap();
        let asked = n2.reconcile_lost(60_000, now).unwrap();
        assert_eq!(asked.len(), 1);
        n2.move_failed(&a.id, "object k/a is corrupt", now).unwrap();
        let failed = n2.box_move(&a.id).unwrap().unwrap();
        assert_eq!((failed.failures, failed.failed_at_ms), (1, Some(now)));
        assert!(n2.moves(None, Some("n2")).unwrap().iter().all(|m| m.error.is_some()), "not received again");
        for (at, failures) in [(now + 1, 1), (now + 9_999, 1)] {
            assert!(n2.reconcile_lost(60_000, at).unwrap().is_empty(), "asked again {} ms after {failures}", at - now);
        }
        let again = n2.reconcile_lost(60_000, now + 10_000).unwrap();
        assert_eq!(
            again.iter().map(|m| (m.to.as_str(), m.failures, m.error.is_none())).collect::<Vec<_>>(),
            [("n2", 1, true)]
        );
        assert_eq!(n2.box_move(&again[0].box_id).unwrap().unwrap().error, None, "stored as asked");
        // Failed a second time: twice the wait.
        n2.move_failed(&a.id, "still corrupt", now + 10_000).unwrap();
        assert!(n2.reconcile_lost(60_000, now + 29_999).unwrap().is_empty());
        assert_eq!(n2.reconcile_lost(60_000, now + 30_000).unwrap().len(), 1);
        assert_eq!(retry_after_ms(10), 600_000, "at most 10 minutes");
        assert_eq!(retry_after_ms(u32::MAX), 600_000);
        // n1 back: the failed move is forgotten and the box stays n1's.
        n2.move_failed(&a.id, "again", now + 30_000).unwrap();
        n1.renew_lease(&offer("n1", 4)).unwrap();
        assert!(n2.reconcile_lost(60_000, crate::clock::now_ms()).unwrap().is_empty());
        assert!(n2.box_move(&a.id).unwrap().is_none());
        assert_eq!(n2.get_by_id(&a.id).unwrap().unwrap().node, "n1");
    }

    /// A move held up by a lost node ends: one whose target is lost leaves
    /// the box with its live source (it waited for that node to come back);
    /// one whose source was lost before it was ready is re-homed from the
    /// object store, as the rest of its node's boxes (it waited too).
    #[test]
    fn moves_held_up_by_a_lost_node_end() {
        let db = TestDb::postgres();
        let (n1, n2) = two_nodes(&db);
        let n3 = db.open().for_node("n3");
        n3.renew_lease(&offer("n3", 4)).unwrap();
        let now = crate::clock::now_ms();
        let lease = |node: &str, until: u64| {
            n1.execute("UPDATE nodes SET lease_until_ms = ?1 WHERE name = ?2", &args![until, node]).unwrap();
        };
        lease("n1", now + 3_600_000);
        lease("n2", now + 3_600_000);
        let a = new_box(&n1, "a");
        assert!(n1.ask_move(&move_of(&a, "n3", MoveReason::Move)).unwrap());
        lease("n3", now - 61_000);
        assert!(n2.reconcile_lost(60_000, now).unwrap().is_empty());
        assert!(n2.box_move(&a.id).unwrap().is_none(), "still waiting for its lost target");
        assert_eq!(n2.get_by_id(&a.id).unwrap().unwrap().node, "n1");
        // The target back: it finds nothing to take.
        let mut late = move_of(&a, "n3", MoveReason::Move);
        late.ready = true;
        assert!(!n3.take_box(&late, 60_000, now).unwrap());

        let b = new_box(&n1, "b");
        n1.add_durable_link(&link(&b.id, 100)).unwrap();
        assert!(n1.ask_move(&move_of(&b, "n2", MoveReason::Move)).unwrap());
        lease("n1", now - 61_000);
        let asked = n2.reconcile_lost(60_000, now).unwrap();
        let got: Vec<_> = asked.iter().map(|m| (m.box_id.clone(), m.to.as_str(), m.reason, m.ready)).collect();
        assert_eq!(got, [(b.id.clone(), "n2", MoveReason::Lost, true)], "still waiting for its lost source");
    }

    /// Two reconcilers at once: one decides, the other finds the lock held.
    #[test]
    fn one_reconciler_at_a_time() {
        let db = TestDb::postgres();
        let (_n1, n2, _, now) = lost_node_with_a_durable_box(&db);
        let other = db.open().for_node("n3");
        let held = other.transaction(|tx| {
            tx.query_row("SELECT pg_try_advisory_xact_lock(?1)", &args![RECONCILER_LOCK])?;
            n2.reconcile_lost(60_000, now)
        });
        assert!(held.unwrap().is_empty(), "the lock is held by another");
        assert_eq!(n2.reconcile_lost(60_000, now).unwrap().len(), 1);
    }
}
