//! `moat front`: a fleet's front door. It runs today's SSH front door (the
//! same confined child `moat serve` runs, restarted the same way) and,
//! beside it, the router (`moat front-router`, a child under its own
//! unprivileged uid) that holds the fleet certificate and the store's DSN
//! and answers the front door's requests by forwarding each to a node.
//!
//! This process stays root only to start those two again when they die. It
//! reads the member's files once and hands them to the router, which opens
//! no file; each connection the front door dials is passed to the router as
//! a descriptor, unread. The host key the front door presents is the fleet's
//! (sealed in the store; the router opens it), so every front door looks the
//! same to `known_hosts`.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use moat_api::server::Answer;
use moat_api::{Hello, Packets};
use moat_fleet::join::Token;
use moat_fleet::pki::Role;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::paths;
use crate::privsep::{self, FrontDoor, Restarts};

/// Flags of `moat front`.
#[derive(Args)]
pub struct FrontArgs {
    /// The state dir `moat fleet join` wrote for this front door.
    #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Address to listen on for SSH.
    #[arg(long, default_value = "127.0.0.1:2222")]
    listen: SocketAddr,
    /// Seconds a client has to authenticate.
    #[arg(long, default_value_t = 30)]
    auth_timeout: u64,
    /// Seconds of silence after which a connection is closed.
    #[arg(long, default_value_t = 3600)]
    idle_timeout: u64,
    /// The uid and gid the SSH-facing process runs as; must own nothing.
    #[arg(long, default_value_t = moat_core::record::FRONT_DOOR_ID)]
    front_door_id: u32,
    /// The uid and gid the router runs as; must own nothing.
    #[arg(long, default_value_t = ROUTER_ID)]
    router_id: u32,
}

/// The router's uid and gid unless the operator picks another: beside the
/// front door's and the gateway's, none of them the same.
pub const ROUTER_ID: u32 = moat_core::record::GATEWAY_ID - 1;

/// What the router says once it is ready.
#[derive(Serialize, Deserialize)]
pub struct RouterReady {
    /// The fleet's SSH host key (OpenSSH text).
    pub host_key: String,
}

/// Runs a front door until killed.
pub fn run(args: FrontArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    if !nix::unistd::Uid::effective().is_root() {
        bail!("moat front runs as root: it starts the SSH front door and the router each under a uid of its own");
    }
    privsep::raise_fd_limit();
    let member = moat_fleet::join::read_member(&args.state_dir)?;
    if member.member.role != Role::Front {
        bail!(
            "{} is {} {}, not a front door",
            args.state_dir.display(),
            member.member.role.as_str(),
            member.member.name
        );
    }
    let runtime = tokio::runtime::Runtime::new().context("start the async runtime")?;
    runtime.block_on(serve(args, member))
}

async fn serve(args: FrontArgs, member: Token) -> Result<()> {
    let listener = std::net::TcpListener::bind(args.listen).with_context(|| format!("listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let (link_tx, link_rx) = watch::channel(None);
    let (ready_tx, mut ready_rx) = watch::channel(None);
    let name = member.member.name.clone();
    // Both polled by this (main) thread, never a runtime worker: the
    // children die with the thread that started them (PR_SET_PDEATHSIG).
    let routers = keep_router(member, args.router_id, link_tx, ready_tx);
    let doors = async {
        let host_key = loop {
            if let Some(key) = ready_rx.borrow_and_update().clone() {
                break key;
            }
            ready_rx.changed().await.context("the router never started")?;
        };
        let front = FrontDoor {
            id: args.front_door_id,
            hello: Hello { host_key, auth_timeout_secs: args.auth_timeout, idle_timeout_secs: args.idle_timeout },
        };
        tracing::info!(%addr, front = %name, "moat front serving");
        // One machine-readable line on stdout, for scripts that asked for port 0.
        println!("listening on {addr}");
        privsep::supervise(listener, front, Arc::new(ToRouter { link: link_rx })).await
    };
    let ((), served) = tokio::join!(routers, doors);
    served
}

/// Answers the front door's dials by passing each connection to the router.
struct ToRouter {
    link: watch::Receiver<Option<Arc<Packets>>>,
}

impl Answer for ToRouter {
    async fn answer(self: Arc<Self>, conn: Packets) -> std::io::Result<()> {
        let link = self.link.borrow().clone();
        match link {
            Some(link) => link.send(b"c", &[conn.as_fd()]).await,
            // Between routers: the front door hears that nothing answers.
            None => Ok(()),
        }
    }
}

/// Runs the router, starting it again whenever it dies; publishes its link
/// while it lives, and its host key once.
async fn keep_router(
    member: Token,
    id: u32,
    link: watch::Sender<Option<Arc<Packets>>>,
    ready: watch::Sender<Option<String>>,
) {
    let mut restarts = Restarts::default();
    loop {
        let started = Instant::now();
        match start_router(&member, id).await {
            Ok((mut child, routed, host_key)) => {
                ready.send_replace(Some(host_key));
                link.send_replace(Some(Arc::new(routed)));
                tracing::info!(pid = child.id(), "router started");
                let status = child.wait().await;
                link.send_replace(None);
                tracing::warn!(status = ?status, "router exited; starting it again");
            }
            Err(e) => tracing::error!(error = %format!("{e:#}"), "router failed to start; starting it again"),
        }
        restarts.wait(started).await;
    }
}

async fn start_router(member: &Token, id: u32) -> Result<(tokio::process::Child, Packets, String)> {
    let id = id.to_string();
    let (child, link) = privsep::spawn_child("moat-router", &["front-router".as_ref(), "--id".as_ref(), id.as_ref()])?;
    link.send(&serde_json::to_vec(member)?, &[]).await.context("hand the router its member files")?;
    let ready = link.recv(64 << 10).await?.context("the router exited before it was ready")?;
    let ready: RouterReady = serde_json::from_slice(&ready.bytes).context("read the router's ready")?;
    Ok((child, link, ready.host_key))
}
