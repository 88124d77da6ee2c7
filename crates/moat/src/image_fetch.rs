//! `moat image-fetch` (internal): the unprivileged process that talks to a
//! registry for one pull. Started by `moat serve` with its socket as stdin;
//! enters the upstream network namespace if told to and confines itself as
//! the gateway does (its uid, no capability, the gateway's seccomp list: it
//! may dial, and write only to descriptors it is handed). It resolves the
//! reference to its documents and config and sends them back, then writes
//! each blob it is asked for into the file that comes with the request.
//! Everything it says is checked again by the daemon, digests first.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use moat_api::Packets;
use moat_core::RegistryLogin;
use moat_gateway::GatewayHello;
use moat_oci::client::{Bounds, Login, Registry};
use moat_oci::manifest::Descriptor;
use moat_oci::Reference;
use serde::{Deserialize, Serialize};

/// Largest message either side sends (documents are bounded at 4 MiB each).
pub const MAX_MESSAGE: usize = 16 << 20;

/// What the daemon tells the fetcher first.
#[derive(Serialize, Deserialize)]
pub struct FetchHello {
    /// The upstream settings (the gateway's).
    pub upstream: GatewayHello,
    /// What to pull.
    pub reference: String,
    /// The operator's default registry, for short names.
    pub default_registry: Option<String>,
    /// The account's login for the reference's registry, if it has one.
    pub logins: Vec<RegistryLogin>,
    /// The pull's bounds.
    pub bounds: Bounds,
}

/// What the daemon asks after the first answer.
#[derive(Serialize, Deserialize)]
pub enum ToFetch {
    /// Write this blob into the attached file.
    Blob {
        /// Which.
        desc: Descriptor,
        /// How it is named in progress lines.
        label: String,
    },
}

/// What the fetcher says.
#[derive(Serialize, Deserialize)]
pub enum FromFetch {
    /// The reference resolved: the documents fetched in order (an index
    /// first, if there was one), and the config.
    Resolved {
        /// The reference in full.
        reference: String,
        /// The name it suggests.
        name_hint: String,
        /// The registry it is on.
        registry: String,
        /// Whether it was pinned by digest (the first document's).
        pinned: Option<String>,
        /// The documents, as served.
        documents: Vec<String>,
        /// The config, as served.
        config: String,
    },
    /// A line of progress.
    Progress(String),
    /// The blob asked for is written and matched its digest.
    Fetched,
    /// It failed (one line).
    Failed(String),
}

/// Runs the fetcher as `id`, dialling from `netns` if given.
pub fn run(id: u32, netns: Option<std::path::PathBuf>) -> Result<()> {
    let start = crate::privsep::ChildStart::new(c"moat-image-fetch")?;
    crate::gateway::dial_from(netns.as_deref())?;
    moat_box::confine::gateway(id, id).context("confine the fetcher")?;
    let runtime = start.runtime()?;
    runtime.block_on(serve(start.link))
}

async fn say(link: &Packets, msg: &FromFetch) -> Result<()> {
    Ok(link.send(&serde_json::to_vec(msg)?, &[]).await?)
}

async fn serve(link: std::os::fd::OwnedFd) -> Result<()> {
    let link = Packets::new(link)?;
    let Some(hello) = link.recv(MAX_MESSAGE).await? else { bail!("moat serve went away") };
    let hello: FetchHello = serde_json::from_slice(&hello.bytes).context("read the pull")?;
    match fetch(&link, hello).await {
        Ok(()) => Ok(()),
        Err(e) => say(&link, &FromFetch::Failed(format!("{e:#}"))).await,
    }
}

async fn fetch(link: &Packets, hello: FetchHello) -> Result<()> {
    let reference = Reference::parse(&hello.reference, hello.default_registry.as_deref())?;
    let upstream = hello.upstream.upstream().map_err(anyhow::Error::msg)?;
    let tls = upstream.tls.clone().context("this host has no TLS roots to verify registries with")?;
    let upstream = Arc::new(moat_gateway::upstream::Upstream::new(upstream));
    let login = hello
        .logins
        .into_iter()
        .find(|l| l.registry == reference.registry)
        .map(|l| Login { user: l.user, password: l.password });
    let registry = Registry::new(&reference, upstream, (*tls).clone(), login, hello.bounds)?;
    say(link, &FromFetch::Progress(format!("{reference}: resolving"))).await?;
    let resolved = registry.resolve(&reference).await?;
    let msg = FromFetch::Resolved {
        reference: reference.to_string(),
        name_hint: reference.local_name(),
        registry: reference.registry.clone(),
        pinned: reference.digest.as_ref().map(|d| d.to_string()),
        documents: resolved.documents.iter().map(|d| String::from_utf8_lossy(d).into_owned()).collect(),
        config: String::from_utf8_lossy(&resolved.config).into_owned(),
    };
    say(link, &msg).await?;
    while let Some(msg) = link.recv(MAX_MESSAGE).await? {
        let ToFetch::Blob { desc, label } =
            serde_json::from_slice(&msg.bytes).context("moat serve sent a bad message")?;
        let fd = msg.fds.into_iter().next().context("a blob request without its file")?;
        let mut file = std::fs::File::from(fd);
        let started = Instant::now();
        let mut last = Instant::now();
        let total = desc.size;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let line_label = label.clone();
        let mut progress = move |got: u64| {
            if last.elapsed().as_millis() >= 1000 {
                last = Instant::now();
                let rate = got as f64 / started.elapsed().as_secs_f64().max(0.001);
                let _ = tx.send(format!("{line_label}: {} of {} ({}/s)", size(got), size(total), size(rate as u64)));
            }
        };
        let work = registry.blob(&desc, &label, &mut file, &mut progress);
        tokio::pin!(work);
        let result = loop {
            tokio::select! {
                r = &mut work => break r,
                Some(line) = rx.recv() => say(link, &FromFetch::Progress(line)).await?,
            }
        };
        match result {
            Ok(()) => {
                let rate = total as f64 / started.elapsed().as_secs_f64().max(0.001);
                say(link, &FromFetch::Progress(format!("{label}: {} ({}/s)", size(total), size(rate as u64)))).await?;
                say(link, &FromFetch::Fetched).await?;
            }
            Err(e) => say(link, &FromFetch::Failed(e.to_string())).await?,
        }
    }
    Ok(())
}

fn size(bytes: u64) -> String {
    moat_core::limits::format_measured(bytes)
}
