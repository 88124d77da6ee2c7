//! The manager's side of durable boxes: it tells the uploader (moat-durable's
//! worker, set once at start) when a box reached a point worth keeping
//! (suspended, checkpointed), and keeps the record of what was uploaded.
//! The uploads themselves never run under a box's lock: a slow object store
//! never stalls a box.

use std::sync::Arc;

use super::{BoxManager, ManagerError};
use crate::backend::Checkpoint;
use crate::ids::{BoxId, Name};
use crate::record::BoxRecord;
use crate::store::durable::{DurableImage, DurableLink};

/// What the manager tells the uploader.
pub trait DurableHooks: Send + Sync {
    /// Box `id` reached a point worth keeping: queue an upload.
    fn changed(&self, id: &BoxId);
    /// Whether an upload of box `id` is queued or under way.
    fn pending(&self, id: &BoxId) -> bool;
    /// How many boxes wait for an upload.
    fn backlog(&self) -> usize {
        0
    }
    /// Box `id` was removed: what it kept in the object store can go.
    fn removed(&self, id: &BoxId) {
        let _ = id;
    }
    /// Image `key` was made here (pulled or saved): keep it in the object store.
    fn image_made(&self, key: &Name) {
        let _ = key;
    }
    /// Fetches image `key` from the object store into this node's pool;
    /// `Ok(false)` when it is not kept there.
    fn fetch_image<'a>(&'a self, key: &'a Name) -> ImageFetch<'a> {
        let _ = key;
        Box::pin(async { Ok(false) })
    }
}

/// A fetch of an image from the object store (see [`DurableHooks::fetch_image`]).
pub type ImageFetch<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<bool, String>> + Send + 'a>>;

/// How durable a box is, as `info` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durability {
    /// The box is kept in the object store as it was then (ms), if at all.
    pub as_of_ms: Option<u64>,
    /// Bytes it keeps there.
    pub bytes: u64,
    /// An upload is queued or under way.
    pub pending: bool,
}

impl BoxManager {
    /// Sets where changed boxes are reported (once; later calls are ignored).
    pub fn set_durable(&self, hooks: Arc<dyn DurableHooks>) {
        let _ = self.durable.set(hooks);
    }

    /// Queues an upload of box `id`, if boxes are made durable.
    pub(super) fn tell_durable(&self, id: &BoxId) {
        if let Some(hooks) = self.durable.get() {
            hooks.changed(id);
        }
    }

    /// Tells the uploader that image `key` was made here.
    pub(super) fn tell_durable_image(&self, key: &Name) {
        if let Some(hooks) = self.durable.get() {
            hooks.image_made(key);
        }
    }

    /// The image kept in the object store under pool key `key`, if any.
    pub fn durable_image(&self, key: &str) -> Result<Option<DurableImage>, ManagerError> {
        Ok(self.db(|s| s.durable_image(key))?)
    }

    /// Records an image upload that completed; whether it was the first for its key.
    pub fn record_durable_image(&self, image: &DurableImage) -> Result<bool, ManagerError> {
        Ok(self.db(|s| s.add_durable_image(image))?)
    }

    /// Every image kept in the object store.
    pub fn durable_images(&self) -> Result<Vec<DurableImage>, ManagerError> {
        Ok(self.db(|s| s.durable_images())?)
    }

    /// Forgets the image kept under `key` (the collector deletes its object).
    pub fn forget_durable_image(&self, key: &str) -> Result<(), ManagerError> {
        Ok(self.db(|s| s.forget_durable_image(key))?)
    }

    /// Whether any image of anyone's has pool key `key`.
    pub fn image_key_in_use(&self, key: &str) -> Result<bool, ManagerError> {
        Ok(self.db(|s| s.image_key_in_use(key))?)
    }

    /// Pool keys of images (anyone's) that no record keeps in the object store.
    pub fn images_not_durable(&self) -> Result<Vec<Name>, ManagerError> {
        let kept: std::collections::HashSet<String> =
            self.db(|s| s.durable_images())?.into_iter().map(|i| i.key).collect();
        let mut keys: Vec<Name> =
            self.db(|s| s.images(None))?.into_iter().map(|i| i.key).filter(|k| !kept.contains(k.as_str())).collect();
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// Tells the fleet how many of this node's boxes wait for an upload.
    pub fn report_backlog(&self) -> Result<(), ManagerError> {
        let Some(hooks) = self.durable.get() else { return Ok(()) };
        let backlog = u32::try_from(hooks.backlog()).unwrap_or(u32::MAX);
        Ok(self.db(|s| s.set_upload_backlog(&self.node, backlog))?)
    }

    /// Tells the uploader that box `id` is gone.
    pub(super) fn tell_durable_removed(&self, id: &BoxId) {
        if let Some(hooks) = self.durable.get() {
            hooks.removed(id);
        }
    }

    /// Box `id`'s chain in the object store, oldest first.
    pub fn durable_links(&self, id: &BoxId) -> Result<Vec<DurableLink>, ManagerError> {
        Ok(self.db(|s| s.durable_links(id))?)
    }

    /// Records an upload that completed.
    pub fn record_durable(&self, link: &DurableLink) -> Result<(), ManagerError> {
        Ok(self.db(|s| s.add_durable_link(link))?)
    }

    /// Forgets box `id`'s links at places `seqs` (the garbage collector
    /// deletes their objects).
    pub fn forget_durable_links(&self, id: &BoxId, seqs: &[u64]) -> Result<(), ManagerError> {
        Ok(self.db(|s| s.forget_durable_links(id, seqs))?)
    }

    /// Box `id`'s checkpoint `label` is gone: its link no longer keeps it.
    pub fn forget_durable_checkpoint(&self, id: &BoxId, label: &str) -> Result<(), ManagerError> {
        Ok(self.db(|s| s.forget_durable_checkpoint(id, label))?)
    }

    /// Box `id`'s checkpoints on this node, oldest first.
    pub async fn checkpoints_here(&self, id: &BoxId) -> Result<Vec<Checkpoint>, ManagerError> {
        let Some(rec) = self.db(|s| s.get_by_id(id))? else { return Ok(Vec::new()) };
        self.blocking(move |b| b.checkpoints(&rec, false)).await
    }

    /// Forgets every link of removed box `id`.
    pub fn forget_durable(&self, id: &BoxId) -> Result<(), ManagerError> {
        Ok(self.db(|s| s.forget_durable(id))?)
    }

    /// Box `id` if this node acts on it (its own, and the fence open).
    pub fn box_here(&self, id: &BoxId) -> Result<Option<BoxRecord>, ManagerError> {
        let Some(rec) = self.db(|s| s.get_by_id(id))? else { return Ok(None) };
        Ok(self.here(&rec).is_ok().then_some(rec))
    }

    /// This node's boxes.
    pub fn boxes_here(&self) -> Result<Vec<BoxRecord>, ManagerError> {
        Ok(self.db(crate::store::Store::list_here)?)
    }

    /// How durable box `id` is (`None` when boxes are not made durable here).
    pub fn durability(&self, id: &BoxId) -> Result<Option<Durability>, ManagerError> {
        let Some(hooks) = self.durable.get() else { return Ok(None) };
        let head = self.db(|s| s.durable_head(id))?;
        let bytes = self.db(|s| s.durable_bytes(id))?;
        Ok(Some(Durability { as_of_ms: head.map(|h| h.taken_at_ms), bytes, pending: hooks.pending(id) }))
    }
}
