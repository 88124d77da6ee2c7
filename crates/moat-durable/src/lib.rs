//! Durable boxes: a box's root kept in an S3-compatible object store as a
//! chain of `btrfs send` streams of read-only snapshots (a full one, then
//! incrementals against the last uploaded snapshot, a new full every so
//! often), zstd-compressed and SHA-256-checksummed, each under a key never
//! written twice and recorded in the state store only once its upload is
//! complete. A node can receive a box back from there.
//!
//! - [`config`]: where the object store is and how to sign in (never from
//!   the command line).
//! - [`chain`]: what the next upload is and what a restore replays (pure).
//! - [`stream`]: packing a stream (compress, hash) and checking a fetched one.
//! - [`btrfs`]: the `btrfs send` and `btrfs receive` processes.
//! - [`upload`] and [`restore`]: one box, each way.
//! - [`images`]: pulled and saved images, each way.
//! - [`gc`]: deleting what no record needs (removed boxes, links before the
//!   newest full stream, uploads cut short).
//! - [`mover`]: moves between nodes (a drain, a lost node's boxes re-homed).
//! - [`node_stream`]: a box streamed from its node to its move's target.
//! - [`worker`]: the background queue that uploads, retries and backs off,
//!   so an object store that is slow or down never stalls a box.

pub mod btrfs;
pub mod chain;
pub mod config;
pub mod gc;
pub mod images;
pub mod mover;
pub mod node_stream;
pub mod restore;
pub mod stream;
pub mod upload;
pub mod worker;

pub use config::ObjectStoreConfig;
pub use restore::restore_box;
pub use upload::Uploader;
pub use worker::{DurableWorker, PoolDirs, WorkerSettings};

/// A durable-box failure.
#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    /// The object store refused or failed.
    #[error("object store: {0}")]
    ObjectStore(#[from] object_store::Error),
    /// The state store failed.
    #[error("state store")]
    Store(#[from] moat_core::store::StoreError),
    /// A local step (a snapshot, a file, a btrfs process) failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A fetched object is not what was uploaded.
    #[error("object {key} is corrupt: its SHA-256 is {found}, the record says {expected}; nothing was received")]
    Corrupt {
        /// Its key.
        key: String,
        /// What the record says.
        expected: String,
        /// What the bytes hash to.
        found: String,
    },
    /// The recorded chain cannot be replayed.
    #[error("{0}")]
    Chain(#[from] chain::ChainError),
    /// The settings are wrong.
    #[error("{0}")]
    Config(String),
}

/// Wraps an I/O error with what was being done.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DurableError {
    let what = what.into();
    move |source| DurableError::Io { what, source }
}

/// `name` under the object store prefix `prefix` (none when it is empty).
pub(crate) fn under(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}/{name}")
    }
}

/// A name no other upload or receive uses: the time, and random bytes (a
/// failure to get them leaves zeros: the time still makes it this one's).
pub(crate) fn unique_name() -> String {
    let mut rand = [0u8; 4];
    let _ = getrandom::fill(&mut rand);
    format!("{}-{}", moat_core::clock::now_ms(), hex::encode(rand))
}
