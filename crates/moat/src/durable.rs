//! `moat serve`'s durable boxes: the flags naming an S3-compatible object
//! store (its credentials only from the environment or a file, never the
//! command line, where every user of the host could read them), and the
//! background uploader started over the pool; on a fleet node, the mover
//! (drains, moves, lost nodes' boxes re-homed).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use moat_core::BoxManager;
use moat_durable::mover::MoverSettings;
use moat_durable::node_stream::NodeLinks;
use moat_durable::{DurableWorker, ObjectStoreConfig, PoolDirs, Uploader, WorkerSettings};

/// How often the object store's garbage is collected.
const GC_EVERY: Duration = Duration::from_secs(30 * 60);

/// How old an object no record names must be before it is garbage: an upload
/// is recorded only once complete, and none takes this long.
const GC_MIN_AGE: Duration = Duration::from_secs(6 * 3600);

/// The flags of `moat serve` that make boxes durable.
#[derive(Args)]
pub struct DurableArgs {
    /// Keep every box's root in this object store, `s3://BUCKET/PREFIX`
    /// (credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the
    /// environment, or --s3-credentials).
    #[arg(long)]
    pub object_store: Option<String>,
    /// The S3 endpoint, e.g. http://127.0.0.1:8333 [default: AWS's].
    #[arg(long, requires = "object_store")]
    pub s3_endpoint: Option<String>,
    /// The S3 region [default: us-east-1].
    #[arg(long, requires = "object_store")]
    pub s3_region: Option<String>,
    /// A file holding aws_access_key_id and aws_secret_access_key
    /// (`KEY=VALUE` lines, or an AWS credentials file).
    #[arg(long, requires = "object_store")]
    pub s3_credentials: Option<PathBuf>,
    /// How often a running box that changed is uploaded, in seconds.
    #[arg(long, default_value_t = 300)]
    pub upload_interval: u64,
    /// A full stream at least every this many uploads of a box (the rest are
    /// incrementals), so a restore never replays a long chain.
    #[arg(long, default_value_t = 16)]
    pub full_every: u64,
    /// In a fleet: seconds a node's lease stays lapsed before its boxes are
    /// re-homed on live nodes from the object store (a running box comes
    /// back as of its last upload).
    #[arg(long, default_value_t = 60)]
    pub node_grace: u64,
}

/// Starts uploading `manager`'s boxes (in the pool at `pool_root`) if an
/// object store was given; on a fleet node, the mover too, reaching other
/// nodes through `links`.
pub fn start(
    args: &DurableArgs,
    manager: &Arc<BoxManager>,
    pool_root: &Path,
    links: Option<Arc<dyn NodeLinks>>,
) -> Result<Option<Arc<DurableWorker>>> {
    let Some(url) = &args.object_store else { return Ok(None) };
    let config =
        ObjectStoreConfig::new(url, args.s3_endpoint.clone(), args.s3_region.clone(), args.s3_credentials.as_deref())?;
    let store = config.client().context("set up the object store client")?;
    let uploader = Uploader {
        store: Arc::clone(&store),
        prefix: config.prefix.clone(),
        snapshots: pool_root.join("durable"),
        full_every: args.full_every.max(1),
        node: manager.node().to_string(),
    };
    let settings =
        WorkerSettings { interval: Duration::from_secs(args.upload_interval.max(1)), backoff: Duration::from_secs(2) };
    tracing::info!(bucket = %config.bucket, prefix = %config.prefix, "boxes are made durable in the object store");
    let dirs = PoolDirs {
        roots: pool_root.join("boxes"),
        checkpoints: pool_root.join("checkpoints"),
        images: pool_root.join("images"),
        staging: pool_root.join("incoming"),
    };
    let worker = DurableWorker::start(Arc::clone(manager), uploader, dirs, settings);
    moat_durable::gc::start(store, config.prefix.clone(), Arc::clone(manager), GC_EVERY, GC_MIN_AGE);
    if !manager.node().is_empty() {
        let settings =
            MoverSettings { grace: Duration::from_secs(args.node_grace), every: Duration::from_secs(2), links };
        moat_durable::mover::start(Arc::clone(manager), Arc::clone(&worker), settings);
    }
    Ok(Some(worker))
}
