//! The namespace backend: a box is a tree of processes in its own user, mount,
//! pid, net, uts, ipc and cgroup namespaces, on a snapshot of its image, under
//! cgroup limits, seccomp and a reduced capability set. Works on any Linux host.

pub mod boxtmp;
#[allow(unsafe_code)]
pub mod enforce;
pub mod hostview;
pub mod netns;
pub mod plan;
pub mod seccomp;
pub mod spare;
mod stock;
pub mod sysview;

use std::path::PathBuf;

use moat_core::{fault, BackendError, BoxId, BoxRecord, ChangeSink, Copied, Name};

use crate::host::{helper, Host};
use crate::machine::{Machine, StillWork};
use plan::SpawnPlan;
use spare::{Spare, SpareRoot};
use stock::Stock;

/// Helpers kept waiting in cgroups of their own: each is a process and a
/// network namespace, so a few.
const SPARE_HELPERS: usize = 4;

/// Snapshots kept of each image in use: each costs a subvolume's root and
/// nothing else, so enough for a burst of creates.
const SPARE_ROOTS: usize = 16;

/// What only the namespace machine needs.
#[derive(Debug, Clone, Default)]
pub struct NsConfig {
    /// Per-box /proc totals (LXCFS), where available.
    pub host_view: Option<hostview::HostView>,
    /// The sysfs every box binds as its /sys (see [`sysview`]); `None`: each
    /// box mounts its own.
    pub shared_sys: Option<std::path::PathBuf>,
    /// The tmpfs holding every box's /dev and /run (see [`boxtmp`]); `None`:
    /// each box mounts its own.
    pub shared_tmp: Option<std::path::PathBuf>,
}

/// The namespace machine.
pub struct NsMachine {
    host: Host,
    config: NsConfig,
    /// The next `start`'s helper, already in a cgroup (see [`spare`]).
    spare: Stock<(), Spare>,
    /// The next `create`'s root, per image (see [`spare`]).
    spare_roots: Stock<Name, SpareRoot>,
}

impl NsMachine {
    /// The namespace machine of `host`; spares a daemon gone left behind are
    /// removed.
    pub fn new(host: Host, config: NsConfig) -> Self {
        spare::remove_stale(&host.cgroups, &host.pool);
        let running = host.cgroups.box_names();
        // No cgroup at all may as well be cgroups not read: removing a
        // running box's directory would take its /dev from under it.
        if let (Some(shared), false) = (&config.shared_tmp, running.is_empty()) {
            boxtmp::remove_stale(shared, &running);
        }
        let cgroups = host.cgroups.clone();
        let spare = Stock::new(SPARE_HELPERS, move |spare: Spare| spare.discard(&cgroups));
        let pool = std::sync::Arc::clone(&host.pool);
        let spare_roots = Stock::new(SPARE_ROOTS, move |root: SpareRoot| {
            let _ = pool.delete_spare_root(&root.name);
        });
        Self { host, config, spare, spare_roots }
    }

    /// Boots the box's PID 1; returns its host pid.
    fn boot(&self, rec: &BoxRecord) -> Result<u32, BackendError> {
        let cgroups = &self.host.cgroups;
        let run_dir = self.host.run_dir(&rec.id);
        std::fs::create_dir_all(&run_dir).map_err(|e| BackendError::new(format!("create {}", run_dir.display()), e))?;
        // A previous boot's processes (if any) must be gone before a new PID 1.
        cgroups.destroy(&rec.id).map_err(|e| BackendError::new("clear old cgroup", e))?;
        self.clear_tmp(rec)?;
        let spare = self.spare.take(&());
        self.refill_spare();
        let plan = |cgroup_procs| {
            SpawnPlan::for_box(
                rec,
                self.host.pool.box_path(&rec.id),
                cgroup_procs,
                self.agent_socket(rec),
                self.host.config.agent.clone(),
            )
            .with_host_view(rec, self.config.host_view.as_ref(), host_cpus())
            .with_sys(self.config.shared_sys.clone())
            .with_tmp(self.config.shared_tmp.as_deref().map(|shared| boxtmp::box_dir(shared, rec.id.as_ref())))
        };
        if let Some(spare) = spare {
            // The spare's helper is in the cgroup already: it joins nothing.
            match spare.launch(cgroups, &rec.id, &rec.limits, &plan(Vec::new())) {
                Ok(pid) => return Ok(pid),
                Err(e) => {
                    tracing::warn!(box_id = %rec.id, error = %e, "spare helper failed; starting without it");
                    cgroups.destroy(&rec.id).map_err(|e| BackendError::new("clear cgroup", e))?;
                    // Its PID 1 may have made the box's directory already.
                    self.clear_tmp(rec)?;
                }
            }
        }
        let plan = plan(cgroups.procs_files(&rec.id));
        cgroups
            .create(&rec.id, &rec.limits)
            .and_then(|()| cgroups.set_cpus(&rec.id, &plan.cpus))
            .map_err(|e| BackendError::new("create cgroup", e))?;
        let json = serde_json::to_vec(&plan).map_err(|e| BackendError::new("encode spawn plan", e))?;
        helper::run(&self.host.config.helper, "box-spawn", &json).inspect_err(|_| {
            let _ = cgroups.destroy(&rec.id);
        })
    }

    /// Removes what the box kept in /dev and /run (its processes are gone).
    fn clear_tmp(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        match &self.config.shared_tmp {
            Some(shared) => boxtmp::clear(shared, rec.id.as_ref())
                .map_err(|e| BackendError::new(format!("clear {}'s /dev and /run", rec.name), e)),
            None => Ok(()),
        }
    }

    /// Discards the spare roots of `image`, which is gone.
    pub fn forget_image(&self, image: &Name) {
        self.spare_roots.forget(image);
    }

    /// Ends the spares prepared ahead (before the pool is let go).
    pub fn discard_spares(&self) {
        self.spare.close();
        self.spare_roots.close();
    }

    /// A root for a new box of `image`: the spare snapshot if there is one of
    /// this build of the image, else a snapshot made now. Either way a new
    /// spare is prepared in the background.
    fn take_root(&self, image: &Name, id: &BoxId) -> Result<PathBuf, BackendError> {
        let spare = self.spare_roots.take(image);
        if let Some(spare) = spare {
            let current = self.host.pool.image_dev(image) == Some(spare.image_dev);
            if current {
                if let Ok(root) = self.host.pool.adopt_spare_root(&spare.name, id) {
                    self.refill_root(image);
                    return Ok(root);
                }
            }
            // A failed rename, or a rebuilt image (whose other spares are
            // of the old build too): the spare is of no use.
            let _ = self.host.pool.delete_spare_root(&spare.name);
            if !current {
                self.spare_roots.forget(image);
            }
        }
        self.refill_root(image);
        self.host.pool.snapshot_image(image, id).map_err(|e| BackendError::new(format!("snapshot image {image}"), e))
    }

    fn refill_root(&self, image: &Name) {
        let (pool, name) = (std::sync::Arc::clone(&self.host.pool), image.clone());
        self.spare_roots.refill(image.clone(), move || {
            SpareRoot::prepare(&pool, &name)
                .inspect_err(|e| tracing::warn!(error = %e, "could not prepare a spare root"))
                .ok()
        });
    }

    /// Prepares the next spare helper in the background, if there is none.
    fn refill_spare(&self) {
        let (cgroups, helper) = (self.host.cgroups.clone(), self.host.config.helper.clone());
        self.spare.refill((), move || {
            Spare::prepare(&cgroups, &helper)
                .inspect_err(|e| tracing::warn!(error = %e, "could not prepare a spare helper"))
                .ok()
        });
    }

    /// Tells the box's agent its disk limit and use, which its `statfs` of `/`
    /// reports (`df /`). Best effort and never waiting: a box whose agent is
    /// not accepting just keeps the numbers it had.
    fn tell_disk_now(&self, rec: &BoxRecord) {
        use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
        let used = self.host.pool.exclusive_bytes(&rec.id).unwrap_or(0);
        let msg = moat_agent::protocol::HostMsg::Disk { limit: rec.limits.disk, used }.encode();
        let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
        let Ok(sock) = socket(AddressFamily::Unix, SockType::Stream, flags, None) else { return };
        let Ok(addr) = UnixAddr::new(&self.agent_socket(rec)) else { return };
        if connect(std::os::fd::AsRawFd::as_raw_fd(&sock), &addr).is_ok() {
            let _ = nix::unistd::write(&sock, &msg);
        }
    }

    /// Runs `work` with the box's processes frozen (if it runs and is not
    /// frozen already): whatever it reads of the box's files is one instant.
    fn while_frozen(&self, rec: &BoxRecord, work: &mut StillWork<'_>) -> Result<(), BackendError> {
        let cgroups = &self.host.cgroups;
        let frozen = cgroups.freeze(&rec.id).map_err(|e| BackendError::new(format!("freeze {}", rec.name), e))?;
        let done = work();
        let thawed = if frozen { cgroups.thaw(&rec.id) } else { Ok(()) };
        done.map_err(|e| BackendError::new(format!("copy {}", rec.name), e))?;
        thawed.map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))
    }
}

impl Machine for NsMachine {
    fn lay_out(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.take_root(&rec.image, &rec.id).map(drop)
    }

    fn files(&self, rec: &BoxRecord) -> PathBuf {
        self.host.pool.box_path(&rec.id)
    }

    fn start(&self, rec: &BoxRecord) -> Result<u32, BackendError> {
        let pid = self.boot(rec)?;
        self.tell_disk_now(rec);
        Ok(pid)
    }

    fn agent_socket(&self, rec: &BoxRecord) -> PathBuf {
        self.host.run_dir(&rec.id).join("agent.sock")
    }

    fn loopback_on_host(&self) -> bool {
        true
    }

    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.host.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("stop box", e))?;
        self.clear_tmp(rec)
    }

    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.host.cgroups.freeze(&rec.id).map(drop).map_err(|e| BackendError::new(format!("freeze {}", rec.name), e))
    }

    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.host.cgroups.thaw(&rec.id).map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))
    }

    fn copy(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError> {
        // Frozen, the source's processes cannot write during the snapshot, which
        // flushes the subvolume's dirty data: the copy is one instant of it.
        self.while_frozen(src, &mut || {
            fault::point("dup-while-frozen");
            self.host.pool.snapshot_box(&src.id, &dst.id).map(drop)
        })?;
        Ok(Copied::Files)
    }

    fn quiesce(&self, rec: &BoxRecord, work: &mut StillWork<'_>) -> Result<(), BackendError> {
        self.while_frozen(rec, work)
    }

    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        crate::diff::diff(&self.host.pool.box_path(&a.id), &self.host.pool.box_path(&b.id), out)
            .map_err(|e| BackendError::new(format!("compare {} and {}", a.name, b.name), e))
    }

    fn adopted(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        let pid =
            self.host.cgroups.first_pid(&rec.id, rec.pid).ok_or_else(|| BackendError::msg("the box is not running"))?;
        set_running_host_name(pid, &rec.name).map_err(|e| BackendError::new("set the box's host name", e))
    }

    fn tell_disk(&self, rec: &BoxRecord) {
        self.tell_disk_now(rec);
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

/// The CPUs this daemon may use (what a box's share is taken from).
fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}
