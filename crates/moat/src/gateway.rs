//! `moat gateway` (internal): the unprivileged process that serves every
//! box's egress. Started by `moat serve` with its socket as stdin; enters the
//! upstream network namespace if told to, confines itself, then serves the
//! boxes it is handed and sends back what it logs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use moat_api::Packets;
use moat_gateway::{FromGateway, Gateway, GatewayHello, ToGateway, MAX_MESSAGE};
use tokio::sync::mpsc;

/// Log entries waiting to be sent, at most.
const LOG_BACKLOG: usize = 16 << 10;
/// Entries per message, at most.
const LOG_BATCH: usize = 512;

/// Where the gateway keeps package files, and reads advisories.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PackageArgs {
    /// The package cache's directory (the gateway's own).
    #[arg(long)]
    pub package_cache: Option<PathBuf>,
    /// Its bound, in bytes.
    #[arg(long, default_value_t = 0)]
    pub package_cache_bytes: u64,
    /// The operator's OSV export.
    #[arg(long)]
    pub osv_db: Option<PathBuf>,
}

impl PackageArgs {
    /// Its flags, for the gateway's command line.
    pub fn flags(&self) -> Vec<std::ffi::OsString> {
        let mut out = Vec::new();
        if let Some(dir) = &self.package_cache {
            out.extend(["--package-cache".into(), dir.clone().into_os_string()]);
            out.extend(["--package-cache-bytes".into(), self.package_cache_bytes.to_string().into()]);
        }
        if let Some(dir) = &self.osv_db {
            out.extend(["--osv-db".into(), dir.clone().into_os_string()]);
        }
        out
    }
}

/// Runs the gateway as `id` (uid and gid), dialling from `netns` if given.
/// Its package cache is opened and the OSV database read first; then
/// Landlock holds it to the cache's directory alone.
pub fn run(id: u32, netns: Option<PathBuf>, packages: PackageArgs) -> Result<()> {
    let start = crate::privsep::ChildStart::new(c"moat-gateway")?;
    dial_from(netns.as_deref())?;
    let cache = packages.package_cache.as_deref().map(open_dir).transpose()?;
    let tree = cache.as_ref().map(std::os::fd::OwnedFd::try_clone).transpose()?;
    let config = moat_gateway::packages::PackagesConfig {
        cache_dir: cache,
        cache_bytes: packages.package_cache_bytes,
        osv_db: packages.osv_db,
    };
    // Read as root, before the drop: the OSV export is the operator's. Then
    // Landlock holds the gateway to the cache's directory alone.
    let mut registries = moat_gateway::packages::Registries::new(config);
    let files = match &tree {
        Some(dir) => {
            moat_box::sys::landlock_only_beneath(std::os::fd::AsFd::as_fd(dir)).context("landlock the gateway")?
        }
        None => false,
    };
    drop(tree);
    if !files {
        if registries.cache().is_some() {
            tracing::warn!("this kernel has no Landlock: the gateway keeps no package files");
        }
        registries.forget_cache();
    }
    // Its connection limits come of its descriptor limit, read before the
    // filter (which has no getrlimit).
    let admission = moat_gateway::admission::Admission::for_this_process();
    moat_box::confine::gateway(id, id, files).context("confine the gateway")?;
    let runtime = start.runtime()?;
    runtime.block_on(serve(start.link, registries, admission))
}

fn open_dir(dir: &std::path::Path) -> Result<std::os::fd::OwnedFd> {
    let file = std::fs::File::open(dir).with_context(|| format!("open {}", dir.display()))?;
    Ok(file.into())
}

/// Enters `netns`, the network upstream connections leave from (the
/// gateway's and the image fetcher's), if one is given.
pub fn dial_from(netns: Option<&std::path::Path>) -> Result<()> {
    if let Some(netns) = netns {
        let ns = std::fs::File::open(netns).with_context(|| format!("open {}", netns.display()))?;
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("enter the upstream network")?;
    }
    Ok(())
}

async fn serve(
    link: std::os::fd::OwnedFd,
    registries: moat_gateway::packages::Registries,
    admission: moat_gateway::admission::Admission,
) -> Result<()> {
    let link = Arc::new(Packets::new(link)?);
    let Some(hello) = link.recv(MAX_MESSAGE).await? else { bail!("moat serve went away") };
    let hello: GatewayHello = serde_json::from_slice(&hello.bytes).context("read the configuration")?;
    let upstream = hello.upstream().map_err(anyhow::Error::msg)?;
    let (log_tx, log_rx) = mpsc::channel(LOG_BACKLOG);
    let (ask_tx, mut ask_rx) = mpsc::unbounded_channel();
    let gateway = Gateway::new(upstream, registries, admission, log_tx, ask_tx);
    tokio::spawn(send_logs(Arc::clone(&link), log_rx));
    let questions = Arc::clone(&link);
    tokio::spawn(async move {
        while let Some(question) = ask_rx.recv().await {
            let Ok(bytes) = serde_json::to_vec(&question) else { continue };
            if questions.send(&bytes, &[]).await.is_err() {
                return;
            }
        }
    });
    while let Some(msg) = link.recv(MAX_MESSAGE).await? {
        let parsed: ToGateway = serde_json::from_slice(&msg.bytes).context("moat serve sent a bad message")?;
        if let Err(e) = gateway.handle(parsed, msg.fds) {
            tracing::error!(error = %e, "cannot serve a box");
        }
    }
    Ok(())
}

/// Sends log entries back in batches as they come.
async fn send_logs(link: Arc<Packets>, mut rx: mpsc::Receiver<(moat_core::BoxId, moat_core::egress::LogEntry)>) {
    while let Some(first) = rx.recv().await {
        let mut entries = vec![first];
        // A moment for more to gather, so that a busy box costs few messages.
        tokio::time::sleep(Duration::from_millis(20)).await;
        while entries.len() < LOG_BATCH {
            match rx.try_recv() {
                Ok(entry) => entries.push(entry),
                Err(_) => break,
            }
        }
        let Ok(bytes) = serde_json::to_vec(&FromGateway::Log { entries }) else { continue };
        if link.send(&bytes, &[]).await.is_err() {
            return;
        }
    }
}
