//! The uploader's background task. Boxes are queued (once each, however
//! often they are reported) when they suspend or are checkpointed, and every
//! upload interval when they changed since their last upload; the task
//! uploads them one at a time (first each checkpoint not yet kept, then the
//! root), records each link once its object is complete, and retries a
//! failed upload later with a growing backoff. It never holds a box's lock:
//! a box and its sessions go on whatever the object store does.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moat_core::ids::{BoxId, Name};
use moat_core::manager::{DurableHooks, ImageFetch};
use moat_core::record::BoxState;
use moat_core::store::durable::DurableLink;
use moat_core::BoxManager;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::upload::{Uploaded, Uploader};
use crate::DurableError;

/// When uploads happen.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// How often running boxes that changed are uploaded.
    pub interval: Duration,
    /// The first retry's wait; it doubles up to [`MAX_BACKOFF`].
    pub backoff: Duration,
}

/// The longest wait between retries of one box's upload.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Where a node keeps what it makes durable (its pool's directories).
#[derive(Debug, Clone)]
pub struct PoolDirs {
    /// Each box's root, by id.
    pub roots: PathBuf,
    /// Each box's checkpoints, `<id>/<label>`.
    pub checkpoints: PathBuf,
    /// Images, by pool key.
    pub images: PathBuf,
    /// Where fetched streams are received first.
    pub staging: PathBuf,
}

/// A box waiting for its upload.
struct Queued {
    due: Instant,
    failures: u32,
}

/// The uploads to do, and the wake-up for the task.
pub struct DurableWorker {
    queue: Mutex<HashMap<BoxId, Queued>>,
    /// The box being uploaded now.
    current: Mutex<Option<BoxId>>,
    wake: Notify,
    uploader: Uploader,
    /// Where the boxes' files and the images are.
    dirs: PoolDirs,
    /// Held for each upload: one at a time, the mover's last uploads included.
    turn: tokio::sync::Mutex<()>,
    /// The manager it reports to (weak: the manager holds the worker).
    manager: std::sync::OnceLock<std::sync::Weak<BoxManager>>,
    /// Itself, for the tasks it starts.
    me: std::sync::OnceLock<std::sync::Weak<DurableWorker>>,
    /// Images whose upload is under way (or waiting to be tried again).
    images: Mutex<std::collections::HashSet<Name>>,
}

impl DurableHooks for DurableWorker {
    fn changed(&self, id: &BoxId) {
        self.enqueue(id);
    }

    fn removed(&self, id: &BoxId) {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        // Its snapshots here (the next incremental's parent) go with it.
        self.uploader.prune(id, None);
        let Some(manager) = self.manager.get().and_then(std::sync::Weak::upgrade) else { return };
        let (store, prefix, id) = (Arc::clone(&self.uploader.store), self.uploader.prefix.clone(), id.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            match crate::gc::forget_box(&store, &prefix, manager.as_ref(), &id).await {
                Ok(done) => tracing::info!(box_id = %id, objects = done.objects, "a removed box's objects deleted"),
                Err(e) => tracing::warn!(box_id = %id, error = %e, "cannot delete a removed box's objects yet"),
            }
        });
    }

    fn backlog(&self) -> usize {
        let running = self.current.lock().unwrap_or_else(PoisonError::into_inner).is_some();
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).len() + usize::from(running)
    }

    fn pending(&self, id: &BoxId) -> bool {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).contains_key(id)
            || self.current.lock().unwrap_or_else(PoisonError::into_inner).as_ref() == Some(id)
    }

    fn image_made(&self, key: &Name) {
        if !self.images.lock().unwrap_or_else(PoisonError::into_inner).insert(key.clone()) {
            return;
        }
        let (Some(worker), Ok(runtime)) =
            (self.me.get().and_then(std::sync::Weak::upgrade), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let key = key.clone();
        runtime.spawn(async move {
            worker.keep_image(&key).await;
            worker.images.lock().unwrap_or_else(PoisonError::into_inner).remove(&key);
        });
    }

    fn fetch_image<'a>(&'a self, key: &'a Name) -> ImageFetch<'a> {
        Box::pin(async move {
            let manager = self.manager.get().and_then(std::sync::Weak::upgrade).ok_or("the daemon is stopping")?;
            let Some(image) = manager.durable_image(key.as_str()).map_err(|e| e.to_string())? else { return Ok(false) };
            let started = Instant::now();
            crate::images::fetch_image(&self.uploader.store, &image, &self.dirs.staging, &self.dirs.images)
                .await
                .map_err(|e| e.to_string())?;
            tracing::info!(image = %key, bytes = image.bytes, took_ms = started.elapsed().as_millis() as u64,
                "image fetched from the object store");
            Ok(true)
        })
    }
}

impl DurableWorker {
    /// Starts the task uploading `manager`'s boxes (their files in `dirs`)
    /// with `uploader`, and tells the manager to report to it.
    pub fn start(manager: Arc<BoxManager>, uploader: Uploader, dirs: PoolDirs, settings: WorkerSettings) -> Arc<Self> {
        let worker = Arc::new(Self {
            queue: Mutex::default(),
            current: Mutex::default(),
            wake: Notify::new(),
            uploader,
            dirs,
            turn: tokio::sync::Mutex::new(()),
            manager: std::sync::OnceLock::new(),
            me: std::sync::OnceLock::new(),
            images: Mutex::default(),
        });
        let _ = worker.manager.set(Arc::downgrade(&manager));
        let _ = worker.me.set(Arc::downgrade(&worker));
        manager.set_durable(worker.clone());
        tokio::spawn(worker.clone().run(manager, settings));
        worker
    }

    /// How many boxes wait for an upload.
    pub fn backlog(&self) -> usize {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    fn enqueue(&self, id: &BoxId) {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        queue.entry(id.clone()).and_modify(|q| q.due = q.due.min(now)).or_insert(Queued { due: now, failures: 0 });
        drop(queue);
        self.wake.notify_one();
    }

    /// The box due first, if one is due; else how long until one is.
    fn next_due(&self) -> Result<(BoxId, u32), Option<Instant>> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((id, q)) = queue.iter().min_by_key(|(_, q)| q.due) else { return Err(None) };
        if q.due > Instant::now() {
            return Err(Some(q.due));
        }
        let (id, failures) = (id.clone(), q.failures);
        queue.remove(&id);
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(id.clone());
        Ok((id, failures))
    }

    /// Uploads box `id` now if it changed since its last upload, in turn
    /// with the queue's uploads.
    pub async fn upload_now(&self, manager: &Arc<BoxManager>, id: &BoxId) -> Result<(), DurableError> {
        let _turn = self.turn.lock().await;
        upload_one(manager, &self.uploader, &self.dirs, id).await
    }

    /// The object store boxes are kept in, and what its keys start with.
    pub fn uploader(&self) -> &Uploader {
        &self.uploader
    }

    /// Where the boxes' files are.
    pub fn dirs(&self) -> &PoolDirs {
        &self.dirs
    }

    async fn run(self: Arc<Self>, manager: Arc<BoxManager>, settings: WorkerSettings) {
        let mut scan = tokio::time::interval(settings.interval);
        scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            match self.next_due() {
                Ok((id, failures)) => {
                    let result = self.upload_now(&manager, &id).await;
                    *self.current.lock().unwrap_or_else(PoisonError::into_inner) = None;
                    if let Err(e) = result {
                        let wait = settings.backoff.saturating_mul(1 << failures.min(16)).min(MAX_BACKOFF);
                        tracing::warn!(box_id = %id, error = %e, retry_in_s = wait.as_secs(), "upload failed");
                        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                        let due = Instant::now() + wait;
                        queue.entry(id).or_insert(Queued { due, failures: failures + 1 });
                    }
                }
                Err(until) => {
                    let sleep = async {
                        match until {
                            Some(at) => tokio::time::sleep_until(at).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        () = self.wake.notified() => {}
                        () = sleep => {}
                        _ = scan.tick() => self.queue_changed(&manager).await,
                    }
                }
            }
        }
    }

    /// Uploads image `key` and records it, trying again with a growing wait
    /// while the object store fails, until it is kept there (by this node
    /// or another) or gone from here.
    async fn keep_image(&self, key: &Name) {
        let Some(manager) = self.manager.get().and_then(std::sync::Weak::upgrade) else { return };
        let mut wait = Duration::from_secs(2);
        loop {
            if manager.durable_image(key.as_str()).ok().flatten().is_some()
                || !self.dirs.images.join(key.as_str()).is_dir()
            {
                return;
            }
            let uploaded = {
                let _turn = self.turn.lock().await;
                crate::images::upload_image(&self.uploader, &self.dirs.images, key.as_str()).await
            };
            let recorded = uploaded.and_then(|image| {
                moat_core::fault::point("image-before-record");
                manager.record_durable_image(&image).map(|first| (image, first)).map_err(config)
            });
            match recorded {
                Ok((image, first)) => {
                    // Not the first: another node's upload is the image's; this object is garbage.
                    tracing::info!(image = %key, bytes = image.bytes, first, "image made durable");
                    return;
                }
                Err(e) => {
                    tracing::warn!(image = %key, error = %e, retry_in_s = wait.as_secs(), "image upload failed");
                    tokio::time::sleep(wait).await;
                    wait = wait.saturating_mul(2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Queues every box here that changed since its last upload, and every
    /// image here not yet kept in the object store.
    async fn queue_changed(&self, manager: &Arc<BoxManager>) {
        match manager.images_not_durable() {
            Ok(keys) => {
                for key in keys.iter().filter(|k| self.dirs.images.join(k.as_str()).is_dir()) {
                    self.image_made(key);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot list the images to upload"),
        }
        let (uploader, boxes_dir) = (&self.uploader, &self.dirs.roots);
        let boxes = match manager.boxes_here() {
            Ok(boxes) => boxes,
            Err(e) => return tracing::warn!(error = %e, "cannot list this node's boxes to upload"),
        };
        for rec in boxes.into_iter().filter(|r| matches!(r.state, BoxState::Running | BoxState::Suspended)) {
            let head = manager.durable_links(&rec.id).ok().and_then(|mut l| l.pop());
            let root = boxes_dir.join(rec.id.as_str());
            if uploader.changed(&rec.id, &root, head.as_ref()).unwrap_or(false) {
                self.enqueue(&rec.id);
            }
        }
    }
}

/// Uploads box `id` if it is this node's: each of its checkpoints not yet
/// kept, oldest first, then its root if it changed since its last upload.
async fn upload_one(
    manager: &Arc<BoxManager>,
    uploader: &Uploader,
    dirs: &PoolDirs,
    id: &BoxId,
) -> Result<(), DurableError> {
    let Some(rec) = manager.box_here(id).map_err(config)? else { return Ok(()) };
    if rec.state == BoxState::Creating {
        return Ok(());
    }
    let root = dirs.roots.join(id.as_str());
    if !root.is_dir() {
        return Ok(());
    }
    let mut links = manager.durable_links(id).map_err(config)?;
    for checkpoint in manager.checkpoints_here(id).await.map_err(config)? {
        if links.iter().any(|l| l.checkpoint.as_deref() == Some(checkpoint.label.as_str())) {
            continue;
        }
        let path = dirs.checkpoints.join(id.as_str()).join(&checkpoint.label);
        let up = uploader.upload_checkpoint(id, (&path, &checkpoint.label, checkpoint.created_ms), &links).await?;
        record(manager, uploader, &links, &up)?;
        if !path.is_dir() {
            // Removed while it was sent: its link keeps nothing.
            manager.forget_durable_checkpoint(id, &checkpoint.label).map_err(config)?;
        }
        log_upload(&rec.name, &up);
        links.push(up.link);
    }
    if !uploader.changed(id, &root, links.last())? {
        return Ok(());
    }
    let up = uploader.upload(id, &root, &links).await?;
    record(manager, uploader, &links, &up)?;
    log_upload(&rec.name, &up);
    Ok(())
}

/// Records upload `up` after `links`, or forgets it (its object is one no
/// record names, and the old head stays the next incremental's parent).
fn record(manager: &BoxManager, uploader: &Uploader, links: &[DurableLink], up: &Uploaded) -> Result<(), DurableError> {
    let id = &up.link.box_id;
    // Complete in the object store, named by no record yet.
    moat_core::fault::point("upload-before-record");
    if let Err(e) = manager.record_durable(&up.link) {
        uploader.prune(id, links.last().map(|l| l.snapshot.as_str()));
        return Err(DurableError::Config(format!("record the upload: {e}")));
    }
    uploader.prune(id, Some(&up.link.snapshot));
    Ok(())
}

fn log_upload(name: &moat_core::ids::Name, up: &Uploaded) {
    let link = &up.link;
    tracing::info!(
        box_id = %link.box_id, %name, seq = link.seq, full = link.parent_seq.is_none(),
        checkpoint = link.checkpoint.as_deref().unwrap_or(""), bytes = link.bytes, raw_bytes = up.raw_bytes,
        took_ms = up.took.as_millis() as u64, "box made durable"
    );
}

fn config(e: impl ToString) -> DurableError {
    DurableError::Config(e.to_string())
}
