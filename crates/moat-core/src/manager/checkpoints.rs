//! Checkpoints: a box's filesystem saved by label, listed, removed, and
//! restored in place (the box boots again, the same machine back in time,
//! and the state it had is kept as a checkpoint `before-LABEL`).

use std::sync::Arc;

use super::{BoxManager, ManagerError};
use crate::backend::Checkpoint;
use crate::ids::{AccountId, Name};
use crate::record::BoxState;

impl BoxManager {
    /// Saves the box as checkpoint `label` (default `c1`, `c2`, ...); returns
    /// the label.
    pub async fn checkpoint(
        &self,
        account: &AccountId,
        name: &Name,
        label: Option<Name>,
    ) -> Result<Name, ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        let labels = self.checkpoint_labels(&rec).await?;
        self.room_for_one_more(&rec.name, &labels)?;
        let label = match label {
            Some(label) if labels.iter().any(|l| l == label.as_str()) => {
                return Err(ManagerError::CheckpointExists(rec.name, label));
            }
            Some(label) => label,
            None => next_label(&labels),
        };
        let (r, l) = (rec.clone(), label.clone());
        let saved = self.blocking(move |b| b.checkpoint(&r, &l)).await;
        // Held still for the checkpoint, then let go: the fence may have
        // closed meanwhile.
        self.still_serving(&rec);
        saved??;
        tracing::info!(box_id = %rec.id, name = %rec.name, %label, "checkpoint saved");
        self.tell_durable(&rec.id);
        Ok(label)
    }

    /// The box's checkpoints, oldest first, with the bytes only each holds.
    /// Finding those walks each checkpoint's tree: such walks take turns
    /// with `diff`'s.
    pub async fn checkpoints(&self, account: &AccountId, name: &Name) -> Result<Vec<Checkpoint>, ManagerError> {
        let rec = self.get(account, name)?;
        let _mine = self.account_diff_turns.hold(account).await;
        let _turn = self.diff_turns.acquire().await.ok();
        self.blocking(move |b| b.checkpoints(&rec, true)).await
    }

    /// Deletes the box's checkpoint `label`.
    pub async fn remove_checkpoint(&self, account: &AccountId, name: &Name, label: &Name) -> Result<(), ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        if !self.checkpoint_labels(&rec).await?.iter().any(|l| l == label.as_str()) {
            return Err(ManagerError::NoSuchCheckpoint(rec.name, label.clone()));
        }
        let (r, l) = (rec.clone(), label.clone());
        self.blocking(move |b| b.delete_checkpoint(&r, &l)).await??;
        if self.durable.get().is_some() {
            if let Err(e) = self.forget_durable_checkpoint(&rec.id, label.as_str()) {
                // Its link keeps it in the object store until the box goes:
                // room, not correctness (a restore elsewhere brings it back).
                tracing::warn!(box_id = %rec.id, %label, error = %e, "cannot forget a removed checkpoint's link");
            }
        }
        Ok(())
    }

    /// Puts the box back to checkpoint `label`: its processes end, its
    /// filesystem becomes a copy of the checkpoint (the box's current secret
    /// placeholders written in), and it boots again. Returns the label the
    /// state before the restore is kept under. On failure the box boots again
    /// as it was.
    pub async fn restore(
        self: &Arc<Self>,
        account: &AccountId,
        name: &Name,
        label: &Name,
    ) -> Result<Name, ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        let labels = self.checkpoint_labels(&rec).await?;
        if !labels.iter().any(|l| l == label.as_str()) {
            return Err(ManagerError::NoSuchCheckpoint(rec.name, label.clone()));
        }
        self.room_for_one_more(&rec.name, &labels)?;
        let before = before_label(label, &labels)?;
        let vars = self.secret_environment(&rec.id)?;
        if rec.state != BoxState::Stopped {
            self.stop_locked(&rec, false).await?;
        }
        let (r, l, b) = (rec.clone(), label.clone(), before.clone());
        let restored = self
            .blocking(move |backend| {
                backend.restore(&r, &l, &b)?;
                backend.set_environment(&r, &vars)
            })
            .await
            .and_then(|r| r.map_err(ManagerError::from));
        // Up again either way: restored, or as it was.
        let rec = self.get(account, &rec.name)?;
        let booted = self.bring_up(&rec).await;
        self.schedule_idle(&rec.id);
        restored?;
        // The state before is a checkpoint now, to keep.
        self.tell_durable(&rec.id);
        booted?;
        tracing::info!(box_id = %rec.id, name = %rec.name, %label, %before, "box restored");
        Ok(before)
    }

    async fn checkpoint_labels(&self, rec: &crate::record::BoxRecord) -> Result<Vec<String>, ManagerError> {
        let r = rec.clone();
        let found = self.blocking(move |b| b.checkpoints(&r, false)).await?;
        Ok(found.into_iter().map(|c| c.label).collect())
    }

    fn room_for_one_more(&self, name: &Name, labels: &[String]) -> Result<(), ManagerError> {
        if labels.len() >= self.config.max_checkpoints {
            return Err(ManagerError::TooManyCheckpoints(name.clone(), self.config.max_checkpoints));
        }
        Ok(())
    }
}

/// `c<n>`, one past the highest `c<n>` in `labels` (and not taken).
fn next_label(labels: &[String]) -> Name {
    let highest = labels.iter().filter_map(|l| l.strip_prefix('c')?.parse::<u64>().ok()).max().unwrap_or(0);
    let free = (highest.saturating_add(1)..).map(|n| format!("c{n}")).find(|l| !labels.contains(l));
    Name::new(&free.unwrap_or_default()).expect("c<digits> is a name")
}

/// `before-LABEL`, or `before-LABEL-2`, ... if that is taken (an undone
/// restore's own `before-` is not repeated: `before-before-...` would grow
/// past a name's length after a few undos).
fn before_label(label: &Name, labels: &[String]) -> Result<Name, ManagerError> {
    let mut bare = label.as_str();
    while let Some(rest) = bare.strip_prefix("before-") {
        bare = rest;
    }
    let base = format!("before-{bare}");
    let free = std::iter::once(base.clone())
        .chain((2..).map(|n| format!("{base}-{n}")))
        .find(|l| !labels.contains(l))
        .unwrap_or(base);
    Name::new(&free).map_err(|_| ManagerError::NameTooLong(free))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn labels_count_up_and_befores_never_collide() {
        let labels: Vec<String> = ["c1", "c7", "cx", "before-c1"].iter().map(|s| s.to_string()).collect();
        assert_eq!(next_label(&labels).as_str(), "c8");
        let before_c1 = Name::new("before-before-c1").unwrap();
        assert_eq!(before_label(&before_c1, &labels).unwrap().as_str(), "before-c1-2");
        assert_eq!(next_label(&[]).as_str(), "c1");
        let c1 = Name::new("c1").unwrap();
        assert_eq!(before_label(&c1, &labels).map(|n| n.to_string()).ok().as_deref(), Some("before-c1-2"));
        let long = Name::new(&"a".repeat(60)).unwrap();
        assert!(matches!(before_label(&long, &labels), Err(ManagerError::NameTooLong(_))));
    }
}
