//! The host's one [`Backend`]: what every box needs of storage (images,
//! checkpoints, quotas and charges, identity, removal) done once over the
//! pool, and what only its kind of machine can do (boot, freeze, copy while
//! running, list its files) asked of the [`Machine`] its record names.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use moat_agent::protocol::HostMsg;
use moat_core::backend::Progress;
use moat_core::{
    fault, AccountId, AgentAddr, Backend, BackendError, BackendKind, BoxHandle, BoxId, BoxRecord, BoxState, ChangeSink,
    Checkpoint, Copied, MeterReading, Name, NetAttach, Received,
};

use crate::checkpoint::Owner;
use crate::host::{own, Host};
use crate::machine::Machine;
use crate::ns::NsMachine;
use crate::pool::Pool;
use crate::vm::VmMachine;
use crate::{identity, image, travel};

/// How long a box's agent has to answer a short request (a VM's, under TCG
/// and a loaded host, is slow).
const AGENT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Every box of this host, whichever machine runs it.
pub struct HostBackend {
    host: Host,
    ns: NsMachine,
    /// MicroVMs, or why this server runs none.
    vm: Result<VmMachine, String>,
}

impl HostBackend {
    /// The host's boxes, run by `ns` and, where this server has them, `vm`.
    pub fn new(host: Host, ns: NsMachine, vm: Result<VmMachine, String>) -> Self {
        Self { host, ns, vm }
    }

    /// The host's shared parts.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// Gives the pool back, e.g. to unmount it, once background work (a
    /// spare's refill, a trim) lets go of it; `None` if that takes over 10 s.
    pub fn into_pool(self) -> Option<Pool> {
        let Self { host, ns, vm } = self;
        ns.discard_spares();
        drop((ns, vm));
        let mut pool = host.pool;
        for _ in 0..1000 {
            match Arc::try_unwrap(pool) {
                Ok(pool) => return Some(pool),
                Err(shared) => pool = shared,
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        None
    }

    fn machine(&self, kind: BackendKind) -> Result<&dyn Machine, BackendError> {
        match kind {
            BackendKind::Ns => Ok(&self.ns),
            BackendKind::Vm => match &self.vm {
                Ok(vm) => Ok(vm),
                Err(why) => Err(BackendError::msg(format!("this server runs no microVM boxes: {why}"))),
            },
        }
    }

    fn handle_for(&self, machine: &dyn Machine, rec: &BoxRecord, pid: u32) -> BoxHandle {
        BoxHandle {
            pid,
            agent: AgentAddr::Unix(machine.agent_socket(rec)),
            network: NetAttach::Netns(format!("/proc/{pid}/ns/net").into()),
            ca_key: Some(self.host.pool.ca_key_path(&rec.id)).filter(|p| p.exists()),
        }
    }

    /// Gives a box's new subvolume (laid out, or copied) its disk limit,
    /// account charge and a fresh identity; on failure it is deleted.
    fn make_own(&self, machine: &dyn Machine, rec: &BoxRecord) -> Result<(), BackendError> {
        let limit = rec.limits.disk + machine.disk_slack();
        own::make_own(&self.host.pool, rec, &machine.files(rec), limit, self.host.config.account_disk)
    }

    /// What the box's subvolumes are charged to and limited by.
    fn owner<'a>(machine: &dyn Machine, rec: &'a BoxRecord) -> Owner<'a> {
        Owner { id: &rec.id, account: &rec.account, disk_limit: rec.limits.disk + machine.disk_slack() }
    }
}

impl Backend for HostBackend {
    fn has_image(&self, image: &Name) -> bool {
        self.host.pool.has_image(image)
    }

    fn image_removed(&self, image: &Name) {
        self.ns.forget_image(image);
        if let Ok(vm) = &self.vm {
            vm.forget_image(image);
        }
    }

    fn save_image(&self, rec: &BoxRecord, key: &Name) -> Result<(), BackendError> {
        if rec.backend != BackendKind::Ns {
            return Err(BackendError::msg("a VM box cannot be saved as an image yet"));
        }
        // One atomic snapshot of the root, running or not: what a crash then would leave.
        let pool = &self.host.pool;
        let root = pool.box_path(&rec.id);
        crate::sys::subvolume_snapshot(&root, &pool.images_dir(), key.as_str(), true)
            .map_err(|e| BackendError::new(format!("save box {} as image {key}", rec.name), e))
    }

    fn image_has_user(&self, image: &Name, name: &str) -> bool {
        crate::layers::has_user(&self.host.pool, image, name)
    }

    fn build_image(&self, name: &Name, progress: Progress<'_>) -> Result<(), BackendError> {
        image::build(&self.host.pool, name, progress).map_err(|e| BackendError::new(format!("build image {name}"), e))
    }

    fn create(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        let machine = self.machine(rec.backend)?;
        let started = std::time::Instant::now();
        machine.lay_out(rec)?;
        let laid_out = started.elapsed();
        self.make_own(machine, rec)?;
        tracing::debug!(box_id = %rec.id, laid_out = ?laid_out, made_own = ?started.elapsed() - laid_out, "box files made");
        Ok(())
    }

    fn start(&self, rec: &BoxRecord) -> Result<BoxHandle, BackendError> {
        let machine = self.machine(rec.backend)?;
        // A restore left unfinished is finished before the box runs on its root.
        self.host.pool.finish_restore_of(&rec.id).map_err(|e| BackendError::new("finish the box's restore", e))?;
        let started = std::time::Instant::now();
        let pid = machine.start(rec)?;
        tracing::debug!(box_id = %rec.id, took = ?started.elapsed(), "box booted");
        Ok(self.handle_for(machine, rec, pid))
    }

    fn is_running(&self, rec: &BoxRecord) -> bool {
        self.host.runs(&rec.id)
    }

    fn set_service(&self, rec: &BoxRecord, argv: &[String]) -> Result<(), BackendError> {
        let socket = self.machine(rec.backend)?.agent_socket(rec);
        let msg = HostMsg::Service { argv: argv.to_vec() };
        crate::agent_call::ask(&socket, &msg, AGENT_DEADLINE)
            .map_err(|e| BackendError::new(format!("tell box {} its service", rec.name), e))
    }

    fn service_log(&self, rec: &BoxRecord) -> Result<Vec<u8>, BackendError> {
        let socket = self.machine(rec.backend)?.agent_socket(rec);
        crate::agent_call::output(&socket, &HostMsg::ServiceLog, AGENT_DEADLINE)
            .map_err(|e| BackendError::new(format!("read box {}'s service log", rec.name), e))
    }

    fn handle(&self, rec: &BoxRecord) -> Option<BoxHandle> {
        let machine = self.machine(rec.backend).ok()?;
        self.host.cgroups.first_pid(&rec.id, rec.pid).map(|pid| self.handle_for(machine, rec, pid))
    }

    fn box_sockets(&self, rec: &BoxRecord, count: usize) -> Result<Option<Vec<OwnedFd>>, BackendError> {
        if !self.machine(rec.backend)?.loopback_on_host() {
            return Ok(None);
        }
        let cgroups = &self.host.cgroups;
        let not_running = || BackendError::msg(format!("box {} is not running", rec.name));
        let pid = cgroups.first_pid(&rec.id, rec.pid).ok_or_else(not_running)?;
        let still_the_box = || cgroups.pids(&rec.id).iter().any(|p| u32::try_from(*p) == Ok(pid));
        crate::host::port_socket::box_sockets(pid, still_the_box, count)
            .map(Some)
            .map_err(|e| BackendError::new(format!("make sockets in box {}'s network", rec.name), e))
    }

    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.machine(rec.backend)?.stop(rec)?;
        // A saved machine is of the processes that just ended.
        self.host.pool.forget_saved_machine(&rec.id).map_err(|e| BackendError::new("remove a saved machine", e))
    }

    fn park(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.machine(rec.backend)?.park(rec)
    }

    fn destroy(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.discard(&rec.id)
    }

    fn discard(&self, id: &BoxId) -> Result<(), BackendError> {
        // Needs no machine: a box of a kind this server does not run goes too.
        self.host.cgroups.destroy(id).map_err(|e| BackendError::new("stop box", e))?;
        self.host.pool.forget_saved_machine(id).map_err(|e| BackendError::new("remove a saved machine", e))?;
        self.host.pool.delete_box(id).map_err(|e| BackendError::new("delete box filesystem", e))?;
        match std::fs::remove_dir_all(self.host.run_dir(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(BackendError::new("remove run dir", e)),
            _ => Ok(()),
        }
    }

    fn pack_for_move(&self, rec: &BoxRecord) -> Result<bool, BackendError> {
        let machine = self.machine(rec.backend)?;
        if rec.backend == BackendKind::Ns {
            return machine.stop(rec).map(|()| false);
        }
        machine.park(rec)?;
        travel::pack(&self.host.pool, &rec.id).map_err(|e| BackendError::new("pack the saved machine to move", e))
    }

    fn received(&self, rec: &BoxRecord, received: &Received) -> Result<(), BackendError> {
        let machine = self.machine(rec.backend)?;
        let pool = &self.host.pool;
        // A machine saved here before (a move away and back) is not this box's now.
        pool.forget_saved_machine(&rec.id).map_err(|e| BackendError::new("remove a saved machine", e))?;
        let limit = rec.limits.disk + machine.disk_slack();
        let made = pool
            .set_disk_limit(&rec.id, limit)
            .and_then(|()| pool.charge_account(&rec.id, &rec.account, self.host.config.account_disk))
            .and_then(|()| pool.charge_received(&rec.id, &rec.account, &received.subvolumes, limit))
            .map_err(|e| BackendError::new("charge the received box's disk use", e))
            .and_then(|()| {
                for (label, subvolume, saved_ms) in &received.checkpoints {
                    pool.keep_received_checkpoint(&rec.id, subvolume, label, *saved_ms)
                        .map_err(|e| BackendError::new(format!("keep checkpoint {label}"), e))?;
                }
                Ok(())
            })
            .and_then(|()| {
                // A VM box that travelled with its saved machine keeps its CA
                // (its running guest trusts it); any other gets a new one.
                let unpacked = match rec.backend {
                    BackendKind::Vm => travel::unpack(pool, &rec.id),
                    BackendKind::Ns => Ok(None),
                };
                match unpacked.map_err(|e| BackendError::new("unpack the saved machine", e))? {
                    Some(key) => Ok(key),
                    None => identity::rekey_ca(&machine.files(rec))
                        .map_err(|e| BackendError::new("give the box a new CA", e)),
                }
            })
            .and_then(|key| pool.store_ca_key(&rec.id, &key).map_err(|e| BackendError::new("store the CA key", e)));
        made.inspect_err(|_| {
            let _ = pool.forget_saved_machine(&rec.id);
            let _ = pool.delete_box(&rec.id);
        })
    }

    fn local_boxes(&self) -> Vec<BoxId> {
        // Its files, and its processes: a box whose files are gone (a lost
        // disk) may still run here, and must be found to be ended.
        let files: Vec<String> = std::fs::read_dir(self.host.pool.boxes_dir())
            .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let names: std::collections::BTreeSet<String> =
            files.into_iter().chain(self.host.cgroups.box_names()).collect();
        names.iter().filter_map(|n| BoxId::parse(n)).collect()
    }

    fn set_environment(&self, rec: &BoxRecord, vars: &[(String, Option<String>)]) -> Result<(), BackendError> {
        if vars.is_empty() {
            return Ok(());
        }
        let machine = self.machine(rec.backend)?;
        let dir: std::os::fd::OwnedFd =
            std::fs::File::open(machine.files(rec)).map_err(|e| BackendError::new("open the box's files", e))?.into();
        crate::environment::update(&dir, vars).map_err(|e| BackendError::new("write the box's /etc/environment", e))?;
        machine.files_changed(rec, &["etc/environment"])
    }

    fn dup(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError> {
        let machine = self.machine(src.backend)?;
        let started = std::time::Instant::now();
        let pool = &self.host.pool;
        let copied = machine
            .copy(src, dst)
            // A VM box's disk is a file no larger than its limit (see `lineage`).
            .and_then(|copied| match src.backend {
                BackendKind::Ns => pool
                    .note_copy(&src.id, &dst.id)
                    .map(|()| copied)
                    .map_err(|e| BackendError::new(format!("note {}'s parent", dst.name), e)),
                BackendKind::Vm => Ok(copied),
            })
            .inspect_err(|_| {
                // Nothing of a copy that failed is left behind.
                let _ = pool.forget_saved_machine(&dst.id);
                let _ = pool.delete_box(&dst.id);
            })?;
        fault::point("dup-after-snapshot");
        let snapshot = started.elapsed();
        self.make_own(machine, dst).inspect_err(|_| {
            let _ = pool.forget_saved_machine(&dst.id);
        })?;
        tracing::debug!(box_id = %dst.id, snapshot = ?snapshot, made_own = ?started.elapsed() - snapshot, "copied");
        Ok(copied)
    }

    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        if a.backend != b.backend {
            return Err(BackendError::msg(format!(
                "{} is a {} box and {} a {} box: only boxes of one backend are compared",
                a.name, a.backend, b.name, b.backend
            )));
        }
        self.machine(a.backend)?.diff(a, b, out)
    }

    fn checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        let machine = self.machine(rec.backend)?;
        let owner = Self::owner(machine, rec);
        // Held still: the checkpoint is one instant of the box.
        machine.quiesce(rec, &mut || {
            fault::point("checkpoint-while-frozen");
            self.host.pool.save_checkpoint(&owner, label.as_str())
        })
    }

    fn checkpoints(&self, rec: &BoxRecord, held: bool) -> Vec<Checkpoint> {
        self.host.pool.checkpoints(&rec.id, held)
    }

    fn restore(&self, rec: &BoxRecord, label: &Name, before: &Name) -> Result<(), BackendError> {
        let machine = self.machine(rec.backend)?;
        // A saved machine belongs to the files it was saved with.
        self.host.pool.forget_saved_machine(&rec.id).map_err(|e| BackendError::new("remove a saved machine", e))?;
        self.host
            .pool
            .restore_checkpoint(&Self::owner(machine, rec), label.as_str(), before.as_str())
            .map_err(|e| BackendError::new(format!("restore {} to {label}", rec.name), e))?;
        // The same machine, under the name it has now (a promote since the
        // checkpoint renamed it). The files are back already: a restore that
        // cannot write the name (the box made its /etc a link out of itself,
        // which writes in its root never follow) is still a restore.
        if let Err(e) = identity::rename_if_changed(&machine.files(rec), &rec.name) {
            tracing::warn!(box_name = %rec.name, error = %e, "restored; its host name files could not be written");
        }
        Ok(())
    }

    fn delete_checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        self.host
            .pool
            .delete_checkpoint(&rec.id, label.as_str())
            .map_err(|e| BackendError::new(format!("delete checkpoint {label} of {}", rec.name), e))
    }

    fn adopt(&self, rec: &BoxRecord, from: &AccountId) -> Result<(), BackendError> {
        let machine = self.machine(rec.backend)?;
        self.host
            .pool
            .move_charge(&rec.id, from, &rec.account, self.host.config.account_disk)
            .map_err(|e| BackendError::new("charge the box's disk use to its owner", e))?;
        identity::rename(&machine.files(rec), &rec.name).map_err(|e| BackendError::new("name the box", e))?;
        machine.adopted(rec)
    }

    fn rename(&self, rec: &BoxRecord, name: &Name) -> Result<(), BackendError> {
        let machine = self.machine(rec.backend)?;
        identity::rename(&machine.files(rec), name).map_err(|e| BackendError::new("rename box", e))?;
        machine.files_changed(rec, &["etc/hostname", "etc/hosts"])?;
        // A running box's processes see the new name at once, as an adopted
        // warm box's do, and a suspended namespace box's when they wake (a
        // stopped one takes it from its files at start).
        let live =
            rec.state == BoxState::Running || (rec.state == BoxState::Suspended && rec.backend == BackendKind::Ns);
        if live {
            let renamed = BoxRecord { name: name.clone(), ..rec.clone() };
            if let Err(e) = machine.adopted(&renamed) {
                tracing::warn!(box_name = %name, error = %e, "the running box keeps its old host name until it restarts");
            }
        }
        Ok(())
    }

    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.machine(rec.backend)?.thaw(rec)
    }

    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.machine(rec.backend)?.suspend(rec)
    }

    fn meter(&self, rec: &BoxRecord) -> Option<MeterReading> {
        let machine = self.machine(rec.backend).ok()?;
        if rec.state == BoxState::Running {
            machine.tell_disk(rec);
        }
        self.host.cgroups.meter(&rec.id)
    }

    fn disk_usage(&self, rec: &BoxRecord) -> Option<u64> {
        self.host.pool.exclusive_bytes(&rec.id)
    }

    fn account_disk_usage(&self, account: &AccountId) -> Option<u64> {
        self.host.pool.account_bytes(account)
    }
}
