//! One upload of one box: a read-only snapshot of its root (the box never
//! pauses) or of one of its checkpoints, `btrfs send` of it (against the newest link's snapshot when this
//! node still has it), compressed and hashed as it streams to the object
//! store in parts, under a key no other upload uses. The caller records the
//! link once this returns, then [`Uploader::prune`] drops the snapshots the
//! next incremental no longer needs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use moat_box::sys;
use moat_core::clock::now_ms;
use moat_core::ids::BoxId;
use moat_core::store::durable::DurableLink;
use object_store::{ObjectStore, WriteMultipart};

use crate::chain::{next_link, object_key};
use crate::stream::{pack, Packed, CHUNK};
use crate::{btrfs, io_err, DurableError};

/// How many parts are in flight to the object store at once.
const PARTS_IN_FLIGHT: usize = 2;

/// Uploads boxes' roots to one object store.
pub struct Uploader {
    /// The object store.
    pub store: Arc<dyn ObjectStore>,
    /// What every key starts with.
    pub prefix: String,
    /// Where this node keeps each box's snapshots (`<pool>/durable`).
    pub snapshots: PathBuf,
    /// A full stream at least every this many links.
    pub full_every: u64,
    /// This node's name.
    pub node: String,
}

/// What an upload did.
#[derive(Debug, Clone)]
pub struct Uploaded {
    /// The link to record.
    pub link: DurableLink,
    /// The stream's size before compression.
    pub raw_bytes: u64,
    /// How long it took.
    pub took: std::time::Duration,
}

impl Uploader {
    /// Where box `id`'s snapshots are.
    pub fn box_dir(&self, id: &BoxId) -> PathBuf {
        self.snapshots.join(id.as_str())
    }

    /// Whether the box whose root is `root` changed since `head` was taken
    /// (true when this node does not have `head`'s snapshot: then it needs a
    /// full upload anyway; and when `head` was sent from a checkpoint, whose
    /// snapshot says nothing of the root).
    pub fn changed(&self, id: &BoxId, root: &Path, head: Option<&DurableLink>) -> Result<bool, DurableError> {
        let Some(head) = head.filter(|h| h.checkpoint.is_none()) else { return Ok(true) };
        let snapshot = self.box_dir(id).join(&head.snapshot);
        if !snapshot.exists() {
            return Ok(true);
        }
        // A snapshot's generation at creation is its source's generation
        // right after it was taken; any later write raises the source's.
        let (_, taken) = btrfs::generations(&snapshot)?;
        let (now, _) = btrfs::generations(root)?;
        Ok(now > taken)
    }

    /// Uploads the box whose root is `root` as the next link after `links`.
    pub async fn upload(&self, id: &BoxId, root: &Path, links: &[DurableLink]) -> Result<Uploaded, DurableError> {
        self.upload_from(id, root, links, None).await
    }

    /// Uploads box `id`'s checkpoint `label` (at `path`, saved at
    /// `saved_ms`) as the next link after `links`: the link carries the label.
    pub async fn upload_checkpoint(
        &self,
        id: &BoxId,
        (path, label, saved_ms): (&Path, &str, u64),
        links: &[DurableLink],
    ) -> Result<Uploaded, DurableError> {
        self.upload_from(id, path, links, Some((label, saved_ms))).await
    }

    /// Uploads a read-only snapshot of `source` as the next link after
    /// `links`; `checkpoint`: the source is that checkpoint, as of then.
    async fn upload_from(
        &self,
        id: &BoxId,
        source: &Path,
        links: &[DurableLink],
        checkpoint: Option<(&str, u64)>,
    ) -> Result<Uploaded, DurableError> {
        let started = Instant::now();
        let dir = self.box_dir(id);
        std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        let taken_at_ms = checkpoint.map_or_else(now_ms, |(_, saved_ms)| saved_ms);
        let name = crate::unique_name();
        sys::subvolume_snapshot(source, &dir, &name, true)
            .map_err(io_err(format!("snapshot {} read-only", source.display())))?;
        let next = next_link(links, self.full_every, |s| dir.join(s).exists());
        let key = object_key(&self.prefix, id, next.seq, &name, next.parent.is_none());
        let sent = self.send(&dir.join(&name), next.parent.as_ref().map(|p| dir.join(&p.snapshot)), &key).await;
        let packed = match sent {
            Ok(packed) => packed,
            Err(e) => {
                let _ = sys::subvolume_delete(&dir, &name);
                return Err(e);
            }
        };
        let link = DurableLink {
            box_id: id.clone(),
            seq: next.seq,
            parent_seq: next.parent.map(|p| p.seq),
            key,
            snapshot: name,
            sha256: packed.sha256,
            bytes: packed.bytes,
            taken_at_ms,
            uploaded_at_ms: now_ms(),
            node: self.node.clone(),
            checkpoint: checkpoint.map(|(label, _)| label.to_string()),
        };
        Ok(Uploaded { link, raw_bytes: packed.raw_bytes, took: started.elapsed() })
    }

    /// Streams `btrfs send` of `snapshot` (against `parent`) to `key`.
    pub(crate) async fn send(
        &self,
        snapshot: &Path,
        parent: Option<PathBuf>,
        key: &str,
    ) -> Result<Packed, DurableError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(PARTS_IN_FLIGHT);
        let (snapshot, what) = (snapshot.to_path_buf(), format!("btrfs send of {}", snapshot.display()));
        let packer = tokio::task::spawn_blocking(move || -> Result<Packed, DurableError> {
            let mut child = btrfs::send(&snapshot, parent.as_deref())?;
            let stdout = child.stdout.take().ok_or_else(|| DurableError::Config("btrfs send: no stdout".into()))?;
            let packed =
                pack(stdout, |chunk| tx.blocking_send(chunk).map_err(|_| std::io::Error::other("upload ended")));
            let _ = child.kill();
            let status = btrfs::finish(child, &what);
            let packed = packed.map_err(io_err(what.clone()))?;
            status.map(|()| packed)
        });
        let upload = self.store.put_multipart(&object_store::path::Path::from(key)).await?;
        let mut parts = WriteMultipart::new_with_chunk_size(upload, CHUNK);
        let mut failed = None;
        while let Some(chunk) = rx.recv().await {
            if let Err(e) = parts.wait_for_capacity(PARTS_IN_FLIGHT).await {
                failed = Some(e);
                break;
            }
            parts.put(Bytes::from(chunk));
        }
        drop(rx);
        let packed = packer.await.map_err(|e| DurableError::Config(format!("the packer panicked: {e}")));
        match (failed, packed) {
            (None, Ok(Ok(packed))) => {
                parts.finish().await?;
                Ok(packed)
            }
            (Some(e), _) => {
                let _ = parts.abort().await;
                Err(e.into())
            }
            (None, Ok(Err(e)) | Err(e)) => {
                let _ = parts.abort().await;
                Err(e)
            }
        }
    }

    /// Deletes box `id`'s snapshots but `keep` (the newest recorded link's,
    /// which the next incremental is against).
    pub fn prune(&self, id: &BoxId, keep: Option<&str>) {
        let dir = self.box_dir(id);
        let Ok(entries) = std::fs::read_dir(&dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if Some(name.as_str()) != keep {
                if let Err(e) = sys::subvolume_delete(&dir, &name) {
                    tracing::warn!(box_id = %id, snapshot = name, error = %e, "cannot delete an old durable snapshot");
                }
            }
        }
        if keep.is_none() {
            let _ = std::fs::remove_dir(&dir);
        }
    }
}
