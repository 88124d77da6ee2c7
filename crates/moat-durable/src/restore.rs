//! Receiving a box back from the object store. Every object of the chain is
//! fetched into a staging directory and its SHA-256 checked against the
//! record before any byte reaches `btrfs receive` (a fetched stream is
//! hostile input until then); the streams are received there as read-only
//! subvolumes, and the box's root is made a writable snapshot of the newest
//! (a received subvolume is never made writable in place); the caller makes
//! the box's checkpoints read-only snapshots of theirs. On any failure
//! the staging directory and all it received are deleted: nothing is left.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use moat_box::sys;
use moat_core::store::durable::DurableLink;
use moat_core::Received;
use object_store::ObjectStore;

use crate::chain::{restore_plan, ChainError};
use crate::stream::{unpack, Verifier};
use crate::{btrfs, io_err, DurableError};

/// A box received from the object store.
#[derive(Debug)]
pub struct Restored {
    /// Its new root, writable.
    pub root: PathBuf,
    /// The box is as it was then (ms since the epoch).
    pub as_of_ms: u64,
    /// How many bytes were fetched.
    pub fetched_bytes: u64,
}

/// Receives the box whose chain is `links` as `<parent>/<name>`, staging in
/// `staging` (on the same btrfs filesystem). `adopt` is called once the root
/// exists, before what was received is deleted, with the received
/// subvolumes' ids (under simple quotas their data stays charged to them:
/// the caller counts it against the box as it counts a local box's writes)
/// and the box's checkpoints among them (the caller keeps a snapshot of
/// each); if it fails, the root is deleted too. `keep_in`: see [`Incoming::keep_in`].
pub async fn restore_box(
    store: &Arc<dyn ObjectStore>,
    links: &[DurableLink],
    staging: &Path,
    (parent, name): (&Path, &str),
    keep_in: Option<&Path>,
    adopt: impl FnOnce(&Received) -> Result<(), DurableError>,
) -> Result<Restored, DurableError> {
    let plan = restore_plan(links).map_err(|e| match e {
        ChainError::Empty(_) => ChainError::Empty(name.to_string()),
        e => e,
    })?;
    let Some(head) = plan.last() else { return Err(ChainError::Empty(name.to_string()).into()) };
    let mut incoming = Incoming::new(staging, name)?;
    let mut fetched_bytes = 0;
    let started = std::time::Instant::now();
    for link in &plan {
        fetched_bytes += fetch_verified(store, (&link.key, &link.sha256), &incoming.file(link)).await?;
    }
    tracing::debug!(
        box_name = name,
        links = plan.len(),
        fetched_bytes,
        took_ms = started.elapsed().as_millis() as u64,
        "a box's streams fetched and checked"
    );
    let started = std::time::Instant::now();
    let head_dir = match keep_in.filter(|_| head.checkpoint.is_none()) {
        Some(dir) => incoming.keep_in(dir),
        None => incoming.dir.clone(),
    };
    for (i, link) in plan.iter().enumerate() {
        let dir = if i + 1 == plan.len() { &head_dir } else { &incoming.dir };
        receive_file(incoming.file(link), dir.clone(), link.key.clone()).await?;
    }
    tracing::debug!(box_name = name, took_ms = started.elapsed().as_millis() as u64, "a box's streams received");
    let received = head_dir.join(&head.snapshot);
    if !received.is_dir() {
        return Err(DurableError::Config(format!(
            "the streams of {name} received no subvolume {} (a stream not of this chain?)",
            head.snapshot
        )));
    }
    let dir_of = |i: usize| if i + 1 == plan.len() { &head_dir } else { &incoming.dir };
    let subvolumes: Vec<(Option<String>, PathBuf, u64)> = plan
        .iter()
        .enumerate()
        .map(|(i, l)| (l.checkpoint.clone(), dir_of(i).join(&l.snapshot), l.taken_at_ms))
        .collect();
    let root = root_of(&received, &subvolumes, (parent, name), adopt)?;
    incoming.kept();
    Ok(Restored { root, as_of_ms: head.taken_at_ms, fetched_bytes })
}

/// Makes `<parent>/<name>` a writable snapshot of `head`, received with
/// `subvolumes` (each with the checkpoint it is, if one, and as of when),
/// and has `adopt` take them (if it fails, the root is deleted): the end
/// of every receive, from the object store or from another node.
pub(crate) fn root_of(
    head: &Path,
    subvolumes: &[(Option<String>, PathBuf, u64)],
    (parent, name): (&Path, &str),
    adopt: impl FnOnce(&Received) -> Result<(), DurableError>,
) -> Result<PathBuf, DurableError> {
    sys::subvolume_snapshot(head, parent, name, false)
        .map_err(io_err(format!("make {name} a writable snapshot of what was received")))?;
    let received = Received {
        subvolumes: subvolumes.iter().filter_map(|(_, path, _)| sys::subvolume_id(path).ok()).collect(),
        checkpoints: subvolumes
            .iter()
            .filter_map(|(label, path, as_of)| Some((label.clone()?, path.clone(), *as_of)))
            .collect(),
    };
    if let Err(e) = adopt(&received) {
        let _ = sys::subvolume_delete(parent, name);
        return Err(e);
    }
    Ok(parent.join(name))
}

/// [`receive_one`] off the async workers.
pub(crate) async fn receive_file(file: PathBuf, dir: PathBuf, key: String) -> Result<(), DurableError> {
    tokio::task::spawn_blocking(move || receive_one(&file, &dir, &key))
        .await
        .map_err(|e| DurableError::Config(format!("a receive panicked: {e}")))?
}

/// Fetches object `key` into `file`, hashing it as it lands; refuses it
/// (and deletes the file) unless the hash is `sha256`, the record's.
pub(crate) async fn fetch_verified(
    store: &Arc<dyn ObjectStore>,
    (key, sha256): (&str, &str),
    file: &Path,
) -> Result<u64, DurableError> {
    let mut out = File::create(file).map_err(io_err(format!("create {}", file.display())))?;
    let mut verifier = Verifier::default();
    let mut body = store.get(&object_store::path::Path::from(key)).await?.into_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        verifier.update(&chunk);
        out.write_all(&chunk).map_err(io_err(format!("write {}", file.display())))?;
    }
    // Not synced: it is read back by this boot (a crash clears staging),
    // and an fsync of a whole box here cost a disk's worth of time per GiB.
    match verifier.check(sha256) {
        Ok(bytes) => Ok(bytes),
        Err(found) => {
            let _ = std::fs::remove_file(file);
            Err(DurableError::Corrupt { key: key.to_string(), expected: sha256.to_string(), found })
        }
    }
}

/// Receives one verified object into `dir`.
fn receive_one(file: &Path, dir: &Path, key: &str) -> Result<(), DurableError> {
    let input = File::open(file).map_err(io_err(format!("open {}", file.display())))?;
    let mut child = btrfs::receive(dir)?;
    let fed = child.stdin.take().map(|stdin| unpack(input, stdin));
    let what = format!("btrfs receive of {key}");
    let done = btrfs::finish(child, &what);
    match fed {
        Some(Ok(())) => done,
        Some(Err(e)) => done.and(Err(io_err(what)(e))),
        None => Err(DurableError::Config("btrfs receive: no stdin".into())),
    }
}

/// Deletes every staging directory in `staging` with all it received: what
/// restores a crash cut short left.
pub fn clear_staging(staging: &Path) {
    let Ok(entries) = std::fs::read_dir(staging) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with("incoming-") {
            drop(Incoming { dir: entry.path(), keep_in: None });
        }
    }
}

/// A staging directory for one restore, deleted with all it received when
/// dropped.
pub(crate) struct Incoming {
    pub(crate) dir: PathBuf,
    /// Where the head is received instead, and what it holds deleted too
    /// unless [`Incoming::kept`].
    keep_in: Option<PathBuf>,
}

impl Incoming {
    pub(crate) fn new(staging: &Path, name: &str) -> Result<Self, DurableError> {
        let dir = staging.join(format!("incoming-{name}-{}", crate::unique_name()));
        std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        Ok(Self { dir, keep_in: None })
    }

    /// Has the box's head (its newest link, a root's) received in `dir`, an
    /// empty directory, and kept there once the box is: the box's uploader
    /// keeps its snapshots there, so it finds the head link's snapshot and
    /// the box's next upload is an incremental against it (its received
    /// UUID is what the stream names as its parent: the chain stays whole),
    /// not a full stream. Received there, not moved there: btrfs refuses to
    /// move a read-only subvolume to another directory.
    pub(crate) fn keep_in(&mut self, dir: &Path) -> PathBuf {
        self.keep_in = Some(dir.to_path_buf());
        dir.to_path_buf()
    }

    /// The box is made: what was received in [`Incoming::keep_in`] stays.
    pub(crate) fn kept(&mut self) {
        self.keep_in = None;
    }

    fn file(&self, link: &DurableLink) -> PathBuf {
        self.dir.join(format!("{}.zst", link.seq))
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        delete_received(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(dir) = &self.keep_in {
            delete_received(dir);
        }
    }
}

/// Deletes the subvolumes received under `dir` (read-only: no file in them
/// can be removed one by one), in it or in a directory of it.
fn delete_received(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().is_ok_and(|t| t.is_dir()) && sys::subvolume_delete(dir, &name).is_err() {
            delete_received(&entry.path());
        }
    }
}
