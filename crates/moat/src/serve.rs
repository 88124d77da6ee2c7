//! `moat serve`: the daemon.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use moat_api::server::Privileged;
use moat_api::Hello;
use moat_core::{BoxManager, ManagerConfig};
use moat_sshd::auth::{load_or_create_host_key, AuthorizedKeys};

use crate::paths;
use crate::privsep::{self, FrontDoor};

/// Flags of `moat serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:2222")]
    listen: SocketAddr,
    /// State directory: database, storage pool, host key.
    #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// OpenSSH authorized_keys file; each key is an account [default: ~/.ssh/authorized_keys].
    #[arg(long)]
    authorized_keys: Option<PathBuf>,
    /// A static moat-agent binary to use instead of the one built into moat
    /// (also `$MOAT_AGENT`).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Seconds a client has to authenticate.
    #[arg(long, default_value_t = 30)]
    auth_timeout: u64,
    /// Seconds of silence after which a connection is closed.
    #[arg(long, default_value_t = 3600)]
    idle_timeout: u64,
    /// Seconds a box keeps running after its last SSH session ends, before it is
    /// suspended (boxes can set their own with `set NAME idle`).
    #[arg(long, default_value_t = 10)]
    idle_grace: u64,
    /// Seconds a box may stay suspended before its memory is released (it is
    /// stopped; its files stay) [default: never].
    #[arg(long)]
    park_after: Option<u64>,
    /// Seconds between usage samples of every box.
    #[arg(long, default_value_t = 30)]
    meter_interval: u64,
    /// Most boxes one account (key) may have.
    #[arg(long, default_value_t = 32)]
    max_boxes: usize,
    /// Most checkpoints one box may have (a restore keeps one more).
    #[arg(long, default_value_t = 32)]
    max_checkpoints: usize,
    /// Most images (pulled and saved) one account may have.
    #[arg(long, default_value_t = 32)]
    max_images: usize,
    /// Boxes kept booted ahead of demand (0: none): one of each of the
    /// kinds (image, limits, backend) `new` asked for last, which a `new`
    /// of that kind takes.
    #[arg(long, default_value_t = 3)]
    warm_boxes: usize,
    /// Most CPUs one box may ask for [default: this host's].
    #[arg(long)]
    max_cpus: Option<u32>,
    /// Most memory one box may ask for, e.g. 8G [default: this host's].
    #[arg(long, value_parser = parse_size)]
    max_memory: Option<u64>,
    /// Most disk one box may write beyond its image, e.g. 100G.
    #[arg(long, value_parser = parse_size, default_value = "256G")]
    max_disk: u64,
    /// Most memory the limits of one account's boxes may add up to, e.g. 64G
    /// [default: 4 times this host's].
    #[arg(long, value_parser = parse_size)]
    max_memory_per_account: Option<u64>,
    /// Most disk one account's boxes may hold together, counting what removed
    /// boxes left shared with their copies [default: --max-disk].
    #[arg(long, value_parser = parse_size)]
    max_disk_per_account: Option<u64>,
    /// The uid and gid the SSH-facing process runs as; must own nothing.
    #[arg(long, default_value_t = moat_core::record::FRONT_DOOR_ID)]
    front_door_id: u32,
    /// The uid and gid the egress gateway runs as; must own nothing.
    #[arg(long, default_value_t = moat_core::record::GATEWAY_ID)]
    gateway_id: u32,
    /// The egress policy a new box gets unless `new --policy` names one:
    /// none, registries or github-read.
    #[arg(long, default_value = "none")]
    default_policy: String,
    /// The resolver the gateway asks for the names boxes may reach
    /// [default: the first nameserver in /etc/resolv.conf].
    #[arg(long)]
    upstream_dns: Option<SocketAddr>,
    /// The network namespace the gateway dials from [default: this process's].
    #[arg(long)]
    upstream_netns: Option<PathBuf>,
    /// An address range the gateway may dial although it is not public
    /// (repeatable; for a test internet only).
    #[arg(long)]
    upstream_allow: Vec<String>,
    /// A PEM file of roots the gateway also trusts when it looks inside HTTPS
    /// (repeatable; besides /etc/ssl/certs/ca-certificates.crt).
    #[arg(long)]
    upstream_ca: Vec<PathBuf>,
    /// The registry short image names are on (`image pull python:3.12` is
    /// `REGISTRY/python:3.12`; `docker.io` is Docker Hub) [default: none:
    /// a reference must name its registry].
    #[arg(long)]
    registry: Option<String>,
    /// Most bytes one pulled image may have (its blobs, compressed; each
    /// layer at most this unpacked).
    #[arg(long, value_parser = parse_size, default_value = "8G")]
    max_image_size: u64,
    /// Most bytes of package files (PyPI, npm, crates.io) the gateway keeps
    /// for every box to share, checked against their indexes; 0: none
    /// (files are still checked) [in STATE_DIR/packages].
    #[arg(long, value_parser = parse_size, default_value = "4G")]
    package_cache: u64,
    /// An OSV export (a directory of OSV JSON records, kept fresh by the
    /// operator; moat never fetches it) for `policy NAME packages advisories`,
    /// read when the gateway starts (restart `moat serve` to read a new one).
    #[arg(long)]
    osv_db: Option<PathBuf>,
    /// Seconds a registry may send nothing mid-answer before a pull fails.
    #[arg(long, default_value_t = 30)]
    pull_stall_timeout: u64,
    /// The key secrets are sealed with (made on first start)
    /// [default: STATE_DIR/secrets.key].
    #[arg(long)]
    secrets_key: Option<PathBuf>,
    #[command(flatten)]
    vm: crate::microvm::VmArgs,
    #[command(flatten)]
    fleet: crate::node::NodeArgs,
    #[command(flatten)]
    durable: crate::durable::DurableArgs,
    #[command(flatten)]
    web: crate::web::WebArgs,
}

fn parse_size(s: &str) -> Result<u64, String> {
    moat_core::limits::parse_size(s).map_err(|e| e.to_string())
}

/// The host's CPUs and memory: what a box may ask for at most by default.
fn host_capacity() -> (u32, u64) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        })
        .map_or(u64::MAX, |kib| kib << 10);
    (cpus, memory)
}

/// Binds a node's fleet listener and renews its lease once (so that the
/// lease names the port actually bound); the offer it keeps renewing.
async fn node_listener(
    node: &crate::node::Node,
    store: &moat_core::Store,
    args: &crate::node::NodeArgs,
    disk: u64,
) -> Result<(tokio::net::TcpListener, moat_core::store::nodes::NodeOffer)> {
    let listener = tokio::net::TcpListener::bind(node.advertise)
        .await
        .with_context(|| format!("listen for the fleet on {}", node.advertise))?;
    let offer = args.offer(&node.name, listener.local_addr()?, host_capacity(), disk);
    tokio::task::block_in_place(|| store.renew_lease(&offer)).context("take this node's lease")?;
    tracing::info!(node = %node.name, address = %offer.address, "fleet node");
    Ok((listener, offer))
}

/// Runs the daemon until killed.
pub fn run(args: ServeArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Runtime::new().context("start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    privsep::raise_fd_limit();
    let state_dir = args.state_dir;
    paths::private_dir(&state_dir)?;
    let agent = crate::agent::resolve(args.agent.as_deref(), &state_dir)?;
    let max_disk_per_account = args.max_disk_per_account.unwrap_or(args.max_disk);
    let (backend, default_backend) = paths::backend(&state_dir, agent.clone(), max_disk_per_account, &args.vm)?;
    if !backend.host().pool.simple_quotas() {
        tracing::warn!("disk quotas: {}", paths::FULL_QGROUPS);
    }
    // Every account's boxes share the pool: one allowed all of it leaves the
    // others' boxes without a byte to write once it has filled it.
    if let Some(pool) = backend.host().pool.capacity().filter(|pool| max_disk_per_account >= *pool) {
        tracing::warn!(
            pool_gib = pool >> 30,
            max_disk_per_account_gib = max_disk_per_account >> 30,
            "one account's boxes may fill the whole storage pool, and then every other account's boxes can \
             write nothing: with several accounts, set --max-disk-per-account to a share of the pool"
        );
    }
    let node = args.fleet.node(&state_dir)?;
    let dsn = args.fleet.store.clone().or_else(|| node.as_ref().map(|n| n.dir.config.store.clone()));
    let node_name = node.as_ref().map_or(String::new(), |n| n.name.clone());
    let store = paths::open_store(&state_dir, dsn.as_deref(), &node_name)?;
    // A node renews its lease before anything else: until then no box may be
    // placed on it, and its front doors' routers would call it lost.
    let listener = match &node {
        Some(node) => Some(node_listener(node, &store, &args.fleet, max_disk_per_account).await?),
        None => None,
    };
    // Never below the per-box defaults, or a plain `new` would be refused.
    let (host_cpus, host_memory) = host_capacity();
    let defaults = moat_core::Limits::default();
    let (host_cpus, host_memory) = (host_cpus.max(defaults.cpus), host_memory.max(defaults.memory));
    let config = ManagerConfig {
        idle_grace: Duration::from_secs(args.idle_grace),
        park_after: args.park_after.map(Duration::from_secs),
        meter_interval: Duration::from_secs(args.meter_interval.max(1)),
        max_boxes: args.max_boxes,
        max_limits: moat_core::Limits {
            cpus: args.max_cpus.unwrap_or(host_cpus),
            memory: args.max_memory.unwrap_or(host_memory),
            // A quarter of what all boxes together may hold.
            pids: u32::try_from(moat_box::host::cgroup::task_budget() / 4)
                .unwrap_or(u32::MAX)
                .clamp(defaults.pids, 1 << 16),
            disk: args.max_disk,
        },
        max_memory_per_account: args.max_memory_per_account.unwrap_or(host_memory.saturating_mul(4)),
        max_disk_per_account,
        max_checkpoints: args.max_checkpoints,
        max_images: args.max_images,
        warm_boxes: args.warm_boxes,
        default_backend,
        ..ManagerConfig::default()
    };
    let registries = crate::registries::of_this_host();
    let default_policy = moat_core::policy::preset(&args.default_policy, &registries)
        .map_err(|e| anyhow::anyhow!("--default-policy: {e}"))?;
    for cidr in &args.upstream_allow {
        cidr.parse::<moat_gateway::upstream::Cidr>().map_err(|e| anyhow::anyhow!("--upstream-allow: {e}"))?;
    }
    let upstream_dns = match args.upstream_dns.or_else(crate::gateway_supervisor::host_resolver) {
        Some(addr) => addr,
        None => anyhow::bail!("no nameserver in /etc/resolv.conf: give the gateway one with --upstream-dns"),
    };
    let pool_root = backend.host().pool.root().to_path_buf();
    let pool = Arc::clone(&backend.host().pool);
    moat_box::layers::clean_partials(&pool);
    let manager = BoxManager::new(store, Arc::new(backend), config);
    // Every node of a fleet seals with the fleet key: a secret added through
    // one node opens on the node its box is on.
    let key = match &node {
        Some(node) => node.dir.fleet_key.0,
        None => paths::secrets_key(&args.secrets_key.unwrap_or_else(|| state_dir.join("secrets.key")))?,
    };
    manager.set_sealer(moat_core::secrets::Sealer::new(&key).map_err(anyhow::Error::msg)?);
    // Before any box is recovered or made, so that every box gets its gateway.
    let egress = Arc::new(crate::gateway_supervisor::Egress::default());
    manager.set_network_hooks(egress.clone());
    manager.recover().await.context("recover boxes")?;
    // A node serves none of the copies it holds of boxes now another node's
    // (moved, or re-homed while this node was away): they go first.
    let stale = manager.discard_stale().await.context("discard stale copies of boxes")?;
    if stale > 0 {
        tracing::warn!(stale, "discarded this node's copies of boxes other nodes hold now");
    }
    // The first `new` after a start finds a box of the default image ready
    // (if that image is built; none is built for it).
    manager.prepare_warm(&moat_core::Name::new(moat_core::images::DEFAULT)?);
    let gateway = crate::gateway_supervisor::GatewayConfig {
        id: args.gateway_id,
        netns: args.upstream_netns,
        hello: moat_gateway::GatewayHello {
            upstream_dns,
            upstream_allow: args.upstream_allow,
            upstream_roots: crate::gateway_supervisor::upstream_roots(&args.upstream_ca)?,
        },
        packages: crate::gateway::PackageArgs {
            package_cache: Some(crate::paths::package_cache(&state_dir, args.gateway_id)?),
            package_cache_bytes: args.package_cache,
            osv_db: args.osv_db,
        },
    };
    // A push's scratch files are its own: what a stopped daemon left is nobody's.
    let _ = std::fs::remove_dir_all(pool.root().join("pushes"));
    // Pulls leave through the gateway's upstream settings, as its uid.
    manager.set_image_puller(Arc::new(crate::image_pull::Puller {
        pool,
        id: args.gateway_id,
        netns: gateway.netns.clone(),
        upstream: gateway.hello.clone(),
        default_registry: args.registry,
        bounds: moat_oci::client::Bounds {
            max_image: args.max_image_size,
            stall: Duration::from_secs(args.pull_stall_timeout.max(1)),
            document: Duration::from_secs(args.pull_stall_timeout.max(1) * 2),
        },
        runtime: tokio::runtime::Handle::current(),
        making: moat_core::keyed_locks::KeyedLocks::default(),
    }));
    // Polled by this (main) thread, never a runtime worker: the children die
    // with the thread that started them (PR_SET_PDEATHSIG), and a worker may
    // become a blocking thread that exits when idle.
    let gateway = crate::gateway_supervisor::supervise(egress, gateway, Arc::clone(&manager));
    manager.spawn_meter();
    // A fleet node streams boxes moving between it and a live node directly.
    let links: Option<Arc<dyn moat_durable::node_stream::NodeLinks>> = match &node {
        Some(node) => Some(crate::node_links::FleetLinks::new(&node.dir).await?),
        None => None,
    };
    let durable = crate::durable::start(&args.durable, &manager, &pool_root, links)?;

    let host_key = load_or_create_host_key(&state_dir.join("ssh_host_ed25519_key"))?;
    let host_key = host_key.to_openssh(russh::keys::ssh_key::LineEnding::LF).context("encode the host key")?;
    let keys_path = match args.authorized_keys {
        Some(path) => path,
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".ssh/authorized_keys"),
    };
    let keys = AuthorizedKeys::new(keys_path.clone());
    // In a fleet the accounts are the store's keys (`moat fleet keys`); the
    // file still adds its own.
    // The same store the manager holds (no second connection); on a single
    // host with SQLite it has no fleet keys and the file alone answers.
    let store_keys = Arc::clone(&manager);
    let (fleet, file) = (Arc::clone(&manager), keys.clone());
    manager.set_account_check(Arc::new(move |account| fleet.fleet_lists(account) || file.lists(account)));
    // A key taken out ends its sessions (ssh, forwards, web) within a second.
    manager.spawn_access_sweep();
    let authorize = move |key: &str| store_keys.account_for_fleet_key(key).or_else(|| keys.account_for_text(key));
    let web = args.web.plan(&state_dir)?;
    let site = web.as_ref().map(|w| w.site.clone());
    let privileged =
        Arc::new(Privileged { manager, authorize: Box::new(authorize), default_policy, registries, web: site });
    if let (Some(node), Some((listener, offer))) = (node, listener) {
        tokio::spawn(crate::node::keep_lease(Arc::clone(&privileged.manager), offer));
        let answerer = Arc::clone(&privileged);
        let boxes = durable.map(|worker| {
            let manager = Arc::clone(&privileged.manager);
            Arc::new(crate::node_links::BoxSender { manager, worker }) as Arc<dyn moat_fleet::listen::BoxSource>
        });
        tokio::spawn(async move {
            if let Err(e) = moat_fleet::listen::serve_node(&node.dir, listener, answerer, boxes).await {
                tracing::error!(error = %format!("{e:#}"), "the fleet listener failed");
            }
        });
    }
    let front = FrontDoor {
        id: args.front_door_id,
        hello: Hello {
            host_key: host_key.to_string(),
            auth_timeout_secs: args.auth_timeout,
            idle_timeout_secs: args.idle_timeout,
        },
    };

    let listener = std::net::TcpListener::bind(args.listen).with_context(|| format!("listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, state_dir = %state_dir.display(), authorized_keys = %keys_path.display(), "moat serving");
    // One machine-readable line on stdout, for scripts that asked for port 0.
    println!("listening on {addr}");
    let edge = async {
        match web {
            Some(web) => web.supervise(Arc::clone(&privileged)).await,
            None => std::future::pending().await,
        }
    };
    let ((), front_door, edge) =
        tokio::join!(gateway, privsep::supervise(listener, front, Arc::clone(&privileged)), edge);
    front_door.and(edge)
}
