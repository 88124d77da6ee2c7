//! Where things live by default, and how the backend is put together.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use moat_box::ns::hostview::HostView;
use moat_box::ns::{boxtmp, sysview, NsConfig, NsMachine};
use moat_box::pool::Pool;
use moat_box::{Host, HostBackend, HostConfig};
use moat_core::Store;

/// The state directory unless told otherwise.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/moat";

/// Size of the sparse pool image on hosts whose state dir is not on btrfs.
pub const DEFAULT_POOL_SIZE: u64 = 256 << 30;

/// What a pool without btrfs simple quotas cannot do, and the fix (`moat
/// doctor` prints it, `moat serve` logs it at start).
pub const FULL_QGROUPS: &str = "full qgroups only: this kernel predates btrfs simple quotas (Linux 6.7), \
    so per-box limits hold but checkpoints are refused and account budgets are not enforced; \
    run Linux 6.7 or later for them (Debian 12 with bookworm-backports' linux-image-amd64, Debian 13, Ubuntu 24.04)";

/// Opens (formatting and mounting if needed) the storage pool under `state_dir`.
pub fn open_pool(state_dir: &Path) -> Result<Pool> {
    std::fs::create_dir_all(state_dir).with_context(|| format!("create {}", state_dir.display()))?;
    Pool::open(state_dir, DEFAULT_POOL_SIZE).context("open the storage pool")
}

/// Makes `dir` (the state directory) if needed and closes it to everyone but
/// root: the front door's uid, in particular, may not look inside.
pub fn private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("restrict {}", dir.display()))
}

/// Where the per-box /proc totals (LXCFS) are mounted.
pub fn host_view_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("lxcfs")
}

/// Where the sysfs every box binds as its /sys is mounted.
pub fn shared_sys_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("sys")
}

/// Where the tmpfs holding every box's /dev and /run is mounted.
pub fn shared_tmp_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("boxtmp")
}

/// The host's machinery over the state dir's pool: this executable as the
/// helper boxes start through, `agent` in every box.
pub fn host(state_dir: &Path, agent: PathBuf, account_disk: u64) -> Result<Host> {
    let pool = open_pool(state_dir)?;
    let helper = std::env::current_exe().context("find this executable")?;
    let cgroup_parent = cgroup_parent(state_dir)?;
    Ok(Host::open(pool, HostConfig { run_dir: state_dir.join("run"), helper, agent, account_disk, cgroup_parent })?)
}

/// The cgroup the state dir's boxes live under: `moat`, or `moat-NODE` once
/// it joined a fleet as node `NODE` (see `cgroup::parent_name`).
pub fn cgroup_parent(state_dir: &Path) -> Result<String> {
    if !state_dir.join("fleet.json").exists() {
        return Ok(moat_box::host::cgroup::parent_name(""));
    }
    // The membership alone: its keys and certificates are not needed here.
    let member = moat_fleet::join::read_member(state_dir)
        .with_context(|| format!("read {}'s fleet membership", state_dir.display()))?
        .member;
    let name = &member.name;
    if moat_core::ids::Name::new(name).is_err() {
        anyhow::bail!("{}: fleet member name {name:?} is not a DNS label", state_dir.display());
    }
    Ok(match member.role {
        moat_core::store::fleet::MemberRole::Node => moat_box::host::cgroup::parent_name(name),
        _ => moat_box::host::cgroup::parent_name(""),
    })
}

/// The backend as `serve` and `bench` run it: namespace boxes with per-box
/// /proc totals where LXCFS runs, and VM boxes where this host has what they
/// need; and the kind a box is when `new` does not say.
pub fn backend(
    state_dir: &Path,
    agent: PathBuf,
    account_disk: u64,
    vm: &crate::microvm::VmArgs,
) -> Result<(HostBackend, moat_core::BackendKind)> {
    let host = host(state_dir, agent, account_disk)?;
    let config = NsConfig {
        host_view: HostView::ensure(&host_view_dir(state_dir)),
        shared_sys: sysview::ensure(&shared_sys_dir(state_dir)),
        shared_tmp: boxtmp::ensure(&shared_tmp_dir(state_dir)),
    };
    let ns = NsMachine::new(host.clone(), config);
    let (vm, default) = crate::microvm::machine(state_dir, &host, vm);
    Ok((HostBackend::new(host, ns, vm), default))
}

/// The store (the state dir's SQLite database, or PostgreSQL at `dsn`), as
/// fleet node `node` (`""`: a single host), handing out host uids from the
/// blocks of them this state dir holds on this host, and claiming more as
/// its boxes fill them (see [`crate::uid_block`]); the claim lasts as long
/// as the store.
pub fn open_store(state_dir: &Path, dsn: Option<&str>, node: &str) -> Result<Store> {
    let mut store = match dsn {
        Some(dsn) => Store::connect(dsn).context("open the state store")?.for_node(node),
        None => open_database(&state_dir.join("moat.db"))?,
    };
    let claim = crate::uid_block::claim(state_dir, &store.slot_blocks_in_use()?)?;
    let (blocks, moves) = (claim.blocks().to_vec(), claim.moves().to_vec());
    let claim = std::sync::Mutex::new(claim);
    let more: moat_core::store::MoreSlots = Box::new(move || {
        let mut claim = claim.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        claim.grow().map_err(|e| format!("{e:#}"))
    });
    store.use_slot_blocks(&blocks, &moves, Some(more))?;
    Ok(store)
}

/// The state dir's SQLite database, readable by root alone.
fn open_database(db: &Path) -> Result<Store> {
    let store = Store::open(db).context("open the state database")?;
    // It holds sealed secrets: readable by root alone, whatever the umask
    // (and inside a directory only root may enter).
    for file in [db.to_path_buf(), db.with_extension("db-wal"), db.with_extension("db-shm")] {
        use std::os::unix::fs::PermissionsExt as _;
        match std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(anyhow::Error::from(e).context(format!("restrict {}", file.display())));
            }
            _ => {}
        }
    }
    Ok(store)
}

/// The key secrets are sealed with: read from `path`, or made there (32
/// random bytes, mode 0600) the first time. Kept apart from the database, so
/// that a copy of the database alone opens no secret.
pub fn secrets_key(path: &Path) -> Result<[u8; 32]> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::read(path) {
        Ok(bytes) => {
            let key: [u8; 32] =
                bytes.try_into().map_err(|_| anyhow::anyhow!("{}: not a 32-byte key", path.display()))?;
            return Ok(key);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(anyhow::Error::from(e).context(format!("read {}", path.display()))),
    }
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| anyhow::anyhow!("random key: {e}"))?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    file.write_all(&key).and_then(|()| file.sync_all()).with_context(|| format!("write {}", path.display()))?;
    Ok(key)
}

/// The package cache's directory, STATE_DIR/packages: the gateway's (`id`)
/// own, reachable by no one else (the state dir is private).
pub fn package_cache(state_dir: &Path, id: u32) -> Result<PathBuf> {
    let dir = state_dir.join("packages");
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    std::os::unix::fs::chown(&dir, Some(id), Some(id)).with_context(|| format!("chown {}", dir.display()))?;
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    Ok(dir)
}
