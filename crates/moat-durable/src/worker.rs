//! The uploader's background task. Boxes are queued (once each, however
//! often they are reported) when they suspend or are checkpointed, and every
//! upload interval when they changed since their last upload; the task
//! uploads them one at a time, records each link once its object is
//! complete, and retries a failed upload later with a growing backoff. It
//! never holds a box's lock: a box and its sessions go on whatever the
//! object store does.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moat_core::ids::BoxId;
use moat_core::manager::DurableHooks;
use moat_core::record::BoxState;
use moat_core::BoxManager;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::upload::Uploader;
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
    /// Where the boxes' roots are.
    boxes_dir: PathBuf,
    /// Held for each upload: one at a time, the mover's last uploads included.
    turn: tokio::sync::Mutex<()>,
    /// The manager it reports to (weak: the manager holds the worker).
    manager: std::sync::OnceLock<std::sync::Weak<BoxManager>>,
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
}

impl DurableWorker {
    /// Starts the task uploading `manager`'s boxes (their roots under
    /// `boxes_dir`) with `uploader`, and tells the manager to report to it.
    pub fn start(
        manager: Arc<BoxManager>,
        uploader: Uploader,
        boxes_dir: PathBuf,
        settings: WorkerSettings,
    ) -> Arc<Self> {
        let worker = Arc::new(Self {
            queue: Mutex::default(),
            current: Mutex::default(),
            wake: Notify::new(),
            uploader,
            boxes_dir,
            turn: tokio::sync::Mutex::new(()),
            manager: std::sync::OnceLock::new(),
        });
        let _ = worker.manager.set(Arc::downgrade(&manager));
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
        upload_one(manager, &self.uploader, &self.boxes_dir, id).await
    }

    /// The object store boxes are kept in, and what its keys start with.
    pub fn uploader(&self) -> &Uploader {
        &self.uploader
    }

    /// Where the boxes' roots are.
    pub fn boxes_dir(&self) -> &std::path::Path {
        &self.boxes_dir
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

    /// Queues every box here that changed since its last upload.
    async fn queue_changed(&self, manager: &Arc<BoxManager>) {
        let (uploader, boxes_dir) = (&self.uploader, &self.boxes_dir);
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

/// Uploads box `id` if it is this node's and changed since its last upload.
async fn upload_one(
    manager: &Arc<BoxManager>,
    uploader: &Uploader,
    boxes_dir: &std::path::Path,
    id: &BoxId,
) -> Result<(), DurableError> {
    let Some(rec) = manager.box_here(id).map_err(|e| DurableError::Config(e.to_string()))? else { return Ok(()) };
    if rec.state == BoxState::Creating {
        return Ok(());
    }
    let root = boxes_dir.join(id.as_str());
    if !root.is_dir() {
        return Ok(());
    }
    let links = manager.durable_links(id).map_err(|e| DurableError::Config(e.to_string()))?;
    if !uploader.changed(id, &root, links.last())? {
        return Ok(());
    }
    let up = uploader.upload(id, &root, &links).await?;
    // Complete in the object store, named by no record yet.
    moat_core::fault::point("upload-before-record");
    if let Err(e) = manager.record_durable(&up.link) {
        // Not recorded: the object is one no record names, and the old head
        // stays the next incremental's parent.
        uploader.prune(id, links.last().map(|l| l.snapshot.as_str()));
        return Err(DurableError::Config(format!("record the upload: {e}")));
    }
    uploader.prune(id, Some(&up.link.snapshot));
    tracing::info!(
        box_id = %id, name = %rec.name, seq = up.link.seq, full = up.link.parent_seq.is_none(),
        bytes = up.link.bytes, raw_bytes = up.raw_bytes, took_ms = up.took.as_millis() as u64,
        "box made durable"
    );
    Ok(())
}
