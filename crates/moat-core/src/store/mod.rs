//! The state store: one database, SQLite under the state dir on a single
//! host or PostgreSQL shared by a fleet, reached through [`sql`], the one
//! data-access layer both engines sit behind. Its tables are in [`schema`];
//! beside the boxes kept here, the usage [`ledger`], the [`egress_log`] and
//! sealed [`secrets`] are stores of their own.
//!
//! Every change is one transaction, so a crash leaves either the old or the new
//! row; the manager rolls back boxes left in `creating`.

mod checkpoints;
pub mod counters;
pub mod durable;
pub mod effects;
pub mod egress_log;
pub mod fleet;
pub mod images;
pub mod ledger;
mod log_shares;
pub mod moves;
pub mod nodes;
mod schema;
pub mod secrets;
pub mod services;
mod sql;
/// [`Store::set_state`], in `tx`.
pub(crate) fn set_state_in(tx: &mut dyn Exec, id: &BoxId, state: BoxState, pid: Option<u32>) -> Result<(), StoreError> {
    tx.execute(
        "UPDATE boxes SET state = ?2, pid = ?3, state_since = ?4 WHERE id = ?1",
        &args![id.as_str(), state.as_str(), pid, crate::clock::now()],
    )?;
    Ok(())
}

#[cfg(test)]
mod testing;
pub mod web;

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use self::sql::{args, Db, Engine, Exec, Row, Value};
use crate::backend::BackendKind;
use crate::ids::{AccountId, BoxId, Name};
use crate::limits::Limits;
use crate::policy::Policy;
use crate::record::{BoxRecord, BoxState, MAX_SLOTS, SLOTS_PER_BLOCK};

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The SQLite database itself failed.
    #[error("state database")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL refused a statement.
    #[error("state store (PostgreSQL)")]
    Postgres(#[source] postgres::Error),
    /// PostgreSQL cannot be reached; the message names the server (never its
    /// password). The next call tries again.
    #[error("{0}")]
    Unreachable(String),
    /// The store's address does not parse.
    #[error("state store address: {0}")]
    Dsn(String),
    /// A column holds something the store never writes there.
    #[error("state database: {0}")]
    Column(String),
    /// The database was last opened by a newer moat.
    #[error("the state database is from a newer moat (schema version {found}; this moat knows up to {known})")]
    Newer {
        /// The database's version.
        found: u32,
        /// This moat's.
        known: u32,
    },
    /// The account has as many boxes as its cap allows.
    #[error("the account has {0} boxes, its most")]
    AccountBoxes(u64),
    /// With the box, the account's memory limits would pass its cap.
    #[error("the account's memory limits would add up to {asked} bytes, past {max}")]
    AccountMemory {
        /// The sum with the box.
        asked: u64,
        /// The cap.
        max: u64,
    },
    /// The account already has a box by this name.
    #[error("a box named {0} already exists")]
    NameTaken(Name),
    /// Every uid range is in use.
    #[error("no free uid range left for another box")]
    NoSlot,
    /// A row that does not parse (the database was edited by hand).
    #[error("corrupt row for box {0}")]
    Corrupt(String),
    /// This node has no room for the box.
    #[error("node {node} is full ({what})")]
    NodeFull {
        /// The node.
        node: String,
        /// What it lacks.
        what: nodes::Resource,
    },
    /// This node takes no new boxes: it is unknown, cordoned, or its lease lapsed.
    #[error("node {0} is not taking new boxes (unknown, cordoned, or its lease has lapsed)")]
    NodeUnavailable(String),
    /// A fleet member's join token was used already.
    #[error("fleet member {0} has joined already (a join token works once)")]
    AlreadyJoined(String),
    /// A lost node renewed its lease before its boxes were taken elsewhere.
    #[error("node {0} is back: it keeps its boxes")]
    NodeBack(String),
    /// A box's record changed since its move was asked.
    #[error("box {0} changed since its move was asked")]
    MoveStale(String),
    /// No fleet member has this serial, or it was revoked.
    #[error("no fleet member {0} (never issued, or revoked)")]
    NoMember(String),
}

/// Gives this server one more block of uid slots when every slot of its
/// blocks is taken (the host's registry decides which), or says why not.
pub type MoreSlots = Box<dyn Fn() -> Result<u32, String> + Send + Sync>;

/// The state store, on either engine.
pub struct Store {
    db: Db,
    /// The blocks of uid slots this server hands out from, lowest slot of
    /// the first block first (see [`SLOTS_PER_BLOCK`]).
    slot_blocks: Mutex<Vec<u32>>,
    /// Where another block comes from when those are full (none: they are all).
    more_slots: Option<MoreSlots>,
    /// The fleet node this process is (`""`: a single host).
    node: String,
    /// What one account's boxes may add up to (none: no bound).
    account_cap: Option<AccountCap>,
    /// SQLite's log copied into the database off the writers' path.
    _checkpoints: Option<checkpoints::Checkpoints>,
}

const COLUMNS: &str = "b.id, b.account, b.name, b.image, b.cpus, b.memory, b.pids, b.slot, b.state, b.pid, \
                       b.created_at, b.disk, b.parent, p.name, b.idle, b.keep_running, b.state_since, b.backend, \
                       b.node, b.epoch";

/// `boxes` as `b`, with each box's parent (if it still exists) as `p`.
const FROM: &str = "boxes b LEFT JOIN boxes p ON p.id = b.parent";

/// What one account's boxes may add up to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountCap {
    /// Boxes.
    pub boxes: u64,
    /// Their memory limits, in bytes.
    pub memory: u64,
}

/// How many boxes `account` has, and their memory limits together.
fn account_totals_in(tx: &mut dyn Exec, account: &AccountId) -> Result<(u64, u64), StoreError> {
    let sql = "SELECT CAST(COUNT(*) AS BIGINT), CAST(COALESCE(SUM(memory), 0) AS BIGINT) FROM boxes WHERE account = ?1";
    let row = tx.query_row(sql, &args![account.0.as_str()])?;
    row.map(|r| Ok((r.get::<u64>(0)?, r.get::<u64>(1)?))).transpose().map(Option::unwrap_or_default)
}

/// Any number, the same in every moat: held (PostgreSQL) while the egress
/// log or the effects ledger is written, so that nodes writing at once take
/// their accounts' shares one after the other (in any order they would
/// deadlock on the shares' rows).
pub(crate) const LOG_LOCK: i64 = 0x6d6f_6174_0003;

/// Any number, the same in every moat: held (PostgreSQL) while a box is
/// added, so that two nodes never pick the same slot or overfill a node.
pub(crate) const INSERT_LOCK: i64 = 0x6d6f_6174_0002;

/// The millisecond a box made at `created_at` (seconds) was made: now's,
/// when that second is now (as callers pass it); else the second's start.
fn created_ms(created_at: u64) -> u64 {
    let now_ms = crate::clock::now_ms();
    if now_ms / 1000 == created_at {
        now_ms
    } else {
        created_at.saturating_mul(1000)
    }
}

impl Store {
    /// Opens (creating if needed) the SQLite database at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = rusqlite::Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let checkpoints = checkpoints::Checkpoints::start(path);
        if checkpoints.is_some() {
            conn.pragma_update(None, "wal_autocheckpoint", checkpoints::FALLBACK_PAGES)?;
        }
        Self::on(Db::Sqlite(Mutex::new(conn))).map(|store| Self { _checkpoints: checkpoints, ..store })
    }

    /// Connects to the PostgreSQL database at `dsn`
    /// (`postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE`), bringing its
    /// tables up to date. Fails with [`StoreError::Unreachable`] if it cannot
    /// be reached within about two seconds. No TLS: the server is reached
    /// over loopback or a unix socket (`host=/run/postgresql`) this round.
    pub fn connect(dsn: &str) -> Result<Self, StoreError> {
        Self::on(Db::Postgres(sql::Postgres::new(dsn)?))
    }

    fn on(db: Db) -> Result<Self, StoreError> {
        schema::migrate(&db)?;
        Ok(Self {
            db,
            slot_blocks: Mutex::new(vec![0]),
            more_slots: None,
            node: String::new(),
            account_cap: None,
            _checkpoints: None,
        })
    }

    /// The same store, as fleet node `name`: boxes it adds are on `name`, and
    /// must fit there (see [`Store::renew_lease`]).
    pub fn for_node(mut self, name: &str) -> Self {
        self.node = name.to_owned();
        self
    }

    /// The same store, refusing a box that would take an account past `cap`
    /// (checked in the transaction that adds it: adds at once cannot each
    /// pass a check made before the others).
    pub fn capped(mut self, cap: AccountCap) -> Self {
        self.account_cap = Some(cap);
        self
    }

    /// The fleet node this process is (`""`: a single host).
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// Runs one statement; how many rows it changed.
    pub(crate) fn execute(&self, sql: &str, args: &[Value]) -> Result<u64, StoreError> {
        self.db.with(|c| c.execute(sql, args))
    }

    /// Runs one query; every row it returns.
    pub(crate) fn query(&self, sql: &str, args: &[Value]) -> Result<Vec<Row>, StoreError> {
        self.db.with(|c| c.query(sql, args))
    }

    /// The first row a query returns, if any.
    pub(crate) fn query_row(&self, sql: &str, args: &[Value]) -> Result<Option<Row>, StoreError> {
        self.db.with(|c| c.query_row(sql, args))
    }

    /// Runs `f` in one transaction: committed if it returns `Ok`, rolled back if not.
    pub(crate) fn transaction<T>(
        &self,
        f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.db.transaction(f)
    }

    /// Runs `f` in one transaction whose commit does not wait for the disk
    /// (see [`Db::transaction_unsynced`]).
    pub(crate) fn transaction_unsynced<T>(
        &self,
        f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.db.transaction_unsynced(f)
    }

    /// The lowest uid slot of this node's blocks that no box here has,
    /// taking one more block when they are full (inside the transaction that
    /// gives it, under the insert lock on PostgreSQL).
    pub(crate) fn free_slot(&self, tx: &mut dyn Exec) -> Result<u32, StoreError> {
        loop {
            let blocks = self.slot_blocks.lock().unwrap_or_else(PoisonError::into_inner).clone();
            for block in blocks {
                if let Some(slot) = self.free_slot_in(tx, block)? {
                    return Ok(slot);
                }
            }
            let Some(more) = &self.more_slots else { return Err(StoreError::NoSlot) };
            let block = more().map_err(|why| {
                tracing::warn!("no block of uid slots to add: {why}");
                StoreError::NoSlot
            })?;
            self.slot_blocks.lock().unwrap_or_else(PoisonError::into_inner).push(block);
        }
    }

    /// The lowest slot of `block` no box on this node has, if any.
    fn free_slot_in(&self, tx: &mut dyn Exec, block: u32) -> Result<Option<u32>, StoreError> {
        let (start, end) = (block * SLOTS_PER_BLOCK, ((block + 1) * SLOTS_PER_BLOCK).min(MAX_SLOTS));
        let range = "FROM boxes WHERE node = ?1 AND slot >= ?2 AND slot < ?3";
        let taken = tx.query_row(&format!("SELECT COUNT(*) {range}"), &args![&self.node, start, end])?;
        if taken.map(|r| r.get::<u32>(0)).transpose()?.unwrap_or(0) >= end.saturating_sub(start) {
            return Ok(None);
        }
        let used = tx.query(&format!("SELECT slot {range} ORDER BY slot"), &args![&self.node, start, end])?;
        let mut slot = start;
        for row in used {
            if row.get::<u32>(0)? != slot {
                break;
            }
            slot += 1;
        }
        Ok((slot < end).then_some(slot))
    }

    /// The blocks of uid slots the boxes already here use, lowest first.
    pub fn slot_blocks_in_use(&self) -> Result<Vec<u32>, StoreError> {
        let rows = self.query(
            "SELECT DISTINCT slot / ?2 FROM boxes WHERE node = ?1 ORDER BY 1",
            &args![&self.node, SLOTS_PER_BLOCK],
        )?;
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Hands out slots of `blocks` only (block 0 unless set), first moving
    /// the boxes of each `(from, to)` of `moves` from block `from` to block
    /// `to` (same place in the block); more come from `more` when they are
    /// full. Moves are only for boxes that are not running: a slot is which
    /// host uids the next boot maps, and files on disk do not depend on it
    /// (they are mapped at mount time).
    pub fn use_slot_blocks(
        &mut self,
        blocks: &[u32],
        moves: &[(u32, u32)],
        more: Option<MoreSlots>,
    ) -> Result<(), StoreError> {
        self.transaction(|tx| {
            for &(from, to) in moves {
                tx.execute(
                    "UPDATE boxes SET slot = ?1 + slot % ?3 WHERE node = ?4 AND slot >= ?2 AND slot < ?2 + ?3",
                    &args![to * SLOTS_PER_BLOCK, from * SLOTS_PER_BLOCK, SLOTS_PER_BLOCK, &self.node],
                )?;
            }
            Ok(())
        })?;
        *self.slot_blocks.get_mut().unwrap_or_else(PoisonError::into_inner) = blocks.to_vec();
        self.more_slots = more;
        Ok(())
    }

    /// Adds a box in state `creating`, giving it the lowest free uid slot.
    /// On a fleet node, only if the node is live, not cordoned, and has room
    /// ([`StoreError::NodeUnavailable`], [`StoreError::NodeFull`]).
    pub fn insert_new(
        &self,
        account: &AccountId,
        name: &Name,
        (image, limits, backend): (&Name, Limits, BackendKind),
        created_at: u64,
        policy: &Policy,
    ) -> Result<BoxRecord, StoreError> {
        self.insert(account, name, (image, limits, backend), created_at, None, policy)
    }

    /// Adds a box in state `creating` as a duplicate of `parent` (its policy
    /// too), on this node, if it fits (as [`Store::insert_new`]).
    pub fn insert_dup(&self, parent: &BoxRecord, name: &Name, created_at: u64) -> Result<BoxRecord, StoreError> {
        let policy = self.policy(&parent.id)?;
        let made = (&parent.image, parent.limits, parent.backend);
        self.insert(&parent.account, name, made, created_at, Some(parent), &policy)
    }

    /// A box's egress policy (none stored: reaches nothing).
    pub fn policy(&self, id: &BoxId) -> Result<Policy, StoreError> {
        let row = self.query_row("SELECT policy FROM policies WHERE box_id = ?1", &args![id.as_str()])?;
        match row.map(|r| r.get::<String>(0)).transpose()? {
            None => Ok(Policy::default()),
            Some(text) => serde_json::from_str(&text).map_err(|_| StoreError::Corrupt(id.to_string())),
        }
    }

    /// Sets a box's egress policy.
    pub fn set_policy(&self, id: &BoxId, policy: &Policy) -> Result<(), StoreError> {
        let text = serde_json::to_string(policy).map_err(|_| StoreError::Corrupt(id.to_string()))?;
        self.execute(SET_POLICY, &args![id.as_str(), text])?;
        Ok(())
    }

    /// When box `id` was made, to the millisecond where it is known (boxes
    /// made before it was kept: the start of their `created_at` second).
    pub fn created_ms(&self, id: &BoxId) -> Result<Option<u64>, StoreError> {
        let row = self.query_row("SELECT created_ms, created_at FROM boxes WHERE id = ?1", &args![id.as_str()])?;
        row.map(|r| Ok(r.get::<Option<u64>>(0)?.unwrap_or(r.get::<u64>(1)?.saturating_mul(1000)))).transpose()
    }

    fn insert(
        &self,
        account: &AccountId,
        name: &Name,
        (image, limits, backend): (&Name, Limits, BackendKind),
        created_at: u64,
        parent: Option<&BoxRecord>,
        policy: &Policy,
    ) -> Result<BoxRecord, StoreError> {
        let policy = serde_json::to_string(policy).map_err(|_| StoreError::Corrupt(name.to_string()))?;
        self.transaction(|tx| {
            if tx.engine() == Engine::Postgres {
                tx.execute("SELECT pg_advisory_xact_lock(?1)", &args![INSERT_LOCK])?;
            }
            refuse_taken(tx, account, name)?;
            self.refuse_over_cap(tx, account, limits.memory)?;
            if !self.node.is_empty() {
                nodes::check_room(tx, &self.node, &limits, crate::clock::now_ms())?;
            }
            let slot = self.free_slot(tx)?;
            let rec = BoxRecord {
                id: BoxId::random(),
                account: account.clone(),
                name: name.clone(),
                image: image.clone(),
                limits,
                backend,
                slot,
                state: BoxState::Creating,
                pid: None,
                created_at,
                parent: parent.map(|p| p.id.clone()),
                parent_name: parent.map(|p| p.name.clone()),
                idle: None,
                keep_running: false,
                state_since: created_at,
                node: self.node.clone(),
                epoch: 0,
            };
            tx.execute(
                "INSERT INTO boxes (id, account, name, image, cpus, memory, pids, slot, state, pid, created_at, disk, \
                 parent, state_since, backend, node, epoch, created_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?11, ?14, ?15, ?16, ?17)",
                &args![
                    rec.id.as_str(),
                    &account.0,
                    name.as_str(),
                    image.as_str(),
                    limits.cpus,
                    limits.memory,
                    limits.pids,
                    slot,
                    rec.state.as_str(),
                    None::<u32>,
                    created_at,
                    limits.disk,
                    rec.parent.as_ref().map(BoxId::as_str),
                    backend.as_str(),
                    &rec.node,
                    rec.epoch,
                    created_ms(created_at),
                ],
            )?;
            tx.execute(SET_POLICY, &args![rec.id.as_str(), policy])?;
            if let Some(parent) = parent {
                services::copy(tx, &parent.id, &rec.id)?;
            }
            Ok(rec)
        })
    }

    /// Gives box `id`, booted ahead of demand (still `creating`, under the
    /// warm account), to `account` as `name`, made at `created_at` with
    /// `policy`, and records it running as PID `pid`. One transaction.
    pub fn adopt(
        &self,
        id: &BoxId,
        account: &AccountId,
        name: &Name,
        created_at: u64,
        policy: &Policy,
        pid: Option<u32>,
    ) -> Result<BoxRecord, StoreError> {
        let policy_text = serde_json::to_string(policy).map_err(|_| StoreError::Corrupt(name.to_string()))?;
        self.transaction(|tx| {
            if tx.engine() == Engine::Postgres {
                tx.execute("SELECT pg_advisory_xact_lock(?1)", &args![INSERT_LOCK])?;
            }
            refuse_taken(tx, account, name)?;
            let memory = tx.query_row("SELECT memory FROM boxes WHERE id = ?1", &args![id.as_str()])?;
            let memory = memory.map(|r| r.get::<u64>(0)).transpose()?.unwrap_or(0);
            self.refuse_over_cap(tx, account, memory)?;
            let changed = tx.execute(
                "UPDATE boxes SET account = ?2, name = ?3, created_at = ?4, state_since = ?4, state = ?5, pid = ?6, \
                 created_ms = ?9 WHERE id = ?1 AND state = ?7 AND account = ?8",
                &args![
                    id.as_str(),
                    &account.0,
                    name.as_str(),
                    created_at,
                    BoxState::Running.as_str(),
                    pid,
                    BoxState::Creating.as_str(),
                    crate::ids::WARM_ACCOUNT,
                    created_ms(created_at)
                ],
            )?;
            if changed != 1 {
                return Err(StoreError::Corrupt(id.to_string()));
            }
            tx.execute(SET_POLICY, &args![id.as_str(), policy_text])?;
            Ok(())
        })?;
        self.get_by_id(id)?.ok_or_else(|| StoreError::Corrupt(id.to_string()))
    }

    /// The account's box called `name`.
    pub fn get(&self, account: &AccountId, name: &Name) -> Result<Option<BoxRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM {FROM} WHERE b.account = ?1 AND b.name = ?2");
        self.query_row(&sql, &args![&account.0, name.as_str()])?.map(|r| from_row(&r)).transpose()
    }

    /// The account's boxes, by name; every box when `account` is `None`.
    /// On every node of a fleet.
    pub fn list(&self, account: Option<&AccountId>) -> Result<Vec<BoxRecord>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {FROM} WHERE b.account = COALESCE(?1, b.account) ORDER BY b.name, b.account"
        );
        self.query(&sql, &args![account.map(|a| a.0.as_str())])?.iter().map(from_row).collect()
    }

    /// How many boxes `account` has, and the memory their limits add up to
    /// (what a `new` is checked against: counted, not listed, so a create
    /// does not read ten thousand rows).
    pub fn account_totals(&self, account: &AccountId) -> Result<(u64, u64), StoreError> {
        self.db.with(|tx| account_totals_in(tx, account))
    }

    /// Refuses a box of `memory` that would take `account` past the cap.
    fn refuse_over_cap(&self, tx: &mut dyn Exec, account: &AccountId, memory: u64) -> Result<(), StoreError> {
        // Boxes booted ahead are the operator's (`--warm-boxes`): counted
        // when one is given to an account.
        let Some(cap) = self.account_cap.filter(|_| account.0 != crate::ids::WARM_ACCOUNT) else { return Ok(()) };
        let (boxes, held) = account_totals_in(tx, account)?;
        if boxes >= cap.boxes {
            return Err(StoreError::AccountBoxes(boxes));
        }
        let asked = held.saturating_add(memory);
        if asked > cap.memory {
            return Err(StoreError::AccountMemory { asked, max: cap.memory });
        }
        Ok(())
    }

    /// Every account's boxes on this node (all of them on a single host), by name.
    pub fn list_here(&self) -> Result<Vec<BoxRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM {FROM} WHERE b.node = ?1 ORDER BY b.name, b.account");
        self.query(&sql, &args![&self.node])?.iter().map(from_row).collect()
    }

    /// Records a state change, with the PID 1 of a running box.
    pub fn set_state(&self, id: &BoxId, state: BoxState, pid: Option<u32>) -> Result<(), StoreError> {
        self.db.with(|c| set_state_in(c, id, state, pid))
    }

    /// Sets a box's idle grace (`None`: the daemon's default).
    pub fn set_idle(&self, id: &BoxId, idle: Option<u32>) -> Result<(), StoreError> {
        self.execute("UPDATE boxes SET idle = ?2 WHERE id = ?1", &args![id.as_str(), idle])?;
        Ok(())
    }

    /// Exempts a box from suspension, or not.
    pub fn set_keep_running(&self, id: &BoxId, on: bool) -> Result<(), StoreError> {
        self.execute("UPDATE boxes SET keep_running = ?2 WHERE id = ?1", &args![id.as_str(), on])?;
        Ok(())
    }

    /// The box with host id `id`.
    pub fn get_by_id(&self, id: &BoxId) -> Result<Option<BoxRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM {FROM} WHERE b.id = ?1");
        self.query_row(&sql, &args![id.as_str()])?.map(|r| from_row(&r)).transpose()
    }

    /// Promotes `child` over `parent`: in one transaction, the parent takes the
    /// name `parent_new_name` and the child takes the parent's name.
    pub fn promote(&self, child: &BoxRecord, parent: &BoxRecord, parent_new_name: &Name) -> Result<(), StoreError> {
        self.transaction(|tx| {
            refuse_taken(tx, &parent.account, parent_new_name)?;
            let rename = "UPDATE boxes SET name = ?2 WHERE id = ?1";
            tx.execute(rename, &args![parent.id.as_str(), parent_new_name.as_str()])?;
            tx.execute(rename, &args![child.id.as_str(), parent.name.as_str()])?;
            tx.execute(RETIRE_NAME, &args![&child.account.0, child.name.as_str()])?;
            Ok(())
        })
    }

    /// Notes that the account's box `name` is gone.
    pub fn retire_name(&self, account: &AccountId, name: &Name) -> Result<(), StoreError> {
        self.execute(RETIRE_NAME, &args![&account.0, name.as_str()])?;
        Ok(())
    }

    /// What a login under `name` asks of the store, in one query: the
    /// account's boxes (name, node) and whether `name` is a retired one.
    pub fn login_names(&self, account: &AccountId, name: &Name) -> Result<(Vec<(Name, String)>, bool), StoreError> {
        let sql = "SELECT name, node, 'box' FROM boxes WHERE account = ?1 \
                   UNION ALL SELECT name, '', 'retired' FROM retired_names WHERE account = ?1 AND name = ?2";
        let (mut boxes, mut retired) = (Vec::new(), false);
        for row in self.query(sql, &args![&account.0, name.as_str()])? {
            if row.get::<String>(2)? == "retired" {
                retired = true;
                continue;
            }
            let found = row.get::<String>(0)?;
            let found = Name::new(&found).map_err(|_| StoreError::Corrupt(found))?;
            boxes.push((found, row.get::<String>(1)?));
        }
        Ok((boxes, retired))
    }

    /// Whether the account's box `name` once existed (it may exist again).
    pub fn is_retired(&self, account: &AccountId, name: &Name) -> Result<bool, StoreError> {
        let sql = "SELECT 1 FROM retired_names WHERE account = ?1 AND name = ?2";
        Ok(self.query_row(sql, &args![&account.0, name.as_str()])?.is_some())
    }

    /// Forgets a box.
    pub fn delete(&self, id: &BoxId) -> Result<(), StoreError> {
        let id_of = id.clone();
        let id = args![id.as_str()];
        self.transaction(|tx| {
            tx.execute("DELETE FROM boxes WHERE id = ?1", &id)?;
            tx.execute("DELETE FROM policies WHERE box_id = ?1", &id)?;
            tx.execute("DELETE FROM secret_grants WHERE box_id = ?1", &id)?;
            tx.execute("DELETE FROM secret_limits WHERE box_id = ?1", &id)?;
            tx.execute("DELETE FROM box_moves WHERE box_id = ?1", &id)?;
            web::forget(tx, &id_of)?;
            services::forget(tx, &id_of)?;
            Ok(())
        })
    }
}

/// Sets a box's policy, whether or not it had one.
const SET_POLICY: &str = "INSERT INTO policies (box_id, policy) VALUES (?1, ?2) \
                          ON CONFLICT (box_id) DO UPDATE SET policy = excluded.policy";

/// Notes a name an account's box no longer has.
const RETIRE_NAME: &str = "INSERT INTO retired_names (account, name) VALUES (?1, ?2) ON CONFLICT DO NOTHING";

/// Refuses `name` if `account` has a box by it already.
fn refuse_taken(tx: &mut dyn Exec, account: &AccountId, name: &Name) -> Result<(), StoreError> {
    let sql = "SELECT 1 FROM boxes WHERE account = ?1 AND name = ?2";
    if tx.query_row(sql, &args![&account.0, name.as_str()])?.is_some() {
        return Err(StoreError::NameTaken(name.clone()));
    }
    Ok(())
}

fn from_row(r: &Row) -> Result<BoxRecord, StoreError> {
    let id: String = r.get(0)?;
    let corrupt = || StoreError::Corrupt(id.clone());
    Ok(BoxRecord {
        id: BoxId::parse(&id).ok_or_else(corrupt)?,
        account: AccountId(r.get(1)?),
        name: Name::new(&r.get::<String>(2)?).map_err(|_| corrupt())?,
        image: Name::new(&r.get::<String>(3)?).map_err(|_| corrupt())?,
        limits: Limits { cpus: r.get(4)?, memory: r.get(5)?, pids: r.get(6)?, disk: r.get(11)? },
        slot: r.get(7)?,
        state: BoxState::parse(&r.get::<String>(8)?).ok_or_else(corrupt)?,
        pid: r.get(9)?,
        created_at: r.get(10)?,
        parent: match r.get::<Option<String>>(12)? {
            Some(p) => Some(BoxId::parse(&p).ok_or_else(corrupt)?),
            None => None,
        },
        parent_name: r.get::<Option<String>>(13)?.and_then(|n| Name::new(&n).ok()),
        idle: r.get(14)?,
        keep_running: r.get(15)?,
        state_since: r.get(16)?,
        backend: BackendKind::parse(&r.get::<String>(17)?).ok_or_else(corrupt)?,
        node: r.get(18)?,
        epoch: r.get(19)?,
    })
}

#[cfg(test)]
mod tests {
    use super::testing::{on_both_engines, TestDb};
    use super::*;

    on_both_engines!(
        insert_get_list_delete_survive_reopen,
        dup_records_lineage_and_promote_swaps_names,
        slots_come_from_the_servers_blocks_only,
        freed_slots_are_reused_lowest_first,
        a_box_made_now_is_known_to_the_millisecond,
        an_accounts_cap_holds_where_boxes_are_added_but_not_for_warm_ones,
    );

    /// The cap counts an account's boxes and memory as each is added; boxes
    /// booted ahead (the warm account's) are not held to it.
    fn an_accounts_cap_holds_where_boxes_are_added_but_not_for_warm_ones(db: &TestDb) {
        let store = db.open().capped(AccountCap { boxes: 2, memory: 3 << 30 });
        let spec = (&names("debian"), Limits::default(), BackendKind::Ns);
        let (alice, warm) = (AccountId("a".into()), AccountId(crate::ids::WARM_ACCOUNT.into()));
        let add =
            |account: &AccountId, name: &str| store.insert_new(account, &names(name), spec, 1, &Policy::default());
        add(&alice, "one").unwrap();
        assert!(matches!(add(&alice, "two"), Err(StoreError::AccountMemory { .. })), "4G of limits under a 3G cap");
        for n in ["w1", "w2", "w3"] {
            add(&warm, n).unwrap();
        }
        let small = (&names("debian"), Limits { memory: 1 << 30, ..Limits::default() }, BackendKind::Ns);
        store.insert_new(&alice, &names("two"), small, 1, &Policy::default()).unwrap();
        assert!(matches!(
            store.insert_new(&alice, &names("three"), small, 1, &Policy::default()),
            Err(StoreError::AccountBoxes(2))
        ));
    }

    /// A box made now knows its millisecond (a copy's split from its
    /// parent); one made at another second, that second's start.
    fn a_box_made_now_is_known_to_the_millisecond(db: &TestDb) {
        let store = db.open();
        let made = |name: &str, at: u64| {
            let spec = (&names("debian"), Limits::default(), BackendKind::Ns);
            store.insert_new(&AccountId("a".into()), &names(name), spec, at, &Policy::default()).unwrap()
        };
        let before = crate::clock::now_ms();
        let now = made("now", crate::clock::now());
        let after = crate::clock::now_ms();
        let ms = store.created_ms(&now.id).unwrap().unwrap();
        assert!(ms >= before.min(now.created_at * 1000) && ms <= after, "{before} <= {ms} <= {after}");
        assert_eq!(ms / 1000, now.created_at, "within its second");
        let old = made("old", 5);
        assert_eq!(store.created_ms(&old.id).unwrap(), Some(5000));
        let copy = store.insert_dup(&now, &names("copy"), crate::clock::now()).unwrap();
        assert!(store.created_ms(&copy.id).unwrap().unwrap() >= ms);
        assert_eq!(store.created_ms(&BoxId::random()).unwrap(), None);
    }

    fn names(s: &str) -> Name {
        Name::new(s).unwrap()
    }

    fn insert_get_list_delete_survive_reopen(db: &TestDb) {
        let alice = AccountId("SHA256:alice".into());
        let bob = AccountId("SHA256:bob".into());
        let web = {
            let store = db.open();
            let web = store
                .insert_new(
                    &alice,
                    &names("web"),
                    (&names("debian"), Limits::default(), BackendKind::Ns),
                    1,
                    &Policy::default(),
                )
                .unwrap();
            let db = store
                .insert_new(
                    &alice,
                    &names("db"),
                    (&names("debian"), Limits::default(), BackendKind::Ns),
                    2,
                    &Policy::default(),
                )
                .unwrap();
            assert_ne!(web.slot, db.slot);
            // Names are per account.
            store
                .insert_new(
                    &bob,
                    &names("web"),
                    (&names("busybox"), Limits::default(), BackendKind::Ns),
                    3,
                    &Policy::default(),
                )
                .unwrap();
            assert!(matches!(
                store.insert_new(
                    &alice,
                    &names("web"),
                    (&names("debian"), Limits::default(), BackendKind::Ns),
                    4,
                    &Policy::default()
                ),
                Err(StoreError::NameTaken(_))
            ));
            store.set_state(&web.id, BoxState::Running, Some(42)).unwrap();
            web
        };
        let store = db.open();
        let got = store.get(&alice, &names("web")).unwrap().unwrap();
        assert_eq!((got.id, got.state, got.pid), (web.id.clone(), BoxState::Running, Some(42)));
        assert_eq!(store.list(Some(&alice)).unwrap().len(), 2);
        assert_eq!(store.list(None).unwrap().len(), 3);
        let memory = Limits::default().memory;
        assert_eq!(store.account_totals(&alice).unwrap(), (2, 2 * memory));
        store.delete(&web.id).unwrap();
        assert!(store.get(&alice, &names("web")).unwrap().is_none());
        assert_eq!(store.account_totals(&alice).unwrap(), (1, memory));
        assert_eq!(store.account_totals(&AccountId("SHA256:carol".into())).unwrap(), (0, 0));
    }

    fn dup_records_lineage_and_promote_swaps_names(db: &TestDb) {
        let store = db.open();
        let a = AccountId("a".into());
        let web = store
            .insert_new(
                &a,
                &names("web"),
                (&names("debian"), Limits::default(), BackendKind::Ns),
                1,
                &Policy::default(),
            )
            .unwrap();
        let try_ = store.insert_dup(&web, &names("web-try"), 2).unwrap();
        let got = store.get(&a, &names("web-try")).unwrap().unwrap();
        assert_eq!(got.parent, Some(web.id.clone()));
        assert_eq!(got.parent_name, Some(names("web")));
        store.promote(&try_, &web, &names("web-prev")).unwrap();
        assert_eq!(store.get(&a, &names("web")).unwrap().unwrap().id, try_.id);
        let prev = store.get(&a, &names("web-prev")).unwrap().unwrap();
        assert_eq!(prev.id, web.id);
        assert_eq!(store.get(&a, &names("web")).unwrap().unwrap().parent_name, Some(names("web-prev")));
        assert!(store.is_retired(&a, &names("web-try")).unwrap(), "the promoted child's old name is retired");
        assert!(!store.is_retired(&AccountId("b".into()), &names("web-try")).unwrap(), "per account");
        // What a login asks, in one query: the boxes and their node, and the name's past.
        let (mut boxes, retired) = store.login_names(&a, &names("web-try")).unwrap();
        boxes.sort();
        assert_eq!(boxes, [(names("web"), String::new()), (names("web-prev"), String::new())]);
        assert!(retired);
        assert!(!store.login_names(&a, &names("web")).unwrap().1);
        assert_eq!(store.login_names(&AccountId("b".into()), &names("web-try")).unwrap(), (Vec::new(), false));
        // A second promote onto an existing name is refused and changes nothing.
        let other = store.insert_dup(&prev, &names("other"), 3).unwrap();
        assert!(matches!(store.promote(&other, &prev, &names("web")), Err(StoreError::NameTaken(_))));
        assert_eq!(store.get(&a, &names("web-prev")).unwrap().unwrap().id, web.id);
    }

    fn slots_come_from_the_servers_blocks_only(db: &TestDb) {
        let mut store = db.open();
        store.use_slot_blocks(&[3], &[], None).unwrap();
        let a = AccountId("a".into());
        let new = |store: &Store, name: &str| {
            store.insert_new(
                &a,
                &names(name),
                (&names("debian"), Limits::default(), BackendKind::Ns),
                1,
                &Policy::default(),
            )
        };
        let (first, second) = (new(&store, "one").unwrap(), new(&store, "two").unwrap());
        assert_eq!((first.slot, second.slot), (3 * SLOTS_PER_BLOCK, 3 * SLOTS_PER_BLOCK + 1));
        assert_eq!(store.slot_blocks_in_use().unwrap(), [3]);
        // Moved to another block, boxes keep their places in it.
        store.use_slot_blocks(&[5], &[(3, 5)], None).unwrap();
        let moved = store.get(&a, &names("two")).unwrap().unwrap();
        assert_eq!(moved.slot, 5 * SLOTS_PER_BLOCK + 1);
        // A full block: the next box is refused without a source of more,
        // and takes the first slot of the block it gives when there is one.
        // Boxes in every slot of `block` but its first two, named PREFIXi.
        let fill = |store: &Store, prefix: &str, block: u32| {
            store
                .execute(
                    "WITH RECURSIVE n(i) AS (SELECT 2 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?1) \
                     INSERT INTO boxes (id, account, name, image, cpus, memory, pids, slot, state, created_at) \
                     SELECT ?3 || i, 'filler', ?3 || i, 'busybox', 1, 1, 1, ?2 + i, 'stopped', 0 FROM n",
                    &args![SLOTS_PER_BLOCK, block * SLOTS_PER_BLOCK, prefix],
                )
                .unwrap();
        };
        fill(&store, "f", 5);
        assert!(matches!(new(&store, "full"), Err(StoreError::NoSlot)));
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let more: MoreSlots = Box::new({
            let asked = std::sync::Arc::clone(&asked);
            move || Ok(8 + asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
        });
        store.use_slot_blocks(&[5], &[], Some(more)).unwrap();
        assert_eq!(new(&store, "full").unwrap().slot, 8 * SLOTS_PER_BLOCK);
        assert_eq!(new(&store, "next").unwrap().slot, 8 * SLOTS_PER_BLOCK + 1, "one block asked for, and kept");
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(store.slot_blocks_in_use().unwrap(), [5, 8]);
        // A slot freed in the first block is the next one given.
        store.execute("DELETE FROM boxes WHERE name = 'f100'", &[]).unwrap();
        assert_eq!(new(&store, "gap").unwrap().slot, 5 * SLOTS_PER_BLOCK + 100);
        // A registry with nothing to give: refused.
        store.use_slot_blocks(&[5, 8], &[], Some(Box::new(|| Err("none free".into())))).unwrap();
        fill(&store, "g", 8);
        assert!(matches!(new(&store, "none"), Err(StoreError::NoSlot)));
    }

    #[test]
    fn old_databases_gain_new_columns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(schema::BOXES).unwrap();
        conn.execute(
            "INSERT INTO boxes (id, account, name, image, cpus, memory, pids, slot, state, pid, created_at) \
             VALUES ('00ff', 'a', 'old', 'debian', 1, 1073741824, 100, 0, 'stopped', NULL, 5)",
            [],
        )
        .unwrap();
        drop(conn);
        let store = Store::open(&path).unwrap();
        let old = store.get(&AccountId("a".into()), &names("old")).unwrap().unwrap();
        assert_eq!(old.limits.disk, 16 << 30);
        assert_eq!(old.parent, None);
    }

    fn freed_slots_are_reused_lowest_first(db: &TestDb) {
        let store = db.open();
        let a = AccountId("a".into());
        let b0 = store
            .insert_new(&a, &names("b0"), (&names("i"), Limits::default(), BackendKind::Ns), 0, &Policy::default())
            .unwrap();
        let b1 = store
            .insert_new(&a, &names("b1"), (&names("i"), Limits::default(), BackendKind::Ns), 0, &Policy::default())
            .unwrap();
        assert_eq!((b0.slot, b1.slot), (0, 1));
        store.delete(&b0.id).unwrap();
        let b2 = store
            .insert_new(&a, &names("b2"), (&names("i"), Limits::default(), BackendKind::Ns), 0, &Policy::default())
            .unwrap();
        assert_eq!(b2.slot, 0);
    }
}
