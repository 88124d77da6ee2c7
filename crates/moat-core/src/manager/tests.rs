//! The manager's rules over an in-memory backend: what is left after each
//! kind of failure, promote's all-or-nothing, locks, and restart recovery.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::backend::{AgentAddr, BoxHandle, ChangeSink, Copied, MeterReading, Progress};

/// A backend that keeps boxes as entries in a map, and fails the operations
/// it is told to.
#[derive(Default)]
struct MemBackend {
    state: Mutex<Mem>,
}

#[derive(Default)]
struct Mem {
    /// Box id -> host name written in its files.
    files: HashMap<String, String>,
    running: HashSet<String>,
    frozen: HashSet<String>,
    /// Operations that fail ("start", "dup", "rename:<name>", ...).
    fail: HashSet<String>,
    next_pid: u32,
    /// Box id -> its /etc/environment.
    env: HashMap<String, HashMap<String, String>>,
    /// Box id -> its checkpoints.
    checkpoints: HashMap<String, Vec<Saved>>,
    /// Whether `dup` copies a running source's whole machine (as the VM
    /// backend does), not its files alone.
    copies_machines: bool,
}

/// A checkpoint: (label, host name in its files, environment).
type Saved = (String, String, HashMap<String, String>);

impl MemBackend {
    fn fail(&self, op: &str) {
        self.state.lock().unwrap().fail.insert(op.to_string());
    }
    fn heal(&self) {
        self.state.lock().unwrap().fail.clear();
    }
    fn check(&self, op: &str) -> Result<(), BackendError> {
        if self.state.lock().unwrap().fail.contains(op) {
            return Err(BackendError::msg(format!("injected failure: {op}")));
        }
        Ok(())
    }
    fn host_name(&self, id: &BoxId) -> Option<String> {
        self.state.lock().unwrap().files.get(id.as_str()).cloned()
    }
    fn box_count(&self) -> usize {
        self.state.lock().unwrap().files.len()
    }
    fn env(&self, id: &BoxId) -> HashMap<String, String> {
        self.state.lock().unwrap().env.get(id.as_str()).cloned().unwrap_or_default()
    }
    fn crash(&self, id: &BoxId) {
        self.state.lock().unwrap().running.remove(id.as_str());
    }
}

impl Backend for MemBackend {
    fn has_image(&self, image: &Name) -> bool {
        ["busybox", "alpine"].contains(&image.as_str())
    }
    fn build_image(&self, _image: &Name, _progress: Progress<'_>) -> Result<(), BackendError> {
        Err(BackendError::msg("no builds here"))
    }
    fn save_image(&self, _rec: &BoxRecord, _key: &Name) -> Result<(), BackendError> {
        Ok(())
    }
    fn create(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.check("create")?;
        self.state.lock().unwrap().files.insert(rec.id.as_str().into(), rec.name.to_string());
        Ok(())
    }
    fn start(&self, rec: &BoxRecord) -> Result<BoxHandle, BackendError> {
        self.check("start")?;
        let mut s = self.state.lock().unwrap();
        s.running.insert(rec.id.as_str().into());
        s.next_pid += 1;
        Ok(mem_handle(rec, 1000 + s.next_pid))
    }
    fn is_running(&self, rec: &BoxRecord) -> bool {
        self.state.lock().unwrap().running.contains(rec.id.as_str())
    }
    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.check("stop")?;
        self.state.lock().unwrap().running.remove(rec.id.as_str());
        Ok(())
    }
    fn destroy(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.check("destroy")?;
        let mut s = self.state.lock().unwrap();
        s.files.remove(rec.id.as_str());
        s.running.remove(rec.id.as_str());
        Ok(())
    }
    fn handle(&self, rec: &BoxRecord) -> Option<BoxHandle> {
        self.is_running(rec).then(|| mem_handle(rec, rec.pid.unwrap_or(1)))
    }
    fn dup(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError> {
        self.check("dup")?;
        let mut s = self.state.lock().unwrap();
        assert!(s.files.contains_key(src.id.as_str()), "dup of a box with no files");
        s.files.insert(dst.id.as_str().into(), dst.name.to_string());
        let env = s.env.get(src.id.as_str()).cloned().unwrap_or_default();
        s.env.insert(dst.id.as_str().into(), env);
        Ok(if s.copies_machines && s.running.contains(src.id.as_str()) { Copied::Machine } else { Copied::Files })
    }
    fn set_environment(&self, rec: &BoxRecord, vars: &[(String, Option<String>)]) -> Result<(), BackendError> {
        self.check("set_environment")?;
        let mut s = self.state.lock().unwrap();
        let env = s.env.entry(rec.id.as_str().into()).or_default();
        for (k, v) in vars {
            match v {
                Some(v) => env.insert(k.clone(), v.clone()),
                None => env.remove(k),
            };
        }
        Ok(())
    }
    fn checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        self.check("checkpoint")?;
        let mut s = self.state.lock().unwrap();
        let files = s.files[rec.id.as_str()].clone();
        let env = s.env.get(rec.id.as_str()).cloned().unwrap_or_default();
        s.checkpoints.entry(rec.id.as_str().into()).or_default().push((label.to_string(), files, env));
        Ok(())
    }
    fn checkpoints(&self, rec: &BoxRecord, _held: bool) -> Vec<crate::backend::Checkpoint> {
        let s = self.state.lock().unwrap();
        let saved = s.checkpoints.get(rec.id.as_str()).cloned().unwrap_or_default();
        saved
            .into_iter()
            .map(|(label, _, _)| crate::backend::Checkpoint { label, created_ms: 0, held_bytes: None })
            .collect()
    }
    fn restore(&self, rec: &BoxRecord, label: &Name, before: &Name) -> Result<(), BackendError> {
        self.check("restore")?;
        let mut s = self.state.lock().unwrap();
        assert!(!s.running.contains(rec.id.as_str()), "restore of a running box");
        let id = rec.id.as_str().to_string();
        let saved = s.checkpoints[&id].iter().find(|(l, _, _)| l == label.as_str()).cloned().unwrap();
        let (files, env) = (s.files[&id].clone(), s.env.get(&id).cloned().unwrap_or_default());
        s.checkpoints.get_mut(&id).unwrap().push((before.to_string(), files, env));
        s.files.insert(id.clone(), saved.1);
        s.env.insert(id, saved.2);
        Ok(())
    }
    fn delete_checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        let mut s = self.state.lock().unwrap();
        s.checkpoints.entry(rec.id.as_str().into()).or_default().retain(|(l, _, _)| l != label.as_str());
        Ok(())
    }
    fn diff(&self, _: &BoxRecord, _: &BoxRecord, _: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        Ok(())
    }
    fn adopt(&self, rec: &BoxRecord, _from: &AccountId) -> Result<(), BackendError> {
        self.check("adopt")?;
        self.state.lock().unwrap().files.insert(rec.id.as_str().into(), rec.name.to_string());
        Ok(())
    }
    fn rename(&self, rec: &BoxRecord, name: &Name) -> Result<(), BackendError> {
        self.check(&format!("rename:{name}"))?;
        self.state.lock().unwrap().files.insert(rec.id.as_str().into(), name.to_string());
        Ok(())
    }
    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.check("thaw")?;
        self.state.lock().unwrap().frozen.remove(rec.id.as_str());
        Ok(())
    }
    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.state.lock().unwrap().frozen.insert(rec.id.as_str().into());
        Ok(())
    }
    fn meter(&self, _rec: &BoxRecord) -> Option<MeterReading> {
        Some(MeterReading::default())
    }
    fn disk_usage(&self, _rec: &BoxRecord) -> Option<u64> {
        Some(0)
    }
    fn account_disk_usage(&self, _: &AccountId) -> Option<u64> {
        None
    }
}

fn mem_handle(rec: &BoxRecord, pid: u32) -> BoxHandle {
    BoxHandle {
        pid,
        agent: AgentAddr::Unix(format!("/nonexistent/{}", rec.id.as_str()).into()),
        network: crate::backend::NetAttach::Netns(format!("/proc/{pid}/ns/net").into()),
        ca_key: None,
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    db: std::path::PathBuf,
    backend: Arc<MemBackend>,
    manager: Arc<BoxManager>,
    alice: AccountId,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("moat.db");
    let backend = Arc::new(MemBackend::default());
    // Warm boxes have a test of their own.
    let config = ManagerConfig { warm_boxes: 0, ..ManagerConfig::default() };
    let manager = BoxManager::new(Store::open(&db).unwrap(), backend.clone(), config);
    Fixture { _dir: dir, db, backend, manager, alice: AccountId("SHA256:alice".into()) }
}

fn name(s: &str) -> Name {
    Name::new(s).unwrap()
}

/// A busybox box called `n` with `limits`, nothing else said.
fn busybox(n: &str, limits: Limits) -> BoxSpec {
    BoxSpec { name: name(n), image: name("busybox"), limits, policy: Policy::default(), backend: None, run: false }
}

impl Fixture {
    async fn new_box(&self, n: &str) -> Result<BoxRecord, ManagerError> {
        self.manager.create(&self.alice, busybox(n, Limits::default()), Box::new(|_: &str| {})).await
    }
    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.manager.list(&self.alice).unwrap().into_iter().map(|r| r.name.to_string()).collect();
        v.sort();
        v
    }
}

#[tokio::test]
async fn a_failed_new_leaves_nothing() {
    let f = fixture();
    f.backend.fail("start");
    assert!(f.new_box("web").await.is_err());
    assert!(f.names().is_empty());
    assert_eq!(f.backend.box_count(), 0, "the files made before start failed are gone");
    f.backend.heal();
    f.new_box("web").await.unwrap();
    assert_eq!(f.names(), ["web"]);
    assert!(matches!(f.new_box("web").await, Err(ManagerError::Store(StoreError::NameTaken(_)))));
    assert!(matches!(f.new_box("moat").await, Err(ManagerError::ReservedName(_))));
}

#[tokio::test]
async fn a_failed_dup_leaves_the_source_alone() {
    let f = fixture();
    let src = f.new_box("web").await.unwrap();
    for op in ["dup", "start"] {
        f.backend.fail(op);
        assert!(f.manager.dup(&f.alice, &name("web"), &name("try")).await.is_err(), "{op}");
        f.backend.heal();
        assert_eq!(f.names(), ["web"], "{op}");
        assert_eq!(f.backend.box_count(), 1, "{op}");
        assert!(f.backend.is_running(&src));
    }
    let copy = f.manager.dup(&f.alice, &name("web"), &name("try")).await.unwrap();
    assert_eq!(copy.parent, Some(src.id.clone()));
    assert_eq!(f.names(), ["try", "web"]);
}

#[tokio::test]
async fn a_copied_machine_waits_suspended_for_its_first_session() {
    let f = fixture();
    f.backend.state.lock().unwrap().copies_machines = true;
    let net = Arc::new(NetLog::default());
    f.manager.set_network_hooks(net.clone());
    f.new_box("web").await.unwrap();
    net.take();
    let copy = f.manager.dup(&f.alice, &name("web"), &name("try")).await.unwrap();
    assert_eq!(copy.state, BoxState::Suspended);
    assert_eq!(copy.pid, None);
    assert!(!f.backend.is_running(&copy), "nothing runs until a session comes");
    assert!(net.take().is_empty(), "no network for a copy not yet running");
    let (handle, _session) = f.manager.open_session(&f.alice, &name("try")).await.unwrap();
    assert!(f.backend.is_running(&copy));
    assert_eq!(f.manager.get(&f.alice, &name("try")).unwrap().pid, Some(handle.pid));
    // Resuming, it has nothing attached yet: it is attached as it boots.
    assert_eq!(net.take(), ["resuming No", "up try 0", "secrets []"]);
}

/// A resume bills the time the box was suspended as suspended and marks it
/// running in one commit; a thaw that fails bills nothing and leaves it
/// suspended (what serves its network let go again), to be billed in full by
/// the resume that works.
#[tokio::test]
async fn a_resume_bills_the_suspension_and_a_failed_one_leaves_the_box_suspended() {
    let f = fixture();
    let net = Arc::new(NetLog::default());
    f.manager.set_network_hooks(net.clone());
    f.new_box("web").await.unwrap();
    f.manager.suspend(&f.alice, &name("web")).await.unwrap();
    net.take();
    // What the ledger holds (`usage` would bill up to now first).
    let suspended = || async {
        let rows = Store::open(&f.db).unwrap().usage(&f.alice, 0, None).unwrap();
        rows.iter().map(|r| r.suspended_seconds).sum::<f64>()
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    f.backend.fail("thaw");
    assert!(f.manager.open_session(&f.alice, &name("web")).await.is_err());
    let rec = f.manager.get(&f.alice, &name("web")).unwrap();
    assert_eq!(rec.state, BoxState::Suspended);
    assert_eq!(suspended().await, 0.0, "no sample for a resume that failed");
    assert_eq!(net.take(), ["resuming No", "suspended"], "its sockets made, then let go");
    tokio::time::sleep(Duration::from_millis(600)).await;
    f.backend.heal();
    let (handle, _session) = f.manager.open_session(&f.alice, &name("web")).await.unwrap();
    let rec = f.manager.get(&f.alice, &name("web")).unwrap();
    assert_eq!((rec.state, rec.pid), (BoxState::Running, Some(handle.pid)));
    let billed = suspended().await;
    assert!((1.2..5.0).contains(&billed), "both waits billed suspended: {billed} s");
}

/// An idle box whose suspension failed (the store away) is suspended once
/// it can be: tried again, not left running and billed until a restart.
#[tokio::test]
async fn an_idle_suspension_that_failed_is_tried_again() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("moat.db");
    let backend = Arc::new(MemBackend::default());
    let config = ManagerConfig { warm_boxes: 0, idle_grace: Duration::from_millis(100), ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&db).unwrap(), backend.clone(), config);
    let alice = AccountId("SHA256:alice".into());
    m.create(&alice, busybox("web", Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    let store = rusqlite::Connection::open(&db).unwrap();
    store
        .execute_batch(
            "CREATE TRIGGER no_suspension BEFORE UPDATE OF state ON boxes WHEN NEW.state = 'suspended' \
             BEGIN SELECT RAISE(ABORT, 'injected: the store is gone'); END;",
        )
        .unwrap();
    drop(m.open_session(&alice, &name("web")).await.unwrap());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(m.get(&alice, &name("web")).unwrap().state, BoxState::Running, "the store refused it");
    store.execute_batch("DROP TRIGGER no_suspension").unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while m.get(&alice, &name("web")).unwrap().state != BoxState::Suspended {
        assert!(tokio::time::Instant::now() < deadline, "never tried again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A suspension the store cannot record is undone: the box is thawed, so
/// that it is what the store still says (running), and the network is not
/// told it is suspended. (Frozen but called running, it would take sessions
/// and never answer them.)
#[tokio::test]
async fn a_suspension_the_store_cannot_record_leaves_the_box_running() {
    let f = fixture();
    let net = Arc::new(NetLog::default());
    f.manager.set_network_hooks(net.clone());
    let rec = f.new_box("web").await.unwrap();
    net.take();
    // The one write that marks a box suspended fails; the meter's go through.
    let db = rusqlite::Connection::open(&f.db).unwrap();
    db.execute_batch(
        "CREATE TRIGGER no_suspension BEFORE UPDATE OF state ON boxes WHEN NEW.state = 'suspended' \
         BEGIN SELECT RAISE(ABORT, 'injected: the store is gone'); END;",
    )
    .unwrap();
    let failed = f.manager.suspend(&f.alice, &name("web")).await.unwrap_err();
    assert!(matches!(failed, ManagerError::Store(_)), "{failed:?}");
    assert_eq!(f.manager.get(&f.alice, &name("web")).unwrap().state, BoxState::Running);
    assert!(!f.backend.state.lock().unwrap().frozen.contains(rec.id.as_str()), "left frozen");
    assert!(net.take().is_empty(), "the network was told of a suspension that did not happen");
    // With the store back, it suspends.
    db.execute_batch("DROP TRIGGER no_suspension").unwrap();
    f.manager.suspend(&f.alice, &name("web")).await.unwrap();
    assert_eq!(f.manager.get(&f.alice, &name("web")).unwrap().state, BoxState::Suspended);
    assert!(f.backend.state.lock().unwrap().frozen.contains(rec.id.as_str()));
}

/// The meter's pass samples every box (a commit per batch), leaves a box
/// busy with something else to the next pass, which bills it all, and parks
/// a box suspended past the limit.
#[tokio::test]
async fn a_meter_pass_samples_every_box_leaves_a_busy_one_to_the_next_and_parks() {
    let f = fixture();
    let config =
        ManagerConfig { warm_boxes: 0, park_after: Some(Duration::ZERO), max_boxes: 100, ..ManagerConfig::default() };
    let manager = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    let count = super::meter::METER_BATCH + 6;
    for i in 0..count {
        manager.create(&f.alice, busybox(&format!("b{i}"), Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    }
    manager.suspend(&f.alice, &name("b0")).await.unwrap();
    let busy = manager.get(&f.alice, &name("b1")).unwrap();
    let held = manager.lock_for(&busy.id).lock_owned().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let running = || {
        let rows = Store::open(&f.db).unwrap().usage(&f.alice, 0, None).unwrap();
        rows.into_iter().map(|r| (r.name.to_string(), r.running_seconds)).collect::<HashMap<_, _>>()
    };
    manager.meter_all().await.unwrap();
    let billed = running();
    for i in 2..count {
        assert!(billed[&format!("b{i}")] >= 1.0, "b{i} sampled: {:?}", billed.get(&format!("b{i}")));
    }
    assert_eq!(billed.get("b1").copied().unwrap_or(0.0), 0.0, "a busy box is left alone");
    assert_eq!(manager.get(&f.alice, &name("b0")).unwrap().state, BoxState::Stopped, "parked");
    drop(held);
    manager.meter_all().await.unwrap();
    assert!(running()["b1"] >= 1.0, "the next pass bills the busy box's whole interval");
}

/// The meter's pass leaves a suspended box alone (its counters do not
/// move): no ledger rows while it sleeps, and its suspension is billed whole
/// by its next sample (here `usage`'s).
#[tokio::test]
async fn a_meter_pass_writes_nothing_for_a_suspended_box() {
    let f = fixture();
    f.new_box("web").await.unwrap();
    f.manager.suspend(&f.alice, &name("web")).await.unwrap();
    let rows = || {
        let db = rusqlite::Connection::open(&f.db).unwrap();
        db.query_row("SELECT COUNT(*) FROM usage_samples", [], |r| r.get::<_, i64>(0)).unwrap()
    };
    let before = rows();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for _ in 0..3 {
        f.manager.meter_all().await.unwrap();
    }
    assert_eq!(rows(), before, "the pass wrote rows for a suspended box");
    let report = f.manager.usage(&f.alice, 0, None).await.unwrap();
    let suspended = report.boxes[0].usage.suspended_seconds;
    assert!((1.0..5.0).contains(&suspended), "its suspension billed at the next sample: {suspended} s");
}

#[tokio::test]
async fn promote_is_all_or_nothing() {
    let f = fixture();
    let parent = f.new_box("web").await.unwrap();
    let child = f.manager.dup(&f.alice, &name("web"), &name("try")).await.unwrap();
    // The parent's rename fails: the child's, done first, is undone.
    f.backend.fail("rename:web-prev");
    assert!(f.manager.promote(&f.alice, &name("try")).await.is_err());
    f.backend.heal();
    assert_eq!(f.names(), ["try", "web"]);
    assert_eq!(f.backend.host_name(&child.id).as_deref(), Some("try"));
    assert_eq!(f.backend.host_name(&parent.id).as_deref(), Some("web"));
    // The store refuses (the kept name is taken): both files are put back.
    f.new_box("web-prev").await.unwrap();
    assert!(f.manager.promote(&f.alice, &name("try")).await.is_err());
    assert_eq!(f.backend.host_name(&child.id).as_deref(), Some("try"));
    assert_eq!(f.backend.host_name(&parent.id).as_deref(), Some("web"));
    f.manager.remove(&f.alice, &name("web-prev")).await.unwrap();
    // Then it works, in the store and in the files.
    assert_eq!(f.manager.promote(&f.alice, &name("try")).await.unwrap().as_str(), "web-prev");
    assert_eq!(f.manager.get(&f.alice, &name("web")).unwrap().id, child.id);
    assert_eq!(f.manager.get(&f.alice, &name("web-prev")).unwrap().id, parent.id);
    assert_eq!(f.backend.host_name(&child.id).as_deref(), Some("web"));
    assert_eq!(f.backend.host_name(&parent.id).as_deref(), Some("web-prev"));
    assert!(f.manager.was_box(&f.alice, &name("try")).unwrap());
    // A box that is not a copy cannot be promoted.
    assert!(matches!(f.manager.promote(&f.alice, &name("web-prev")).await, Err(ManagerError::NoParent(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_promote_and_remove_do_not_interleave() {
    for _ in 0..20 {
        let f = fixture();
        f.new_box("web").await.unwrap();
        f.manager.dup(&f.alice, &name("web"), &name("try")).await.unwrap();
        let (m1, m2, a1, a2) = (f.manager.clone(), f.manager.clone(), f.alice.clone(), f.alice.clone());
        let promote = tokio::spawn(async move { m1.promote(&a1, &name("try")).await });
        let remove = tokio::spawn(async move { m2.remove(&a2, &name("web")).await });
        let (promoted, removed) = (promote.await.unwrap(), remove.await.unwrap());
        // Whatever the order, the store and the files agree on every box left.
        for rec in f.manager.list(&f.alice).unwrap() {
            assert_eq!(f.backend.host_name(&rec.id).as_deref(), Some(rec.name.as_str()), "{promoted:?} {removed:?}");
        }
        assert_eq!(f.backend.box_count(), f.names().len());
    }
}

/// On a fleet node, an account's disk budget counts what its boxes hold on
/// the other nodes (as they last said), not only here.
#[tokio::test]
async fn a_fleet_nodes_disk_budget_counts_the_other_nodes() {
    let f = fixture();
    let config = ManagerConfig { max_disk_per_account: 1000, warm_boxes: 0, ..ManagerConfig::default() };
    let store = Store::open(&f.db).unwrap().for_node("n1");
    store.renew_lease(&crate::store::nodes::tests::offer("n1", 10)).unwrap();
    let now = crate::clock::now_ms();
    store.set_account_disk("n2", &[(f.alice.clone(), 900)], now).unwrap();
    let m = BoxManager::new(store, f.backend.clone(), config);
    let spec = |n: &str| BoxSpec {
        name: name(n),
        image: name("busybox"),
        limits: Limits::default(),
        policy: Policy::default(),
        backend: None,
        run: false,
    };
    m.create(&f.alice, spec("under"), Box::new(|_: &str| {})).await.unwrap();
    m.db(|s| s.set_account_disk("n2", &[(f.alice.clone(), 1000)], now)).unwrap();
    assert!(matches!(
        m.create(&f.alice, spec("over"), Box::new(|_: &str| {})).await,
        Err(ManagerError::DiskBudget { .. })
    ));
}

/// A node whose lease may have lapsed freezes the boxes it runs and ends
/// their sessions (another node may be given them: never two live copies),
/// from what the store last listed, without the store; back, it thaws those
/// the store still says are its own and running, and no others.
#[tokio::test]
async fn a_closed_fence_freezes_the_nodes_boxes_and_ends_their_sessions() {
    let f = fixture();
    let config = ManagerConfig { warm_boxes: 0, ..ManagerConfig::default() };
    let store = Store::open(&f.db).unwrap().for_node("n1");
    store.renew_lease(&crate::store::nodes::tests::offer("n1", 10)).unwrap();
    let m = BoxManager::new(store, f.backend.clone(), config);
    let spec = |n: &str| busybox(n, Limits::default());
    for n in ["web", "idle"] {
        m.create(&f.alice, spec(n), Box::new(|_: &str| {})).await.unwrap();
    }
    m.suspend(&f.alice, &name("idle")).await.unwrap();
    let (_, session) = m.open_shared_session(&f.alice, &name("web"), None).await.unwrap();
    let id = |n: &str| m.get(&f.alice, &name(n)).unwrap().id.as_str().to_string();
    let frozen = || f.backend.state.lock().unwrap().frozen.clone();
    m.report_disk().unwrap();
    // Made after the store last listed this node's boxes: frozen too.
    m.create(&f.alice, spec("late"), Box::new(|_: &str| {})).await.unwrap();
    m.close_fence();
    assert!(!m.serving());
    assert!(frozen().contains(&id("web")) && frozen().contains(&id("idle")) && frozen().contains(&id("late")));
    tokio::time::timeout(Duration::from_secs(1), session.revoked()).await.expect("the session was not ended");
    m.open_fence().unwrap();
    assert!(m.serving());
    assert!(!frozen().contains(&id("web")), "a running box left frozen");
    assert!(frozen().contains(&id("idle")), "a suspended box thawed");
}

/// A resume that passed the fence's check before it closed, and thawed its
/// box after the fence froze what it found, freezes the box again and is
/// refused; the fence's opening thaws it (the store says it runs).
#[tokio::test]
async fn a_resume_racing_the_fence_leaves_its_box_frozen_until_it_opens() {
    let f = fixture();
    let config = ManagerConfig { warm_boxes: 0, ..ManagerConfig::default() };
    let store = Store::open(&f.db).unwrap().for_node("n1");
    store.renew_lease(&crate::store::nodes::tests::offer("n1", 10)).unwrap();
    let m = BoxManager::new(store, f.backend.clone(), config);
    m.create(&f.alice, busybox("web", Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    m.suspend(&f.alice, &name("web")).await.unwrap();
    let (rec, guard) = m.locked(&f.alice, &name("web")).await.unwrap();
    let frozen = || f.backend.state.lock().unwrap().frozen.contains(rec.id.as_str());
    m.report_disk().unwrap();
    m.close_fence();
    assert!(matches!(m.bring_up(&rec).await, Err(ManagerError::Fenced(_))));
    assert!(frozen(), "a box thawed after the fence closed runs on");
    drop(guard);
    m.open_fence().unwrap();
    assert!(!frozen(), "the box the resume left frozen stayed so once the fence opened");
}

/// Copies asked for at once each pass the early check before any is made
/// (they wait their turn on the parent): the store refuses those past the
/// account's box count as it adds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_at_once_stay_within_the_accounts_box_count() {
    let f = fixture();
    let config = ManagerConfig { max_boxes: 3, warm_boxes: 0, ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    m.create(&f.alice, busybox("web", Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    // The parent held (as by a long dup): every copy passes the early check.
    let (_, held) = m.locked(&f.alice, &name("web")).await.unwrap();
    let mut copies = tokio::task::JoinSet::new();
    for i in 0..8 {
        let (m, alice) = (Arc::clone(&m), f.alice.clone());
        copies.spawn(async move { m.dup(&alice, &name("web"), &name(&format!("copy{i}"))).await });
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);
    let mut refused = 0;
    while let Some(done) = copies.join_next().await {
        match done.unwrap() {
            Ok(_) => {}
            Err(ManagerError::TooManyBoxes(n)) => {
                assert_eq!(n, 3);
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((m.list(&f.alice).unwrap().len(), refused), (3, 6));
}

/// A plain `new` on a server whose maximum disk is below the default disk
/// takes the maximum; a disk asked for above it is refused.
#[tokio::test]
async fn defaults_fit_within_the_operators_maximum() {
    let f = fixture();
    let max_limits = Limits { disk: 8 << 30, ..ManagerConfig::default().max_limits };
    let config = ManagerConfig { max_limits, warm_boxes: 0, ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    let made = m.create(&f.alice, busybox("web", Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    assert_eq!(made.limits.disk, 8 << 30);
    let asked = busybox("big", Limits { disk: 20 << 30, ..Limits::default() });
    assert!(matches!(m.create(&f.alice, asked, Box::new(|_: &str| {})).await, Err(ManagerError::OverMax { .. })));
}

/// A share checked against one box opens no session in another that took
/// its name meanwhile (the owner promoted a private copy over it).
#[tokio::test]
async fn a_share_opens_no_session_in_the_box_that_took_its_name() {
    let f = fixture();
    let m = &f.manager;
    let bob = AccountId("SHA256:bob".into());
    f.new_box("web").await.unwrap();
    m.share(&f.alice, &name("web"), &bob).unwrap();
    let owner = crate::web::Owner::of(&f.alice);
    let checked = m.reachable(&bob, &name("web"), Some(&owner)).unwrap();
    m.dup(&f.alice, &name("web"), &name("web-try")).await.unwrap();
    m.promote(&f.alice, &name("web-try")).await.unwrap();
    assert!(matches!(m.open_session_of(&checked).await, Err(ManagerError::NoSuchBox(_))));
    assert!(matches!(m.open_shared_session(&bob, &name("web"), Some(&owner)).await, Err(ManagerError::NoSuchBox(_))));
}

#[tokio::test]
async fn an_accounts_memory_budget_counts_its_boxes_limits_only() {
    let f = fixture();
    let config = ManagerConfig { max_memory_per_account: 3 << 30, ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    let spec = |n: &str, gib: u64| BoxSpec {
        name: name(n),
        image: name("busybox"),
        limits: Limits { memory: gib << 30, ..Limits::default() },
        policy: Policy::default(),
        backend: None,
        run: false,
    };
    let bob = AccountId("SHA256:bob".into());
    m.create(&bob, spec("big", 3), Box::new(|_: &str| {})).await.unwrap();
    for n in ["a", "b"] {
        m.create(&f.alice, spec(n, 1), Box::new(|_: &str| {})).await.unwrap();
    }
    assert!(matches!(
        m.create(&f.alice, spec("c", 2), Box::new(|_: &str| {})).await,
        Err(ManagerError::MemoryBudget { .. })
    ));
    m.create(&f.alice, spec("c", 1), Box::new(|_: &str| {})).await.unwrap();
    assert_eq!((m.count(&f.alice).unwrap(), m.count(&bob).unwrap()), (3, 1));
    m.remove(&f.alice, &name("a")).await.unwrap();
    assert_eq!(m.count(&f.alice).unwrap(), 2);
}

/// An account's images are counted: past `--max-images` a new one is
/// refused (each holds disk outside its boxes'), one of a name it has
/// replaces it, and other accounts count their own.
#[tokio::test]
async fn images_past_the_most_are_refused_and_a_replacement_is_not() {
    let f = fixture();
    let config = ManagerConfig { max_images: 2, warm_boxes: 0, ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    m.create(&f.alice, busybox("a", Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    m.save_image(&f.alice, &name("a"), name("t1")).await.unwrap();
    m.save_image(&f.alice, &name("a"), name("t2")).await.unwrap();
    let refused = m.save_image(&f.alice, &name("a"), name("t3")).await;
    assert!(matches!(refused, Err(ManagerError::TooManyImages(2))), "{refused:?}");
    m.save_image(&f.alice, &name("a"), name("t1")).await.unwrap();
    let bob = AccountId("SHA256:bob".into());
    m.create(&bob, busybox("b", Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    m.save_image(&bob, &name("b"), name("t3")).await.unwrap();
    m.remove_image(&f.alice, &name("t2")).unwrap();
    m.save_image(&f.alice, &name("a"), name("t3")).await.unwrap();
}

#[tokio::test]
async fn quotas_and_limits() {
    let f = fixture();
    let config = ManagerConfig { max_boxes: 1, ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    let spec = |n: &str, cpus| busybox(n, Limits { cpus, ..Limits::default() });
    assert!(matches!(
        m.create(&f.alice, spec("a", 65), Box::new(|_: &str| {})).await,
        Err(ManagerError::OverMax { .. })
    ));
    m.create(&f.alice, spec("a", 1), Box::new(|_: &str| {})).await.unwrap();
    assert!(matches!(
        m.create(&f.alice, spec("b", 1), Box::new(|_: &str| {})).await,
        Err(ManagerError::TooManyBoxes(1))
    ));
    // Another account has its own count and cannot see alice's box.
    let bob = AccountId("SHA256:bob".into());
    m.create(&bob, spec("a", 1), Box::new(|_: &str| {})).await.unwrap();
    assert!(matches!(m.get(&bob, &name("a")), Ok(r) if r.account == bob));
    assert!(m.remove(&bob, &name("b")).await.is_err());
    let unknown = BoxSpec {
        name: name("c"),
        image: name("nope"),
        limits: Limits::default(),
        policy: Policy::default(),
        backend: None,
        run: false,
    };
    let created = f.manager.create(&bob, unknown, Box::new(|_: &str| {})).await;
    assert!(matches!(created, Err(ManagerError::NoSuchImage(_))), "{created:?}");
}

#[tokio::test]
async fn restart_recovery() {
    let f = fixture();
    let kept = f.new_box("kept").await.unwrap();
    let died = f.new_box("died").await.unwrap();
    // A crash in the middle of a `new`: a row in `creating` and files on disk.
    let half = f
        .manager
        .store
        .insert_new(
            &f.alice,
            &name("half"),
            (&name("busybox"), Limits::default(), crate::BackendKind::Ns),
            0,
            &Policy::default(),
        )
        .unwrap();
    f.backend.create(&half).unwrap();
    // A box whose processes died while the daemon was down.
    f.backend.crash(&died.id);
    let again = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), ManagerConfig::default());
    again.recover().await.unwrap();
    assert_eq!(f.backend.host_name(&half.id), None, "the half-made box's files are gone");
    assert!(again.get(&f.alice, &name("half")).is_err());
    assert_eq!(again.get(&f.alice, &name("kept")).unwrap().state, BoxState::Running);
    assert_eq!(again.get(&f.alice, &name("died")).unwrap().state, BoxState::Stopped);
    assert!(f.backend.is_running(&kept));
}

/// Records what the network hooks were told (the flag: the next resume
/// cannot be served in place).
#[derive(Default)]
struct NetLog(Mutex<Vec<String>>, std::sync::atomic::AtomicBool);

impl NetworkHooks for NetLog {
    fn up(&self, rec: &BoxRecord, _: &BoxHandle, policy: &Policy) {
        self.push(format!("up {} {}", rec.name, policy.allow.len()));
    }
    fn up_suspended(&self, rec: &BoxRecord, _: &BoxHandle, policy: &Policy) {
        self.push(format!("up suspended {} {}", rec.name, policy.allow.len()));
    }
    fn suspended(&self, _: &BoxId) {
        self.push("suspended".into());
    }
    fn resuming(&self, _: &BoxId, wait: Wait) -> bool {
        self.push(format!("resuming {wait:?}"));
        wait == Wait::Yes || !self.1.swap(false, std::sync::atomic::Ordering::SeqCst)
    }
    fn down(&self, _: &BoxId) {
        self.push("down".into());
    }
    fn policy_changed(&self, _: &BoxId, policy: &Policy) {
        self.push(format!("policy {}", policy.allow.len()));
    }
    fn secrets_changed(&self, _: &BoxId, secrets: &[crate::secrets::BoxSecret]) {
        let shown: Vec<String> = secrets
            .iter()
            .map(|s| format!("{}={}{}", s.name, s.value.expose(), if s.killed { " killed" } else { "" }))
            .collect();
        self.push(format!("secrets [{}]", shown.join(",")));
    }
    fn answered(&self, _: &BoxId, question: u64, answer: crate::egress::Answer) {
        self.push(format!("answered {question} {answer:?}"));
    }
}

impl NetLog {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

#[tokio::test]
async fn the_network_follows_the_lifecycle_and_dup_keeps_the_policy() {
    let f = fixture();
    let net = Arc::new(NetLog::default());
    f.manager.set_network_hooks(net.clone());
    f.new_box("web").await.unwrap();
    assert_eq!(net.take(), ["up web 0", "secrets []"]);
    let rule = crate::policy::Rule::parse(&["pypi.org"]).unwrap();
    let web = name("web");
    let changed = f.manager.change_policy(&f.alice, &web, |p| -> Result<(), ()> {
        p.allow(rule.clone());
        Ok(())
    });
    assert_eq!(changed.await.unwrap().unwrap().allow, std::slice::from_ref(&rule));
    // A refused change changes nothing and tells no one.
    assert!(f.manager.change_policy(&f.alice, &name("web"), |_| Err(())).await.unwrap().is_err());
    assert_eq!(net.take(), ["policy 1"]);
    f.manager.dup(&f.alice, &name("web"), &name("try")).await.unwrap();
    assert_eq!(net.take(), ["up try 1", "secrets []"]);
    assert_eq!(f.manager.policy(&f.alice, &name("try")).unwrap().allow, [rule]);
    f.manager.suspend(&f.alice, &name("web")).await.unwrap();
    f.manager.stop(&f.alice, &name("web")).await.unwrap();
    f.manager.start(&f.alice, &name("web")).await.unwrap();
    f.manager.remove(&f.alice, &name("web")).await.unwrap();
    assert_eq!(net.take(), ["suspended", "down", "up web 1", "secrets []", "down"]);
    // A resume gets the box served again before it thaws; a box found
    // suspended at daemon start is attached to be served once it resumes.
    f.manager.suspend(&f.alice, &name("try")).await.unwrap();
    f.manager.start(&f.alice, &name("try")).await.unwrap();
    f.manager.suspend(&f.alice, &name("try")).await.unwrap();
    assert_eq!(net.take(), ["suspended", "resuming No", "suspended"]);
    // Not ready in place: asked again where it may wait, before the thaw.
    net.1.store(true, std::sync::atomic::Ordering::SeqCst);
    f.manager.start(&f.alice, &name("try")).await.unwrap();
    f.manager.suspend(&f.alice, &name("try")).await.unwrap();
    assert_eq!(net.take(), ["resuming No", "resuming Yes", "suspended"]);
    let again = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), ManagerConfig::default());
    again.set_network_hooks(net.clone());
    again.recover().await.unwrap();
    assert_eq!(net.take(), ["up suspended try 1", "secrets []"]);
}

#[tokio::test]
async fn questions_reach_their_owner_only_and_always_adds_a_rule_first() {
    use crate::egress::Answer;
    let f = fixture();
    let net = Arc::new(NetLog::default());
    f.manager.set_network_hooks(net.clone());
    let web = f.new_box("web").await.unwrap();
    net.take();
    let mut news = f.manager.follow_questions();
    assert!(f.manager.ask(&web.id, 41, "pypi.org".into(), Some(443), vec!["pip install x".into()]));
    let (owner, q) = news.recv().await.unwrap();
    assert_eq!((owner, q.box_name.as_str(), q.name.as_str(), q.port), (f.alice.clone(), "web", "pypi.org", Some(443)));
    assert_eq!(f.manager.questions(&f.alice), std::slice::from_ref(&q));
    // Another account neither sees nor answers it.
    let bob = AccountId("SHA256:bob".into());
    assert!(f.manager.questions(&bob).is_empty());
    assert!(matches!(f.manager.answer(&bob, q.id, Answer::Always).await, Err(ManagerError::NoSuchQuestion(_))));
    f.manager.answer(&f.alice, q.id, Answer::Always).await.unwrap();
    assert_eq!(net.take(), ["policy 1", "answered 41 Always"]);
    assert_eq!(f.manager.policy(&f.alice, &name("web")).unwrap().allow[0].to_string(), "pypi.org");
    // Answered once only; an unknown box's question is not put.
    assert!(f.manager.answer(&f.alice, q.id, Answer::Deny).await.is_err());
    assert!(!f.manager.ask(&BoxId::parse("0000000000000000").unwrap(), 1, "x.org".into(), None, Vec::new()));
}

/// One account's boxes asking without end fill their account's share of
/// open questions, not the table every account's share.
#[tokio::test]
async fn one_accounts_questions_leave_room_for_the_others() {
    let f = fixture();
    let web = f.new_box("web").await.unwrap();
    let mut put = 0;
    while f.manager.ask(&web.id, put, format!("n{put}.example"), None, Vec::new()) {
        put += 1;
        assert!(put <= 4096, "no bound on one account's questions");
    }
    assert_eq!(put, 256);
    let bob = AccountId("SHA256:bob".into());
    let spec = BoxSpec {
        name: name("other"),
        image: name("busybox"),
        limits: Limits::default(),
        policy: Policy::default(),
        backend: None,
        run: false,
    };
    let other = f.manager.create(&bob, spec, Box::new(|_: &str| {})).await.unwrap();
    assert!(f.manager.ask(&other.id, 1, "pypi.org".into(), None, Vec::new()));
    assert_eq!(f.manager.questions(&bob).len(), 1);
}

/// On a fleet node a question's number comes from the store, so no other
/// node holds the same, and a number this node does not hold is declined as
/// another node's (the router then asks the next).
#[tokio::test]
async fn a_fleet_nodes_questions_are_numbered_by_the_store() {
    use crate::egress::Answer;
    let f = fixture();
    let store = Store::open(&f.db).unwrap().for_node("n1");
    store.renew_lease(&crate::store::nodes::tests::offer("n1", 10)).unwrap();
    let m = BoxManager::new(store, f.backend.clone(), ManagerConfig { warm_boxes: 0, ..ManagerConfig::default() });
    let spec = BoxSpec {
        name: name("web"),
        image: name("busybox"),
        limits: Limits::default(),
        policy: Policy::default(),
        backend: None,
        run: false,
    };
    let web = m.create(&f.alice, spec, Box::new(|_: &str| {})).await.unwrap();
    // Another node's boxes asked first.
    let other = Store::open(&f.db).unwrap().for_node("n2");
    assert_eq!((other.next_number("question").unwrap(), other.next_number("question").unwrap()), (1, 2));
    assert!(m.ask(&web.id, 7, "pypi.org".into(), None, Vec::new()));
    assert_eq!(m.questions(&f.alice).iter().map(|q| q.id).collect::<Vec<_>>(), [3]);
    assert!(matches!(m.answer(&f.alice, 1, Answer::Deny).await, Err(ManagerError::QuestionElsewhere(1))));
    assert_eq!(m.answer(&f.alice, 3, Answer::Deny).await.unwrap().id, 3);
}

#[tokio::test]
async fn secrets_are_granted_as_placeholders_and_only_the_gateway_gets_values() {
    use crate::secrets::{Limit, LimitKind, Sealer, SecretSpec, SecretValue};
    let f = fixture();
    let net = Arc::new(NetLog::default());
    f.manager.set_network_hooks(net.clone());
    let spec = SecretSpec {
        name: name("llm"),
        host: crate::policy::HostName::parse("api.example").unwrap(),
        header: "x-api-key".into(),
        format: "{}".into(),
        env: "LLM_KEY".into(),
    };
    let value = SecretValue::new("sk-REAL-0123456789").unwrap();
    assert!(matches!(f.manager.add_secret(&f.alice, spec.clone(), &value), Err(ManagerError::NoSecretKey)));
    f.manager.set_sealer(Sealer::new(&[1; 32]).unwrap());
    f.manager.add_secret(&f.alice, spec.clone(), &value).unwrap();
    assert!(matches!(f.manager.add_secret(&f.alice, spec.clone(), &value), Err(ManagerError::SecretExists(_))));
    let listed = format!("{:?}", f.manager.secrets(&f.alice).unwrap());
    assert!(!listed.contains("sk-REAL-0123456789"), "{listed}");
    // Another account has no such secret.
    let bob = AccountId("SHA256:bob".into());
    assert!(f.manager.secrets(&bob).unwrap().is_empty());

    let web = f.new_box("web").await.unwrap();
    net.take();
    f.manager.grant_secret(&f.alice, &name("llm"), &name("web")).await.unwrap();
    let placeholder = f.backend.env(&web.id)["LLM_KEY"].clone();
    assert!(placeholder.starts_with(crate::secrets::PLACEHOLDER_PREFIX));
    assert_eq!(net.take(), ["policy 1", "secrets [llm=sk-REAL-0123456789]"]);
    assert_eq!(f.manager.policy(&f.alice, &name("web")).unwrap().allow[0].to_string(), "api.example:443");
    // A second secret for the same header of the same host (or the same
    // variable) would overwrite the first: refused.
    let clash = SecretSpec { name: name("llm-b"), header: "X_API_KEY".into(), env: "OTHER".into(), ..spec.clone() };
    f.manager.add_secret(&f.alice, clash, &value).unwrap();
    let refused = f.manager.grant_secret(&f.alice, &name("llm-b"), &name("web")).await;
    assert!(matches!(refused, Err(ManagerError::SecretClash { .. })), "{refused:?}");
    f.manager.remove_secret(&f.alice, &name("llm-b")).await.unwrap();
    net.take();

    // A duplicate has a placeholder of its own, and the secret too.
    let copy = f.manager.dup(&f.alice, &name("web"), &name("copy")).await.unwrap();
    let copied = f.backend.env(&copy.id)["LLM_KEY"].clone();
    assert!(copied.starts_with(crate::secrets::PLACEHOLDER_PREFIX) && copied != placeholder);
    assert!(net.take().contains(&"secrets [llm=sk-REAL-0123456789]".to_string()));

    f.manager
        .limit_secret(&f.alice, &name("llm"), None, Limit::new(LimitKind::Requests, 5, Some(60)).unwrap())
        .await
        .unwrap();
    f.manager.kill_secret(&f.alice, &name("llm")).await.unwrap();
    assert_eq!(
        net.take(),
        [
            "secrets [llm=sk-REAL-0123456789]",
            "secrets [llm=sk-REAL-0123456789]",
            "secrets [llm=sk-REAL-0123456789 killed]",
            "secrets [llm=sk-REAL-0123456789 killed]"
        ]
    );
    f.manager.revoke_secret(&f.alice, &name("llm"), &name("web")).await.unwrap();
    assert!(!f.backend.env(&web.id).contains_key("LLM_KEY"));
    assert_eq!(net.take(), ["secrets []"]);
    // Use is billed from the gateway's log entries.
    use crate::egress::{LogEntry, LogKind, LogVerdict};
    let entry = LogEntry {
        sent: 10,
        received: 20,
        secret: Some("llm".into()),
        tokens: Some(7),
        ..LogEntry::new(1, LogKind::Http, "api.example", 443, LogVerdict::Allow)
    };
    f.manager.record_egress(vec![(copy.id.clone(), entry)]);
    let used = f.manager.secrets(&f.alice).unwrap()[0].used.clone();
    assert_eq!(used, [("copy".to_string(), crate::secrets::SecretUse { requests: 1, tokens: 7, bytes: 30 })]);
    f.manager.remove_secret(&f.alice, &name("llm")).await.unwrap();
    assert!(!f.backend.env(&copy.id).contains_key("LLM_KEY"));
    assert!(f.manager.secrets(&f.alice).unwrap().is_empty());
    // A new secret never inherits a removed one's use.
    let spec = SecretSpec { name: name("llm2"), ..spec };
    f.manager.add_secret(&f.alice, spec, &value).unwrap();
    assert!(f.manager.secrets(&f.alice).unwrap()[0].used.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_puts_a_box_back_boots_it_and_can_be_undone() {
    let f = fixture();
    let rec = f.new_box("web").await.unwrap();
    let (web, c1) = (name("web"), name("c1"));
    assert_eq!(f.manager.checkpoint(&f.alice, &web, None).await.unwrap(), c1);
    let again = f.manager.checkpoint(&f.alice, &web, Some(c1.clone())).await;
    assert!(matches!(again, Err(ManagerError::CheckpointExists(..))), "{again:?}");
    f.backend.set_environment(&rec, &[("X".into(), Some("after".into()))]).unwrap();

    assert_eq!(f.manager.restore(&f.alice, &web, &c1).await.unwrap().as_str(), "before-c1");
    assert!(!f.backend.env(&rec.id).contains_key("X"), "not put back");
    assert!(f.backend.is_running(&rec), "not booted again");
    assert_eq!(f.manager.get(&f.alice, &web).unwrap().state, BoxState::Running);
    // Undone through the state it kept.
    f.manager.restore(&f.alice, &web, &name("before-c1")).await.unwrap();
    assert_eq!(f.backend.env(&rec.id).get("X").map(String::as_str), Some("after"));

    // A failed restore boots the box as it was; bad labels change nothing.
    f.backend.fail("restore");
    assert!(f.manager.restore(&f.alice, &web, &c1).await.is_err());
    f.backend.heal();
    assert!(f.backend.is_running(&rec));
    assert_eq!(f.backend.env(&rec.id).get("X").map(String::as_str), Some("after"));
    let unknown = f.manager.restore(&f.alice, &web, &name("nope")).await;
    assert!(matches!(unknown, Err(ManagerError::NoSuchCheckpoint(..))), "{unknown:?}");
    let unknown = f.manager.remove_checkpoint(&f.alice, &web, &name("nope")).await;
    assert!(matches!(unknown, Err(ManagerError::NoSuchCheckpoint(..))), "{unknown:?}");

    // At most max_checkpoints, a restore's kept state included.
    while f.manager.checkpoints(&f.alice, &web).await.unwrap().len() < ManagerConfig::default().max_checkpoints {
        f.manager.checkpoint(&f.alice, &web, None).await.unwrap();
    }
    let full = f.manager.checkpoint(&f.alice, &web, None).await;
    assert!(matches!(full, Err(ManagerError::TooManyCheckpoints(..))), "{full:?}");
    let full = f.manager.restore(&f.alice, &web, &c1).await;
    assert!(matches!(full, Err(ManagerError::TooManyCheckpoints(..))), "{full:?}");
    f.manager.remove_checkpoint(&f.alice, &web, &c1).await.unwrap();
    f.manager.checkpoint(&f.alice, &web, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_box_of_a_kind_no_longer_asked_for_goes() {
    let f = fixture();
    let kept = std::time::Duration::from_millis(1000);
    let config = ManagerConfig { warm_boxes: 2, warm_kept: kept, ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    let spec = |n: &str, cpus: u32| busybox(n, Limits { cpus, ..Limits::default() });
    let warm_ids = || -> Vec<BoxId> {
        let all = m.store.list(None).unwrap().into_iter();
        all.filter(|b| b.account.0 == WARM_ACCOUNT && b.pid.is_some()).map(|b| b.id).collect()
    };
    // Asked for twice: booted ahead, with the default kind's box beside it.
    m.create(&f.alice, spec("a", 1), Box::new(|_: &str| {})).await.unwrap();
    m.create(&f.alice, spec("b", 1), Box::new(|_: &str| {})).await.unwrap();
    eventually("a warm box of the kind asked for", || m.warm_ready_for(&spec("x", 1))).await;
    let asked_for = warm_ids();
    // Asked for again while it waits: it stays past its time from the first asks.
    tokio::time::sleep(kept / 2).await;
    m.refill_warm(m.kind_of(&spec("x", 1)));
    tokio::time::sleep(kept * 3 / 4).await;
    assert!(m.warm_ready_for(&spec("x", 1)), "a warm box went while its kind was asked for");
    // Unasked for its time, it goes, processes and record; the default kind's stays.
    eventually("the unasked kind's box gone", || !m.warm_ready_for(&spec("x", 1))).await;
    // Its record goes a moment after it stops being offered.
    let gone = || -> Vec<&BoxId> { asked_for.iter().filter(|id| m.store.get_by_id(id).unwrap().is_none()).collect() };
    eventually("the unasked kind's record gone", || !gone().is_empty()).await;
    let gone = gone();
    assert_eq!(gone.len(), 1, "{asked_for:?}");
    assert!(f.backend.host_name(gone[0]).is_none(), "the expired warm box still runs");
    m.prepare_warm(&name("busybox"));
    eventually("the default kind's box", || m.warm_ready(&name("busybox"))).await;
    tokio::time::sleep(kept * 2).await;
    assert!(m.warm_ready(&name("busybox")), "the default kind's warm box expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_takes_a_box_booted_ahead_and_a_restart_rolls_warm_ones_back() {
    let f = fixture();
    let warm = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), ManagerConfig::default());
    let spec = |n: &str| BoxSpec {
        name: name(n),
        image: name("busybox"),
        limits: Limits::default(),
        policy: Policy::default(),
        backend: None,
        run: false,
    };
    // At start, a box of an image not built is not made; of a built one, it
    // is. (Had the first taken the pool's one place, the second would wait
    // for it forever.)
    warm.prepare_warm(&name("nope"));
    warm.prepare_warm(&name("busybox"));
    eventually("a warm box made at start", || warm.warm_ready(&name("busybox"))).await;
    assert_eq!(f.backend.box_count(), 1);
    let first = warm.create(&f.alice, spec("first"), Box::new(|_: &str| {})).await.unwrap();
    // One is made in the background for the next `new`, and no account sees it.
    eventually("a warm box made after a new", || warm.warm_ready(&name("busybox"))).await;
    assert_eq!(f.backend.box_count(), 2);
    let ready = warm.store.list(None).unwrap().into_iter().find(|b| b.account.0 == WARM_ACCOUNT).unwrap();
    assert_eq!(warm.list(&f.alice).unwrap().len(), 1);
    let second = warm.create(&f.alice, spec("second"), Box::new(|_: &str| {})).await.unwrap();
    assert_eq!(second.id, ready.id, "the warm box was not taken");
    assert_eq!((second.account.clone(), second.state, second.pid), (f.alice.clone(), BoxState::Running, ready.pid));
    assert_eq!(f.backend.host_name(&second.id).as_deref(), Some("second"), "not given its name");
    assert_ne!(first.id, second.id);
    // Other limits are made anew. Asked for once, they take no place in the
    // pool; asked for again, the pool's one place goes to a box of them,
    // which the next `new` of them takes.
    let big = |n: &str| BoxSpec { limits: Limits { cpus: 1, ..Limits::default() }, ..spec(n) };
    eventually("a warm box again", || warm.warm_ready(&name("busybox"))).await;
    let default_warm = warm.store.list(None).unwrap().into_iter().find(|b| b.account.0 == WARM_ACCOUNT).unwrap().id;
    let made = warm.create(&f.alice, big("big"), Box::new(|_: &str| {})).await.unwrap();
    assert_ne!(made.id, default_warm, "other limits took the default limits' warm box");
    assert!(warm.store.get_by_id(&made.id).unwrap().unwrap().account == f.alice);
    let warm_limits = |m: &BoxManager| -> Vec<Limits> {
        let all = m.store.list(None).unwrap().into_iter();
        all.filter(|b| b.account.0 == WARM_ACCOUNT && b.pid.is_some()).map(|b| b.limits).collect()
    };
    eventually("the default limits' warm box", || warm_limits(&warm) == [Limits::default()]).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(warm_limits(&warm), [Limits::default()], "limits asked for once took the pool's place");
    warm.create(&f.alice, big("big1"), Box::new(|_: &str| {})).await.unwrap();
    eventually("a warm box of the new limits alone", || warm_limits(&warm) == [big("x").limits]).await;
    eventually("it ready", || warm.warm_ready_for(&big("x"))).await;
    let ready = warm.store.list(None).unwrap().into_iter().find(|b| b.account.0 == WARM_ACCOUNT).unwrap();
    let again = warm.create(&f.alice, big("big2"), Box::new(|_: &str| {})).await.unwrap();
    assert_eq!(again.id, ready.id, "the warm box of the same limits was not taken");
    // A taken name is refused, warm box or not.
    let taken = warm.create(&f.alice, spec("second"), Box::new(|_: &str| {})).await;
    assert!(matches!(taken, Err(ManagerError::Store(StoreError::NameTaken(_)))), "{taken:?}");

    // A restart rolls every warm box back, as any half-made box.
    eventually("another warm box", || warm.store.list(None).unwrap().iter().any(|b| b.account.0 == WARM_ACCOUNT)).await;
    let leftover = warm.store.list(None).unwrap().into_iter().find(|b| b.account.0 == WARM_ACCOUNT).unwrap();
    let again = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), f.manager.config);
    again.recover().await.unwrap();
    assert_eq!(f.backend.host_name(&leftover.id), None, "a warm box outlived a restart");
    assert!(again.store.list(None).unwrap().iter().all(|b| b.account.0 != WARM_ACCOUNT));
    // A warm box that cannot be given is removed, and `new` makes one anew.
    let w2 = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), ManagerConfig::default());
    w2.create(&f.alice, spec("third"), Box::new(|_: &str| {})).await.unwrap();
    // (The store is shared with the first manager, whose warm box may be
    // there too: the one refused is the one of them that goes.)
    let booted = || -> Vec<BoxId> {
        let all = w2.store.list(None).unwrap().into_iter();
        all.filter(|b| b.account.0 == WARM_ACCOUNT && b.pid.is_some()).map(|b| b.id).collect()
    };
    eventually("a booted warm box", || w2.warm_ready(&name("busybox"))).await;
    let before = booted();
    f.backend.fail("adopt");
    let fourth = w2.create(&f.alice, spec("fourth"), Box::new(|_: &str| {})).await;
    f.backend.heal();
    let fourth = fourth.unwrap();
    assert!(!before.contains(&fourth.id), "the warm box that could not be given was given");
    assert_eq!(fourth.state, BoxState::Running);
    let gone: Vec<&BoxId> = before.iter().filter(|id| w2.store.get_by_id(id).unwrap().is_none()).collect();
    assert_eq!(gone.len(), 1, "the warm box that could not be given is kept: {before:?}");
    assert!(gone.iter().all(|id| f.backend.host_name(id).is_none()), "the warm box that could not be given still runs");

    // Another image asked for takes the pool's place.
    let warm_images = |m: &BoxManager| -> Vec<String> {
        let all = m.store.list(None).unwrap();
        all.into_iter()
            .filter(|b| b.account.0 == WARM_ACCOUNT && b.pid.is_some())
            .map(|b| b.image.to_string())
            .collect()
    };
    eventually("a warm busybox box", || warm_images(&w2) == ["busybox"]).await;
    let alpine = BoxSpec { image: name("alpine"), ..spec("fifth") };
    w2.create(&f.alice, alpine, Box::new(|_: &str| {})).await.unwrap();
    eventually("the alpine box taking the pool's place", || warm_images(&w2) == ["alpine"]).await;
}

/// Waits up to 5 s for `done`, failing the test with `what` if it never is.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_boxes_give_way_to_a_box_asked_for_on_a_full_node() {
    let f = fixture();
    let store = Store::open(&f.db).unwrap().for_node("n1");
    let offer = crate::store::nodes::NodeOffer {
        name: "n1".into(),
        address: "127.0.0.2:7000".into(),
        cpus: 64,
        memory: 64 << 30,
        disk: 1 << 40,
        max_boxes: 2,
    };
    store.renew_lease(&offer).unwrap();
    let config = ManagerConfig { warm_boxes: 1, ..ManagerConfig::default() };
    let m = BoxManager::new(store, f.backend.clone(), config);
    // Limits of their own, none the warm box's.
    let spec = |n: &str, pids| BoxSpec {
        name: name(n),
        image: name("busybox"),
        limits: Limits { pids, ..Limits::default() },
        policy: Policy::default(),
        backend: None,
        run: false,
    };
    m.prepare_warm(&name("busybox"));
    eventually("a warm box", || m.warm_ready(&name("busybox"))).await;
    m.create(&f.alice, spec("one", 101), Box::new(|_: &str| {})).await.unwrap();
    // The node holds two boxes, one of them warm: the next box asked for
    // takes the warm one's room.
    let warm_id = m.store.list(None).unwrap().into_iter().find(|b| b.account.0 == WARM_ACCOUNT).unwrap().id;
    let two = m.create(&f.alice, spec("two", 102), Box::new(|_: &str| {})).await.unwrap();
    assert_ne!(two.id, warm_id);
    assert!(m.store.get_by_id(&warm_id).unwrap().is_none(), "the warm box was kept");
    assert_eq!(f.backend.host_name(&warm_id), None, "the warm box still runs");
    // With no warm box left to give way, a full node says so.
    let full = m.create(&f.alice, spec("three", 103), Box::new(|_: &str| {})).await;
    assert!(matches!(full, Err(ManagerError::NoRoomHere(StoreError::NodeFull { .. }))), "{full:?}");
}

/// Saves at once cannot each find the last place free: 36 at once made 36
/// images where 32 may be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_saved_at_once_keep_to_the_most() {
    let f = fixture();
    let config = ManagerConfig { max_images: 2, warm_boxes: 0, ..ManagerConfig::default() };
    let m = BoxManager::new(Store::open(&f.db).unwrap(), f.backend.clone(), config);
    m.create(&f.alice, busybox("a", Limits::default()), Box::new(|_: &str| {})).await.unwrap();
    let mut saves = tokio::task::JoinSet::new();
    for i in 0..8 {
        let (m, alice) = (Arc::clone(&m), f.alice.clone());
        saves.spawn(async move { m.save_image(&alice, &name("a"), name(&format!("t{i}"))).await.is_ok() });
    }
    let saved = saves.join_all().await.into_iter().filter(|ok| *ok).count();
    assert_eq!(saved, 2);
    assert_eq!(m.images(&f.alice).unwrap().len(), 2);
}
