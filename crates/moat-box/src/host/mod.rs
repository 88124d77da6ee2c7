//! The host's machinery that every kind of machine uses: cgroups, the helper
//! a box is started through, a new box's ownership (quota, charge, identity),
//! network namespace tooling, the gateway's sockets made inside a box's
//! namespace (the privileged half of egress), and the socket families any
//! process of a box may open. Beside it, `ns/` and `vm/` hold only what differs between
//! running a box on the host's kernel and in a guest of its own, and
//! [`crate::backend`] the storage both keep in the one pool.

pub mod cgroup;
pub mod egress;
pub mod helper;
pub mod netns;
pub mod nflog;
pub mod own;
pub mod port_socket;

use std::path::PathBuf;
use std::sync::Arc;

use moat_core::{BackendError, BoxId};

use crate::pool::{Pool, PoolKind};
use cgroup::CgroupLayout;

/// What every machine of a host shares, whichever kind it is.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Per-box run directories (agent sockets, a VM's QMP socket, console
    /// log and initramfs) live under here.
    pub run_dir: PathBuf,
    /// The program run as `<helper> box-spawn` or `<helper> box-vm` to start
    /// a box (the moat binary).
    pub helper: PathBuf,
    /// The static moat-agent binary, every box's PID 1.
    pub agent: PathBuf,
    /// Most bytes one account's boxes may write, together (see
    /// [`Pool::charge_account`]).
    pub account_disk: u64,
    /// The cgroup this server's boxes live under (see [`cgroup::parent_name`]).
    pub cgroup_parent: String,
}

/// The host's shared parts, handed to each machine (cheap to clone).
#[derive(Clone)]
pub struct Host {
    /// The storage pool every box's files live in.
    pub pool: Arc<Pool>,
    /// Where boxes' processes are counted, limited, frozen and killed.
    pub cgroups: CgroupLayout,
    /// Paths and limits.
    pub config: HostConfig,
}

impl Host {
    /// Opens the host's machinery over `pool`: the cgroup layout found here,
    /// restores a crash cut short finished or undone, the run directory, and
    /// a loop pool trimmed in the background.
    pub fn open(pool: Pool, config: HostConfig) -> Result<Self, BackendError> {
        let cgroups =
            CgroupLayout::detect(&config.cgroup_parent).map_err(|e| BackendError::new("cgroups unavailable", e))?;
        pool.finish_restores();
        std::fs::create_dir_all(&config.run_dir)
            .map_err(|e| BackendError::new(format!("create {}", config.run_dir.display()), e))?;
        let pool = Arc::new(pool);
        if let PoolKind::Loop { .. } = pool.kind() {
            spawn_trimmer(Arc::downgrade(&pool));
        }
        Ok(Self { pool, cgroups, config })
    }

    /// Whether box `id` runs, judged from the host, never by asking the box:
    /// its first process lives exactly as long as its cgroup holds processes
    /// (PID 1's death ends the namespace; the supervisor's, the VM).
    pub fn runs(&self, id: &BoxId) -> bool {
        !self.cgroups.pids(id).is_empty()
    }

    /// Box `id`'s run directory.
    pub fn run_dir(&self, id: &BoxId) -> PathBuf {
        self.config.run_dir.join(id.as_str())
    }
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

/// The socket families a box may use, in both machines (a box's processes,
/// and the VMM of a VM box): its own loopback, and the egress gateway's
/// listeners on it, need no more. AF_VSOCK, in particular, reaches the
/// hypervisor when moat runs in a VM, without passing the box's network
/// namespace.
pub(crate) const ALLOWED_SOCKET_FAMILIES: [u32; 4] =
    [libc::AF_UNIX as u32, libc::AF_INET as u32, libc::AF_INET6 as u32, libc::AF_NETLINK as u32];

/// The netlink protocols a box may open: routes and addresses (`ip`),
/// socket lists (`ss`), audit (PAM opens it) and generic netlink. Not the
/// kernel's device events: a box's network namespace belongs to the host's
/// user namespace, so the host's own (other boxes' VMs starting, loop
/// devices, pools) would reach it.
pub(crate) const ALLOWED_NETLINK: [u32; 4] = [
    libc::NETLINK_ROUTE as u32,
    libc::NETLINK_SOCK_DIAG as u32,
    libc::NETLINK_AUDIT as u32,
    libc::NETLINK_GENERIC as u32,
];

/// The seccomp block for `socket` and `socketpair`: a family of
/// [`ALLOWED_SOCKET_FAMILIES`] (else EAFNOSUPPORT) and, for netlink, a
/// protocol of [`ALLOWED_NETLINK`] (else EPROTONOSUPPORT, as a kernel
/// without it answers).
pub(crate) fn socket_rules() -> Vec<libc::sock_filter> {
    use crate::bpf::{arg0_one_of, arg_one_of, jump, off_arg, stmt, BPF_JEQ_K, BPF_LD_W_ABS};
    let netlink = arg_one_of(2, &ALLOWED_NETLINK, libc::EPROTONOSUPPORT);
    let skip = u8::try_from(netlink.len()).unwrap_or(u8::MAX);
    let mut block = vec![stmt(BPF_LD_W_ABS, off_arg(0)), jump(BPF_JEQ_K, libc::AF_NETLINK as u32, 0, skip)];
    block.extend(netlink);
    block.extend(arg0_one_of(&ALLOWED_SOCKET_FAMILIES, libc::EAFNOSUPPORT));
    block
}
