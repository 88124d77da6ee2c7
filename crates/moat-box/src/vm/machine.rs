//! The microVM backend: a box is a guest on QEMU's `microvm` machine with
//! a kernel of its own, its root an ext4 disk file in the box's subvolume
//! (a reflink of its image's disk: copy-on-write, like a namespace box's
//! snapshot), reached over virtio-serial through its supervisor
//! ([`super::supervise`]). The pool, quotas, cgroups and checkpoints are
//! the host's ([`crate::backend`]); this is only what runs a box.
//!
//! The host never mounts a guest's disk (a file system a guest wrote is
//! hostile input to the host's kernel): what moat writes into a box goes
//! through the host's mini-root of files for it ([`super::files`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moat_core::{fault, BackendError, BoxRecord, ChangeSink, Copied, Name};

use crate::host::{helper, Host};
use crate::machine::{Machine, StillWork};
use crate::vm::qemu::{self, MachineSpec};
use crate::vm::supervise::{self, VmPlan};
use crate::vm::Accel;
use crate::vm::{disk, files, rekey, vmlinux};

/// What only the VM machine needs (the helper it runs as `<helper>
/// box-vm`, and the agent that is each guest's `/init`, are the host's).
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// The guest kernel (`vmlinuz-RELEASE`; modules from /lib/modules/RELEASE).
    pub kernel: PathBuf,
    /// An initramfs unpacked before moat's (modules, firmware), if any.
    pub initrd: Option<PathBuf>,
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// How guests' CPUs run here.
    pub accel: Accel,
}

/// A guest gets this long to come up (TCG boots here take ~2 s; a loaded
/// host more).
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the guest's agent may take to take a file.
const PUT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a guest's whole listing may take (diff's own limit).
const LIST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long `stop` lets an awake guest write out its data.
const SYNC_ON_STOP: Duration = Duration::from_secs(3);
/// How long QEMU may take to answer on QMP.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// Room a disk's file takes beyond the disk (the mini-root, metadata).
const DISK_SLACK: u64 = 64 << 20;
/// The files a running guest is handed again when they may have changed.
const LIVE_FILES: &[&str] = &["etc/hostname", "etc/hosts", "etc/environment"];

/// The microVM machine.
pub struct VmMachine {
    host: Host,
    config: VmConfig,
    /// The kernel QEMU loads: [`VmConfig::kernel`] unpacked where it can be.
    boot_kernel: PathBuf,
    /// Per image, held while its disk is made (another image's box need
    /// not wait for it).
    bases: Mutex<HashMap<Name, Arc<Mutex<()>>>>,
    /// The start of every initramfs (see [`VmMachine::initramfs_base`]).
    initramfs: Mutex<Option<Arc<Vec<u8>>>>,
}

impl VmMachine {
    /// The VM machine of `host`.
    pub fn new(host: Host, config: VmConfig) -> Result<Self, BackendError> {
        let pool = &host.pool;
        // Saves a crash cut short are of no use (a park renames only whole ones).
        for entry in std::fs::read_dir(pool.vm_states_dir()).into_iter().flatten().filter_map(Result::ok) {
            if entry.path().extension().is_some_and(|e| e == "partial") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let boot_kernel = match vmlinux::unpacked(&config.kernel, &pool.vm_kernels_dir()) {
            Ok(unpacked) => unpacked,
            Err(e) => {
                tracing::warn!(kernel = %config.kernel.display(), error = %e, "guests boot the kernel packed (slower)");
                config.kernel.clone()
            }
        };
        Ok(Self { host, config, boot_kernel, bases: Mutex::default(), initramfs: Mutex::default() })
    }

    fn box_run_dir(&self, rec: &BoxRecord) -> PathBuf {
        self.host.run_dir(&rec.id)
    }

    fn disk_path(&self, rec: &BoxRecord) -> PathBuf {
        self.host.pool.box_path(&rec.id).join("disk.raw")
    }

    /// The disk of this build of `image` (made from its tree the first
    /// time, unless it would be larger than `at_most`), open: keyed by the
    /// image's subvolume id, which btrfs never hands out twice.
    fn base(&self, image: &Name, at_most: u64) -> Result<std::fs::File, BackendError> {
        let tree = self.host.pool.image_path(image);
        let build =
            crate::sys::subvolume_id(&tree).map_err(|e| BackendError::new(format!("image {image} is not built"), e))?;
        let base = self.host.pool.vm_bases_dir().join(format!("{image}.{build}.raw"));
        let lock =
            Arc::clone(self.bases.lock().unwrap_or_else(PoisonError::into_inner).entry(image.clone()).or_default());
        let _held = lock.lock().unwrap_or_else(PoisonError::into_inner);
        if let Ok(file) = std::fs::File::open(&base) {
            return Ok(file);
        }
        let dir = self.host.pool.vm_bases_dir();
        std::fs::create_dir_all(&dir).map_err(|e| BackendError::new(format!("create {}", dir.display()), e))?;
        // Disks of older builds of this image go.
        self.forget_image(image);
        let partial = base.with_extension("partial");
        disk::ext4_image(&tree, &partial, at_most)
            .and_then(|()| std::fs::rename(&partial, &base))
            .and_then(|()| std::fs::File::open(&base))
            .map_err(|e| BackendError::new(format!("make a disk of image {image}"), e))
    }

    /// Removes the disks made of every build of `image` (boxes made from
    /// them keep their reflinks); only names of the form IMAGE.ID.raw are its.
    pub fn forget_image(&self, image: &Name) {
        let dir = self.host.pool.vm_bases_dir();
        for old in std::fs::read_dir(&dir).into_iter().flatten().filter_map(Result::ok) {
            let name = old.file_name().to_string_lossy().into_owned();
            let id = name.strip_prefix(&format!("{image}.")).and_then(|rest| rest.strip_suffix(".raw"));
            if id.is_some_and(|id| id.parse::<u64>().is_ok()) {
                let _ = std::fs::remove_file(old.path());
            }
        }
    }

    /// A new box's directory: its disk a reflink of the image's, as large as
    /// its disk limit (its file system grown to fill it), and its mini-root
    /// seeded from the image.
    fn make_box_dir(&self, rec: &BoxRecord, base: &std::fs::File) -> std::io::Result<()> {
        let disk = std::fs::OpenOptions::new().write(true).create_new(true).open(self.disk_path(rec))?;
        crate::sys::reflink(base, &disk)?;
        let size = disk.metadata()?.len();
        if rec.limits.disk < size {
            return Err(std::io::Error::other(format!(
                "a disk limit of {} is below the image's {}",
                moat_core::limits::format_size(rec.limits.disk),
                moat_core::limits::format_size(size)
            )));
        }
        disk.set_len(rec.limits.disk)?;
        drop(disk);
        disk::grow(&self.disk_path(rec))?;
        files::seed(&self.files(rec), &self.host.pool.image_path(&rec.image))
    }

    /// The box's initramfs, written to its run directory for QEMU (running as
    /// the box's uid) alone to read.
    fn write_initramfs(&self, rec: &BoxRecord, run_dir: &Path) -> Result<PathBuf, BackendError> {
        use std::os::unix::fs::PermissionsExt;
        let fail = |what: &str| {
            let what = what.to_string();
            move |e: std::io::Error| BackendError::new(what, e)
        };
        let base = self.initramfs_base()?;
        let files = crate::vm::initramfs::files_archive(&self.files(rec)).map_err(fail("make the initramfs"))?;
        let path = run_dir.join("initramfs.cpio");
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, [base.as_slice(), &files].concat()).map_err(fail("write the initramfs"))?;
        std::os::unix::fs::chown(&path, Some(rec.uid_base()), Some(rec.uid_base()))
            .and_then(|()| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)))
            .map_err(fail("hand the initramfs to the box's uid"))?;
        Ok(path)
    }

    /// What every box's initramfs starts with, made on the first boot: the
    /// operator's `--initrd`, then moat's (archives are unpacked in turn,
    /// so moat's `/init` wins), agent and modules read once.
    fn initramfs_base(&self) -> Result<Arc<Vec<u8>>, BackendError> {
        let mut held = self.initramfs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(base) = held.as_ref() {
            return Ok(Arc::clone(base));
        }
        let release = crate::vm::probe::kernel_release(&self.config.kernel).unwrap_or_default();
        let agent = std::fs::read(&self.host.config.agent).map_err(|e| BackendError::new("read the agent", e))?;
        let ours = crate::vm::initramfs::initramfs(&agent, Path::new("/lib/modules"), &release)
            .map_err(|e| BackendError::new("make the initramfs", e))?;
        let mut base = match &self.config.initrd {
            Some(extra) => std::fs::read(extra).map_err(|e| BackendError::new("read --initrd", e))?,
            None => Vec::new(),
        };
        base.extend_from_slice(&ours);
        let base = Arc::new(base);
        *held = Some(Arc::clone(&base));
        Ok(base)
    }

    /// The guest's memory: the box's limit less what QEMU itself needs.
    fn guest_mib(&self, rec: &BoxRecord) -> u64 {
        let overhead = qemu::overhead_mib(self.config.accel);
        (rec.limits.memory >> 20).saturating_sub(overhead).max(qemu::MIN_GUEST_MIB)
    }

    fn spec(&self, rec: &BoxRecord) -> MachineSpec {
        MachineSpec {
            accel: self.config.accel,
            memory_mib: self.guest_mib(rec),
            cpus: rec.limits.cpus.max(1),
            cmdline: qemu::cmdline(self.config.accel, crate::vm::probe::host_tsc_khz()),
            mac: qemu::random_mac(),
            incoming: false,
            memory_file: false,
        }
    }

    /// Where a box's machine is saved while it is parked, or a copy's
    /// machine until it first runs (outside the box's subvolume: the
    /// memory is not the box's disk use).
    fn saved_path(&self, id: &moat_core::BoxId) -> PathBuf {
        self.host.pool.saved_machine(id)
    }

    /// The file that is the guest's memory this boot, the box's uid's alone:
    /// a new one for a fresh boot (nothing of an earlier machine in it), the
    /// one saved beside the machine for a resume; `None` for a machine saved
    /// before memory files (its memory is in its save).
    fn memory_file(&self, rec: &BoxRecord, resume: bool) -> std::io::Result<Option<PathBuf>> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.host.pool.vm_memory(&rec.id);
        if resume {
            match std::fs::metadata(&path) {
                Ok(meta) => self.check_memory_length(rec, meta.len())?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            }
        } else {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            std::fs::create_dir_all(self.host.pool.vm_states_dir())?;
            let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
            // Sparse: only what the guest touches takes room.
            file.set_len(self.guest_mib(rec) << 20)?;
        }
        // A copy's is a reflink root made.
        std::os::unix::fs::chown(&path, Some(rec.uid_base()), Some(rec.uid_base()))?;
        Ok(Some(path))
    }

    /// Writes the running box's machine to `to` (its devices; its memory too
    /// if it has no memory file), runs `meanwhile` while it stands still just
    /// as saved (its disk flushed), and with `go_on` leaves it as it was
    /// (running, or paused); without, it stays stopped as saved, its disk and
    /// memory never written again (it is to be ended).
    fn save_machine(
        &self,
        rec: &BoxRecord,
        to: &Path,
        go_on: bool,
        meanwhile: impl FnOnce() -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        use std::os::unix::fs::OpenOptionsExt;
        let fail = |e: std::io::Error| BackendError::new(format!("save {}'s machine", rec.name), e);
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir).map_err(fail)?;
        }
        let file =
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(to).map_err(fail)?;
        let run_dir = self.box_run_dir(rec);
        let mut qmp = qemu::Qmp::connect(&supervise::qmp_socket(&run_dir), QMP_TIMEOUT).map_err(fail)?;
        let was_running = qmp.running().map_err(fail)?;
        // Whole frames only on the guest's side of its link, as saved (held
        // while `hold` lives: a crash meanwhile lets the link go with it).
        let hold = supervise::Hold::take(&run_dir).inspect_err(
            |e| tracing::warn!(box_id = %rec.id, error = %e, "could not hold the agent's link for a save"),
        );
        // A QEMU maps a memory file exactly when one is there (see `memory_file`).
        let saved = qmp.save(&file, self.host.pool.vm_memory(&rec.id).exists()).map_err(fail);
        let done = saved.and_then(|()| meanwhile());
        if let Ok(hold) = hold {
            if let Err(e) = hold.release() {
                tracing::warn!(box_id = %rec.id, error = %e, "could not let the agent's link go after a save");
            }
        }
        if !go_on {
            if done.is_err() {
                let _ = std::fs::remove_file(to);
            }
            return done;
        }
        // Saving hands the disk over to whoever loads the machine; `cont`
        // takes it back (and runs the vCPUs: a paused machine is paused again).
        let back = qmp.execute("cont", serde_json::Value::Null);
        let paused =
            if was_running { Ok(serde_json::Value::Null) } else { qmp.execute("stop", serde_json::Value::Null) };
        let result = done.and(back.and(paused).map(drop).map_err(fail));
        if result.is_err() {
            let _ = std::fs::remove_file(to);
        }
        result
    }

    /// Runs `work` with the running box's disk as the guest would leave it
    /// if shut down now: the guest writes out its dirty data, then its vCPUs
    /// are paused (QEMU flushing what it holds) for `work`. The box is left
    /// as it was (running, paused, frozen).
    fn flushed_and_paused(
        &self,
        rec: &BoxRecord,
        work: impl FnOnce() -> Result<(), crate::pool::PoolError>,
    ) -> Result<(), BackendError> {
        let fail = |e: std::io::Error| BackendError::new(format!("quiesce {}", rec.name), e);
        let frozen = self.host.cgroups.is_frozen(&rec.id);
        self.host.cgroups.thaw(&rec.id).map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))?;
        let result = (|| {
            let mut qmp =
                qemu::Qmp::connect(&supervise::qmp_socket(&self.box_run_dir(rec)), QMP_TIMEOUT).map_err(fail)?;
            let was_running = qmp.running().map_err(fail)?;
            if !was_running {
                qmp.execute("cont", serde_json::Value::Null).map_err(fail)?;
            }
            let synced = files::sync(&supervise::agent_socket(&self.box_run_dir(rec)), PUT_TIMEOUT);
            let stopped = qmp.execute("stop", serde_json::Value::Null);
            let done = synced
                .and(stopped)
                .map_err(fail)
                .and_then(|_| work().map_err(|e| BackendError::new(format!("copy {}", rec.name), e)));
            let back = if was_running { qmp.execute("cont", serde_json::Value::Null).map(drop) } else { Ok(()) };
            done.and(back.map_err(fail))
        })();
        if frozen {
            let _ = self.host.cgroups.freeze(&rec.id);
        }
        result
    }

    /// Runs `work` with the box's guest running (a suspended one is woken for
    /// it, and suspended again after).
    fn awake<T>(&self, rec: &BoxRecord, work: impl FnOnce() -> Result<T, BackendError>) -> Result<T, BackendError> {
        if !self.host.cgroups.is_frozen(&rec.id) {
            return work();
        }
        self.host.cgroups.thaw(&rec.id).map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))?;
        let woken = self.qmp(rec, "cont").map_err(|e| BackendError::new(format!("resume {}", rec.name), e));
        let result = woken.and_then(|()| work());
        let _ = self.suspend(rec);
        result
    }

    /// Tells a guest that runs again what it missed: the time, fresh
    /// randomness, and its files (all of them for a copy: its identity).
    fn after_resume(&self, rec: &BoxRecord, paths: Option<&[&str]>) -> Result<(), BackendError> {
        let socket = supervise::agent_socket(&self.box_run_dir(rec));
        let reseeded = files::resumed(&socket, PUT_TIMEOUT)
            .map_err(|e| BackendError::new(format!("set {}'s clock and randomness", rec.name), e));
        let pushed = match paths {
            Some(paths) => self.push_files(rec, paths),
            None => files::push_all(&socket, &self.files(rec), PUT_TIMEOUT)
                .map_err(|e| BackendError::new(format!("hand {} its files", rec.name), e)),
        };
        reseeded.and(pushed)
    }

    /// A copy's first run, before its first session: its guest's own
    /// identity files made new too (see [`crate::vm::rekey`]).
    fn rekey(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        let dir = self.host.pool.box_path(&rec.id);
        if !rekey::pending(&dir) {
            return Ok(());
        }
        let socket = supervise::agent_socket(&self.box_run_dir(rec));
        rekey::finish(&dir, &socket, &self.files(rec), &rec.name, PUT_TIMEOUT)
            .map_err(|e| BackendError::new(format!("give {} an identity of its own", rec.name), e))
    }

    fn boot(&self, rec: &BoxRecord, saved: Option<&Path>) -> Result<u32, BackendError> {
        let run_dir = self.box_run_dir(rec);
        std::fs::create_dir_all(&run_dir).map_err(|e| BackendError::new(format!("create {}", run_dir.display()), e))?;
        self.host.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("clear old cgroup", e))?;
        let started = std::time::Instant::now();
        let initramfs = self.write_initramfs(rec, &run_dir)?;
        tracing::debug!(box_id = %rec.id, took = ?started.elapsed(), "vm initramfs written");
        let memory = self
            .memory_file(rec, saved.is_some())
            .map_err(|e| BackendError::new(format!("make {}'s memory file", rec.name), e))?;
        self.host.cgroups.create(&rec.id, &rec.limits).map_err(|e| BackendError::new("create cgroup", e))?;
        let plan = VmPlan {
            qemu: self.config.qemu.clone(),
            kernel: self.boot_kernel.clone(),
            initramfs,
            disk: self.disk_path(rec),
            run_dir,
            machine: MachineSpec { incoming: saved.is_some(), memory_file: memory.is_some(), ..self.spec(rec) },
            uid: rec.uid_base(),
            cgroup_procs: self.host.cgroups.procs_files(&rec.id),
            incoming: saved.map(Path::to_path_buf),
            memory,
            boot_timeout_ms: BOOT_TIMEOUT.as_millis() as u64,
        };
        let json = serde_json::to_vec(&plan).map_err(|e| BackendError::new("encode the plan", e))?;
        let helper = std::time::Instant::now();
        let pid = helper::run(&self.host.config.helper, "box-vm", &json).inspect_err(|_| {
            let _ = self.host.cgroups.destroy(&rec.id);
            if saved.is_none() {
                let _ = std::fs::remove_file(self.host.pool.vm_memory(&rec.id));
            }
        })?;
        tracing::debug!(box_id = %rec.id, prepared = ?helper - started, up = ?helper.elapsed(), "vm booted");
        Ok(pid)
    }

    /// An error unless `len` is the guest's memory: a memory file its QEMU
    /// made longer (outside the disk quota) is neither kept nor resumed.
    fn check_memory_length(&self, rec: &BoxRecord, len: u64) -> std::io::Result<()> {
        let want = self.guest_mib(rec) << 20;
        if len == want {
            return Ok(());
        }
        Err(std::io::Error::other(format!("the memory file is {len} bytes, not {want}")))
    }

    /// Makes a parked machine's memory file (if it has one: else its save
    /// holds it) and its save `partial` durable before the save is named a
    /// machine to resume (a crash between would pair the devices' state with
    /// older memory), and drops the memory from the page cache: a parked box
    /// holds no host memory, and its next run's pages are charged to it.
    fn settle_memory(&self, rec: &BoxRecord, partial: &Path) -> std::io::Result<()> {
        let path = self.host.pool.vm_memory(&rec.id);
        match std::fs::File::open(&path) {
            Ok(memory) => {
                self.check_memory_length(rec, memory.metadata()?.len())?;
                memory.sync_all()?;
                nix::fcntl::posix_fadvise(&memory, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::File::open(partial)?.sync_all()
    }

    /// Makes `dst`'s memory file a copy of `src`'s, if it has one: a reflink,
    /// which first writes out the pages the guest dirtied since they were
    /// last written (the machine is stopped meanwhile, or not running).
    fn copy_memory(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<(), BackendError> {
        let from = self.host.pool.vm_memory(&src.id);
        if !from.exists() {
            return Ok(());
        }
        clone_file(&from, &self.host.pool.vm_memory(&dst.id))
            .map_err(|e| BackendError::new(format!("copy {}'s memory", src.name), e))
    }

    /// Marks `rec`, just copied, for its guest to be re-keyed on its first run.
    fn mark_copy(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        rekey::mark_copy(&self.host.pool.box_path(&rec.id))
            .map_err(|e| BackendError::new(format!("mark {}", rec.name), e))
    }

    /// Runs QMP `command` (no arguments) on the box's machine.
    fn qmp(&self, rec: &BoxRecord, command: &str) -> std::io::Result<()> {
        let path = supervise::qmp_socket(&self.box_run_dir(rec));
        qemu::Qmp::connect(&path, QMP_TIMEOUT)?.execute(command, serde_json::Value::Null).map(drop)
    }

    /// Hands a running, unfrozen guest the files of its mini-root that may
    /// have changed; a box not running gets them at its next boot.
    fn push_files(&self, rec: &BoxRecord, paths: &[&str]) -> Result<(), BackendError> {
        if !self.host.runs(&rec.id) || self.host.cgroups.is_frozen(&rec.id) {
            return Ok(());
        }
        files::push(&supervise::agent_socket(&self.box_run_dir(rec)), &self.files(rec), paths, PUT_TIMEOUT)
            .map_err(|e| BackendError::new(format!("hand {} its files", rec.name), e))
    }
}

impl Machine for VmMachine {
    fn lay_out(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        let started = std::time::Instant::now();
        let base = self.base(&rec.image, rec.limits.disk)?;
        self.host.pool.create_box(&rec.id).map_err(|e| BackendError::new("create the box's subvolume", e))?;
        if let Err(e) = self.make_box_dir(rec, &base) {
            let _ = self.host.pool.delete_box(&rec.id);
            return Err(BackendError::new("make the box's disk", e));
        }
        tracing::debug!(box_id = %rec.id, took = ?started.elapsed(), "vm box laid out");
        Ok(())
    }

    fn files(&self, rec: &BoxRecord) -> PathBuf {
        files::dir(&self.host.pool.box_path(&rec.id))
    }

    fn disk_slack(&self) -> u64 {
        DISK_SLACK
    }

    fn start(&self, rec: &BoxRecord) -> Result<u32, BackendError> {
        let saved = self.saved_path(&rec.id);
        if saved.exists() {
            let started = std::time::Instant::now();
            let resumed = self.boot(rec, Some(&saved));
            let _ = std::fs::remove_file(&saved);
            match resumed {
                Ok(pid) => {
                    let loaded = started.elapsed();
                    let copy = rekey::pending(&self.host.pool.box_path(&rec.id));
                    match self.after_resume(rec, None).and_then(|()| self.rekey(rec)) {
                        Ok(()) => {
                            tracing::debug!(box_id = %rec.id, loaded = ?loaded, told = ?started.elapsed() - loaded, "vm resumed");
                            return Ok(pid);
                        }
                        Err(e) if !copy => {
                            tracing::warn!(box_id = %rec.id, error = ?e, "could not tell a resumed guest what it missed");
                            return Ok(pid);
                        }
                        // A copy that cannot be made a machine of its own
                        // does not run as its parent: booted afresh instead.
                        Err(e) => {
                            tracing::warn!(box_id = %rec.id, error = ?e, "a resumed copy was not re-keyed");
                            self.host.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("stop box", e))?;
                        }
                    }
                }
                // Booted afresh instead, on a disk as a power cut leaves it.
                Err(e) => tracing::warn!(box_id = %rec.id, error = %e, "a saved machine did not load"),
            }
        }
        let pid = self.boot(rec, None)?;
        self.rekey(rec).inspect_err(|_| {
            let _ = self.host.cgroups.destroy(&rec.id);
        })?;
        Ok(pid)
    }

    fn agent_socket(&self, rec: &BoxRecord) -> PathBuf {
        supervise::agent_socket(&self.box_run_dir(rec))
    }

    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        // What the guest wrote reaches its disk first, if it is awake to do it.
        if self.host.runs(&rec.id) && !self.host.cgroups.is_frozen(&rec.id) {
            let _ = files::sync(&supervise::agent_socket(&self.box_run_dir(rec)), SYNC_ON_STOP);
        }
        self.host.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("stop box", e))
    }

    fn park(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        let saved = self.saved_path(&rec.id);
        let partial = saved.with_extension("partial");
        let mut kept = false;
        let ran = self.host.runs(&rec.id);
        if ran {
            // QEMU answers QMP only when not frozen; its vCPUs stay paused,
            // and after the save it never runs them or writes its disk again.
            self.host.cgroups.thaw(&rec.id).map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))?;
            match self.save_machine(rec, &partial, false, || Ok(())) {
                Ok(()) => kept = true,
                Err(e) => tracing::warn!(box_id = %rec.id, error = %e, "could not save a parked machine"),
            }
        }
        self.host.cgroups.destroy(&rec.id).map_err(|e| BackendError::new("stop box", e))?;
        // Only a machine whose QEMU is gone is one to resume (a crash before
        // this leaves a partial file the next park or removal replaces).
        if kept {
            if let Err(e) = self.settle_memory(rec, &partial) {
                tracing::warn!(box_id = %rec.id, error = %e, "a parked machine's memory is not kept");
                let _ = std::fs::remove_file(&partial);
                let _ = std::fs::remove_file(self.host.pool.vm_memory(&rec.id));
                return Ok(());
            }
            std::fs::rename(&partial, &saved)
                .and_then(|()| std::fs::File::open(self.host.pool.vm_states_dir())?.sync_all())
                .map_err(|e| BackendError::new("keep the saved machine", e))?;
        } else if ran {
            // The memory of a machine that was not saved.
            let _ = std::fs::remove_file(self.host.pool.vm_memory(&rec.id));
        }
        Ok(())
    }

    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        // Paused by QEMU, the guest's clocks stop with it (frozen alone, it
        // would find its clock source jumped on resume); frozen, QEMU's own
        // threads use nothing either. A QEMU frozen already (a suspended box
        // a restarted daemon freezes again) was paused first, and answers
        // nothing: asked, it held the daemon's start QMP's timeout a box.
        if !self.host.cgroups.is_frozen(&rec.id) {
            if let Err(e) = self.qmp(rec, "stop") {
                tracing::warn!(box_id = %rec.id, error = %e, "could not pause a guest's vCPUs; freezing it alone");
            }
        }
        self.host.cgroups.freeze(&rec.id).map(drop).map_err(|e| BackendError::new(format!("freeze {}", rec.name), e))
    }

    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        let frozen = self.host.cgroups.is_frozen(&rec.id);
        self.host.cgroups.thaw(&rec.id).map_err(|e| BackendError::new(format!("thaw {}", rec.name), e))?;
        if !self.host.runs(&rec.id) {
            return Ok(());
        }
        let fail = |e: std::io::Error| BackendError::new(format!("resume {}'s vCPUs", rec.name), e);
        let mut qmp = qemu::Qmp::connect(&supervise::qmp_socket(&self.box_run_dir(rec)), QMP_TIMEOUT).map_err(fail)?;
        let paused = !qmp.running().map_err(fail)?;
        if paused {
            qmp.execute("cont", serde_json::Value::Null).map_err(fail)?;
        }
        // Its clock stood while it was paused; and what changed meanwhile. A
        // guest that was neither (a start after a daemon restart) is not asked.
        if frozen || paused {
            if let Err(e) = self.after_resume(rec, Some(LIVE_FILES)) {
                tracing::warn!(box_id = %rec.id, error = ?e, "could not tell a resumed guest what it missed");
            }
        }
        Ok(())
    }

    fn copy(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError> {
        let saved = self.saved_path(&dst.id);
        if self.host.runs(&src.id) {
            // The machine is saved with its vCPUs paused and its disk
            // flushed, then its disk copied: the copy resumes as the very
            // machine the source was at that instant, its page cache and
            // processes included (when its first session comes: until then
            // it is a file, as a parked box is, and costs no CPU or memory).
            let cgroups = &self.host.cgroups;
            let frozen = cgroups.is_frozen(&src.id);
            let copied = cgroups.thaw(&src.id).map_err(|e| BackendError::new(format!("thaw {}", src.name), e));
            let copied = copied.and_then(|()| {
                self.save_machine(src, &saved, true, || {
                    fault::point("dup-while-frozen");
                    self.host
                        .pool
                        .snapshot_box(&src.id, &dst.id)
                        .map_err(|e| BackendError::new(format!("copy {}", src.name), e))?;
                    self.copy_memory(src, dst)
                })
            });
            if frozen {
                let _ = cgroups.freeze(&src.id);
            }
            return copied.and_then(|()| self.mark_copy(dst)).map(|()| Copied::Machine);
        }
        // A source whose machine is saved (parked, or a copy before its
        // first session) passes that machine on too.
        let pool = &self.host.pool;
        pool.snapshot_box(&src.id, &dst.id).map_err(|e| BackendError::new(format!("copy {}", src.name), e))?;
        self.mark_copy(dst)?;
        let src_saved = self.saved_path(&src.id);
        if !src_saved.exists() {
            return Ok(Copied::Files);
        }
        clone_file(&src_saved, &saved)
            .map_err(|e| BackendError::new(format!("copy {}'s saved machine", src.name), e))?;
        self.copy_memory(src, dst)?;
        Ok(Copied::Machine)
    }

    fn quiesce(&self, rec: &BoxRecord, work: &mut StillWork<'_>) -> Result<(), BackendError> {
        if !self.host.runs(&rec.id) {
            return work().map_err(|e| BackendError::new(format!("checkpoint {}", rec.name), e));
        }
        self.flushed_and_paused(rec, work)
    }

    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        // The host never reads a guest's disk: each guest lists its own files.
        for rec in [a, b] {
            if !self.host.runs(&rec.id) {
                return Err(BackendError::msg(format!(
                    "{0} is not running: a VM box's files are listed by the box itself (`start {0}` first)",
                    rec.name
                )));
            }
        }
        self.awake(a, || {
            self.awake(b, || {
                let listing = |rec: &BoxRecord| {
                    crate::vm::listing::Listing::open(&supervise::agent_socket(&self.box_run_dir(rec)), LIST_TIMEOUT)
                        .map_err(|e| BackendError::new(format!("ask {} for its files", rec.name), e))
                };
                let (mut left, mut right) = (listing(a)?, listing(b)?);
                crate::diff::diff_listings(&mut left, &mut right, out)
                    .map_err(|e| BackendError::new(format!("compare {} and {}", a.name, b.name), e))
            })
        })
    }

    fn files_changed(&self, rec: &BoxRecord, paths: &[&str]) -> Result<(), BackendError> {
        // Its files say so at once, as a namespace box's do.
        self.push_files(rec, paths)
    }

    fn adopted(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.push_files(rec, LIVE_FILES)
    }
}

/// Makes `to` a new copy-on-write copy of `from` (both in the pool).
fn clone_file(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let source = std::fs::File::open(from)?;
    let copy = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(to)?;
    crate::sys::reflink(&source, &copy).inspect_err(|_| {
        let _ = std::fs::remove_file(to);
    })
}
