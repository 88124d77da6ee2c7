//! Garbage collection of the object store: what no record needs any more is
//! deleted, and never what a live record names.
//!
//! - Every object of a box the state store no longer has (removed), and its
//!   links.
//! - The links of a live box that no restore replays (see
//!   [`crate::chain::needed`]: those before its newest full stream, but for
//!   the runs its checkpoints need), objects and rows both.
//! - Objects of a live box that no link names (an upload cut short, or one
//!   whose record failed), once older than `min_age`: an upload under way
//!   right now is recorded only after its object is complete, so a young
//!   unnamed object may be about to be named.
//!
//! - Images no image of anyone's uses any more (objects and records), and
//!   image objects no record names once older than `min_age` (an upload
//!   cut short, or one a faster node's upload of the same image beat).
//!
//! Idempotent, so every node may run it: two that delete the same object
//! both succeed.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use moat_core::ids::BoxId;
use moat_core::store::durable::{DurableImage, DurableLink};
use moat_core::store::Store;
use moat_core::BoxManager;
use object_store::{ObjectMeta, ObjectStore};

use crate::DurableError;

/// What a collection deleted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Collected {
    /// Objects deleted.
    pub objects: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// What the collector asks of the records: the manager's store on a node,
/// a plain store in tests.
pub trait Records: Send + Sync {
    /// Whether box `id` still exists.
    fn exists(&self, id: &BoxId) -> Result<bool, String>;
    /// Its chain, oldest first.
    fn links(&self, id: &BoxId) -> Result<Vec<DurableLink>, String>;
    /// Forgets its links at places `seqs`.
    fn forget_links(&self, id: &BoxId, seqs: &[u64]) -> Result<(), String>;
    /// Forgets all its links.
    fn forget(&self, id: &BoxId) -> Result<(), String>;
    /// The images kept in the object store.
    fn images(&self) -> Result<Vec<DurableImage>, String>;
    /// Whether any image of anyone's has pool key `key`.
    fn image_in_use(&self, key: &str) -> Result<bool, String>;
    /// Forgets the image kept under `key`.
    fn forget_image(&self, key: &str) -> Result<(), String>;
}

impl Records for BoxManager {
    fn exists(&self, id: &BoxId) -> Result<bool, String> {
        self.box_by_id(id).map(|r| r.is_some()).map_err(|e| e.to_string())
    }
    fn links(&self, id: &BoxId) -> Result<Vec<DurableLink>, String> {
        self.durable_links(id).map_err(|e| e.to_string())
    }
    fn forget_links(&self, id: &BoxId, seqs: &[u64]) -> Result<(), String> {
        self.forget_durable_links(id, seqs).map_err(|e| e.to_string())
    }
    fn forget(&self, id: &BoxId) -> Result<(), String> {
        self.forget_durable(id).map_err(|e| e.to_string())
    }
    fn images(&self) -> Result<Vec<DurableImage>, String> {
        self.durable_images().map_err(|e| e.to_string())
    }
    fn image_in_use(&self, key: &str) -> Result<bool, String> {
        self.image_key_in_use(key).map_err(|e| e.to_string())
    }
    fn forget_image(&self, key: &str) -> Result<(), String> {
        self.forget_durable_image(key).map_err(|e| e.to_string())
    }
}

impl Records for Store {
    fn exists(&self, id: &BoxId) -> Result<bool, String> {
        self.get_by_id(id).map(|r| r.is_some()).map_err(|e| e.to_string())
    }
    fn links(&self, id: &BoxId) -> Result<Vec<DurableLink>, String> {
        self.durable_links(id).map_err(|e| e.to_string())
    }
    fn forget_links(&self, id: &BoxId, seqs: &[u64]) -> Result<(), String> {
        self.forget_durable_links(id, seqs).map_err(|e| e.to_string())
    }
    fn forget(&self, id: &BoxId) -> Result<(), String> {
        self.forget_durable(id).map_err(|e| e.to_string())
    }
    fn images(&self) -> Result<Vec<DurableImage>, String> {
        self.durable_images().map_err(|e| e.to_string())
    }
    fn image_in_use(&self, key: &str) -> Result<bool, String> {
        self.image_key_in_use(key).map_err(|e| e.to_string())
    }
    fn forget_image(&self, key: &str) -> Result<(), String> {
        self.forget_durable_image(key).map_err(|e| e.to_string())
    }
}

/// Collects the garbage under `prefix` (`<prefix>/boxes/<id>/...`).
pub async fn collect(
    store: &Arc<dyn ObjectStore>,
    prefix: &str,
    records: &dyn Records,
    min_age: Duration,
) -> Result<Collected, DurableError> {
    let root = crate::under(prefix, "boxes");
    let listed: Vec<ObjectMeta> =
        store.list(Some(&object_store::path::Path::from(root.as_str()))).try_collect().await?;
    let mut by_box: BTreeMap<String, Vec<ObjectMeta>> = BTreeMap::new();
    for meta in listed {
        let key = meta.location.to_string();
        let Some(rest) = key.strip_prefix(&format!("{root}/")) else { continue };
        let Some((id, _)) = rest.split_once('/') else { continue };
        by_box.entry(id.to_string()).or_default().push(meta);
    }
    let config = DurableError::Config;
    let young = chrono_cutoff(min_age);
    let mut done = Collected::default();
    for (id, objects) in by_box {
        // A key that names no box id is not moat's: left alone.
        let Some(id) = BoxId::parse(&id) else { continue };
        let doomed: Vec<&ObjectMeta> = if !records.exists(&id).map_err(config)? {
            objects.iter().collect()
        } else {
            let links = records.links(&id).map_err(config)?;
            let needed = crate::chain::needed(&links);
            let (mut kept, mut old) = (Vec::new(), Vec::new());
            for (i, link) in links.iter().enumerate() {
                if needed.contains(&i) {
                    kept.push(link)
                } else {
                    old.push(link)
                }
            }
            let named: HashSet<&str> = kept.iter().map(|l| l.key.as_str()).collect();
            let old_keys: HashSet<&str> = old.iter().map(|l| l.key.as_str()).collect();
            if !old.is_empty() {
                // Rows first: a link is never left naming a deleted object.
                let seqs: Vec<u64> = old.iter().map(|l| l.seq).collect();
                records.forget_links(&id, &seqs).map_err(config)?;
            }
            objects
                .iter()
                .filter(|m| {
                    let key = m.location.as_ref();
                    old_keys.contains(key) || (!named.contains(key) && m.last_modified < young)
                })
                .collect()
        };
        for meta in &doomed {
            match store.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                    done.objects += 1;
                    done.bytes += meta.size;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if !records.exists(&id).map_err(config)? {
            records.forget(&id).map_err(config)?;
        }
    }
    collect_images(store, prefix, records, young, &mut done).await?;
    Ok(done)
}

/// The images part of [`collect`].
async fn collect_images(
    store: &Arc<dyn ObjectStore>,
    prefix: &str,
    records: &dyn Records,
    young: chrono::DateTime<chrono::Utc>,
    done: &mut Collected,
) -> Result<(), DurableError> {
    let config = DurableError::Config;
    let (mut named, mut unused) = (HashSet::new(), HashSet::new());
    for image in records.images().map_err(config)? {
        if records.image_in_use(&image.key).map_err(config)? {
            named.insert(image.object);
        } else {
            // The record first: none is left naming a deleted object.
            records.forget_image(&image.key).map_err(config)?;
            unused.insert(image.object);
        }
    }
    let root = crate::under(prefix, "images");
    let listed: Vec<ObjectMeta> =
        store.list(Some(&object_store::path::Path::from(root.as_str()))).try_collect().await?;
    let doomed = |m: &&ObjectMeta| {
        let key = m.location.as_ref();
        unused.contains(key) || (!named.contains(key) && m.last_modified < young)
    };
    for meta in listed.iter().filter(doomed) {
        match store.delete(&meta.location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                done.objects += 1;
                done.bytes += meta.size;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Deletes every object of removed box `id` and forgets its links (what
/// `rm` asks at once; [`collect`] would find it later).
pub async fn forget_box(
    store: &Arc<dyn ObjectStore>,
    prefix: &str,
    records: &dyn Records,
    id: &BoxId,
) -> Result<Collected, DurableError> {
    let dir = crate::under(prefix, &format!("boxes/{id}"));
    let listed: Vec<ObjectMeta> = store.list(Some(&object_store::path::Path::from(dir.as_str()))).try_collect().await?;
    let mut done = Collected::default();
    for meta in listed {
        match store.delete(&meta.location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                done.objects += 1;
                done.bytes += meta.size;
            }
            Err(e) => return Err(e.into()),
        }
    }
    records.forget(id).map_err(DurableError::Config)?;
    Ok(done)
}

/// The time before which an object counts as old.
fn chrono_cutoff(min_age: Duration) -> chrono::DateTime<chrono::Utc> {
    chrono::Utc::now() - chrono::TimeDelta::from_std(min_age).unwrap_or(chrono::TimeDelta::MAX)
}

/// Runs [`collect`] every `every` (the first after `every`), logging what it
/// deleted, until the process ends.
pub fn start(
    store: Arc<dyn ObjectStore>,
    prefix: String,
    manager: Arc<BoxManager>,
    every: Duration,
    min_age: Duration,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            match collect(&store, &prefix, manager.as_ref(), min_age).await {
                Ok(done) if done.objects > 0 => {
                    tracing::info!(objects = done.objects, bytes = done.bytes, "object store garbage collected")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "object store garbage collection failed"),
            }
        }
    });
}
