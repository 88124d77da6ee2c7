//! `moat bench`: box and SSH latency, each next to a named peer measured in the
//! same run on the same machine, printed as a table with ratios.
//!
//! - create a box and run `true` in it, against `bwrap --unshare-all --ro-bind / / true`
//!   and `unshare` making the same namespaces;
//! - a burst of creates at once against as many bubblewrap sandboxes at
//!   once (see [`crate::bench_burst`]);
//! - `ssh NAME@HOST true` over loopback (a new connection each time), against
//!   OpenSSH's own sshd running `true` on loopback with the same client;
//! - a suspended box's session to its first byte, against a running box's,
//!   500 times, split between host and box (see [`crate::bench_resume`]);
//! - egress through the gateway against the same client and servers without
//!   it (see [`crate::bench_egress`]);
//! - with `--fleet`, instead: a fleet on this machine against one host and
//!   against OpenSSH's ProxyJump (see [`crate::bench_fleet`]);
//! - with `--http`, instead: a box's web URL through the HTTP edge against
//!   nginx reverse-proxying the same box port (see [`crate::bench_http`]);
//! - with `--durable`, instead: durable boxes' streams against a plain upload
//!   and `btrfs send | receive` (see [`crate::bench_durable`]);
//! - with `--node-loss`, instead: a lost node's 1 GiB box answering from
//!   another node, against the floor of lease and grace (see
//!   [`crate::bench_node_loss`]);
//! - with `--images`, instead: pulled images against skopeo and umoci (see
//!   [`crate::bench_images`]);
//! - with `--packages`, instead: package installs through the gateway's
//!   package path against the registry direct (see [`crate::bench_packages`]);
//! - with `--density N`, instead: N suspended boxes on one host against idle
//!   bubblewrap sandboxes (see [`crate::bench_density`]).
//!
//! Timings are reported, never asserted: this is not a test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use moat_agent::client::{send, AgentReader};
use moat_agent::protocol::{AgentMsg, ExecRequest, HostMsg, Run};
use moat_api::server::Privileged;
use moat_api::Hello;
use moat_core::{AccountId, AgentAddr, BoxManager, BoxSpec, Limits, ManagerConfig, Name};
use moat_sshd::auth::{load_or_create_host_key, AuthorizedKeys};

use crate::bench_egress::{self, BenchNet};
use crate::paths;
use crate::privsep::FrontDoor;

/// Flags of `moat bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Runs per measurement.
    #[arg(long, default_value_t = 40)]
    iterations: usize,
    /// Scratch state directory; removed afterwards.
    #[arg(long, default_value = "/var/tmp/moat-bench")]
    state_dir: PathBuf,
    /// A static moat-agent binary [default: the one built into moat].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Data sizes (MiB) written into a box before timing `dup` against `cp -a`.
    #[arg(long, value_delimiter = ',', default_value = "10,1024,4096")]
    dup_sizes: Vec<u64>,
    /// Runs per dup size.
    #[arg(long, default_value_t = 5)]
    dup_iterations: usize,
    /// Size (MiB) of the download timed through the gateway and directly.
    #[arg(long, default_value_t = 1024)]
    egress_mib: u64,
    /// Runs of that download each way.
    #[arg(long, default_value_t = 3)]
    egress_runs: usize,
    /// Creates started at once for the burst row (against as many bwraps).
    #[arg(long, default_value_t = 20)]
    burst: usize,
    /// Suspend/resume cycles timed (the resume tail: p99 and max need many).
    #[arg(long, default_value_t = 500)]
    resume_runs: usize,
    /// Runs of each VM box measurement (TCG guests take seconds each; 0: none).
    #[arg(long, default_value_t = 5)]
    vm_runs: usize,
    /// Measure a fleet instead (PostgreSQL, two nodes and a front door on
    /// loopback, all started and removed by the bench): SSH through the front
    /// door against one host and against ProxyJump, placement and `new`.
    #[arg(long)]
    fleet: bool,
    /// Measure boxes' web URLs instead: the HTTP edge against Debian's nginx
    /// reverse-proxying the same box port (wrk for latency and throughput),
    /// and the first byte from a suspended box.
    #[arg(long)]
    http: bool,
    /// Measure durable boxes' streams instead (a real SeaweedFS on loopback):
    /// a 1 GiB box's first upload and a 100 MiB change against a plain upload
    /// of the same streams, and a move against `btrfs send | btrfs receive`.
    #[arg(long, conflicts_with_all = ["fleet", "http"])]
    durable: bool,
    /// Measure pulled images instead (Debian's docker-registry in a test
    /// namespace): a ~200 MB image's first pull against `skopeo copy` +
    /// `umoci unpack`, a second image on the same base against its own first
    /// pull, and `new` from a pulled image against the debian image.
    #[arg(long, conflicts_with_all = ["fleet", "http", "durable"])]
    images: bool,
    /// Measure package installs instead (pip of 50 MiB of wheels, npm of a
    /// 300-package tree, from a stand-in registry): with package rules on,
    /// from the shared cache, and with the registry's TLS passed through.
    #[arg(long, conflicts_with_all = ["fleet", "http", "durable", "images"])]
    packages: bool,
    /// Measure density instead: this many busybox boxes made over ssh and
    /// left to suspend; host memory per box against idle bubblewrap
    /// sandboxes, the daemon's RSS, `ls`, a restart, resumes, the first limit hit.
    #[arg(long, value_name = "N", conflicts_with_all = ["fleet", "http", "durable", "images", "packages"])]
    density: Option<usize>,
    /// Measure the gateway against proxies instead: HTTPS downloads
    /// (--egress-mib, --egress-runs) with TLS passed through and with TLS
    /// ended and made again, against nginx's stream module and HAProxy doing
    /// the same (each where installed); throughput and host CPU per GiB.
    #[arg(long, conflicts_with_all = ["fleet", "http", "durable", "images", "packages", "density"])]
    proxies: bool,
    /// Measure a node's loss instead (a fleet of two nodes keeping boxes
    /// in a real SeaweedFS, --node-grace 20): `kill -9` of the node holding
    /// a suspended box of 1 GiB, to `ssh box true` answering from the other.
    #[arg(long, conflicts_with_all = ["fleet", "http", "durable", "images", "packages", "density", "proxies"])]
    node_loss: bool,
    /// Measure creates in bursts only: --iterations rounds (at most 50) of
    /// --burst `new`s at once, each round against as many bubblewrap
    /// sandboxes at once.
    #[arg(long, conflicts_with_all = ["fleet", "http", "durable", "images", "packages", "density", "proxies", "node_loss"])]
    bursts: bool,
    /// Measure egress only: DNS answers, fresh HTTPS requests, the download
    /// and the git pushes, through the gateway against direct.
    #[arg(long, conflicts_with_all = ["fleet", "http", "durable", "images", "packages", "density", "proxies", "node_loss", "bursts"])]
    egress: bool,
}

/// Sorted samples of one measurement.
#[derive(Clone)]
pub struct Samples(Vec<Duration>);

impl Samples {
    pub fn collect(n: usize, mut f: impl FnMut() -> Result<Duration>) -> Result<Self> {
        Ok(Self::sorted((0..n).map(|_| f()).collect::<Result<Vec<_>>>()?))
    }
    pub fn sorted(mut v: Vec<Duration>) -> Self {
        v.sort();
        Self(v)
    }
    /// Every sample, shortest first.
    pub fn iter(&self) -> impl Iterator<Item = Duration> + '_ {
        self.0.iter().copied()
    }
    /// The `p`th percentile (the sample at index `len * p / 100`).
    /// This one's median over `other`'s.
    pub fn ratio(&self, other: &Samples) -> f64 {
        self.pct(50).as_secs_f64() / other.pct(50).as_secs_f64()
    }

    pub fn pct(&self, p: usize) -> Duration {
        let i = (self.0.len() * p / 100).min(self.0.len().saturating_sub(1));
        self.0.get(i).copied().unwrap_or_default()
    }
}

/// `text` without the terminal colour codes tracing writes (`ESC [ ... m`).
pub fn without_colours(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().find(|c| c.is_ascii_alphabetic());
        } else {
            out.push(c);
        }
    }
    out
}

pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

pub fn time_command(cmd: &mut Command) -> Result<Duration> {
    let t = Instant::now();
    let status = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status()?;
    let took = t.elapsed();
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(took)
}

/// Runs the benchmark and prints the table.
pub fn run(args: BenchArgs) -> Result<()> {
    // The daemon's own log lines, when asked for (`RUST_LOG=moat_core=debug`).
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    if args.fleet {
        return crate::bench_fleet::run(&args.state_dir, args.iterations);
    }
    if args.http {
        return crate::bench_http::run(&args.state_dir, args.iterations.clamp(1, 20));
    }
    if args.durable {
        return crate::bench_durable::run(&args.state_dir);
    }
    if args.node_loss {
        return crate::bench_node_loss::run(&args.state_dir);
    }
    if args.images {
        return crate::bench_images::run(&args.state_dir);
    }
    if args.packages {
        return crate::bench_packages::run(&args.state_dir);
    }
    if let Some(boxes) = args.density {
        return crate::bench_density::run(&args.state_dir, boxes);
    }
    let _ = crate::purge::run(&args.state_dir);
    let result = tokio::runtime::Runtime::new()?.block_on(bench(&args));
    crate::purge::run(&args.state_dir).context("clean up the bench state")?;
    result
}

async fn bench(args: &BenchArgs) -> Result<()> {
    let dir = &args.state_dir;
    let pool = paths::open_pool(dir)?;
    let busybox = Name::new("busybox")?;
    if !pool.has_image(&busybox) {
        moat_box::image::build(&pool, &busybox, &mut |_: &str| {})?;
    }
    drop(pool);
    let agent = crate::agent::resolve(args.agent.as_deref(), dir)?;
    let vm_args = crate::microvm::VmArgs {
        backend: Some(moat_core::BackendKind::Ns),
        kernel: None,
        initrd: None,
        vm_accel: "auto".into(),
        allow_vm_without_landlock: false,
    };
    let (backend, _) = paths::backend(dir, agent.clone(), u64::MAX, &vm_args)?;
    let store = crate::paths::open_store(dir, None, "")?;
    // As `moat serve` runs: the pool keeps the last three kinds `new` asked for.
    let config = ManagerConfig { warm_boxes: 3, ..ManagerConfig::default() };
    let manager = BoxManager::new(store, Arc::new(backend), config);
    // Every box gets its gateway, as under `moat serve`; it reaches a test
    // internet of the bench's own.
    let net = BenchNet::start()?;
    let egress = Arc::new(crate::gateway_supervisor::Egress::default());
    manager.set_network_hooks(egress.clone());
    let gateway = crate::gateway_supervisor::GatewayConfig {
        id: moat_core::record::GATEWAY_ID,
        netns: Some(net.path()),
        hello: net.gateway_hello(),
        packages: Default::default(),
    };
    // Polled by this thread (see `serve`: the gateway dies with the thread
    // that started it).
    let gateway = crate::gateway_supervisor::supervise(egress, gateway, Arc::clone(&manager));
    let measured = async {
        if args.proxies {
            crate::bench_proxy_peer::measure(&manager, &net, dir, args.egress_runs, args.egress_mib).await
        } else if args.bursts {
            crate::bench_burst::rounds(&manager, args.iterations.clamp(1, 50), args.burst.max(1)).await
        } else if args.egress {
            let egress = egress_samples(args, &manager, &AccountId("bench".into()), &net).await?;
            print_egress(args, &egress);
            Ok(())
        } else {
            measure(args, &manager, &net).await
        }
    };
    tokio::select! {
        r = measured => r,
        () = gateway => bail!("the gateway supervisor ended"),
    }
}

async fn measure(args: &BenchArgs, manager: &Arc<BoxManager>, net: &BenchNet) -> Result<()> {
    let n = args.iterations;
    let dir = &args.state_dir;
    let account = AccountId("bench".into());
    let spec = busybox;

    eprintln!("bench: create a box and run true, {n} times with a warm box ready and {n} times made on demand");
    let image = Name::new("busybox")?;
    let (mut create, mut cold) = (Vec::new(), Vec::new());
    for i in 0..n {
        for warm in [true, false] {
            let name = format!("b{i}-{warm}");
            let mut spec = spec(&name)?;
            if warm {
                // A pool refills between a user's `new`s; give it the time one would.
                wait_warm(manager, &image).await;
            } else {
                // Limits no box was made with before: no warm box fits. The
                // same pause between commands: the spares behind an
                // on-demand create (a helper in a cgroup, a root) refill
                // meanwhile.
                spec.limits.pids += 1 + u32::try_from(i).unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let t = Instant::now();
            manager.create(&account, spec, Box::new(|_: &str| {})).await?;
            let (box_handle, _session) = manager.open_session(&account, &Name::new(&name)?).await?;
            run_true(&box_handle.agent).await?;
            if warm { &mut create } else { &mut cold }.push(t.elapsed());
            manager.remove(&account, &Name::new(&name)?).await?;
        }
    }
    let (create, cold) = (Samples::sorted(create), Samples::sorted(cold));

    let burst = args.burst.max(1);
    eprintln!("bench: {burst} creates at once, and {burst} bwrap sandboxes at once");
    // Settled first: a warm box ready, as after a quiet minute.
    wait_warm(manager, &image).await;
    let burst_moat = crate::bench_burst::moat(manager, &account, burst, |i| spec(&format!("burst{i}"))).await?;
    let burst_bwrap = crate::bench_burst::bwrap(burst).context("bwrap (apt-get install bubblewrap)")?;

    eprintln!("bench: bwrap and unshare, {n} times each");
    let bwrap =
        Samples::collect(n, || time_command(&mut bwrap_true())).context("bwrap (apt-get install bubblewrap)")?;
    let unshare = Samples::collect(n, || {
        time_command(Command::new("unshare").args([
            "--user",
            "--map-root-user",
            "--mount",
            "--pid",
            "--fork",
            "--net",
            "--uts",
            "--ipc",
            "--cgroup",
            "true",
        ]))
    })?;

    eprintln!("bench: ssh round trips, {n} times each");
    let key = dir.join("client_key");
    keygen(&key)?;
    let keys_file = dir.join("authorized_keys");
    std::fs::copy(key.with_extension("pub"), &keys_file)?;
    let account = moat_sshd::auth::account_id(&russh::keys::PublicKey::read_openssh_file(key.with_extension("pub"))?);
    manager.create(&account, spec("rt")?, Box::new(|_: &str| {})).await?;
    // The real arrangement: the privileged side here, the front door a
    // confined process of its own.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let host_key = load_or_create_host_key(&dir.join("host_key"))?;
    let keys = AuthorizedKeys::new(keys_file.clone());
    let privileged = Arc::new(Privileged {
        manager: Arc::clone(manager),
        authorize: Box::new(move |k| keys.account_for_text(k)),
        default_policy: Default::default(),
        registries: Vec::new(),
        web: None,
    });
    let hello = Hello {
        host_key: host_key.to_openssh(russh::keys::ssh_key::LineEnding::LF)?.to_string(),
        auth_timeout_secs: 30,
        idle_timeout_secs: 3600,
    };
    let front = FrontDoor { id: moat_core::record::FRONT_DOOR_ID, hello };
    let server = tokio::spawn(crate::privsep::supervise(listener, front, privileged));
    let ours = tokio::task::spawn_blocking({
        let key = key.clone();
        move || Samples::collect(n, || time_command(&mut ssh(&key, port, "rt")))
    })
    .await??;
    // `race rt 8 -- true` through the same front door; the copies it keeps
    // are removed between runs, untimed.
    let race_runs = n.min(10);
    eprintln!("bench: race rt 8 -- true, {race_runs} times");
    let mut raced = Vec::new();
    for _ in 0..race_runs {
        let key = key.clone();
        let took = tokio::task::spawn_blocking(move || {
            time_command(&mut ssh_command(&key, port, moat_core::ids::CONTROL_USER, &["race", "rt", "8", "--", "true"]))
        })
        .await??;
        raced.push(took);
        for i in 1..=8 {
            manager.remove(&account, &Name::new(&format!("rt-r{i}"))?).await?;
        }
    }
    let raced = Samples::sorted(raced);
    server.abort();

    let sshd_port = free_port()?;
    let user = BenchUser::create(dir)?;
    let mut sshd = start_sshd(dir, &keys_file, sshd_port)?;
    let theirs = tokio::task::spawn_blocking({
        let key = key.clone();
        move || Samples::collect(n, || time_command(&mut ssh(&key, sshd_port, BENCH_USER)))
    })
    .await?;
    let _ = sshd.kill();
    let _ = sshd.wait();
    drop(user);
    let theirs = theirs?;

    let mut dups = Vec::new();
    for &mib in &args.dup_sizes {
        eprintln!("bench: dup of a box holding {mib} MiB, {} times, and cp -a of it", args.dup_iterations);
        let name = Name::new(&format!("data{mib}"))?;
        manager.create(&account, spec(name.as_str())?, Box::new(|_: &str| {})).await?;
        let (box_handle, _session) = manager.open_session(&account, &name).await?;
        run_in_box(&box_handle.agent, &format!("dd if=/dev/zero of=/root/data bs=1M count={mib} 2>/dev/null && sync"))
            .await?;
        drop(_session);
        let mut times = Vec::new();
        for i in 0..args.dup_iterations {
            let copy = Name::new(&format!("data{mib}-{i}"))?;
            let t = Instant::now();
            manager.dup(&account, &name, &copy).await?;
            times.push(t.elapsed());
            manager.remove(&account, &copy).await?;
        }
        times.sort();
        eprintln!("bench: checkpoint of it, and restore to first output, {} times each", args.dup_iterations);
        let mut saves = Vec::new();
        for i in 0..args.dup_iterations {
            let label = Name::new(&format!("s{i}"))?;
            let t = Instant::now();
            manager.checkpoint(&account, &name, Some(label.clone())).await?;
            saves.push(t.elapsed());
            manager.remove_checkpoint(&account, &name, &label).await?;
        }
        let saved = manager.checkpoint(&account, &name, None).await?;
        let mut restores = Vec::new();
        for _ in 0..args.dup_iterations {
            let t = Instant::now();
            let before = manager.restore(&account, &name, &saved).await?;
            let (box_handle, _session) = manager.open_session(&account, &name).await?;
            first_byte(&box_handle.agent, "echo x").await?;
            restores.push(t.elapsed());
            manager.remove_checkpoint(&account, &name, &before).await?;
        }
        // A real copy of the same bytes on the same disk (without reflink, which
        // would share extents just as dup does).
        let id = manager.get(&account, &name)?.id;
        let root = dir.join("pool/boxes").join(id.as_str());
        let copy_dir = dir.join("pool/cp-copy");
        let cp = Samples::collect(1, || {
            let took =
                time_command(Command::new("cp").args(["-a", "--reflink=never"]).arg(root.join("root")).arg(&copy_dir));
            let _ = std::fs::remove_dir_all(&copy_dir);
            took
        })?;
        manager.remove(&account, &name).await?;
        dups.push((mib, Samples(times), cp, Samples::sorted(saves), Samples::sorted(restores)));
    }

    let resume_runs = args.resume_runs.max(1);
    eprintln!("bench: first output byte from a running and from a suspended box, {resume_runs} times each");
    let resume = crate::bench_resume::samples(manager, &account, spec("resume")?, resume_runs).await?;
    let (running, resumed) = (resume.running(), resume.resumed());

    let egress = egress_samples(args, manager, &account, net).await?;
    let vm = match args.vm_runs {
        0 => Vec::new(),
        runs => {
            let agent = crate::agent::resolve(args.agent.as_deref(), dir)?;
            crate::bench_vm::samples(manager, &account, dir, &agent, runs).await?
        }
    };

    println!("| measurement ({n} runs) | p50 | p95 | peer | peer p50 | peer p95 | ratio (p50) |");
    println!("|---|---|---|---|---|---|---|");
    let row = |what: &str, a: &Samples, peer: &str, b: &Samples| {
        println!(
            "| {what} | {} | {} | {peer} | {} | {} | {:.2}x |",
            ms(a.pct(50)),
            ms(a.pct(95)),
            ms(b.pct(50)),
            ms(b.pct(95)),
            a.ratio(b)
        )
    };
    row("create box + run `true` (a warm box ready)", &create, "`bwrap --unshare-all --ro-bind / / true`", &bwrap);
    row("create box + run `true` (a warm box ready)", &create, "`unshare` (same namespaces) `true`", &unshare);
    row("create box + run `true` (made on demand)", &cold, "`bwrap --unshare-all --ro-bind / / true`", &bwrap);
    row(
        &format!("{burst} creates at once, each to `true` run"),
        &burst_moat,
        &format!("{burst} `bwrap ... true` at once"),
        &burst_bwrap,
    );
    row("`ssh box@host true` (new connection)", &ours, "OpenSSH sshd, `ssh user@host true`", &theirs);
    row(&format!("`race rt 8 -- true` ({} runs)", raced.0.len()), &raced, "`ssh box@host true`", &ours);
    row(
        &format!("suspended box: session + first byte of `echo x` ({resume_runs} runs)"),
        &resumed,
        "running box, same",
        &running,
    );
    for (mib, dup, cp, save, restore) in &dups {
        let runs = dup.0.len();
        row(&format!("`dup` of a box holding {mib} MiB ({runs} runs)"), dup, "`cp -a --reflink=never` of it", cp);
        row(&format!("`checkpoint` of a box holding {mib} MiB ({runs} runs)"), save, "`dup` of it", dup);
        row(
            &format!("`restore` of it + first byte of `echo x` ({runs} runs)"),
            restore,
            "`cp -a --reflink=never` of it",
            cp,
        );
    }

    for (what, ours, peer, theirs) in &vm {
        row(&format!("{what} ({} runs)", ours.0.len()), ours, peer, theirs);
    }

    let burst_ratio = burst_moat.pct(95).as_secs_f64() / burst_bwrap.pct(95).as_secs_f64();
    let met = if burst_ratio <= 3.0 { "met" } else { "**not met**" };
    println!("\nburst of {burst}: p95 {burst_ratio:.2}x bubblewrap's burst p95 (target: at most 3x: {met})");
    crate::bench_resume::print(&resume);

    print_egress(args, &egress);
    Ok(())
}

/// The egress table: each row through the gateway against direct.
fn print_egress(args: &BenchArgs, egress: &[(String, Samples, Samples)]) {
    let n = args.iterations;
    println!();
    println!("| egress ({n} runs) | through the gateway p50 | p95 | direct p50 | p95 | added (p50) | ratio (p50) |");
    println!("|---|---|---|---|---|---|---|");
    for (what, through, direct) in egress {
        let added = through.pct(50).as_secs_f64() - direct.pct(50).as_secs_f64();
        println!(
            "| {what} | {} | {} | {} | {} | {:+.2} ms | {:.2}x |",
            ms(through.pct(50)),
            ms(through.pct(95)),
            ms(direct.pct(50)),
            ms(direct.pct(95)),
            added * 1e3,
            through.ratio(direct)
        );
    }
    let mib = args.egress_mib as f64;
    if let Some((_, through, direct)) = egress.iter().find(|(what, _, _)| what.starts_with("download")) {
        let rate = |s: &Samples| mib / s.pct(50).as_secs_f64();
        println!(
            "\ndownload throughput: {:.0} MiB/s through the gateway, {:.0} MiB/s direct ({:.0}%)",
            rate(through),
            rate(direct),
            100.0 * rate(through) / rate(direct)
        );
    }
}

/// The pack a push row sends (the target: under 5 ms added for it).
const PUSH_MIB: usize = 10;

/// (what, through the gateway, direct) for each egress measurement.
async fn egress_samples(
    args: &BenchArgs,
    manager: &Arc<BoxManager>,
    account: &AccountId,
    net: &BenchNet,
) -> Result<Vec<(String, Samples, Samples)>> {
    let n = args.iterations;
    let mut sides = Vec::new();
    let key: [u8; 32] = std::array::from_fn(|i| i as u8);
    manager.set_sealer(moat_core::secrets::Sealer::new(&key).map_err(anyhow::Error::msg)?);
    let value = moat_core::secrets::SecretValue::new("sk-bench-0123456789abcdef").map_err(anyhow::Error::msg)?;
    manager.add_secret(account, bench_egress::secret_spec()?, &value)?;
    let boxes =
        [("pass", false), ("look", true), ("secret", false), ("push", false), ("pushff", true), ("pushpath", true)];
    for (box_name, look) in boxes {
        let name = Name::new(box_name)?;
        let policy = match box_name {
            "push" | "pushff" => bench_egress::push_policy(look)?,
            "pushpath" => bench_egress::push_by_path()?,
            _ => bench_egress::policy(look)?,
        };
        bench_egress::make_box(manager, account, box_name, policy).await?;
        let secret = Name::new(bench_egress::SECRET)?;
        if box_name == "secret" {
            manager.grant_secret(account, &secret, &name).await?;
        }
        let (side, _session) = bench_egress::box_side(manager, account, box_name, &args.state_dir, net).await?;
        let root = args.state_dir.join("pool/boxes").join(manager.get(account, &name)?.id.as_str());
        sides.push(if box_name == "secret" { side.with_secret(&root)? } else { side });
    }
    let direct = bench_egress::Side::direct(net);
    let (pass, look, with_secret) = (&sides[0], &sides[1], &sides[2]);
    let (push, push_ff, push_path) = (sides[3].clone(), sides[4].clone(), sides[5].clone());
    let runs = args.egress_runs;
    let bytes = args.egress_mib << 20;
    let samples = tokio::task::spawn_blocking({
        let (pass, look, with_secret, direct) = (pass.clone(), look.clone(), with_secret.clone(), direct.clone());
        move || -> Result<Vec<(String, Samples, Samples)>> {
            eprintln!("bench: egress: DNS answers and fresh HTTPS requests, {n} times each way");
            let sorted = Samples::sorted;
            let dns = (sorted(pass.dns(n)?), sorted(direct.dns(n)?));
            let https_direct = sorted(direct.https(n)?);
            let passthrough = sorted(pass.https(n)?);
            let looked = sorted(look.https(n)?);
            let injected = sorted(with_secret.https(n)?);
            eprintln!("bench: egress: {} MiB download over HTTP, {runs} times each way", bytes >> 20);
            let download = (sorted(pass.download(runs, bytes)?), sorted(direct.download(runs, bytes)?));
            let pushes = n.min(50);
            eprintln!("bench: egress: git push of a {PUSH_MIB} MiB pack, {pushes} times each way, in turn");
            let body = bench_egress::push_body(PUSH_MIB)?;
            // One push of each kind a round: the machine's drift (other work,
            // the page cache) falls on the direct push and the gateway's alike.
            let mut rounds = [(); 4].map(|()| Vec::with_capacity(pushes));
            for _ in 0..pushes {
                for (times, side) in rounds.iter_mut().zip([&direct, &push_path, &push, &push_ff]) {
                    times.extend(side.pushes(1, &body)?);
                }
            }
            let [pushed_direct, pushed_path, pushed, pushed_ff] = rounds.map(sorted);
            Ok(vec![
                ("DNS answer, allowed name (direct: the test resolver)".into(), dns.0, dns.1),
                ("fresh HTTPS request, passed through".into(), passthrough, Samples(https_direct.0.clone())),
                ("fresh HTTPS request, looked inside".into(), looked, Samples(https_direct.0.clone())),
                ("fresh HTTPS request, a secret written in".into(), injected, https_direct),
                (format!("download of {} MiB over HTTP ({runs} runs)", bytes >> 20), download.0, download.1),
                (
                    format!("git push, {PUSH_MIB} MiB pack, looked inside by a path rule alone ({pushes} runs)"),
                    pushed_path,
                    Samples(pushed_direct.0.clone()),
                ),
                (
                    format!("git push, {PUSH_MIB} MiB pack, refs checked ({pushes} runs)"),
                    pushed,
                    Samples(pushed_direct.0.clone()),
                ),
                (
                    format!("git push, {PUSH_MIB} MiB pack, fast-forward read from the pack ({pushes} runs)"),
                    pushed_ff,
                    pushed_direct,
                ),
            ])
        }
    })
    .await??;
    for (name, _) in boxes {
        manager.remove(account, &Name::new(name)?).await?;
    }
    Ok(samples)
}

/// A busybox box called `name`, with everything else as `new` gives it.
pub fn busybox(name: &str) -> Result<BoxSpec> {
    Ok(BoxSpec {
        name: Name::new(name)?,
        image: Name::new("busybox")?,
        limits: Limits::default(),
        policy: Default::default(),
        backend: None,
        run: false,
    })
}

/// Waits (at most 2 s) until a warm box of `image` is ready.
pub async fn wait_warm(manager: &BoxManager, image: &Name) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !manager.warm_ready(image) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The peer's sandbox: `bwrap --unshare-all --ro-bind / / true`.
pub fn bwrap_true() -> Command {
    let mut cmd = Command::new("bwrap");
    cmd.args(["--unshare-all", "--ro-bind", "/", "/", "true"]);
    cmd
}

pub async fn run_true(addr: &AgentAddr) -> Result<()> {
    run_in_box(addr, "true").await
}

/// A command started in a box: its replies, and the write half that must stay
/// open for the session's life (the agent takes its closing as "client gone").
type Execution = (AgentReader<tokio::net::unix::OwnedReadHalf>, tokio::net::unix::OwnedWriteHalf);

/// Starts `command` in the box through its agent.
async fn exec(addr: &AgentAddr, command: &str) -> Result<Execution> {
    let AgentAddr::Unix(path) = addr;
    let (read, mut write) = tokio::net::UnixStream::connect(path).await?.into_split();
    let req = ExecRequest { run: Run::Command(command.as_bytes().to_vec()), ..Default::default() };
    send(&mut write, &HostMsg::Exec(req)).await?;
    Ok((AgentReader::new(read), write))
}

/// Runs `command` in the box and waits for it to succeed.
async fn run_in_box(addr: &AgentAddr, command: &str) -> Result<()> {
    let (mut reader, _write) = exec(addr, command).await?;
    loop {
        match reader.recv().await? {
            Some(AgentMsg::Exit(moat_agent::protocol::ExitStatus::Code(0))) => return Ok(()),
            Some(AgentMsg::Exit(status)) => bail!("{command:?} failed: {status:?}"),
            Some(AgentMsg::Error(e)) => bail!("exec failed: {e}"),
            Some(_) => {}
            None => bail!("agent hung up"),
        }
    }
}

/// Runs `command` in the box and returns once its first output byte arrives.
pub async fn first_byte(addr: &AgentAddr, command: &str) -> Result<()> {
    let (mut reader, _write) = exec(addr, command).await?;
    loop {
        match reader.recv().await? {
            Some(AgentMsg::Stdout(data)) if !data.is_empty() => return Ok(()),
            Some(AgentMsg::Exit(status)) => bail!("{command:?} ended with no output: {status:?}"),
            Some(AgentMsg::Error(e)) => bail!("exec failed: {e}"),
            Some(_) => {}
            None => bail!("agent hung up"),
        }
    }
}

pub fn keygen(path: &Path) -> Result<()> {
    let status = Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", "", "-f"]).arg(path).status()?;
    if !status.success() {
        bail!("ssh-keygen failed");
    }
    Ok(())
}

/// The same client, options and key exchange for both servers (russh does not
/// offer OpenSSH's default post-quantum hybrid, which costs ~100 ms of CPU).
fn ssh(key: &Path, port: u16, user: &str) -> Command {
    ssh_command(key, port, user, &["true"])
}

/// As [`ssh`], running `command` (its words).
pub(crate) fn ssh_command(key: &Path, port: u16, user: &str, command: &[&str]) -> Command {
    let mut cmd = Command::new("ssh");
    cmd.args([
        "-F",
        "/dev/null",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
    ]);
    cmd.args(["-o", "KexAlgorithms=curve25519-sha256", "-o", "Ciphers=chacha20-poly1305@openssh.com"]);
    cmd.args(["-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-i"]).arg(key);
    cmd.args(["-p", &port.to_string(), &format!("{user}@127.0.0.1")]).args(command);
    cmd
}

pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The account OpenSSH's sshd serves in the benchmark.
pub const BENCH_USER: &str = "moat-bench";

/// A throwaway host account with `/bin/sh` and no startup files, so that sshd's
/// side runs `sh -c true` as a box does (root's shell may source a slow bashrc).
pub struct BenchUser;

impl BenchUser {
    pub fn create(home: &Path) -> Result<Self> {
        let _ = Command::new("userdel").arg(BENCH_USER).output();
        let status = Command::new("useradd").args(["-M", "-s", "/bin/sh", "-d"]).arg(home).arg(BENCH_USER).status()?;
        // "*": no password, but not a locked account (sshd refuses locked ones).
        let unlock = Command::new("usermod").args(["-p", "*", BENCH_USER]).status()?;
        if !status.success() || !unlock.success() {
            bail!("cannot create the benchmark user {BENCH_USER}");
        }
        Ok(Self)
    }
}

impl Drop for BenchUser {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(BENCH_USER).output();
    }
}

/// OpenSSH's sshd on loopback, with its own host key and our client key.
pub fn start_sshd(dir: &Path, keys_file: &Path, port: u16) -> Result<std::process::Child> {
    let host_key = dir.join("sshd_host_key");
    keygen(&host_key)?;
    let config = dir.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {}\nAuthorizedKeysFile {}\nPidFile none\nUsePAM no\n\
             StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n",
            host_key.display(),
            keys_file.display()
        ),
    )?;
    std::fs::create_dir_all("/run/sshd")?;
    let child = Command::new("/usr/sbin/sshd")
        .arg("-D")
        .arg("-f")
        .arg(&config)
        .stderr(Stdio::null())
        .spawn()
        .context("start /usr/sbin/sshd (apt-get install openssh-server)")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("sshd did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child)
}
