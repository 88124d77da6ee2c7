//! Box cgroups: limits, membership, and killing everything in a box.
//!
//! Pure cgroup v2 hosts (the common case) get one directory per box under
//! `/sys/fs/cgroup/moat` (`moat-NODE` for a fleet node: see
//! [`parent_name`]). Hybrid hosts, whose v1 hierarchies hold the memory,
//! pids, cpu and freezer controllers, get one directory in each of those, and
//! in cpuset where it is mounted: there a box's cpuset is the CPUs it is
//! pinned to, which is what LXCFS shows it in /proc/cpuinfo (its quota-based
//! CPU view needs cpu and cpuacct in one hierarchy, which such hosts lack).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moat_core::{Limits, MeterReading};
use serde::{Deserialize, Serialize};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const V1_CONTROLLERS: [&str; 5] = ["memory", "pids", "cpu", "cpuacct", "freezer"];
/// CFS period used for CPU bandwidth, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;

/// The name of the cgroup a server's boxes live under: `moat` on a single
/// host; `moat-NODE` for fleet node `NODE`, because a box keeps its id when
/// it moves between nodes, and two nodes on one host (a test fleet, or an
/// operator's) must not share its cgroup: the source ending its old copy
/// would kill the new one.
pub fn parent_name(node: &str) -> String {
    if node.is_empty() {
        "moat".to_string()
    } else {
        format!("moat-{node}")
    }
}

/// The tasks (processes and threads) all boxes together may hold: the host's
/// PID space (or its thread limit, if lower) less an eighth of it, at least
/// 1,024, kept for the host (its daemons, sshd, moat's own processes), so
/// that no box, nor any account's boxes together, can leave it unable to
/// fork. Set on the parent cgroup, where the kernel counts every box's.
pub fn task_budget() -> u64 {
    let read = |path: &str| fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<u64>().ok());
    let space = [read("/proc/sys/kernel/pid_max"), read("/proc/sys/kernel/threads-max")].into_iter().flatten().min();
    let space = space.unwrap_or(32_768);
    space - (space / 8).max(1024).min(space / 2)
}

/// Which cgroup hierarchy the host offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CgroupLayout {
    /// Unified hierarchy; boxes live under `parent`.
    V2 {
        /// The `moat` cgroup.
        parent: PathBuf,
    },
    /// v1 controllers; boxes live under `<controller>/moat`.
    V1 {
        /// The `moat` cgroup in each of memory, pids, cpu and freezer.
        parents: Vec<PathBuf>,
    },
}

/// A cgroup failure.
#[derive(Debug, thiserror::Error)]
#[error("cgroup {path}: {source}")]
pub struct CgroupError {
    path: PathBuf,
    #[source]
    source: io::Error,
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(|source| CgroupError { path: path.to_path_buf(), source })
}

fn read(path: &Path) -> Result<String, CgroupError> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| CgroupError { path: path.to_path_buf(), source })
}

/// A v1 cpuset starts with no CPUs and no memory nodes, and no process can join
/// it so: give it its parent's. (A no-op outside cpuset.)
fn inherit_cpuset(dir: &Path) -> Result<(), CgroupError> {
    let Some(parent) = dir.parent() else { return Ok(()) };
    for file in ["cpuset.cpus", "cpuset.mems"] {
        if dir.join(file).exists() && read(&dir.join(file))?.is_empty() {
            write(&dir.join(file), &read(&parent.join(file))?)?;
        }
    }
    Ok(())
}

fn mkdir(path: &Path) -> Result<(), CgroupError> {
    match fs::create_dir(path) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(CgroupError { path: path.to_path_buf(), source: e }),
        _ => Ok(()),
    }
}

impl CgroupLayout {
    /// Finds the host's layout and prepares the parent cgroup(s) named
    /// `name` (see [`parent_name`]).
    pub fn detect(name: &str) -> Result<Self, CgroupError> {
        let root = Path::new(CGROUP_ROOT);
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            let source = io::Error::new(io::ErrorKind::InvalidInput, "not a cgroup name");
            return Err(CgroupError { path: root.join(name), source });
        }
        if root.join("cgroup.controllers").exists() {
            let parent = root.join(name);
            mkdir(&parent)?;
            // Delegate the controllers down to the boxes.
            write(&root.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
            write(&parent.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
            let layout = Self::V2 { parent };
            layout.bound_tasks()?;
            return Ok(layout);
        }
        let mut parents = Vec::new();
        for ctrl in V1_CONTROLLERS {
            let parent = root.join(ctrl).join(name);
            mkdir(&parent)?;
            parents.push(parent);
        }
        let cpuset = root.join("cpuset");
        if cpuset.join("cpuset.cpus").exists() {
            let parent = cpuset.join(name);
            mkdir(&parent)?;
            inherit_cpuset(&parent)?;
            parents.push(parent);
        }
        let layout = Self::V1 { parents };
        layout.bound_tasks()?;
        Ok(layout)
    }

    /// Holds every box's tasks together to [`task_budget`].
    fn bound_tasks(&self) -> Result<(), CgroupError> {
        let file = match self {
            Self::V2 { parent } => parent.join("pids.max"),
            Self::V1 { parents } => match parents.iter().find(|p| p.parent().is_some_and(|c| c.ends_with("pids"))) {
                Some(parent) => parent.join("pids.max"),
                None => return Ok(()),
            },
        };
        if !file.exists() {
            return Ok(());
        }
        write(&file, &task_budget().to_string())
    }

    /// The box's cgroup directories (one on v2, one per controller on v1).
    pub fn dirs(&self, id: &(impl AsRef<str> + ?Sized)) -> Vec<PathBuf> {
        match self {
            Self::V2 { parent } => vec![parent.join(id.as_ref())],
            Self::V1 { parents } => parents.iter().map(|p| p.join(id.as_ref())).collect(),
        }
    }

    /// The files a process writes its pid to in order to join the box.
    pub fn procs_files(&self, id: &(impl AsRef<str> + ?Sized)) -> Vec<PathBuf> {
        self.dirs(id).into_iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Creates the box's cgroups with its limits.
    pub fn create(&self, id: &(impl AsRef<str> + ?Sized), limits: &Limits) -> Result<(), CgroupError> {
        // A parent made again here (see `remove_parents`) gets its bound again.
        let parents_gone = self.dirs(id).iter().any(|dir| dir.parent().is_some_and(|p| !p.exists()));
        for dir in self.dirs(id) {
            // The parent may have been removed by `remove_parents` since `detect`.
            fs::create_dir_all(&dir).map_err(|source| CgroupError { path: dir.clone(), source })?;
            if let Some(parent) = dir.parent() {
                inherit_cpuset(parent)?;
            }
            inherit_cpuset(&dir)?;
        }
        if parents_gone {
            self.bound_tasks()?;
        }
        self.set_limits(id, limits)
    }

    /// Confines the box to `cpus` (all of its parent's when empty) where
    /// boxes have a cpuset; a no-op elsewhere.
    pub fn set_cpus(&self, id: &(impl AsRef<str> + ?Sized), cpus: &[usize]) -> Result<(), CgroupError> {
        for dir in self.dirs(id) {
            let file = dir.join("cpuset.cpus");
            if !file.exists() {
                continue;
            }
            let list = if cpus.is_empty() {
                read(&dir.parent().unwrap_or(&dir).join("cpuset.cpus"))?
            } else {
                cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
            };
            write(&file, &list)?;
        }
        Ok(())
    }

    /// Gives cgroup `from` (with its processes) the name `to`.
    pub fn rename(&self, from: &str, to: &(impl AsRef<str> + ?Sized)) -> Result<(), CgroupError> {
        for (old, new) in self.dirs(from).into_iter().zip(self.dirs(to)) {
            // Co-mounted controllers (cpu,cpuacct) share one directory: renamed already.
            if !old.exists() && new.exists() {
                continue;
            }
            fs::rename(&old, &new).map_err(|source| CgroupError { path: old, source })?;
        }
        Ok(())
    }

    /// Moat's cgroups whose names start with `prefix`.
    pub fn named_with_prefix(&self, prefix: &str) -> Vec<String> {
        let parent = match self {
            Self::V2 { parent } => parent,
            Self::V1 { parents } => match parents.first() {
                Some(p) => p,
                None => return Vec::new(),
            },
        };
        crate::pool::names_with_prefix(parent, prefix)
    }

    /// Writes the limits of an existing cgroup.
    pub fn set_limits(&self, id: &(impl AsRef<str> + ?Sized), limits: &Limits) -> Result<(), CgroupError> {
        let quota = u64::from(limits.cpus) * CPU_PERIOD_US;
        match self {
            Self::V2 { parent } => {
                let dir = parent.join(id.as_ref());
                write(&dir.join("memory.max"), &limits.memory.to_string())?;
                if dir.join("memory.swap.max").exists() {
                    write(&dir.join("memory.swap.max"), "0")?;
                }
                write(&dir.join("pids.max"), &limits.pids.to_string())?;
                write(&dir.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
            }
            Self::V1 { parents } => {
                for parent in parents {
                    let dir = parent.join(id.as_ref());
                    let set = |file: &str, value: &str| write(&dir.join(file), value);
                    if dir.join("memory.limit_in_bytes").exists() {
                        let memory = limits.memory.to_string();
                        if dir.join("memory.memsw.limit_in_bytes").exists() {
                            // memsw may never be below the memory limit: raise it
                            // first when raising, lower it last when lowering.
                            let current: u64 = fs::read_to_string(dir.join("memory.limit_in_bytes"))
                                .ok()
                                .and_then(|s| s.trim().parse().ok())
                                .unwrap_or(u64::MAX);
                            if limits.memory > current {
                                set("memory.memsw.limit_in_bytes", &memory)?;
                                set("memory.limit_in_bytes", &memory)?;
                            } else {
                                set("memory.limit_in_bytes", &memory)?;
                                set("memory.memsw.limit_in_bytes", &memory)?;
                            }
                        } else {
                            set("memory.limit_in_bytes", &memory)?;
                        }
                    }
                    if dir.join("pids.max").exists() {
                        set("pids.max", &limits.pids.to_string())?;
                    }
                    if dir.join("cpu.cfs_quota_us").exists() {
                        set("cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                        set("cpu.cfs_quota_us", &quota.to_string())?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The directory holding the box's freezer, and the file that freezes it.
    fn freezer(&self, id: &(impl AsRef<str> + ?Sized)) -> (PathBuf, &'static str) {
        match self {
            Self::V2 { parent } => (parent.join(id.as_ref()), "cgroup.freeze"),
            Self::V1 { parents } => {
                let dir = parents
                    .iter()
                    .find(|p| p.parent().is_some_and(|c| c.ends_with("freezer")))
                    .map(|p| p.join(id.as_ref()))
                    .unwrap_or_default();
                (dir, "freezer.state")
            }
        }
    }

    /// Freezes every process of the box and waits until they are all stopped.
    /// Returns whether this call froze it: `false` if the box has no cgroup (not
    /// running) or was frozen already (suspended), so that only a caller that
    /// froze the box thaws it.
    pub fn freeze(&self, id: &(impl AsRef<str> + ?Sized)) -> Result<bool, CgroupError> {
        let (dir, file) = self.freezer(id);
        if !dir.exists() {
            return Ok(false);
        }
        let v1 = file == "freezer.state";
        let frozen = || self.is_frozen(id);
        if frozen() {
            return Ok(false);
        }
        write(&dir.join(file), if v1 { "FROZEN" } else { "1" })?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !frozen() {
            if Instant::now() > deadline {
                let _ = self.thaw(id);
                return Err(CgroupError { path: dir, source: io::Error::other("processes did not freeze") });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(true)
    }

    /// The box's first process: `recorded` (its PID 1 as the store has it)
    /// if it is still in the box's cgroup, else any process there.
    pub fn first_pid(&self, id: &(impl AsRef<str> + ?Sized), recorded: Option<u32>) -> Option<u32> {
        let pids: Vec<u32> = self.pids(id).into_iter().filter_map(|p| u32::try_from(p).ok()).collect();
        recorded.filter(|p| pids.contains(p)).or_else(|| pids.first().copied())
    }

    /// Whether every process of the box is frozen.
    pub fn is_frozen(&self, id: &(impl AsRef<str> + ?Sized)) -> bool {
        let (dir, file) = self.freezer(id);
        if file == "freezer.state" {
            fs::read_to_string(dir.join(file)).is_ok_and(|s| s.trim() == "FROZEN")
        } else {
            fs::read_to_string(dir.join("cgroup.events")).is_ok_and(|s| s.lines().any(|l| l == "frozen 1"))
        }
    }

    /// Lets the box's processes run again; a no-op if it is not frozen or has no cgroup.
    pub fn thaw(&self, id: &(impl AsRef<str> + ?Sized)) -> Result<(), CgroupError> {
        let (dir, file) = self.freezer(id);
        if !dir.exists() {
            return Ok(());
        }
        write(&dir.join(file), if file == "freezer.state" { "THAWED" } else { "0" })
    }

    /// The box's CPU time and resident memory, if its cgroup exists.
    pub fn meter(&self, id: &(impl AsRef<str> + ?Sized)) -> Option<MeterReading> {
        let read = |path: PathBuf| fs::read_to_string(path).ok();
        match self {
            Self::V2 { parent } => {
                let dir = parent.join(id.as_ref());
                let stat = read(dir.join("cpu.stat"))?;
                let usec: u64 = stat.lines().find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse().ok())?;
                let memory = read(dir.join("memory.current"))?.trim().parse().ok()?;
                Some(MeterReading { cpu_ns: usec * 1000, memory_bytes: memory })
            }
            Self::V1 { parents } => {
                let dir = |ctrl: &str| {
                    parents.iter().find(|p| p.parent().is_some_and(|c| c.ends_with(ctrl))).map(|p| p.join(id.as_ref()))
                };
                let cpu_ns = read(dir("cpuacct")?.join("cpuacct.usage"))?.trim().parse().ok()?;
                let memory_bytes = read(dir("memory")?.join("memory.usage_in_bytes"))?.trim().parse().ok()?;
                Some(MeterReading { cpu_ns, memory_bytes })
            }
        }
    }

    /// Sends SIGKILL to every process of the box, without racing pid reuse:
    /// cgroup v2 kills by cgroup; on v1 the box is frozen first, so none of its
    /// processes can exit (and free its pid) between the listing and the kill,
    /// then thawed so that the kills take effect.
    fn kill_all(&self, id: &(impl AsRef<str> + ?Sized)) -> Result<(), CgroupError> {
        if let Self::V2 { parent } = self {
            let kill = parent.join(id.as_ref()).join("cgroup.kill");
            if kill.exists() {
                return write(&kill, "1");
            }
        }
        // A box that will not freeze is still killed, if with the (tiny) race.
        let _ = self.freeze(id);
        for pid in self.pids(id) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        self.thaw(id)
    }

    /// The names of the boxes that have a cgroup under this server's parent
    /// (running, frozen, or left empty), whatever the pool holds.
    pub fn box_names(&self) -> Vec<String> {
        let parent = match self {
            Self::V2 { parent } => Some(parent),
            Self::V1 { parents } => parents.first(),
        };
        let Some(Ok(entries)) = parent.map(fs::read_dir) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// Removes moat's parent cgroups if no box uses them any more.
    pub fn remove_parents(&self) {
        let parents = match self {
            Self::V2 { parent } => std::slice::from_ref(parent),
            Self::V1 { parents } => parents.as_slice(),
        };
        for parent in parents {
            // Fails (EBUSY) while another daemon's boxes live there; that is fine.
            let _ = fs::remove_dir(parent);
        }
    }

    /// The host pids in the box's cgroup.
    pub fn pids(&self, id: &(impl AsRef<str> + ?Sized)) -> Vec<i32> {
        let Some(procs) = self.procs_files(id).into_iter().next() else {
            return Vec::new();
        };
        fs::read_to_string(procs).unwrap_or_default().lines().filter_map(|l| l.trim().parse().ok()).collect()
    }

    /// Kills every process in the box and removes its cgroups. Missing cgroups are
    /// not an error, so this also finishes a removal that was interrupted.
    pub fn destroy(&self, id: &(impl AsRef<str> + ?Sized)) -> Result<(), CgroupError> {
        let dirs: Vec<PathBuf> = self.dirs(id).into_iter().filter(|d| d.exists()).collect();
        if dirs.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.pids(id).is_empty() {
                break;
            }
            self.kill_all(id)?;
            if Instant::now() > deadline {
                let path = dirs.first().cloned().unwrap_or_default();
                return Err(CgroupError { path, source: io::Error::other("processes survive SIGKILL") });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        for dir in dirs {
            // rmdir fails with EBUSY until the kernel has finished tearing the
            // last task down; give it a moment.
            let mut tries = 0;
            loop {
                match fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if tries < 500 => {
                        let _ = e;
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(source) => return Err(CgroupError { path: dir, source }),
                }
            }
        }
        Ok(())
    }
}
