//! Copies: `dup` (a box's filesystem, or its whole machine, as of now, as a
//! new box with an identity of its own), `diff` (what a copy changed) and
//! `promote` (a copy takes its parent's name).

use std::sync::Arc;

use super::{reserved, BoxManager, ManagerError};
use crate::backend::{BackendKind, ChangeSink, Copied};
use crate::clock::now;
use crate::ids::{AccountId, Name};
use crate::record::{BoxRecord, BoxState};
use crate::store::StoreError;

impl BoxManager {
    /// Duplicates `src` as `dst`: a copy of its filesystem as of now, with a
    /// fresh identity, booted with a fresh process tree; or, where the backend
    /// copies the whole machine, left suspended for its first session to
    /// resume. On any failure (or a crash, rolled back by `recover`) no `dst`
    /// is left and `src` runs on untouched.
    pub async fn dup(self: &Arc<Self>, account: &AccountId, src: &Name, dst: &Name) -> Result<BoxRecord, ManagerError> {
        reserved(dst)?;
        let src = self.get(account, src)?;
        self.check_quota(account, &src.limits)?;
        if self.db(|s| s.get(account, dst))?.is_some() {
            return Err(StoreError::NameTaken(dst.clone()).into());
        }
        let (src, guard) = self.locked(account, &src.name).await?;
        let rec = self.db(|s| s.insert_dup(&src, dst, now()))?;
        // The copy's secrets get placeholders of its own, written over the
        // parent's before it boots.
        let vars = match self.regrant_for_dup(&src.id, &rec.id) {
            Ok(vars) => vars,
            Err(e) => {
                self.db(|s| s.delete(&rec.id))?;
                return Err(e);
            }
        };
        // The parent is held only while it is copied; the copy boots with the
        // parent free, so that copies of one box (a race's) boot at once.
        let (s, d) = (src.clone(), rec.clone());
        let copied = self.blocking(move |b| b.dup(&s, &d)).await.and_then(|c| Ok(c?));
        // Held still for the copy, then let go: the fence may have closed meanwhile.
        self.still_serving(&src);
        let copied = match copied {
            Ok(copied) => copied,
            Err(e) => {
                self.db(|s| s.delete(&rec.id))?;
                return Err(e);
            }
        };
        drop(guard);
        let rec = self
            .finish_new(rec, move |b, d| {
                b.set_environment(d, &vars)
                    .and_then(|()| match copied {
                        Copied::Files => b.start(d).map(Some),
                        Copied::Machine => Ok(None),
                    })
                    .inspect_err(|_| {
                        let _ = b.destroy(d);
                    })
            })
            .await?;
        tracing::info!(box_id = %rec.id, name = %rec.name, parent = %src.name, pid = ?rec.pid, "box duplicated");
        Ok(rec)
    }

    /// What changed in `b` relative to `a`, handed to `out` in batches as it is
    /// found. Comparisons take turns ([`DIFFS_AT_ONCE`] at a time): each
    /// holds up to the backend's bound of memory.
    pub async fn diff(
        self: &Arc<Self>,
        account: &AccountId,
        a: &Name,
        b: &Name,
        mut out: Box<ChangeSink<'static>>,
    ) -> Result<(), ManagerError> {
        let (a, b) = (self.get(account, a)?, self.get(account, b)?);
        // Both copies are read from this node's pool (a dup stays on its node).
        self.here(&a)?;
        self.here(&b)?;
        // The account's turn, then one of all (the semaphore is never
        // closed, so a turn always comes).
        let _mine = self.account_diff_turns.hold(account).await;
        let _turn = self.diff_turns.acquire().await.ok();
        // A VM box lists its own files: it must not be suspended or stopped
        // meanwhile, so both boxes are held (in id order, as `promote` holds
        // them). Namespace boxes' files are read from the host, unheld.
        let mut guards = Vec::new();
        if a.backend == BackendKind::Vm || b.backend == BackendKind::Vm {
            let mut ids = vec![a.id.clone(), b.id.clone()];
            ids.sort_by(|x, y| x.as_str().cmp(y.as_str()));
            ids.dedup();
            for id in ids {
                guards.push(self.lock_for(&id).lock_owned().await);
            }
        }
        // One whose machine is saved to a file (parked, or a copy not yet
        // resumed) runs again to do it, and is suspended again when idle.
        let mut woken = Vec::new();
        for name in [&a.name, &b.name] {
            let rec = self.get(account, name)?;
            if rec.backend != BackendKind::Vm || rec.state != BoxState::Suspended || woken.contains(&rec.id) {
                continue;
            }
            let r = rec.clone();
            if self.blocking(move |backend| backend.handle(&r)).await?.is_none() {
                self.bring_up(&rec).await?;
                woken.push(rec.id);
            }
        }
        let (a, b) = (self.get(account, &a.name)?, self.get(account, &b.name)?);
        let compared = self.blocking(move |backend| backend.diff(&a, &b, &mut *out)).await;
        drop(guards);
        for id in &woken {
            self.schedule_idle(id);
        }
        Ok(compared??)
    }

    /// Makes a duplicate take its parent's place: the parent's name now means the
    /// child, and the parent stays as `<name>-prev` until removed. Returns the
    /// parent's new name. Holds both boxes' locks; on any failure both keep
    /// their names, in the store and in their files.
    pub async fn promote(&self, account: &AccountId, child: &Name) -> Result<Name, ManagerError> {
        let first = self.get(account, child)?;
        let parent_id = first.parent.clone().ok_or_else(|| ManagerError::NoParent(first.name.clone()))?;
        // Both locks, always in id order, so two promotes cannot deadlock.
        let (a, b) = if first.id.as_str() < parent_id.as_str() {
            (first.id.clone(), parent_id.clone())
        } else {
            (parent_id.clone(), first.id.clone())
        };
        let _guard_a = self.lock_for(&a).lock_owned().await;
        let _guard_b = self.lock_for(&b).lock_owned().await;
        // Read again under the locks: either may have changed meanwhile.
        let child = self.get(account, child)?;
        if child.id != first.id {
            return Err(ManagerError::Replaced(child.name));
        }
        if child.state == BoxState::Creating {
            return Err(ManagerError::Busy(child.name));
        }
        self.here(&child)?;
        let parent = self
            .store
            .get_by_id(&parent_id)?
            .filter(|p| p.account == *account && p.state != BoxState::Creating)
            .ok_or_else(|| ManagerError::ParentGone(child.name.clone()))?;
        let prev = format!("{}-prev", parent.name);
        let prev = Name::new(&prev).map_err(|_| ManagerError::NameTooLong(prev))?;
        if self.db(|s| s.get(account, &prev))?.is_some() {
            return Err(StoreError::NameTaken(prev).into());
        }
        // The files first (each step undone if the next fails), then the names
        // in one transaction.
        let (c, p, prev_name) = (child.clone(), parent.clone(), prev.clone());
        self.blocking(move |b| {
            b.rename(&c, &p.name)?;
            b.rename(&p, &prev_name).inspect_err(|_| {
                // Its files may be half renamed (/etc/hostname written, then
                // /etc/hosts refused): both go back.
                let _ = b.rename(&p, &p.name);
                let _ = b.rename(&c, &c.name);
            })
        })
        .await??;
        if let Err(e) = self.db(|s| s.promote(&child, &parent, &prev)) {
            let (c, p) = (child.clone(), parent.clone());
            let _ = self
                .blocking(move |b| {
                    let _ = b.rename(&c, &c.name);
                    let _ = b.rename(&p, &p.name);
                })
                .await;
            return Err(e.into());
        }
        tracing::info!(child = %child.name, parent = %parent.name, %prev, "box promoted");
        Ok(prev)
    }
}
