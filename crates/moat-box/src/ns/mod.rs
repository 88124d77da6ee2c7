//! The namespace backend: a box is a tree of processes in its own user, mount,
//! pid, net, uts, ipc and cgroup namespaces, on a snapshot of its image, under
//! cgroup limits, seccomp and a reduced capability set. Works on any Linux host.

pub mod cgroup;
#[allow(unsafe_code)]
pub mod enforce;
pub mod hostview;
pub mod netns;
pub mod plan;
pub mod seccomp;
pub mod spare;

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};

use moat_core::backend::Progress;
use moat_core::{
    fault, AccountId, AgentAddr, Backend, BackendError, BoxHandle, BoxId, BoxRecord, ChangeSink, Checkpoint, Copied,
    MeterReading, Name, NetAttach,
};

use crate::pool::Pool;
use crate::{identity, image};
use cgroup::CgroupLayout;
use plan::SpawnPlan;
use spare::{Spare, SpareRoot};

/// Where the backend finds its helper and the agent.
#[derive(Debug, Clone)]
pub struct NsConfig {
    /// Host-side per-box directories (agent sockets) live under here.
    pub run_dir: PathBuf,
    /// The program run as `<helper> box-spawn` to start a box (the moat binary).
    pub helper: PathBuf,
    /// The static moat-agent binary.
    pub agent: PathBuf,
    /// Per-box /proc totals (LXCFS), where available.
    pub host_view: Option<hostview::HostView>,
    /// Most bytes one account's boxes may write, together (see [`Pool::charge_account`]).
    pub account_disk: u64,
}

/// The namespace backend.
pub struct NsBackend {
    pool: Arc<Pool>,
    cgroups: CgroupLayout,
    config: NsConfig,
    /// The next `start`'s helper, already in a cgroup (see [`spare`]).
    spare: Arc<Mutex<Option<Spare>>>,
    /// The next `create`'s root, per image (see [`spare`]).
    spare_roots: Arc<Mutex<HashMap<Name, SpareRoot>>>,
}

impl NsBackend {
    /// Boots the box's PID 1; returns its host pid.
    fn boot(&self, rec: &BoxRecord) -> Result<u32, BackendError> {
        let run_dir = self.box_run_dir(rec);
        std::fs::create_dir_all(&run_dir).map_err(|e| BackendError::new(format!("create {}", run_dir.display()), e))?;
        // A previous boot's processes (if any) must be gone before a new PID 1.
        self.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("clear old cgroup", e))?;
        let spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner).take();
        self.refill_spare();
        let plan = |cgroup_procs| {
            SpawnPlan::for_box(
                rec,
                self.pool.box_path(&rec.id),
                cgroup_procs,
                self.socket_path(rec),
                self.config.agent.clone(),
            )
            .with_host_view(rec, self.config.host_view.as_ref(), host_cpus())
        };
        if let Some(spare) = spare {
            // The spare's helper is in the cgroup already: it joins nothing.
            match spare.launch(&self.cgroups, &rec.id, &rec.limits, &plan(Vec::new())) {
                Ok(pid) => return Ok(pid),
                Err(e) => {
                    tracing::warn!(box_id = %rec.id, error = %e, "spare helper failed; starting without it");
                    self.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("clear cgroup", e))?;
                }
            }
        }
        let plan = plan(self.cgroups.procs_files(&rec.id));
        self.cgroups
            .create(&rec.id, &rec.limits)
            .and_then(|()| self.cgroups.set_cpus(&rec.id, &plan.cpus))
            .map_err(|e| BackendError::new("create cgroup", e))?;
        self.run_helper(&plan).inspect_err(|_| {
            let _ = self.cgroups.destroy(&rec.id);
        })
    }

    fn handle_for(&self, rec: &BoxRecord, pid: u32) -> BoxHandle {
        BoxHandle {
            pid,
            agent: AgentAddr::Unix(self.socket_path(rec)),
            network: NetAttach::Netns(format!("/proc/{pid}/ns/net").into()),
            ca_key: Some(self.pool.ca_key_path(&rec.id)).filter(|p| p.exists()),
        }
    }

    /// A backend over `pool` with the host's cgroup layout.
    pub fn new(pool: Pool, config: NsConfig) -> Result<Self, BackendError> {
        let cgroups = CgroupLayout::detect().map_err(|e| BackendError::new("cgroups unavailable", e))?;
        spare::remove_stale(&cgroups, &pool);
        pool.finish_restores();
        std::fs::create_dir_all(&config.run_dir)
            .map_err(|e| BackendError::new(format!("create {}", config.run_dir.display()), e))?;
        let pool = Arc::new(pool);
        if let crate::pool::PoolKind::Loop { .. } = pool.kind() {
            spawn_trimmer(Arc::downgrade(&pool));
        }
        Ok(Self { pool, cgroups, config, spare: Arc::default(), spare_roots: Arc::default() })
    }

    /// Gives the pool back, e.g. to unmount it, once background work (a spare's
    /// refill, a trim) lets go of it; `None` if that takes over 10 s.
    pub fn into_pool(self) -> Option<Pool> {
        if let Some(spare) = self.spare.lock().unwrap_or_else(PoisonError::into_inner).take() {
            spare.discard(&self.cgroups);
        }
        for (_, root) in self.spare_roots.lock().unwrap_or_else(PoisonError::into_inner).drain() {
            let _ = self.pool.delete_spare_root(&root.name);
        }
        let mut pool = self.pool;
        for _ in 0..1000 {
            match Arc::try_unwrap(pool) {
                Ok(pool) => return Some(pool),
                Err(shared) => pool = shared,
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        None
    }

    /// A root for a new box of `image`: the spare snapshot if there is one of
    /// this build of the image, else a snapshot made now. Either way a new
    /// spare is prepared in the background.
    fn take_root(&self, image: &Name, id: &BoxId) -> Result<PathBuf, BackendError> {
        let spare = self.spare_roots.lock().unwrap_or_else(PoisonError::into_inner).remove(image);
        self.refill_root(image);
        if let Some(spare) = spare {
            if self.pool.image_dev(image) == Some(spare.image_dev) {
                if let Ok(root) = self.pool.adopt_spare_root(&spare.name, id) {
                    return Ok(root);
                }
            }
            // A rebuilt image, or a failed rename: the spare is of no use.
            let _ = self.pool.delete_spare_root(&spare.name);
        }
        self.pool.snapshot_image(image, id).map_err(|e| BackendError::new(format!("snapshot image {image}"), e))
    }

    fn refill_root(&self, image: &Name) {
        let (slot, pool, image) = (Arc::clone(&self.spare_roots), Arc::clone(&self.pool), image.clone());
        std::thread::spawn(move || {
            if slot.lock().unwrap_or_else(PoisonError::into_inner).contains_key(&image) {
                return;
            }
            match SpareRoot::prepare(&pool, &image) {
                Ok(root) => {
                    // Another refill may have won the race; keep one.
                    let leftover = match slot.lock().unwrap_or_else(PoisonError::into_inner).entry(image) {
                        Entry::Occupied(_) => Some(root),
                        Entry::Vacant(free) => {
                            free.insert(root);
                            None
                        }
                    };
                    if let Some(root) = leftover {
                        let _ = pool.delete_spare_root(&root.name);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not prepare a spare root"),
            }
        });
    }

    /// Prepares the next spare helper in the background, if there is none.
    fn refill_spare(&self) {
        let (slot, cgroups, helper) = (Arc::clone(&self.spare), self.cgroups.clone(), self.config.helper.clone());
        std::thread::spawn(move || {
            if slot.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                return;
            }
            match Spare::prepare(&cgroups, &helper) {
                Ok(spare) => {
                    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
                    match slot.take() {
                        // Another refill won the race; keep one.
                        Some(other) => {
                            *slot = Some(other);
                            drop(slot);
                            spare.discard(&cgroups);
                        }
                        None => *slot = Some(spare),
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not prepare a spare helper"),
            }
        });
    }

    /// The cgroup layout in use.
    pub fn cgroups(&self) -> &CgroupLayout {
        &self.cgroups
    }

    fn box_run_dir(&self, rec: &BoxRecord) -> PathBuf {
        self.config.run_dir.join(rec.id.as_str())
    }

    fn socket_path(&self, rec: &BoxRecord) -> PathBuf {
        self.box_run_dir(rec).join("agent.sock")
    }

    fn make_own(&self, rec: &BoxRecord, root: &Path) -> Result<(), BackendError> {
        make_own(&self.pool, rec, root, rec.limits.disk, self.config.account_disk)
    }

    /// Tells the box's agent its disk limit and use, which its `statfs` of `/`
    /// reports (`df /`). Best effort and never waiting: a box whose agent is
    /// not accepting just keeps the numbers it had.
    fn tell_disk(&self, rec: &BoxRecord) {
        use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
        let used = self.pool.exclusive_bytes(&rec.id).unwrap_or(0);
        let msg = moat_agent::protocol::HostMsg::Disk { limit: rec.limits.disk, used }.encode();
        let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
        let Ok(sock) = socket(AddressFamily::Unix, SockType::Stream, flags, None) else { return };
        let Ok(addr) = UnixAddr::new(&self.socket_path(rec)) else { return };
        if connect(std::os::fd::AsRawFd::as_raw_fd(&sock), &addr).is_ok() {
            let _ = nix::unistd::write(&sock, &msg);
        }
    }

    fn run_helper(&self, plan: &SpawnPlan) -> Result<u32, BackendError> {
        let json = serde_json::to_vec(plan).map_err(|e| BackendError::new("encode spawn plan", e))?;
        run_helper(&self.config.helper, "box-spawn", &json)
    }

    /// The pool and cgroup layout, for the microVM backend to share.
    pub fn shared(&self) -> (Arc<Pool>, CgroupLayout) {
        (Arc::clone(&self.pool), self.cgroups.clone())
    }
}

/// Gives a box's new directory (a snapshot, a copy) its disk limit (`limit`
/// bytes of its own) and account charge (`account_disk` in all), and a
/// fresh identity written into `root` (the box's root, or a VM box's
/// mini-root of files), its CA key kept on the host; on failure the
/// directory is deleted again.
pub(crate) fn make_own(
    pool: &Pool,
    rec: &BoxRecord,
    root: &Path,
    limit: u64,
    account_disk: u64,
) -> Result<(), BackendError> {
    let result = pool
        .set_disk_limit(&rec.id, limit)
        .and_then(|()| pool.charge_account(&rec.id, &rec.account, account_disk))
        .map_err(|e| BackendError::new("limit disk use", e))
        .and_then(|()| {
            identity::mint(root, &rec.name).map_err(|e| match e.kind() {
                // A new root has written nothing of its own: the account's budget is spent.
                std::io::ErrorKind::QuotaExceeded => BackendError::msg(format!(
                    "your boxes hold all this server allows per account ({}) on disk; remove boxes or files first",
                    moat_core::limits::format_size(account_disk)
                )),
                _ => BackendError::new("mint box identity", e),
            })
        })
        .and_then(|ca_key| {
            pool.store_ca_key(&rec.id, &ca_key).map_err(|e| BackendError::new("store the box's CA key", e))
        });
    if result.is_err() {
        let _ = pool.delete_box(&rec.id);
    }
    result
}

/// Runs `helper verb` with `plan` on its stdin; the pid it prints.
pub(crate) fn run_helper(helper: &Path, verb: &str, plan: &[u8]) -> Result<u32, BackendError> {
    let mut child = Command::new(helper)
        .arg(verb)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| BackendError::new(format!("run {}", helper.display()), e))?;
    if let Some(mut stdin) = child.stdin.take() {
        if let Err(e) = stdin.write_all(plan) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(BackendError::new(format!("send the plan to {verb}"), e));
        }
    }
    let out = child.wait_with_output().map_err(|e| BackendError::new(format!("wait for {verb}"), e))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.trim().parse::<u32>() {
        Ok(pid) if out.status.success() => Ok(pid),
        _ => Err(BackendError::msg(format!("box did not start: {}", String::from_utf8_lossy(&out.stderr).trim()))),
    }
}

/// Runs `work` with the box's processes frozen (if it runs and is not
/// frozen already): whatever it reads of the box's files is one instant.
pub(crate) fn while_frozen(
    cgroups: &CgroupLayout,
    rec: &BoxRecord,
    work: impl FnOnce() -> Result<(), crate::pool::PoolError>,
) -> Result<(), BackendError> {
    let frozen = cgroups.freeze(&rec.id).map_err(|e| BackendError::new(format!("freeze {}", rec.name), e))?;
    let done = work();
    let thawed = if frozen { cgroups.thaw(&rec.id) } else { Ok(()) };
    done.map_err(|e| BackendError::new(format!("copy {}", rec.name), e))?;
    thawed.map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))
}

impl Backend for NsBackend {
    fn set_environment(&self, rec: &BoxRecord, vars: &[(String, Option<String>)]) -> Result<(), BackendError> {
        if vars.is_empty() {
            return Ok(());
        }
        let root = self.pool.box_path(&rec.id);
        let dir: std::os::fd::OwnedFd =
            std::fs::File::open(&root).map_err(|e| BackendError::new("open the box's root", e))?.into();
        crate::environment::update(&dir, vars).map_err(|e| BackendError::new("write the box's /etc/environment", e))
    }

    fn has_image(&self, image: &Name) -> bool {
        self.pool.has_image(image)
    }

    fn build_image(&self, name: &Name, progress: Progress<'_>) -> Result<(), BackendError> {
        image::build(&self.pool, name, progress).map_err(|e| BackendError::new(format!("build image {name}"), e))
    }

    fn create(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        let root = self.take_root(&rec.image, &rec.id)?;
        self.make_own(rec, &root)
    }

    fn start(&self, rec: &BoxRecord) -> Result<BoxHandle, BackendError> {
        // A restore left unfinished is finished before the box runs on its root.
        self.pool.finish_restore_of(&rec.id).map_err(|e| BackendError::new("finish the box's restore", e))?;
        let pid = self.boot(rec)?;
        self.tell_disk(rec);
        Ok(self.handle_for(rec, pid))
    }

    fn is_running(&self, rec: &BoxRecord) -> bool {
        // Judged from the host, not by asking the box: its PID 1 lives exactly as
        // long as its cgroup holds processes (PID 1's death ends the namespace).
        !self.cgroups.pids(&rec.id).is_empty()
    }

    fn handle(&self, rec: &BoxRecord) -> Option<BoxHandle> {
        self.cgroups.first_pid(&rec.id, rec.pid).map(|pid| self.handle_for(rec, pid))
    }

    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("stop box", e))
    }

    fn destroy(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("stop box", e))?;
        self.pool.delete_box(&rec.id).map_err(|e| BackendError::new("delete box filesystem", e))?;
        match std::fs::remove_dir_all(self.box_run_dir(rec)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(BackendError::new("remove run dir", e)),
            _ => Ok(()),
        }
    }

    fn dup(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError> {
        // Frozen, the source's processes cannot write during the snapshot, which
        // flushes the subvolume's dirty data: the copy is one instant of it.
        let copied = while_frozen(&self.cgroups, src, || {
            fault::point("dup-while-frozen");
            self.pool.snapshot_box(&src.id, &dst.id).map(drop)
        });
        if let Err(e) = copied {
            // A snapshot made before the thaw failed is not left behind.
            let _ = self.pool.delete_box(&dst.id);
            return Err(e);
        }
        fault::point("dup-after-snapshot");
        self.make_own(dst, &self.pool.box_path(&dst.id)).map(|()| Copied::Files)
    }

    fn checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        // Frozen, as for `dup`: the checkpoint is one instant of the box.
        while_frozen(&self.cgroups, rec, || {
            fault::point("checkpoint-while-frozen");
            self.pool.save_checkpoint(&owner(rec), label.as_str())
        })
    }

    fn checkpoints(&self, rec: &BoxRecord, held: bool) -> Vec<Checkpoint> {
        self.pool.checkpoints(&rec.id, held)
    }

    fn restore(&self, rec: &BoxRecord, label: &Name, before: &Name) -> Result<(), BackendError> {
        self.pool
            .restore_checkpoint(&owner(rec), label.as_str(), before.as_str())
            .map_err(|e| BackendError::new(format!("restore {} to {label}", rec.name), e))?;
        // The same machine, under the name it has now (a promote since the
        // checkpoint renamed it).
        identity::rename_if_changed(&self.pool.box_path(&rec.id), &rec.name)
            .map_err(|e| BackendError::new("rename box", e))
    }

    fn delete_checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        self.pool
            .delete_checkpoint(&rec.id, label.as_str())
            .map_err(|e| BackendError::new(format!("delete checkpoint {label} of {}", rec.name), e))
    }

    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        crate::diff::diff(&self.pool.box_path(&a.id), &self.pool.box_path(&b.id), out)
            .map_err(|e| BackendError::new(format!("compare {} and {}", a.name, b.name), e))
    }

    fn adopt(&self, rec: &BoxRecord, from: &AccountId) -> Result<(), BackendError> {
        self.pool
            .move_charge(&rec.id, from, &rec.account, self.config.account_disk)
            .map_err(|e| BackendError::new("charge the box's disk use to its owner", e))?;
        identity::rename(&self.pool.box_path(&rec.id), &rec.name).map_err(|e| BackendError::new("name the box", e))?;
        let pid = self.handle(rec).ok_or_else(|| BackendError::msg("the box is not running"))?.pid;
        set_running_host_name(pid, &rec.name).map_err(|e| BackendError::new("set the box's host name", e))
    }

    fn rename(&self, rec: &BoxRecord, name: &Name) -> Result<(), BackendError> {
        identity::rename(&self.pool.box_path(&rec.id), name).map_err(|e| BackendError::new("rename box", e))
    }

    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.cgroups.thaw(&rec.id).map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))
    }

    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.cgroups.freeze(&rec.id).map(|_| ()).map_err(|e| BackendError::new(format!("freeze {}", rec.name), e))
    }

    fn meter(&self, rec: &BoxRecord) -> Option<MeterReading> {
        if rec.state == moat_core::BoxState::Running {
            self.tell_disk(rec);
        }
        self.cgroups.meter(&rec.id)
    }

    fn disk_usage(&self, rec: &BoxRecord) -> Option<u64> {
        self.pool.exclusive_bytes(&rec.id)
    }

    fn account_disk_usage(&self, account: &AccountId) -> Option<u64> {
        self.pool.account_bytes(account)
    }
}

/// Sets the host name of the running box whose PID 1 is `pid`, from a
/// thread of its own that joins the box's UTS namespace (which belongs to
/// the host's user namespace) and ends with it.
fn set_running_host_name(pid: u32, name: &Name) -> std::io::Result<()> {
    let uts = std::fs::File::open(format!("/proc/{pid}/ns/uts"))?;
    let name = name.to_string();
    std::thread::spawn(move || -> std::io::Result<()> {
        nix::sched::setns(&uts, nix::sched::CloneFlags::CLONE_NEWUTS)?;
        nix::unistd::sethostname(&name)?;
        Ok(())
    })
    .join()
    .map_err(|_| std::io::Error::other("the host name thread panicked"))?
}

/// What the box's subvolumes are charged to and limited by.
fn owner(rec: &BoxRecord) -> crate::checkpoint::Owner<'_> {
    crate::checkpoint::Owner { id: &rec.id, account: &rec.account, disk_limit: rec.limits.disk }
}

/// How often the pool's free space is given back to the host.
const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(20);

/// Trims a loop pool now and every [`TRIM_INTERVAL`] while it is open (a trim
/// of space already trimmed costs ~50 ms of kernel time here).
fn spawn_trimmer(pool: std::sync::Weak<Pool>) {
    let _ = std::thread::Builder::new().name("pool-trim".into()).spawn(move || {
        while let Some(pool) = pool.upgrade() {
            if let Err(e) = pool.trim() {
                tracing::warn!(error = %e, "trimming the pool failed");
                return;
            }
            drop(pool);
            std::thread::sleep(TRIM_INTERVAL);
        }
    });
}

/// The CPUs this daemon may use (what a box's share is taken from).
fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}
