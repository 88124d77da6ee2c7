//! The daemon's side of `image pull`: runs the fetcher ([`crate::image_fetch`],
//! unprivileged, on the upstream network) and one unpacker per layer
//! ([`crate::image_unpack`], confined, no network), and checks everything they
//! say: every document's and blob's digest is computed here again, each
//! layer's diff id against the config. Layers already made (by any pull, of
//! any account) are not fetched again; a pull that fails leaves no layer it
//! was making and no blob. Pulls run side by side; two that need one layer
//! take turns making it (the second finds it made).

use std::io::{Read, Seek};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use moat_api::Packets;
use moat_box::layers;
use moat_box::pool::Pool;
use moat_core::backend::Progress;
use moat_core::keyed_locks::KeyedLocks;
use moat_core::manager::Logins;
use moat_core::{ImagePuller, Name, Pulled};
use moat_gateway::GatewayHello;
use moat_oci::client::Bounds;
use moat_oci::digest::{chain, Digest};
use moat_oci::manifest::{self, Compression, Fetched, Manifest};
use moat_oci::unpack::Report;
use moat_oci::Reference;
use sha2::Digest as _;

use crate::image_fetch::{FetchHello, FromFetch, ToFetch, MAX_MESSAGE};

/// Longest one layer's unpacking may take.
const UNPACK_DEADLINE: Duration = Duration::from_secs(600);
/// Largest report an unpacker may print.
const MAX_REPORT: usize = 64 << 10;

/// How pulls are made on this host.
pub struct Puller {
    /// The pool layers and images go into.
    pub pool: Arc<Pool>,
    /// The uid and gid the fetcher runs as.
    pub id: u32,
    /// The network namespace it dials from.
    pub netns: Option<PathBuf>,
    /// The upstream settings (the gateway's).
    pub upstream: GatewayHello,
    /// The registry short names are on.
    pub default_registry: Option<String>,
    /// Bounds on each pull.
    pub bounds: Bounds,
    /// The runtime the fetcher's link is driven on.
    pub runtime: tokio::runtime::Handle,
    /// What pulls are making, by name (a layer's chain id, an image's key):
    /// two pulls of one layer would make it twice; pulls of other layers go
    /// side by side.
    pub making: KeyedLocks<String>,
}

impl ImagePuller for Puller {
    fn pull(&self, reference: &str, logins: Logins<'_>, progress: Progress<'_>) -> Result<Pulled, String> {
        self.runtime.block_on(self.pull_async(reference, logins, progress)).map_err(|e| format!("{e:#}"))
    }

    fn push(
        &self,
        image: &moat_core::store::images::StoredImage,
        reference: &str,
        logins: Logins<'_>,
        progress: Progress<'_>,
    ) -> Result<String, String> {
        self.push_image(image, reference, logins, progress).map_err(|e| format!("{e:#}"))
    }

    fn forget(&self, key: Option<&Name>, unused: &[String]) {
        if let Some(key) = key {
            if let Err(e) = moat_box::image::remove(&self.pool, key) {
                tracing::warn!(image = %key, error = %e, "cannot remove an image no one has");
            }
        }
        for layer in unused {
            if let Err(e) = layers::remove(&self.pool, layer) {
                tracing::warn!(layer, error = %e, "cannot remove a layer no image has");
            }
        }
    }
}

/// The manifest the fetched documents resolve to, every digest checked
/// here: the first against a pinned digest, an index's choice against the
/// manifest that came.
fn check_documents(documents: &[String], pinned: Option<&str>) -> Result<(Digest, Manifest)> {
    let first = documents.first().context("the fetcher sent no manifest")?;
    let mut digest = Digest::of(first.as_bytes());
    if let Some(pinned) = pinned {
        ensure!(digest.as_str() == pinned, "the manifest does not match {pinned} (got {digest})");
    }
    match manifest::read(first.as_bytes(), None)? {
        Fetched::Manifest(m) => {
            ensure!(documents.len() == 1, "the fetcher sent documents after the manifest");
            Ok((digest, m))
        }
        Fetched::Index(entry) => {
            let [_, second] = documents else {
                bail!("the fetcher sent no manifest for the index's linux/amd64 entry")
            };
            digest = Digest::of(second.as_bytes());
            ensure!(digest == entry.digest, "the manifest does not match the index's {} (got {digest})", entry.digest);
            match manifest::read(second.as_bytes(), None)? {
                Fetched::Manifest(m) => Ok((digest, m)),
                Fetched::Index(_) => bail!("an index inside an index"),
            }
        }
    }
}

/// The SHA-256 and length of what is in `file`, read from its start.
fn hash_file(file: &mut std::fs::File) -> Result<(Digest, u64)> {
    file.rewind()?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        len += n as u64;
        hasher.update(buf.get(..n).unwrap_or_default());
    }
    file.rewind()?;
    Ok((Digest::from_hasher(hasher), len))
}

/// The fetcher's next answer, its progress lines handed on meanwhile.
pub(crate) async fn next(link: &Packets, progress: &mut (dyn FnMut(&str) + Send)) -> Result<FromFetch> {
    loop {
        let Some(msg) = link.recv(MAX_MESSAGE).await? else { bail!("the fetcher went away") };
        ensure!(msg.fds.is_empty(), "the fetcher sent descriptors");
        match serde_json::from_slice(&msg.bytes).context("the fetcher sent a bad message")? {
            FromFetch::Progress(line) => progress(&line.chars().take(300).collect::<String>()),
            FromFetch::Failed(why) => bail!("{}", why.chars().take(2000).collect::<String>()),
            other => return Ok(other),
        }
    }
}

impl Puller {
    async fn pull_async(&self, text: &str, logins: Logins<'_>, progress: Progress<'_>) -> Result<Pulled> {
        let reference = Reference::parse(text, self.default_registry.as_deref())?;
        let hello = FetchHello {
            upstream: self.upstream.clone(),
            reference: text.to_string(),
            default_registry: self.default_registry.clone(),
            logins: logins(&reference.registry).into_iter().collect(),
            bounds: self.bounds,
            push: false,
        };
        let (_child, link) = self.start_fetcher(&hello).await?;
        let FromFetch::Resolved { reference: full, name_hint, pinned, documents, config, .. } =
            next(&link, progress).await?
        else {
            bail!("the fetcher answered out of turn");
        };
        let (manifest_digest, manifest) = check_documents(&documents, pinned.as_deref())?;
        let config_digest = Digest::of(config.as_bytes());
        ensure!(
            config_digest == manifest.config.digest,
            "the image config does not match its digest (expected {}, got {config_digest})",
            manifest.config.digest
        );
        let image_config = manifest::read_config(config.as_bytes())?;
        let diff_ids = &image_config.rootfs.diff_ids;
        ensure!(
            diff_ids.is_empty() || diff_ids.len() == manifest.layers.len(),
            "the config names {} layers and the manifest {}",
            diff_ids.len(),
            manifest.layers.len()
        );
        let bytes = manifest.layers.iter().fold(manifest.config.size, |s, (d, _)| s.saturating_add(d.size));
        ensure!(bytes <= self.bounds.max_image, "the image is {bytes} bytes, over --max-image-size");
        let blobs: Vec<Digest> = manifest.layers.iter().map(|(d, _)| d.digest.clone()).collect();
        let chains = chain(&blobs);
        let count = manifest.layers.len();
        // What this pull may write, all its layers together (the compressed
        // bound alone let a 33 MB image of zeros fill the disk with 1 TiB).
        let mut unpacked = 0u64;
        for (i, ((desc, compression), chain_id)) in manifest.layers.iter().zip(&chains).enumerate() {
            let label = format!("layer {}/{count} {}", i + 1, desc.digest.short());
            let _making = self.making.hold(&chain_id.hex().to_string()).await;
            if layers::has(&self.pool, chain_id.hex()) {
                progress(&format!("{label}: have it"));
                continue;
            }
            let parent = i.checked_sub(1).and_then(|p| chains.get(p)).map(|c| c.hex().to_string());
            let result = self
                .make_layer(
                    &link,
                    desc,
                    *compression,
                    &label,
                    parent.as_deref(),
                    chain_id.hex(),
                    diff_ids.get(i),
                    self.bounds.max_image.saturating_sub(unpacked),
                    progress,
                )
                .await;
            match result {
                Ok(bytes) => unpacked = unpacked.saturating_add(bytes),
                Err(e) => {
                    layers::abort(&self.pool, chain_id.hex());
                    return Err(e);
                }
            }
        }
        let hex = manifest_digest.hex().get(..32).unwrap_or_default();
        let key = Name::new(&format!("{}{hex}", moat_core::images::PULLED_PREFIX))?;
        let _making = self.making.hold(&key.to_string()).await;
        layers::make_image(&self.pool, &key, chains.last().map(|c| c.hex()))?;
        self.pool.ensure_quotas()?;
        progress(&format!("{full}: ready ({manifest_digest})"));
        Ok(Pulled {
            reference: full,
            name_hint,
            key,
            digest: manifest_digest.to_string(),
            layers: chains.iter().map(|c| c.hex().to_string()).collect(),
            config,
            bytes,
            manifest: documents.last().cloned().unwrap_or_default(),
        })
    }

    /// Starts a fetcher and tells it `hello` (it ends when the child handle
    /// is dropped).
    pub(crate) async fn start_fetcher(&self, hello: &FetchHello) -> Result<(tokio::process::Child, Packets)> {
        let id = self.id.to_string();
        let mut args: Vec<&std::ffi::OsStr> = vec!["image-fetch".as_ref(), "--id".as_ref(), id.as_ref()];
        if let Some(netns) = &self.netns {
            args.extend(["--netns".as_ref(), netns.as_os_str()]);
        }
        let (child, link) = crate::privsep::spawn_child("moat-image-fetch", &args)?;
        link.send(&serde_json::to_vec(hello)?, &[]).await.context("start the fetcher")?;
        Ok((child, link))
    }

    /// Fetches one layer's blob, checks it, and unpacks it onto its parent,
    /// writing at most `budget` bytes; the bytes it wrote.
    #[allow(clippy::too_many_arguments)]
    async fn make_layer(
        &self,
        link: &Packets,
        desc: &manifest::Descriptor,
        compression: Compression,
        label: &str,
        parent: Option<&str>,
        chain_id: &str,
        diff_id: Option<&Digest>,
        budget: u64,
        progress: Progress<'_>,
    ) -> Result<u64> {
        let blobs = layers::blobs_dir(&self.pool);
        std::fs::create_dir_all(&blobs)?;
        // Named by the layer (which this pull holds), not the blob: another
        // pull may fetch the same blob for a layer of another chain.
        let path = blobs.join(format!("{chain_id}.partial"));
        let result = async {
            let mut file = std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&path)?;
            let ask = ToFetch::Blob { desc: desc.clone(), label: label.to_string() };
            link.send(&serde_json::to_vec(&ask)?, &[file.as_fd()]).await?;
            let FromFetch::Fetched = next(link, progress).await? else { bail!("the fetcher answered out of turn") };
            let (got, len) = hash_file(&mut file)?;
            ensure!(
                got == desc.digest && len == desc.size,
                "{label} does not match its digest (expected {}, got {got}): nothing of it is kept",
                desc.digest
            );
            progress(&format!("{label}: unpacking"));
            let tree = layers::begin(&self.pool, parent, chain_id)?;
            let report = unpack(&tree, file, compression, budget).await.with_context(|| label.to_string())?;
            if let (Some(expected), Some(got)) = (diff_id, &report.diff_id) {
                ensure!(got == expected, "{label} unpacks to {got}, not the config's diff id {expected}");
            }
            if report.devices_skipped > 0 {
                let line =
                    format!("{label}: skipped {} device nodes ({})", report.devices_skipped, report.devices.join(", "));
                tracing::info!("{line}");
                progress(&line);
            }
            layers::seal(&self.pool, chain_id)?;
            Ok(report.bytes)
        }
        .await;
        let _ = std::fs::remove_file(&path);
        result
    }
}

/// Runs the confined unpacker on `blob` into `tree`.
async fn unpack(tree: &std::path::Path, blob: std::fs::File, compression: Compression, max: u64) -> Result<Report> {
    let compression = match compression {
        Compression::None => "none",
        Compression::Gzip => "gzip",
        Compression::Zstd => "zstd",
    };
    let child = tokio::process::Command::new("/proc/self/exe")
        .arg0("moat-image-unpack")
        .arg("image-unpack")
        .arg(tree)
        .arg(compression)
        .arg(max.to_string())
        .env_clear()
        .stdin(Stdio::from(blob))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("start the unpacker")?;
    let out = tokio::time::timeout(UNPACK_DEADLINE, child.wait_with_output())
        .await
        .map_err(|_| anyhow::anyhow!("unpacking took over {} s", UNPACK_DEADLINE.as_secs()))??;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        let why = why.lines().last().unwrap_or("").chars().take(500).collect::<String>();
        bail!("{}", if why.is_empty() { format!("the unpacker failed ({})", out.status) } else { why });
    }
    ensure!(out.stdout.len() <= MAX_REPORT, "the unpacker's report is too long");
    serde_json::from_slice(&out.stdout).context("the unpacker's report")
}
