//! `moat image-fetch` (internal): the unprivileged process that talks to a
//! registry for one pull or one push. Started by `moat serve` with its socket as stdin;
//! enters the upstream network namespace if told to and confines itself as
//! the gateway does (its uid, no capability, the gateway's seccomp list: it
//! may dial, and write only to descriptors it is handed). It resolves the
//! reference to its documents and config and sends them back, then writes
//! each blob it is asked for into the file that comes with the request.
//! Everything it says is checked again by the daemon, digests first. For a
//! push it says it is ready, then answers the daemon's questions (does the
//! repository hold a blob, can it mount one) and uploads what it is handed.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use moat_api::Packets;
use moat_core::RegistryLogin;
use moat_gateway::GatewayHello;
use moat_oci::client::{Bounds, Login, Registry};
use moat_oci::digest::Digest;
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
    /// A push to `reference`, not a pull of it.
    #[serde(default)]
    pub push: bool,
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
    /// A push: does the repository hold this blob?
    HasBlob(Digest),
    /// A push: mount this blob from the registry's repository `from`.
    Mount {
        /// Which.
        digest: Digest,
        /// The repository it is in.
        from: String,
    },
    /// A push: upload the attached file as this blob.
    Upload {
        /// Which.
        digest: Digest,
        /// How it is named in progress lines.
        label: String,
    },
    /// A push: put this manifest under the reference's tag.
    PutManifest {
        /// Its media type.
        media_type: String,
        /// The document.
        manifest: String,
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
    /// A push: ready for questions.
    Ready,
    /// A push: the answer to `HasBlob` or `Mount`.
    Answer(bool),
    /// A push: the upload or the manifest is done.
    Done,
    /// It failed (one line).
    Failed(String),
}

/// Runs the fetcher as `id`, dialling from `netns` if given.
pub fn run(id: u32, netns: Option<std::path::PathBuf>) -> Result<()> {
    let start = crate::privsep::ChildStart::new(c"moat-image-fetch")?;
    crate::gateway::dial_from(netns.as_deref())?;
    moat_box::confine::gateway(id, id, false).context("confine the fetcher")?;
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
    if hello.push {
        return push(link, &registry, &reference, hello.bounds.max_image).await;
    }
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
            serde_json::from_slice(&msg.bytes).context("moat serve sent a bad message")?
        else {
            bail!("moat serve asked a pull for a push's work");
        };
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

/// Serves a push's requests until the daemon closes the link.
async fn push(link: &Packets, registry: &Registry, reference: &Reference, max: u64) -> Result<()> {
    say(link, &FromFetch::Ready).await?;
    while let Some(msg) = link.recv(MAX_MESSAGE).await? {
        let ask: ToFetch = serde_json::from_slice(&msg.bytes).context("moat serve sent a bad message")?;
        let answer = match ask {
            ToFetch::HasBlob(digest) => registry.has_blob(&digest).await.map(FromFetch::Answer),
            ToFetch::Mount { digest, from } => registry.mount_blob(&digest, &from).await.map(FromFetch::Answer),
            ToFetch::Upload { digest, label } => {
                let fd = msg.fds.into_iter().next().context("an upload without its file")?;
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut std::io::Read::take(std::fs::File::from(fd), max + 1), &mut bytes)?;
                if bytes.len() as u64 > max {
                    bail!("{label} is over --max-image-size");
                }
                let started = Instant::now();
                let len = bytes.len() as u64;
                let done = registry.upload_blob(&digest, bytes.into()).await;
                if done.is_ok() {
                    let rate = len as f64 / started.elapsed().as_secs_f64().max(0.001);
                    say(link, &FromFetch::Progress(format!("{label}: {} ({}/s)", size(len), size(rate as u64))))
                        .await?;
                }
                done.map(|()| FromFetch::Done)
            }
            ToFetch::PutManifest { media_type, manifest } => {
                let tag = reference.tag.clone();
                registry.put_manifest(&tag, &media_type, manifest.into_bytes().into()).await.map(|()| FromFetch::Done)
            }
            ToFetch::Blob { .. } => bail!("moat serve asked a push for a pull's work"),
        };
        match answer {
            Ok(answer) => say(link, &answer).await?,
            Err(e) => say(link, &FromFetch::Failed(e.to_string())).await?,
        }
    }
    Ok(())
}

fn size(bytes: u64) -> String {
    moat_core::limits::format_measured(bytes)
}
