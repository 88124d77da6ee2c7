//! A box's network follows its lifecycle: whoever serves its egress (the
//! gateway, through the daemon) is told when its network namespace comes up,
//! freezes and goes away, and when its policy changes.

use std::sync::Arc;

use super::{BoxManager, ManagerError};
use crate::backend::BoxHandle;
use crate::egress::LogEntry;
use crate::ids::{AccountId, BoxId, Name};
use crate::policy::Policy;
use crate::record::BoxRecord;

/// Told about boxes' networks. Calls are quick (they hand work on) and
/// cannot fail the lifecycle: a box whose egress cannot be served reaches
/// nothing, which is safe.
pub trait NetworkHooks: Send + Sync {
    /// The box runs (booted, or found running at daemon start) with this
    /// policy; its network is at `handle.network`.
    fn up(&self, rec: &BoxRecord, handle: &BoxHandle, policy: &Policy);
    /// As [`up`](Self::up), for a box found suspended at daemon start: it
    /// needs serving only once it resumes.
    fn up_suspended(&self, rec: &BoxRecord, handle: &BoxHandle, policy: &Policy) {
        self.up(rec, handle, policy);
        self.suspended(&rec.id);
    }
    /// The box was suspended: its open connections should end, and it needs
    /// nothing held for it until it resumes (a frozen box sends nothing).
    fn suspended(&self, id: &BoxId);
    /// The suspended box is about to thaw: what serves it must be back
    /// first. Asked first in place with [`Wait::No`], where it must not
    /// block; `false` back (not ready yet) has it asked again with
    /// [`Wait::Yes`] on a thread that may.
    fn resuming(&self, _id: &BoxId, _wait: Wait) -> bool {
        true
    }
    /// The box's processes ended (stopped or removed).
    fn down(&self, id: &BoxId);
    /// The box's policy changed.
    fn policy_changed(&self, id: &BoxId, policy: &Policy);
    /// The secrets granted to the box changed (or the box came up): these
    /// are all it has now.
    fn secrets_changed(&self, id: &BoxId, secrets: &[crate::secrets::BoxSecret]);
    /// The box's owner answered the gateway's question `question`.
    fn answered(&self, id: &BoxId, question: u64, answer: crate::egress::Answer);
}

/// Whether a hook may block its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// It runs on an async worker: it must answer at once.
    No,
    /// It runs on a thread of its own, which it may hold.
    Yes,
}

impl BoxManager {
    /// Sets who is told about boxes' networks (once, before boxes run).
    pub fn set_network_hooks(&self, hooks: Arc<dyn NetworkHooks>) {
        let _ = self.network.set(hooks);
    }

    /// Tells the hooks, if any, off the async worker (making a box's
    /// listeners may wait up to a second for its ports).
    pub(super) fn tell_network(&self, tell: impl FnOnce(&dyn NetworkHooks)) {
        if let Some(hooks) = self.network.get() {
            super::in_place(|| tell(hooks.as_ref()));
        }
    }

    /// Tells the hooks the suspended box `id` is about to thaw: in place
    /// first (a thread woken for the work waited for a core for milliseconds
    /// on a busy host), and when they must wait (its listeners, for the
    /// gateway to let go of the old ones), on a thread of the blocking pool. That wait needs the daemon's
    /// message to the gateway sent meanwhile: waited for in place, the
    /// message sat queued behind this worker until the wait's full second
    /// ran out (one resume in five, in `moat bench`'s back-to-back suspend
    /// and resume).
    pub(super) async fn network_resuming(&self, id: &BoxId) {
        let Some(hooks) = self.network.get().cloned() else { return };
        if !hooks.resuming(id, Wait::No) {
            let id = id.clone();
            let _ = tokio::task::spawn_blocking(move || hooks.resuming(&id, Wait::Yes)).await;
        }
    }

    /// Tells the hooks box `rec` is up at `handle` (`suspended`: found so at
    /// daemon start).
    pub(super) fn network_up(&self, rec: &BoxRecord, handle: &BoxHandle, suspended: bool) {
        if self.network.get().is_none() {
            return;
        }
        match self.db(|s| s.policy(&rec.id)) {
            Ok(policy) if suspended => self.tell_network(|hooks| hooks.up_suspended(rec, handle, &policy)),
            Ok(policy) => self.tell_network(|hooks| hooks.up(rec, handle, &policy)),
            Err(e) => tracing::error!(box_id = %rec.id, error = %e, "cannot read the box's policy; it reaches nothing"),
        }
        self.tell_secrets(&rec.id);
    }

    pub(super) fn network_down(&self, id: &BoxId) {
        self.tell_network(|hooks| hooks.down(id));
    }

    /// A box's egress policy.
    pub fn policy(&self, account: &AccountId, name: &Name) -> Result<Policy, ManagerError> {
        let rec = self.get(account, name)?;
        Ok(self.db(|s| s.policy(&rec.id))?)
    }

    /// Changes a box's policy with `change` (which may refuse), stores it,
    /// and hands it to the gateway in one swap. Returns the new policy.
    pub async fn change_policy<E>(
        &self,
        account: &AccountId,
        name: &Name,
        change: impl FnOnce(&mut Policy) -> Result<(), E>,
    ) -> Result<Result<Policy, E>, ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        let mut policy = self.db(|s| s.policy(&rec.id))?;
        if let Err(e) = change(&mut policy) {
            return Ok(Err(e));
        }
        self.db(|s| s.set_policy(&rec.id, &policy))?;
        self.tell_network(|hooks| hooks.policy_changed(&rec.id, &policy));
        tracing::info!(box_id = %rec.id, name = %rec.name, "policy changed");
        Ok(Ok(policy))
    }

    /// Records what the gateway reported (its box ids were checked as its
    /// message was read), and hands it to followers.
    pub fn record_egress(&self, entries: Vec<(BoxId, LogEntry)>) {
        if entries.is_empty() {
            return;
        }
        if let Err(e) = self.db(|s| s.append_egress(&entries)) {
            tracing::error!(error = %e, "cannot store egress log entries");
        }
        self.bill_egress(&entries);
        for (id, e) in &entries {
            if let (Some(secret), crate::egress::LogVerdict::Allow) = (&e.secret, e.verdict) {
                let used = crate::secrets::SecretUse {
                    requests: 1,
                    tokens: e.tokens.unwrap_or(0),
                    bytes: e.sent + e.received,
                };
                // A request with two secrets in it is a use of each.
                for name in secret.split(',') {
                    self.record_secret_use(id, name, used);
                }
            }
        }
        for entry in entries {
            // No follower is fine.
            let _ = self.egress_follow.send(entry);
        }
    }

    /// Adds the bytes of finished connections to the ledger, per box.
    fn bill_egress(&self, entries: &[(BoxId, LogEntry)]) {
        let mut per_box: std::collections::HashMap<&BoxId, (u64, u64)> = std::collections::HashMap::new();
        for (id, e) in entries.iter().filter(|(_, e)| e.kind == crate::egress::LogKind::Tcp) {
            let bytes = per_box.entry(id).or_default();
            bytes.0 = bytes.0.saturating_add(e.sent);
            bytes.1 = bytes.1.saturating_add(e.received);
        }
        for (id, (sent, received)) in per_box.into_iter().filter(|(_, b)| b.0 + b.1 > 0) {
            let billed = self.db(|s| match s.get_by_id(id)? {
                Some(rec) => s.record_egress_bytes(id, &rec.account, &rec.name, crate::clock::now_ms(), sent, received),
                None => Ok(()),
            });
            if let Err(e) = billed {
                tracing::error!(box_id = %id, error = %e, "cannot bill egress bytes");
            }
        }
    }

    /// A box's egress log from `since_ms` to before `until_ms`, and whether
    /// older entries were left out (see [`crate::store::Store::egress_between`]).
    pub fn egress_log(
        &self,
        account: &AccountId,
        name: &Name,
        since_ms: u64,
        until_ms: Option<u64>,
    ) -> Result<(Vec<LogEntry>, bool), ManagerError> {
        let rec = self.get(account, name)?;
        Ok(self.db(|s| s.egress_between(&rec.id, since_ms, until_ms))?)
    }

    /// Entries recorded from now on, for every box (the caller filters by
    /// id); a follower that falls behind loses the oldest and is told how many.
    pub fn follow_egress(&self) -> tokio::sync::broadcast::Receiver<(BoxId, LogEntry)> {
        self.egress_follow.subscribe()
    }
}
