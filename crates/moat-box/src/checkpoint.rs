//! Checkpoints: a box's root saved by label as a read-only snapshot under
//! `<pool>/checkpoints/<box id>/<label>`, and restored in place: the root
//! becomes a writable snapshot of a checkpoint, and the root it replaces is
//! kept as a checkpoint itself.
//!
//! Counting: under simple quotas each extent stays charged to the subvolume
//! that wrote it for as long as anything holds it, so data a checkpoint keeps
//! alive is still charged to the root that wrote it. A restore gives the box
//! a new root subvolume, whose own count starts at zero; so a box with
//! checkpoints also gets a qgroup of its own, holding every root it has had,
//! limited to its disk limit. (Full qgroups count shared data to nobody in
//! particular: there checkpoints are refused.)
//!
//! A restore is three steps on the pool (snapshot, two renames) under an
//! intent file; [`Pool::finish_restores`] completes or undoes one a crash
//! interrupted, before any box boots.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use moat_core::{fault, AccountId, BoxId, Checkpoint};

use crate::pool::{account_qgroup, box_qgroup, io_err, Pool, PoolError};
use crate::sys;

/// Where a restore in progress is written down, in the box's checkpoint directory.
const INTENT: &str = ".restoring";
/// An exclusive limit btrfs reads as none (`btrfs qgroup limit none`).
const NO_LIMIT: u64 = u64::MAX;

/// What a box's subvolumes are charged to, and limited by.
#[derive(Debug, Clone)]
pub struct Owner<'a> {
    /// The box.
    pub id: &'a BoxId,
    /// Its account (whose qgroup holds the box's roots too).
    pub account: &'a AccountId,
    /// The box's disk limit.
    pub disk_limit: u64,
}

impl Pool {
    /// The directory of box `id`'s checkpoints.
    pub fn checkpoints_dir(&self, id: &BoxId) -> PathBuf {
        self.root().join("checkpoints").join(id.as_str())
    }

    fn checkpoint_path(&self, id: &BoxId, label: &str) -> PathBuf {
        self.checkpoints_dir(id).join(label)
    }

    /// Whether box `id` has checkpoint `label`.
    pub fn has_checkpoint(&self, id: &BoxId, label: &str) -> bool {
        self.checkpoint_path(id, label).is_dir()
    }

    /// Box `id`'s checkpoints, oldest first, with when each was made.
    fn saved(&self, id: &BoxId) -> Vec<(u64, String)> {
        let dir = self.checkpoints_dir(id);
        let mut found: Vec<(u64, String)> = fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|e| {
                let label = e.file_name().into_string().ok()?;
                (!label.starts_with('.')).then(|| (saved_at(&dir, &label), label))
            })
            .collect();
        found.sort();
        found
    }

    /// Box `id`'s checkpoint labels, oldest first.
    pub fn checkpoint_labels(&self, id: &BoxId) -> Vec<String> {
        self.saved(id).into_iter().map(|(_, label)| label).collect()
    }

    /// Box `id`'s checkpoints, oldest first, with when each was made and
    /// (with `held`: a walk of each tree) the bytes only it holds (shared with
    /// no other checkpoint, root or image). The walks are the host's work on
    /// trees a box filled: one call's take at most [`HELD_WALKS`] together,
    /// one call's at a time; a tree not walked by then shows none.
    pub fn checkpoints(&self, id: &BoxId, held: bool) -> Vec<Checkpoint> {
        let _walking = held.then(|| WALKING.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let deadline = std::time::Instant::now() + HELD_WALKS;
        self.saved(id)
            .into_iter()
            .map(|(created_ms, label)| {
                let held_bytes = if held { exclusive_bytes(&self.checkpoint_path(id, &label), deadline) } else { None };
                Checkpoint { label, created_ms, held_bytes }
            })
            .collect()
    }

    /// Saves box `id`'s root as read-only checkpoint `label` (the caller
    /// keeps the box from writing meanwhile).
    pub fn save_checkpoint(&self, owner: &Owner<'_>, label: &str) -> Result<(), PoolError> {
        if !self.simple_quotas() {
            return Err(PoolError::Unsupported(
                "checkpoints need btrfs simple quotas (Linux 6.7 or later, a pool made with them) to be \
                 counted against the box's disk limit",
            ));
        }
        self.own_box_qgroup(owner.id, owner.disk_limit)?;
        let dir = self.checkpoints_dir(owner.id);
        fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        let root = self.box_path(owner.id);
        sys::subvolume_snapshot(&root, &dir, label, true).map_err(io_err("snapshot", &root))?;
        note_saved_at(&dir, label);
        Ok(())
    }

    /// Makes `received` (a read-only subvolume received for box `id`, its
    /// data charged to the box already) the box's checkpoint `label`, saved
    /// at `saved_ms`.
    pub fn keep_received_checkpoint(
        &self,
        id: &BoxId,
        received: &Path,
        label: &str,
        saved_ms: u64,
    ) -> Result<(), PoolError> {
        let dir = self.checkpoints_dir(id);
        fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        sys::subvolume_snapshot(received, &dir, label, true).map_err(io_err("snapshot", received))?;
        let _ = fs::write(saved_at_path(&dir, label), saved_ms.to_string());
        Ok(())
    }

    /// Deletes box `id`'s checkpoint `label`.
    pub fn delete_checkpoint(&self, id: &BoxId, label: &str) -> Result<(), PoolError> {
        let dir = self.checkpoints_dir(id);
        sys::subvolume_delete(&dir, label).map_err(io_err("delete checkpoint", &self.checkpoint_path(id, label)))?;
        let _ = fs::remove_file(saved_at_path(&dir, label));
        Ok(())
    }

    /// Deletes every checkpoint of box `id` (its qgroup stays while data it
    /// charged is held by a copy).
    pub fn delete_checkpoints(&self, id: &BoxId) -> Result<(), PoolError> {
        for label in self.checkpoint_labels(id) {
            self.delete_checkpoint(id, &label)?;
        }
        let dir = self.checkpoints_dir(id);
        match fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err("remove", &dir)(e)),
            _ => {}
        }
        // Its qgroup goes too, once nothing it counts is left (a copy may
        // still share data a root of the box wrote: then it stays, harmless).
        let _ = sys::qgroup_destroy(self.root(), box_qgroup(id));
        Ok(())
    }

    /// Makes box `id`'s root (the box stopped) a writable snapshot of its
    /// checkpoint `label`, and keeps the root it had as checkpoint `before`.
    /// Done whole or not at all; a crash midway is finished by
    /// [`finish_restores`](Self::finish_restores).
    pub fn restore_checkpoint(&self, owner: &Owner<'_>, label: &str, before: &str) -> Result<(), PoolError> {
        let id = owner.id;
        let dir = self.checkpoints_dir(id);
        let intent = dir.join(INTENT);
        let text = format!("{label}\n{before}\n{}\n{}\n", owner.account.0, owner.disk_limit);
        write_synced(&intent, &text).map_err(io_err("write", &intent))?;
        fault::point("restore-after-intent");
        if let Err(e) = self.swap_root(owner, label, before) {
            // Undone: the root is the one it was, and nothing is left to finish.
            if self.box_path(id).is_dir() && !self.restoring_path(id).exists() {
                let _ = fs::remove_file(&intent);
            }
            return Err(e);
        }
        fault::point("restore-after-swap");
        // (Failing here leaves the intent: the next start finishes it.)
        self.finish_swap(owner, before)?;
        let _ = fs::remove_file(&intent);
        Ok(())
    }

    /// The snapshot and the renames of a restore; each failure undoes the
    /// steps before it.
    fn swap_root(&self, owner: &Owner<'_>, label: &str, before: &str) -> Result<(), PoolError> {
        let id = owner.id;
        let (root, next) = (self.box_path(id), self.restoring_path(id));
        let (saved, kept) = (self.checkpoint_path(id, label), self.checkpoint_path(id, before));
        sys::subvolume_snapshot(&saved, &self.boxes_dir(), &restoring_name(id), false)
            .map_err(io_err("snapshot", &saved))?;
        fault::point("restore-after-snapshot");
        if let Err(e) = fs::rename(&root, &kept) {
            let _ = sys::subvolume_delete(&self.boxes_dir(), &restoring_name(id));
            return Err(io_err("move the box's root to", &kept)(e));
        }
        fault::point("restore-after-move");
        if let Err(e) = fs::rename(&next, &root) {
            let _ = fs::rename(&kept, &root);
            let _ = sys::subvolume_delete(&self.boxes_dir(), &restoring_name(id));
            return Err(io_err("move the restored root to", &root)(e));
        }
        Ok(())
    }

    /// After the renames: the old root becomes read-only, and the new one is
    /// charged and limited as the box's roots are. Repeatable.
    fn finish_swap(&self, owner: &Owner<'_>, before: &str) -> Result<(), PoolError> {
        let kept = self.checkpoint_path(owner.id, before);
        // Making it read-only writes metadata charged to its groups, which a
        // box that filled its disk (the commonest reason to restore) has at
        // their limits: lifted for the step (nothing runs in the box), then
        // put back.
        // (Each limit is set through the pool's own root, whose transaction
        // no limit holds: set through `kept` itself, it was refused too.)
        let (pool, group) = (self.root(), box_qgroup(owner.id));
        let own = sys::subvolume_id(&kept).map_err(io_err("look up subvolume", &kept))?;
        let limits = |bytes| {
            sys::qgroup_limit_exclusive(pool, group, bytes).map_err(io_err("limit box qgroup on", pool))?;
            sys::qgroup_limit_exclusive(pool, own, bytes).map_err(io_err("limit", &kept))
        };
        limits(NO_LIMIT)?;
        let readonly = sys::subvolume_set_readonly(&kept).map_err(io_err("make read-only", &kept));
        limits(owner.disk_limit)?;
        readonly?;
        note_saved_at(&self.checkpoints_dir(owner.id), before);
        self.set_disk_limit(owner.id, owner.disk_limit)?;
        let root = self.box_path(owner.id);
        let subvolume = sys::subvolume_id(&root).map_err(io_err("look up subvolume", &root))?;
        let pool = self.root();
        sys::qgroup_assign(pool, subvolume, account_qgroup(owner.account))
            .map_err(io_err("charge account for", &root))?;
        sys::qgroup_assign(pool, subvolume, box_qgroup(owner.id)).map_err(io_err("charge box for", &root))
    }

    /// Gives box `id` its own qgroup, limited to `disk_limit` and holding
    /// its root. Every step is repeated each time (each is idempotent): one
    /// cut short before must not leave a group that limits nothing.
    pub(crate) fn own_box_qgroup(&self, id: &BoxId, disk_limit: u64) -> Result<(), PoolError> {
        let group = box_qgroup(id);
        let pool = self.root();
        let root = self.box_path(id);
        let subvolume = sys::subvolume_id(&root).map_err(io_err("look up subvolume", &root))?;
        sys::qgroup_create(pool, group).map_err(io_err("create box qgroup on", pool))?;
        sys::qgroup_limit_exclusive(pool, group, disk_limit).map_err(io_err("limit box qgroup on", pool))?;
        sys::qgroup_assign(pool, subvolume, group).map_err(io_err("charge box for", &root))
    }

    fn restoring_path(&self, id: &BoxId) -> PathBuf {
        self.boxes_dir().join(restoring_name(id))
    }

    /// Completes, or undoes, a restore of box `id` left unfinished (a crash,
    /// or a step that failed); nothing to do without one.
    pub fn finish_restore_of(&self, id: &BoxId) -> Result<(), PoolError> {
        let intent = self.checkpoints_dir(id).join(INTENT);
        let Ok(text) = fs::read_to_string(&intent) else { return Ok(()) };
        let outcome = self.finish_restore(id, &text)?;
        tracing::warn!(box_id = %id, outcome, "finished an interrupted restore");
        let _ = fs::remove_file(&intent);
        Ok(())
    }

    /// Completes, or undoes, every restore a crash interrupted: after it,
    /// each such box is either as it was or fully restored.
    pub fn finish_restores(&self) {
        let base = self.root().join("checkpoints");
        for entry in fs::read_dir(&base).into_iter().flatten().filter_map(Result::ok) {
            let Some(id) = entry.file_name().to_str().and_then(BoxId::parse) else { continue };
            if let Err(e) = self.finish_restore_of(&id) {
                tracing::error!(box_id = %id, error = %e, "cannot finish an interrupted restore");
            }
        }
    }

    fn finish_restore(&self, id: &BoxId, intent: &str) -> Result<&'static str, PoolError> {
        let mut lines = intent.lines();
        let (Some(_label), Some(before), Some(account), Some(limit)) =
            (lines.next(), lines.next(), lines.next(), lines.next().and_then(|l| l.parse().ok()))
        else {
            return Err(PoolError::Unsupported("an unreadable restore intent"));
        };
        let account = AccountId(account.to_string());
        let owner = Owner { id, account: &account, disk_limit: limit };
        let (root, next) = (self.box_path(id), self.restoring_path(id));
        let kept = self.checkpoint_path(id, before);
        match (root.is_dir(), next.is_dir(), kept.is_dir()) {
            // Nothing moved yet: undone.
            (true, true, false) => {
                sys::subvolume_delete(&self.boxes_dir(), &restoring_name(id))
                    .map_err(io_err("delete subvolume", &next))?;
                Ok("undone")
            }
            (true, false, false) => Ok("undone"),
            // The old root is kept, the new one not in place yet: completed.
            (false, true, true) => {
                fs::rename(&next, &root).map_err(io_err("move the restored root to", &root))?;
                self.finish_swap(&owner, before)?;
                Ok("completed")
            }
            (true, false, true) => {
                self.finish_swap(&owner, before)?;
                Ok("completed")
            }
            _ => Err(PoolError::Unsupported("a restore's subvolumes are in no state it leaves")),
        }
    }
}

/// Where the time checkpoint `label` was saved is kept (a subvolume's own
/// times say when its data was first made: for a restore's kept state, when
/// the box's root was).
fn saved_at_path(dir: &Path, label: &str) -> PathBuf {
    dir.join(format!(".{label}.saved"))
}

/// Notes that checkpoint `label` was saved now (best effort: without the
/// note, the checkpoint's own creation time stands in).
fn note_saved_at(dir: &Path, label: &str) {
    let _ = fs::write(saved_at_path(dir, label), moat_core::clock::now_ms().to_string());
}

/// When checkpoint `label` in `dir` was saved (ms since the epoch).
fn saved_at(dir: &Path, label: &str) -> u64 {
    let noted = fs::read_to_string(saved_at_path(dir, label)).ok().and_then(|t| t.trim().parse().ok());
    noted.unwrap_or_else(|| {
        fs::metadata(dir.join(label))
            .and_then(|m| m.created())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64)
    })
}

/// The name a restored root has until it takes the root's place.
fn restoring_name(id: &BoxId) -> String {
    format!("restoring-{id}")
}

/// Writes `text` to `path` and makes it (and its name) durable.
fn write_synced(path: &Path, text: &str) -> io::Result<()> {
    let mut file = fs::File::create(path)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    fs::File::open(path.parent().unwrap_or(Path::new("/")))?.sync_all()
}

/// How long one `checkpoints` call may walk trees for the bytes each holds.
pub const HELD_WALKS: std::time::Duration = std::time::Duration::from_secs(20);

/// Held while checkpoints' trees are walked (one call's at a time).
static WALKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Bytes under `path` that share their extents with nothing else on the
/// filesystem (`btrfs filesystem du`; the tree is read-only, so it cannot
/// change while it is walked), unless the walk is not over by `deadline`.
fn exclusive_bytes(path: &Path, deadline: std::time::Instant) -> Option<u64> {
    let mut du = Command::new("btrfs")
        .args(["filesystem", "du", "-s", "--raw"])
        .arg(path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    // One line of output (-s): the pipe cannot fill while it runs.
    while du.try_wait().ok()?.is_none() {
        if std::time::Instant::now() >= deadline {
            let _ = du.kill();
            let _ = du.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut du.stdout.take()?, &mut text).ok()?;
    text.lines().last()?.split_whitespace().nth(1)?.parse().ok()
}
