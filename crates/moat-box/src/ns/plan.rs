//! The pure half of starting a box: everything the privileged helper will do,
//! decided up front as plain data that tests can read without root.

use std::path::PathBuf;

use moat_core::record::UIDS_PER_BOX;
use moat_core::BoxRecord;
use serde::{Deserialize, Serialize};

/// Linux capabilities a box's root keeps (Docker's default set); every other
/// one is dropped from the bounding set.
pub const KEPT_CAPS: &[u32] = &[
    0,  // CAP_CHOWN
    1,  // CAP_DAC_OVERRIDE
    3,  // CAP_FOWNER
    4,  // CAP_FSETID
    5,  // CAP_KILL
    6,  // CAP_SETGID
    7,  // CAP_SETUID
    8,  // CAP_SETPCAP
    10, // CAP_NET_BIND_SERVICE
    13, // CAP_NET_RAW
    18, // CAP_SYS_CHROOT
    27, // CAP_MKNOD
    29, // CAP_AUDIT_WRITE
    31, // CAP_SETFCAP
];

/// Host device nodes bind-mounted into the box's `/dev`.
pub const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// `/proc` entries hidden behind `/dev/null` (host information a box does not
/// need): among them the host's block devices (its disk, every loop device and
/// so every moat pool on the host) and its memory zones, which tell what the
/// box's own view of memory hides.
pub const MASKED_PROC: &[&str] = &[
    "kcore",
    "keys",
    "timer_list",
    "sysrq-trigger",
    "latency_stats",
    "cmdline",
    "partitions",
    "zoneinfo",
    "buddyinfo",
    "pagetypeinfo",
    "vmallocinfo",
    "sched_debug",
];

/// `/sys` directories hidden behind an empty read-only tmpfs: the pool's btrfs
/// (every tenant's quota groups) and block devices (each loop device names the
/// file behind it: every moat server's state dir).
pub const MASKED_SYS: &[&str] = &["fs/btrfs", "block", "devices/virtual/block"];

/// The box's PID 1 is the last process the kernel's OOM killer picks in its
/// box (it would take the whole box with it): the host lowers its score where
/// it may, and the agent starts everything at +500 (moat-agent's spawn.rs).
pub const AGENT_OOM_SCORE_ADJ: &str = "-999";

/// Most pseudo-terminals one box may hold at once.
pub const MAX_PTYS: u32 = 256;

/// The tty group's gid in Debian images, for devpts.
const TTY_GID: u32 = 5;

/// Everything the helper needs to start one box.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpawnPlan {
    /// The box's root filesystem on the host.
    pub rootfs: PathBuf,
    /// Host name inside the box.
    pub hostname: String,
    /// Host uid (and gid) that box uid 0 maps to.
    pub uid_base: u32,
    /// How many uids the box maps.
    pub uid_count: u32,
    /// cgroup.procs files to join before the namespaces are made.
    pub cgroup_procs: Vec<PathBuf>,
    /// Where the agent's listening socket is bound on the host.
    pub agent_socket: PathBuf,
    /// The static moat-agent binary on the host.
    pub agent_binary: PathBuf,
    /// Host gid of the box's tty group (devpts `gid=`).
    pub devpts_gid: u32,
    /// Files bound over the box's own (host file, path under the root): its
    /// totals in /proc instead of the host's.
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// The CPUs PID 1 (and so every process) runs on; empty: all.
    pub cpus: Vec<usize>,
    /// The sysfs bound read-only as the box's /sys (see [`super::sysview`]);
    /// `None`: the box mounts one of its own.
    #[serde(default)]
    pub sys: Option<PathBuf>,
    /// The box's directory in the shared tmpfs, whose `.dev` and `.run` are
    /// bound as its /dev and /run (see [`super::boxtmp`]); `None`: the box
    /// mounts a tmpfs of its own.
    #[serde(default)]
    pub tmp: Option<PathBuf>,
}

impl SpawnPlan {
    /// Plans the start of `rec`.
    pub fn for_box(
        rec: &BoxRecord,
        rootfs: PathBuf,
        cgroup_procs: Vec<PathBuf>,
        agent_socket: PathBuf,
        agent_binary: PathBuf,
    ) -> Self {
        let uid_base = rec.uid_base();
        Self {
            rootfs,
            hostname: rec.name.to_string(),
            uid_base,
            uid_count: UIDS_PER_BOX,
            cgroup_procs,
            agent_socket,
            agent_binary,
            devpts_gid: uid_base + TTY_GID,
            binds: Vec::new(),
            cpus: Vec::new(),
            sys: None,
            tmp: None,
        }
    }

    /// Shows the box its own totals: the host view's files, and an affinity
    /// of as many of the host's `host_cpus` CPUs as its limit allows.
    pub fn with_host_view(
        mut self,
        rec: &BoxRecord,
        view: Option<&super::hostview::HostView>,
        host_cpus: usize,
    ) -> Self {
        self.binds = view.map(|v| v.binds().to_vec()).unwrap_or_default();
        self.cpus = super::hostview::cpu_affinity(rec.limits.cpus, rec.slot, host_cpus);
        self
    }

    /// Binds `sys` as the box's /sys rather than mounting a sysfs of its own.
    pub fn with_sys(mut self, sys: Option<PathBuf>) -> Self {
        self.sys = sys;
        self
    }

    /// Keeps the box's /dev and /run in `tmp`, its directory in the shared
    /// tmpfs, rather than in a tmpfs of its own.
    pub fn with_tmp(mut self, tmp: Option<PathBuf>) -> Self {
        self.tmp = tmp;
        self
    }

    /// The line written to both `uid_map` and `gid_map`.
    pub fn id_map(&self) -> String {
        format!("0 {} {}\n", self.uid_base, self.uid_count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moat_core::{AccountId, BoxId, BoxState, Limits, Name};

    fn record(slot: u32) -> BoxRecord {
        BoxRecord {
            id: BoxId::random(),
            account: AccountId("a".into()),
            name: Name::new("web").unwrap(),
            image: Name::new("debian").unwrap(),
            limits: Limits::default(),
            backend: moat_core::BackendKind::Ns,
            slot,
            state: BoxState::Creating,
            pid: None,
            created_at: 0,
            parent: None,
            parent_name: None,
            idle: None,
            keep_running: false,
            state_since: 0,
            node: String::new(),
            epoch: 0,
        }
    }

    #[test]
    fn boxes_get_disjoint_unprivileged_uid_ranges() {
        let plan = |slot| SpawnPlan::for_box(&record(slot), "/r".into(), vec![], "/s".into(), "/a".into());
        let (a, b) = (plan(0), plan(1));
        assert!(a.uid_base >= 65536, "box root must not be a host system uid");
        assert_eq!(a.uid_base + a.uid_count, b.uid_base);
        assert_eq!(a.id_map(), format!("0 {} 65536\n", a.uid_base));
        assert_eq!(a.devpts_gid, a.uid_base + 5);
        assert_eq!(a.hostname, "web");
        assert!(a.binds.is_empty() && a.cpus.is_empty());
        let mut one = record(3);
        one.limits.cpus = 1;
        let pinned =
            SpawnPlan::for_box(&one, "/r".into(), vec![], "/s".into(), "/a".into()).with_host_view(&one, None, 2);
        assert_eq!(pinned.cpus, vec![1]);
    }

    #[test]
    fn dangerous_capabilities_are_not_kept() {
        for cap in [
            2,  /* DAC_READ_SEARCH */
            12, /* NET_ADMIN */
            16, /* SYS_MODULE */
            19, /* SYS_PTRACE */
            21, /* SYS_ADMIN */
        ] {
            assert!(!KEPT_CAPS.contains(&cap), "{cap}");
        }
    }
}
