//! A fleet's nodes in the store: what each offers (renewed with its lease),
//! what its boxes use, and the placement check a new box passes on its way
//! in, in the same transaction as its row, so that nodes adding boxes at
//! once never overfill one.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::sql::{args, Exec, Row};
use super::{Store, StoreError};
use crate::ids::AccountId;
use crate::limits::Limits;

/// How long a renewed lease lasts: a node that has not renewed for this long
/// is taken for lost.
pub const LEASE_MS: u64 = 10_000;

/// What a node offers the fleet; renewed with its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeOffer {
    /// Its name, unique in the fleet.
    pub name: String,
    /// Where it answers the core API (`HOST:PORT`).
    pub address: String,
    /// CPUs its boxes may be given, in all.
    pub cpus: u32,
    /// Memory its boxes may be given, in all, in bytes.
    pub memory: u64,
    /// Disk its pool offers, in bytes.
    pub disk: u64,
    /// Most boxes it holds.
    pub max_boxes: u32,
}

/// A node as the store knows it, with what its boxes use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRow {
    /// What it offers.
    pub offer: NodeOffer,
    /// Takes no new boxes (its boxes stay).
    pub cordoned: bool,
    /// Its lease is live until then, milliseconds since the epoch.
    pub lease_until_ms: u64,
    /// When it last renewed its lease.
    pub renewed_at_ms: u64,
    /// Boxes on it, in any state.
    pub boxes: u32,
    /// CPUs given to its boxes, in all.
    pub cpus_used: u64,
    /// Memory given to its boxes, in all, in bytes.
    pub memory_used: u64,
    /// Its boxes waiting for an upload to the object store, as it last said.
    pub upload_backlog: u32,
    /// Its boxes moving to another node.
    pub moving: u32,
}

impl NodeRow {
    /// Whether its lease is live at `now_ms`.
    pub fn is_live(&self, now_ms: u64) -> bool {
        now_ms < self.lease_until_ms
    }

    /// Counts a box with `limits` as one of its own.
    pub(crate) fn add(&mut self, limits: &Limits) {
        self.boxes += 1;
        self.memory_used += limits.memory;
        self.cpus_used += u64::from(limits.cpus);
    }

    /// Whether a box with `limits` fits, and if not, what it lacks.
    pub(crate) fn room_for(&self, limits: &Limits) -> Result<(), Resource> {
        if self.boxes >= self.offer.max_boxes {
            return Err(Resource::Boxes);
        }
        if self.memory_used + limits.memory > self.offer.memory {
            return Err(Resource::Memory);
        }
        if self.cpus_used + u64::from(limits.cpus) > u64::from(self.offer.cpus) {
            return Err(Resource::Cpus);
        }
        Ok(())
    }
}

/// What a full node lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resource {
    /// It holds as many boxes as it takes.
    Boxes,
    /// Its boxes have all its memory.
    Memory,
    /// Its boxes have all its CPUs.
    Cpus,
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Boxes => "no room for another box",
            Self::Memory => "not enough memory left",
            Self::Cpus => "not enough CPUs left",
        })
    }
}

/// Each node with what its boxes use.
const NODES: &str = "SELECT n.name, n.address, n.cpus, n.memory, n.disk, n.max_boxes, n.cordoned, \
                     n.lease_until_ms, n.renewed_at_ms, COUNT(b.id), \
                     CAST(COALESCE(SUM(b.cpus), 0) AS BIGINT), CAST(COALESCE(SUM(b.memory), 0) AS BIGINT), \
                     n.upload_backlog, \
                     (SELECT CAST(COUNT(*) AS BIGINT) FROM box_moves m WHERE m.from_node = n.name) \
                     FROM nodes n LEFT JOIN boxes b ON b.node = n.name";

const GROUPED: &str = "GROUP BY n.name, n.address, n.cpus, n.memory, n.disk, n.max_boxes, n.cordoned, \
                       n.lease_until_ms, n.renewed_at_ms, n.upload_backlog ORDER BY n.name";

impl Store {
    /// Records what this node offers and renews its lease for [`LEASE_MS`]
    /// (adding the node if it is new; a cordon stays as it was).
    pub fn renew_lease(&self, offer: &NodeOffer) -> Result<(), StoreError> {
        self.transaction(|tx| {
            // Never while its boxes are being taken elsewhere (see `moves`).
            super::moves::lock_node(tx, &offer.name)?;
            let now = crate::clock::now_ms();
            tx.execute(
                "INSERT INTO nodes (name, address, cpus, memory, disk, max_boxes, lease_until_ms, renewed_at_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT (name) DO UPDATE SET \
                 address = excluded.address, cpus = excluded.cpus, memory = excluded.memory, disk = excluded.disk, \
                 max_boxes = excluded.max_boxes, lease_until_ms = excluded.lease_until_ms, \
                 renewed_at_ms = excluded.renewed_at_ms",
                &args![
                    &offer.name,
                    &offer.address,
                    offer.cpus,
                    offer.memory,
                    offer.disk,
                    offer.max_boxes,
                    now + LEASE_MS,
                    now
                ],
            )?;
            Ok(())
        })
    }

    /// Every node, by name, with what its boxes use.
    pub fn nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        self.query(&format!("{NODES} {GROUPED}"), &[])?.iter().map(node_from_row).collect()
    }

    /// Node `name`, with what its boxes use.
    pub fn node(&self, name: &str) -> Result<Option<NodeRow>, StoreError> {
        self.db.with(|c| node(c, name))
    }

    /// Notes how many of node `name`'s boxes wait for an upload.
    pub fn set_upload_backlog(&self, name: &str, backlog: u32) -> Result<(), StoreError> {
        self.execute("UPDATE nodes SET upload_backlog = ?2 WHERE name = ?1", &args![name, backlog])?;
        Ok(())
    }

    /// Cordons node `name` (it takes no new boxes) or lifts its cordon; false
    /// if there is no such node.
    pub fn set_cordoned(&self, name: &str, cordoned: bool) -> Result<bool, StoreError> {
        Ok(self.execute("UPDATE nodes SET cordoned = ?2 WHERE name = ?1", &args![name, cordoned])? == 1)
    }
}

/// Every node (inside a transaction).
pub(crate) fn all_nodes(tx: &mut dyn Exec) -> Result<Vec<NodeRow>, StoreError> {
    tx.query(&format!("{NODES} {GROUPED}"), &[])?.iter().map(node_from_row).collect()
}

fn node(tx: &mut dyn Exec, name: &str) -> Result<Option<NodeRow>, StoreError> {
    let row = tx.query_row(&format!("{NODES} WHERE n.name = ?1 {GROUPED}"), &args![name])?;
    row.as_ref().map(node_from_row).transpose()
}

/// Refuses a box with `limits` on `node` unless the node is live at `now_ms`,
/// not cordoned, and has room. Inside the insert's transaction, under the
/// insert lock (PostgreSQL), so what it counts stays true until the commit.
pub(crate) fn check_room(tx: &mut dyn Exec, name: &str, limits: &Limits, now_ms: u64) -> Result<(), StoreError> {
    let unavailable = || StoreError::NodeUnavailable(name.to_owned());
    let here = node(tx, name)?.ok_or_else(unavailable)?;
    if here.cordoned || !here.is_live(now_ms) {
        return Err(unavailable());
    }
    here.room_for(limits).map_err(|what| StoreError::NodeFull { node: name.to_owned(), what })
}

fn node_from_row(r: &Row) -> Result<NodeRow, StoreError> {
    Ok(NodeRow {
        offer: NodeOffer {
            name: r.get(0)?,
            address: r.get(1)?,
            cpus: r.get(2)?,
            memory: r.get(3)?,
            disk: r.get(4)?,
            max_boxes: r.get(5)?,
        },
        cordoned: r.get(6)?,
        lease_until_ms: r.get(7)?,
        renewed_at_ms: r.get(8)?,
        boxes: r.get(9)?,
        cpus_used: r.get(10)?,
        memory_used: r.get(11)?,
        upload_backlog: r.get(12)?,
        moving: r.get(13)?,
    })
}

/// Each node's measure of each account's disk use (schema 14), for budgets
/// counted across the fleet.
pub(crate) const ACCOUNT_DISK: &str = "
CREATE TABLE IF NOT EXISTS account_disk (
    node     TEXT NOT NULL,
    account  TEXT NOT NULL,
    bytes    INTEGER NOT NULL,
    at_ms    INTEGER NOT NULL,
    PRIMARY KEY (node, account)
);
";

/// How old a node's measure may be and still count: a node away longer has
/// had its boxes re-homed, and they are counted where they went.
pub const ACCOUNT_DISK_FRESH_MS: u64 = 10 * 60 * 1000;

impl Store {
    /// Replaces node `node`'s measures of its accounts' disk use, as of `at_ms`.
    pub fn set_account_disk(&self, node: &str, usage: &[(AccountId, u64)], at_ms: u64) -> Result<(), StoreError> {
        self.transaction(|tx| {
            tx.execute("DELETE FROM account_disk WHERE node = ?1", &args![node])?;
            for (account, bytes) in usage {
                tx.execute(
                    "INSERT INTO account_disk (node, account, bytes, at_ms) VALUES (?1, ?2, ?3, ?4)",
                    &args![node, &account.0, *bytes, at_ms],
                )?;
            }
            Ok(())
        })
    }

    /// What `account` uses on the fleet's nodes other than `node`, as they
    /// last said (measures older than [`ACCOUNT_DISK_FRESH_MS`] left out).
    pub fn account_disk_elsewhere(&self, node: &str, account: &AccountId, now_ms: u64) -> Result<u64, StoreError> {
        let row = self.query_row(
            "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM account_disk WHERE account = ?1 AND node <> ?2 AND at_ms >= ?3",
            &args![&account.0, node, now_ms.saturating_sub(ACCOUNT_DISK_FRESH_MS)],
        )?;
        Ok(row.map(|r| r.get::<i64>(0)).transpose()?.map_or(0, |n| u64::try_from(n).unwrap_or(0)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::{Arc, Barrier};

    use super::*;
    use crate::backend::BackendKind;
    use crate::ids::{AccountId, Name};
    use crate::policy::Policy;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(
        placement_checks_lease_cordon_and_room,
        boxes_are_on_their_node_with_slots_of_its_own,
        an_accounts_disk_elsewhere_is_the_other_nodes_fresh_measures
    );

    fn an_accounts_disk_elsewhere_is_the_other_nodes_fresh_measures(db: &TestDb) {
        let store = db.open();
        let (a, b) = (AccountId("SHA256:a".into()), AccountId("SHA256:b".into()));
        let now = 100 * ACCOUNT_DISK_FRESH_MS;
        store.set_account_disk("n1", &[(a.clone(), 100), (b.clone(), 7)], now).unwrap();
        store.set_account_disk("n2", &[(a.clone(), 20)], now).unwrap();
        store.set_account_disk("n3", &[(a.clone(), 3)], now - ACCOUNT_DISK_FRESH_MS - 1).unwrap();
        assert_eq!(store.account_disk_elsewhere("n1", &a, now).unwrap(), 20, "n3's is stale, n1's is its own");
        assert_eq!(store.account_disk_elsewhere("n2", &a, now).unwrap(), 100);
        assert_eq!(store.account_disk_elsewhere("", &a, now).unwrap(), 120);
        assert_eq!(store.account_disk_elsewhere("n1", &b, now).unwrap(), 0);
        // A node's next measure replaces all of its last (an account gone from it included).
        store.set_account_disk("n2", &[(b.clone(), 5)], now).unwrap();
        assert_eq!(store.account_disk_elsewhere("n1", &a, now).unwrap(), 0);
        assert_eq!(store.account_disk_elsewhere("n1", &b, now).unwrap(), 5);
    }

    const GIB: u64 = 1 << 30;

    pub(crate) fn offer(name: &str, max_boxes: u32) -> NodeOffer {
        NodeOffer {
            name: name.into(),
            address: "127.0.0.2:7000".into(),
            cpus: 8,
            memory: 8 * GIB,
            disk: 100 * GIB,
            max_boxes,
        }
    }

    fn new_box(store: &Store, name: &str, limits: Limits) -> Result<crate::record::BoxRecord, StoreError> {
        let image = Name::new("debian").unwrap();
        let made = (&image, limits, BackendKind::Ns);
        store.insert_new(&AccountId("a".into()), &Name::new(name).unwrap(), made, 1, &Policy::default())
    }

    fn small() -> Limits {
        Limits { cpus: 1, memory: GIB, ..Limits::default() }
    }

    fn placement_checks_lease_cordon_and_room(db: &TestDb) {
        let n1 = db.open().for_node("n1");
        let unavailable = |r: Result<_, StoreError>| matches!(r, Err(StoreError::NodeUnavailable(n)) if n == "n1");
        assert!(unavailable(new_box(&n1, "early", small())), "a node with no lease yet");
        n1.renew_lease(&offer("n1", 3)).unwrap();
        new_box(&n1, "one", small()).unwrap();

        assert!(n1.set_cordoned("n1", true).unwrap());
        assert!(!n1.set_cordoned("nope", true).unwrap());
        assert!(unavailable(new_box(&n1, "two", small())), "cordoned");
        n1.renew_lease(&offer("n1", 3)).unwrap();
        assert!(n1.node("n1").unwrap().unwrap().cordoned, "a renewal keeps the cordon");
        n1.set_cordoned("n1", false).unwrap();

        n1.execute("UPDATE nodes SET lease_until_ms = ?1", &args![crate::clock::now_ms() - 1]).unwrap();
        assert!(unavailable(new_box(&n1, "two", small())), "the lease lapsed");
        n1.renew_lease(&offer("n1", 3)).unwrap();

        let full = |r: Result<_, StoreError>, what| matches!(r, Err(StoreError::NodeFull { node, what: w }) if node == "n1" && w == what);
        let big = Limits { memory: 7 * GIB + 1, ..small() };
        assert!(full(new_box(&n1, "two", big), Resource::Memory));
        assert!(full(new_box(&n1, "two", Limits { cpus: 8, ..small() }), Resource::Cpus));
        new_box(&n1, "two", Limits { cpus: 7, ..small() }).unwrap();
        new_box(&n1, "three", Limits { cpus: 0, ..small() }).unwrap();
        assert!(full(new_box(&n1, "four", Limits { cpus: 0, memory: 0, ..small() }), Resource::Boxes));
        let err = new_box(&n1, "four", small()).unwrap_err().to_string();
        assert_eq!(err, "node n1 is full (no room for another box)");

        let row = n1.node("n1").unwrap().unwrap();
        assert_eq!((row.boxes, row.cpus_used, row.memory_used), (3, 8, 3 * GIB));
        assert!(row.is_live(crate::clock::now_ms()) && !row.is_live(row.lease_until_ms));
        assert_eq!(row.lease_until_ms - row.renewed_at_ms, LEASE_MS);
        // dup stays on its source's node, and fits or fails as a new box does.
        let one = n1.get(&AccountId("a".into()), &Name::new("one").unwrap()).unwrap().unwrap();
        assert!(full(n1.insert_dup(&one, &Name::new("one-try").unwrap(), 2), Resource::Boxes));
        assert!(n1.node("nope").unwrap().is_none());
    }

    fn boxes_are_on_their_node_with_slots_of_its_own(db: &TestDb) {
        let single = db.open();
        let here = new_box(&single, "local", small()).unwrap();
        assert_eq!((here.node.as_str(), here.epoch), ("", 0));
        if let TestDb::Sqlite(_) = db {
            return; // one node only: its slots are unique table-wide
        }
        let (n1, n2) = (db.open().for_node("n1"), db.open().for_node("n2"));
        n1.renew_lease(&offer("n1", 5)).unwrap();
        n2.renew_lease(&offer("n2", 5)).unwrap();
        let a = new_box(&n1, "a1", small()).unwrap();
        let b = new_box(&n2, "b1", small()).unwrap();
        assert_eq!((a.slot, b.slot, a.node.as_str(), b.node.as_str()), (0, 0, "n1", "n2"), "slots are per node");
        let got = n2.get(&AccountId("a".into()), &Name::new("a1").unwrap()).unwrap().unwrap();
        assert_eq!(got.node, "n1");
        let names =
            |list: Vec<crate::record::BoxRecord>| list.into_iter().map(|b| b.name.to_string()).collect::<Vec<_>>();
        assert_eq!(names(n1.list(None).unwrap()), ["a1", "b1", "local"], "list: every node's boxes");
        assert_eq!(names(n1.list_here().unwrap()), ["a1"]);
        assert_eq!(names(single.list_here().unwrap()), ["local"]);
        let nodes = n1.nodes().unwrap();
        assert_eq!(nodes.iter().map(|n| (n.offer.name.as_str(), n.boxes)).collect::<Vec<_>>(), [("n1", 1), ("n2", 1)]);
        assert_eq!(nodes[0].offer, offer("n1", 5));
    }

    /// 50 `new`s on a node that takes 20, each on its own connection, at once.
    #[test]
    fn concurrent_inserts_never_overfill_a_node() {
        let db = TestDb::postgres();
        db.open().for_node("n1").renew_lease(&NodeOffer { cpus: 100, memory: 100 * GIB, ..offer("n1", 20) }).unwrap();
        let stores: Vec<Store> = (0..50).map(|_| db.open().for_node("n1")).collect();
        let start = Arc::new(Barrier::new(stores.len()));
        let threads: Vec<_> = stores
            .into_iter()
            .enumerate()
            .map(|(i, store)| {
                let start = Arc::clone(&start);
                std::thread::spawn(move || {
                    start.wait();
                    new_box(&store, &format!("b{i}"), small())
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let placed = results.iter().filter(|r| r.is_ok()).count();
        let refused =
            results.iter().filter(|r| matches!(r, Err(StoreError::NodeFull { what: Resource::Boxes, .. }))).count();
        assert_eq!((placed, refused), (20, 30), "{:?}", results.iter().find(|r| r.is_err()));
        let mut slots: Vec<u32> = results.iter().flatten().map(|b| b.slot).collect();
        slots.sort_unstable();
        assert_eq!(slots, (0..20).collect::<Vec<_>>(), "each its own slot");
        assert_eq!(db.open().node("n1").unwrap().unwrap().boxes, 20);
    }
}
