//! Privilege separation: the privileged side (this process: manager,
//! backends, store) runs the front door, which parses everything from the
//! network, as a child of its own under an unprivileged uid, confined by
//! `moat_box::confine`, and answers its requests over `moat_api`. A front door
//! that dies is started again; boxes never notice. `moat front` runs the same
//! front door, its requests answered by a fleet's router instead.

use std::net::TcpListener;
use std::os::fd::{AsFd, OwnedFd};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use moat_api::server::Answer;
use moat_api::{Hello, Packets};

/// Who the front door runs as, and what it is told.
pub struct FrontDoor {
    /// Its uid and gid.
    pub id: u32,
    /// Its configuration.
    pub hello: Hello,
}

/// A confined child that serves a listening socket and asks the privileged
/// side through moat-api: the front door, the HTTP edge.
pub trait Confined {
    /// Its name in ps and logs, and the hidden subcommand that runs it.
    fn names(&self) -> (&'static str, &'static str);
    /// Its uid and gid.
    fn id(&self) -> u32;
    /// Its configuration, as sent.
    fn hello(&self) -> Result<Vec<u8>>;
}

impl Confined for FrontDoor {
    fn names(&self) -> (&'static str, &'static str) {
        ("moat-front-door", "front-door")
    }

    fn id(&self) -> u32 {
        self.id
    }

    fn hello(&self) -> Result<Vec<u8>> {
        Ok(serde_json::to_vec(&self.hello)?)
    }
}

/// Runs the front door on `listener`, its requests answered by `answerer`,
/// until this process ends, restarting it whenever it dies. The front door holds the only copy of the listening
/// socket (so the process on the SSH port is the unprivileged one); a restart
/// binds the same address again.
pub async fn supervise<A: Answer>(listener: TcpListener, front: impl Confined, answerer: Arc<A>) -> Result<()> {
    // (std sets SO_REUSEADDR: the address binds again while old connections linger.)
    let addr = listener.local_addr()?;
    let mut listener = Some(listener);
    let mut restarts = Restarts::default();
    loop {
        let socket = match listener.take() {
            Some(socket) => socket,
            None => match TcpListener::bind(addr) {
                Ok(socket) => socket,
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "cannot listen again; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
        };
        let started = Instant::now();
        let (name, _) = front.names();
        match run_once(socket, &front, Arc::clone(&answerer)).await {
            Ok(status) => tracing::warn!(%status, name, "exited; starting it again"),
            Err(e) => tracing::error!(error = %format!("{e:#}"), name, "failed; starting it again"),
        }
        restarts.wait(started).await;
    }
}

/// Spacing between restarts of a child process: none to speak of unless it
/// keeps dying at once, then doubling up to a second.
pub struct Restarts {
    backoff: Duration,
}

impl Default for Restarts {
    fn default() -> Self {
        Self { backoff: Duration::from_millis(50) }
    }
}

impl Restarts {
    /// Waits before starting again a child that started at `started`.
    pub async fn wait(&mut self, started: Instant) {
        self.backoff = if started.elapsed() > Duration::from_secs(5) {
            Duration::from_millis(50)
        } else {
            (self.backoff * 2).min(Duration::from_secs(1))
        };
        tokio::time::sleep(self.backoff).await;
    }
}

/// Starts `moat ARGS` as a child named `arg0`, with nothing of our
/// environment but `RUST_LOG`, and a new socket to us as its stdin; returns
/// the child and our end. It is killed if dropped.
pub fn spawn_child(arg0: &str, args: &[&std::ffi::OsStr]) -> Result<(tokio::process::Child, Packets)> {
    let (ours, theirs) = Packets::pair().with_context(|| format!("make the socket to {arg0}"))?;
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.arg0(arg0)
        .args(args)
        .env_clear()
        .env(moat_box::confine::PARENT_VAR, std::process::id().to_string())
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    if let Some(filter) = std::env::var_os("RUST_LOG") {
        cmd.env("RUST_LOG", filter);
    }
    let child = cmd.spawn().with_context(|| format!("start {arg0}"))?;
    // `cmd` holds the child's end until dropped.
    drop(cmd);
    Ok((child, Packets::new(ours)?))
}

/// Starts one front door (or edge) and serves its requests until it exits.
async fn run_once<A: Answer>(
    listener: TcpListener,
    front: &impl Confined,
    answerer: Arc<A>,
) -> Result<std::process::ExitStatus> {
    let id = front.id().to_string();
    let (name, command) = front.names();
    let (mut child, dialer) = spawn_child(name, &[command.as_ref(), "--id".as_ref(), id.as_ref()])?;
    let hello = front.hello()?;
    let listener = OwnedFd::from(listener);
    dialer.send(&hello, &[listener.as_fd()]).await.with_context(|| format!("hand {name} its socket"))?;
    drop(listener);
    tracing::info!(pid = child.id(), name, "started");
    tokio::select! {
        status = child.wait() => Ok(status?),
        served = moat_api::server::serve(dialer, answerer) => {
            // It closed its end without exiting, or spoke out of turn: either
            // way it is no longer one we trust to run.
            if let Err(e) = served {
                tracing::error!(error = %e, name, "misbehaved; killing it");
            }
            let _ = child.start_kill();
            Ok(child.wait().await?)
        }
    }
}

/// Both processes: each box session holds a few descriptors, and the daemon
/// and the gateway hold seven of each box's sockets (its DNS, proxy and
/// dropped-packet sockets, kept to attach a restarted gateway): the default
/// soft limit (1024) is a few hundred sessions, a common hard one (20,000)
/// under 3,000 boxes. Root (the daemon, before it starts its children, which
/// inherit it) raises the hard limit to what the kernel allows a process
/// (`fs.nr_open`); anyone takes what the hard limit allows.
pub fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    let most = std::fs::read_to_string("/proc/sys/fs/nr_open").ok().and_then(|n| n.trim().parse::<u64>().ok());
    if let Some(most) = most.filter(|most| *most > hard) {
        // The soft limit stays bounded: children inherit it, and some tools
        // close or size tables up to it (fs.nr_open may be a billion).
        if setrlimit(Resource::RLIMIT_NOFILE, most.min(SOFT_MOST), most).is_ok() {
            return;
        }
        // Raising a hard limit takes CAP_SYS_RESOURCE, which some roots lack
        // (containers, some VMs); a service manager can set it instead.
        if hard < DESCRIPTORS_FOR_10K_RUNNING && nix::unistd::geteuid().is_root() {
            tracing::warn!(
                limit = hard,
                boxes = hard / DESCRIPTORS_PER_BOX,
                "the open-file limit allows about this many running boxes (the daemon and the gateway \
                 hold {DESCRIPTORS_PER_BOX} of each running box's sockets, with room for sessions; a \
                 suspended box holds none); raise its hard limit (LimitNOFILE= in a systemd unit) for more"
            );
        }
    }
    let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
}

/// The soft limit at most, where the hard limit could be raised.
const SOFT_MOST: u64 = 1 << 20;

/// Descriptors each running box takes in the daemon and in the gateway: its
/// seven sockets (DNS over UDP and TCP and the proxy, on IPv4 and IPv6, and
/// its dropped-packet reports), and one to spare for its sessions.
const DESCRIPTORS_PER_BOX: u64 = 8;

/// Below this, the warning above.
const DESCRIPTORS_FOR_10K_RUNNING: u64 = 10_000 * DESCRIPTORS_PER_BOX;

/// What a confined child (the front door, the gateway) starts from: logging
/// to stderr, its name in ps, no descriptor but stdin (its socket to us),
/// stdout and stderr, and what it must learn before confinement forbids it.
pub struct ChildStart {
    /// Its socket to the privileged side.
    pub link: OwnedFd,
    workers: usize,
}

impl ChildStart {
    /// Run first thing in the child, before it confines itself.
    pub fn new(name: &std::ffi::CStr) -> Result<Self> {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
            .with_writer(std::io::stderr)
            .init();
        // Spawned as /proc/self/exe, it would be "exe" in ps and in audit logs.
        let _ = nix::sys::prctl::set_name(name);
        moat_box::sys::close_from(3).context("close inherited descriptors")?;
        let link = std::io::stdin().as_fd().try_clone_to_owned().context("take the socket to moat serve")?;
        // (Reads cgroup files, which the confined child may not open.)
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        raise_fd_limit();
        Ok(Self { link, workers })
    }

    /// How many threads its work may use: one per CPU it may run on.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The async runtime, made once the child is confined.
    pub fn runtime(&self) -> Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.workers)
            .enable_all()
            .build()
            .context("start the async runtime")
    }
}
