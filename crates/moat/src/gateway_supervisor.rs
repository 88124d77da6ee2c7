//! The gateway's supervisor, on the privileged side: has each running box's
//! gateway listeners made inside its network namespace
//! ([`moat_box::host::egress`]), keeps them (so a restarted gateway gets the
//! same sockets, and connections waiting in their backlogs survive), and runs
//! the gateway process, confined like the front door, to serve them. While
//! the gateway is down a box's connections wait unanswered and its DNS
//! queries go unanswered: nothing gets out (fail closed). A suspended box has
//! no listeners: they are closed as it freezes and made again before it
//! thaws.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use anyhow::{Context, Result};
use moat_box::host::egress::{listeners_in, listeners_when_free};
use moat_core::box_ca::CaKey;
use moat_core::policy::Policy;
use moat_core::secrets::BoxSecret;
use moat_core::{AccountId, BoxHandle, BoxId, BoxManager, BoxRecord, NetAttach, Wait};
use moat_gateway::{FromGateway, GatewayHello, Role, ToGateway, MAX_MESSAGE};
use tokio::sync::mpsc;

/// A message for the gateway and the sockets that go with it.
type Outgoing = (ToGateway, Vec<OwnedFd>);

struct Attachment {
    /// The box's PID 1 on the host (what it runs is shown with questions).
    pid: u32,
    /// Its network namespace, where its sockets are made.
    netns: PathBuf,
    /// Its owner.
    account: AccountId,
    policy: Policy,
    ca_key: Option<CaKey>,
    /// Empty while it is suspended: a frozen box sends nothing, and ten
    /// thousand suspended boxes would otherwise hold seven descriptors each
    /// here and in the gateway (made again as it resumes, in well under a
    /// millisecond).
    sockets: Vec<(Role, OwnedFd)>,
    /// Whether it runs (and so should have sockets).
    running: bool,
    /// Its secrets, opened (only ever sent to the gateway).
    secrets: Vec<BoxSecret>,
}

impl Attachment {
    /// Everything the gateway needs to serve the box, in order.
    fn messages(&self, id: &BoxId) -> Vec<Outgoing> {
        let Some(attach) = self.message(id) else { return Vec::new() };
        let secrets = ToGateway::Secrets { box_id: id.clone(), secrets: self.secrets.clone() };
        vec![attach, (secrets, Vec::new())]
    }

    fn message(&self, id: &BoxId) -> Option<Outgoing> {
        let (roles, fds) = self.to_pass(id)?;
        let attach = ToGateway::Attach {
            box_id: id.clone(),
            account: self.account.clone(),
            policy: self.policy.clone(),
            ca_key: self.ca_key.clone(),
            roles,
        };
        Some((attach, fds))
    }

    /// Runs without the sockets it should have: a resume found its ports
    /// still held by a gateway slow to let go of them (or hung).
    fn unserved(&self) -> bool {
        self.running && self.sockets.is_empty()
    }

    /// Keeps `sockets` as the running box's, and the message that hands them
    /// to the gateway.
    fn listen_on(&mut self, id: &BoxId, sockets: Vec<(Role, OwnedFd)>) -> Option<Outgoing> {
        self.sockets = sockets;
        let (roles, fds) = self.to_pass(id)?;
        Some((ToGateway::Listen { box_id: id.clone(), roles }, fds))
    }

    /// Its sockets' roles, and copies of the sockets to pass.
    fn to_pass(&self, id: &BoxId) -> Option<(Vec<Role>, Vec<OwnedFd>)> {
        let fds: std::io::Result<Vec<OwnedFd>> = self.sockets.iter().map(|(_, fd)| fd.try_clone()).collect();
        let fds = fds.inspect_err(|e| tracing::error!(box_id = %id, error = %e, "cannot pass a box's sockets")).ok()?;
        Some((self.sockets.iter().map(|(role, _)| *role).collect(), fds))
    }
}

/// Box `id`'s gateway sockets, or nothing, said in the log (the box then
/// reaches nothing).
fn made(id: &BoxId, sockets: std::io::Result<Vec<(Role, OwnedFd)>>) -> Option<Vec<(Role, OwnedFd)>> {
    sockets
        .inspect_err(|e| tracing::error!(box_id = %id, error = %e, "no gateway for this box: it reaches nothing"))
        .ok()
}

#[derive(Default)]
struct State {
    boxes: HashMap<BoxId, Attachment>,
    /// The running gateway's inbox, if one runs.
    link: Option<mpsc::UnboundedSender<Outgoing>>,
}

/// Egress for every running box.
#[derive(Default)]
pub struct Egress {
    state: Mutex<State>,
}

impl Egress {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn tell(state: &State, msg: Outgoing) {
        if let Some(link) = &state.link {
            let _ = link.send(msg);
        }
    }

    /// Makes the sockets of running boxes that have none, once their ports
    /// are free, and hands them over (off this thread: entering a namespace
    /// takes one of its own).
    async fn serve_unserved(&self) {
        let unserved: Vec<(BoxId, PathBuf)> = self
            .state()
            .boxes
            .iter()
            .filter(|(_, a)| a.unserved())
            .map(|(id, a)| (id.clone(), a.netns.clone()))
            .collect();
        for (id, netns) in unserved {
            let Ok(Ok(sockets)) = tokio::task::spawn_blocking(move || listeners_in(&netns)).await else { continue };
            let mut state = self.state();
            // Suspended or served meanwhile: these just close.
            let Some(a) = state.boxes.get_mut(&id).filter(|a| a.unserved()) else { continue };
            if let Some(msg) = a.listen_on(&id, sockets) {
                Self::tell(&state, msg);
            }
            tracing::info!(box_id = %id, "the box's gateway sockets are made at last");
        }
    }

    /// Keeps what serving box `rec` takes, and hands it to the gateway.
    fn attach(
        &self,
        rec: &BoxRecord,
        handle: &BoxHandle,
        policy: &Policy,
        sockets: Vec<(Role, OwnedFd)>,
        running: bool,
    ) {
        let NetAttach::Netns(netns) = &handle.network;
        let ca_key = handle.ca_key.as_ref().and_then(|path| {
            std::fs::read_to_string(path)
                .inspect_err(|e| tracing::error!(box_id = %rec.id, error = %e, "cannot read the box's CA key"))
                .ok()
        });
        let attachment = Attachment {
            pid: handle.pid,
            netns: netns.clone(),
            account: rec.account.clone(),
            policy: policy.clone(),
            ca_key: ca_key.map(CaKey),
            sockets,
            running,
            secrets: Vec::new(),
        };
        let mut state = self.state();
        for msg in attachment.messages(&rec.id) {
            Self::tell(&state, msg);
        }
        state.boxes.insert(rec.id.clone(), attachment);
    }
}

impl moat_core::NetworkHooks for Egress {
    fn up(&self, rec: &BoxRecord, handle: &BoxHandle, policy: &Policy) {
        let NetAttach::Netns(netns) = &handle.network;
        if let Some(sockets) = made(&rec.id, listeners_when_free(netns)) {
            self.attach(rec, handle, policy, sockets, true);
        }
    }

    fn up_suspended(&self, rec: &BoxRecord, handle: &BoxHandle, policy: &Policy) {
        self.attach(rec, handle, policy, Vec::new(), false);
    }

    fn suspended(&self, id: &BoxId) {
        let mut state = self.state();
        if let Some(a) = state.boxes.get_mut(id) {
            a.sockets.clear();
            a.running = false;
        }
        Self::tell(&state, (ToGateway::Suspend { box_id: id.clone() }, Vec::new()));
    }

    fn resuming(&self, id: &BoxId, wait: Wait) -> bool {
        // Made unlocked (they may wait for the ports); the box's own lock
        // keeps its other hooks away meanwhile.
        let Some(netns) = self.state().boxes.get(id).map(|a| a.netns.clone()) else { return true };
        let sockets = match wait {
            // Ports the gateway has not let go of yet are waited for elsewhere.
            Wait::No => match listeners_in(&netns) {
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return false,
                other => other,
            },
            Wait::Yes => listeners_when_free(&netns),
        };
        let sockets = made(id, sockets);
        let mut state = self.state();
        let Some(a) = state.boxes.get_mut(id) else { return true };
        a.running = true;
        if let Some(msg) = sockets.and_then(|sockets| a.listen_on(id, sockets)) {
            Self::tell(&state, msg);
        }
        true
    }

    fn down(&self, id: &BoxId) {
        let mut state = self.state();
        state.boxes.remove(id);
        Self::tell(&state, (ToGateway::Detach { box_id: id.clone() }, Vec::new()));
    }

    fn policy_changed(&self, id: &BoxId, policy: &Policy) {
        let mut state = self.state();
        if let Some(a) = state.boxes.get_mut(id) {
            a.policy = policy.clone();
        }
        Self::tell(&state, (ToGateway::Policy { box_id: id.clone(), policy: policy.clone() }, Vec::new()));
    }

    fn secrets_changed(&self, id: &BoxId, secrets: &[BoxSecret]) {
        let mut state = self.state();
        let Some(a) = state.boxes.get_mut(id) else { return };
        a.secrets = secrets.to_vec();
        Self::tell(&state, (ToGateway::Secrets { box_id: id.clone(), secrets: secrets.to_vec() }, Vec::new()));
    }

    fn answered(&self, _id: &BoxId, question: u64, answer: moat_core::egress::Answer) {
        Self::tell(&self.state(), (ToGateway::Answer { id: question, answer }, Vec::new()));
    }
}

impl Egress {
    /// Acts on what the gateway said (off the thread that polls it: the
    /// store writes with fsync).
    fn hear(&self, manager: &BoxManager, news: FromGateway) {
        match news {
            FromGateway::Log { entries } => manager.record_egress(entries),
            FromGateway::Ask { box_id, id, name, port } => {
                let pid = self.state().boxes.get(&box_id).map(|a| a.pid);
                let running = pid.map(crate::procs::newest_descendants).unwrap_or_default();
                // A question that cannot be put is refused at once.
                if !manager.ask(&box_id, id, name.to_string(), port, running) {
                    let deny = ToGateway::Answer { id, answer: moat_core::egress::Answer::Deny };
                    Self::tell(&self.state(), (deny, Vec::new()));
                }
            }
        }
    }
}

/// How to run the gateway process.
pub struct GatewayConfig {
    /// Its uid and gid.
    pub id: u32,
    /// The network namespace it dials from (default: ours).
    pub netns: Option<PathBuf>,
    /// What it is told at start.
    pub hello: GatewayHello,
    /// Its package cache and OSV database.
    pub packages: crate::gateway::PackageArgs,
}

/// Runs the gateway until this process ends, restarting it whenever it dies,
/// and feeds what it logs to `manager`.
pub async fn supervise(egress: Arc<Egress>, config: GatewayConfig, manager: Arc<BoxManager>) {
    // Entries are stored by a task of their own (SQLite with fsync), not by
    // this future, which the main thread polls.
    let (news_tx, mut news_rx) = mpsc::unbounded_channel();
    tokio::spawn({
        let egress = Arc::clone(&egress);
        async move {
            while let Some(news) = news_rx.recv().await {
                egress.hear(&manager, news);
            }
        }
    });
    let mut restarts = crate::privsep::Restarts::default();
    loop {
        let started = Instant::now();
        match run_once(&egress, &config, &news_tx).await {
            Ok(status) => tracing::warn!(%status, "gateway exited; starting it again"),
            Err(e) => tracing::error!(error = %format!("{e:#}"), "gateway failed; starting it again"),
        }
        egress.state().link = None;
        restarts.wait(started).await;
    }
}

/// How often running boxes without their sockets are tried again.
const UNSERVED_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// What the gateway says, on its way to the manager.
type News = mpsc::UnboundedSender<FromGateway>;

async fn run_once(egress: &Egress, config: &GatewayConfig, news: &News) -> Result<std::process::ExitStatus> {
    let id = config.id.to_string();
    let mut args: Vec<&std::ffi::OsStr> = vec!["gateway".as_ref(), "--id".as_ref(), id.as_ref()];
    if let Some(netns) = &config.netns {
        args.extend(["--netns".as_ref(), netns.as_os_str()]);
    }
    let package_flags = config.packages.flags();
    args.extend(package_flags.iter().map(|f| f.as_os_str()));
    let (mut child, link) = crate::privsep::spawn_child("moat-gateway", &args)?;
    link.send(&serde_json::to_vec(&config.hello)?, &[]).await.context("configure the gateway")?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
    {
        // Under the lock: every box now, then every change after, in order.
        let mut state = egress.state();
        for (id, attachment) in &state.boxes {
            for msg in attachment.messages(id) {
                let _ = tx.send(msg);
            }
        }
        state.link = Some(tx);
    }
    tracing::info!(pid = child.id(), "gateway started");
    let send = async {
        while let Some((msg, fds)) = rx.recv().await {
            let bytes = serde_json::to_vec(&msg)?;
            let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
            link.send(&bytes, &borrowed).await?;
        }
        anyhow::Ok(())
    };
    let receive = async {
        while let Some(msg) = link.recv(MAX_MESSAGE).await? {
            // A gateway that speaks out of turn is no longer trusted to run.
            anyhow::ensure!(msg.fds.is_empty(), "gateway sent descriptors");
            let _ = news.send(serde_json::from_slice(&msg.bytes).context("gateway sent a bad message")?);
        }
        anyhow::Ok(())
    };
    let retry = async {
        let mut every = tokio::time::interval(UNSERVED_RETRY);
        loop {
            every.tick().await;
            egress.serve_unserved().await;
        }
    };
    tokio::select! {
        () = retry => anyhow::bail!("the retries of unserved boxes ended"),
        status = child.wait() => Ok(status?),
        r = send => {
            r.context("talking to the gateway")?;
            let _ = child.start_kill();
            Ok(child.wait().await?)
        }
        r = receive => {
            if let Err(e) = r {
                tracing::error!(error = %format!("{e:#}"), "killing the gateway");
            }
            let _ = child.start_kill();
            Ok(child.wait().await?)
        }
    }
}

/// The first nameserver of the host's resolv.conf (the gateway's default
/// upstream resolver).
pub fn host_resolver() -> Option<std::net::SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next()? == "nameserver").then_some(())?;
        let ip: std::net::IpAddr = words.next()?.split('%').next()?.parse().ok()?;
        Some(std::net::SocketAddr::new(ip, 53))
    })
}

/// Where Debian (and most distributions) keep the host's trusted roots.
const HOST_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The roots the gateway verifies real hosts with: the host's, and `extra`
/// (a test internet's CA).
pub fn upstream_roots(extra: &[PathBuf]) -> Result<String> {
    let mut pem = std::fs::read_to_string(HOST_ROOTS).unwrap_or_default();
    for path in extra {
        let more = std::fs::read_to_string(path).with_context(|| format!("--upstream-ca {}", path.display()))?;
        pem.push('\n');
        pem.push_str(&more);
    }
    Ok(pem)
}
