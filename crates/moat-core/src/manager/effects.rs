//! The effects ledger as the owner asks for it: a box's effects since a
//! time or one of its checkpoints, and two copies' effects since they split
//! (see [`crate::effects`]).

use std::sync::Arc;

use super::{BoxManager, ManagerError};
use crate::effects::{Effect, Since};
use crate::ids::{AccountId, Name};

impl BoxManager {
    /// Box `name`'s effects since `since`, oldest first.
    pub async fn effects(
        self: &Arc<Self>,
        account: &AccountId,
        name: &Name,
        since: &Since,
    ) -> Result<Vec<Effect>, ManagerError> {
        let rec = self.get(account, name)?;
        let since_ms = match since {
            Since::Start => 0,
            Since::Time(ms) => *ms,
            Since::Checkpoint(label) => {
                let r = rec.clone();
                let found = self.blocking(move |b| b.checkpoints(&r, false)).await?;
                let checkpoint = found.into_iter().find(|c| c.label == label.as_str());
                checkpoint.ok_or_else(|| ManagerError::NoSuchCheckpoint(rec.name.clone(), label.clone()))?.created_ms
            }
        };
        Ok(self.db(|s| s.effects_since(&rec.id, since_ms))?)
    }

    /// What `a` and `b` each did since they split: since the younger of the
    /// two was made (a copy of the other, or of the same box), to the
    /// millisecond.
    pub async fn split_effects(
        self: &Arc<Self>,
        account: &AccountId,
        a: &Name,
        b: &Name,
    ) -> Result<(Vec<Effect>, Vec<Effect>), ManagerError> {
        let (ra, rb) = (self.get(account, a)?, self.get(account, b)?);
        let split_ms = self.split_ms(&ra, &rb)?;
        let (ia, ib) = (ra.id.clone(), rb.id.clone());
        Ok((self.db(|s| s.effects_since(&ia, split_ms))?, self.db(|s| s.effects_since(&ib, split_ms))?))
    }

    /// When two boxes split: when the younger was made, to the millisecond.
    pub(super) fn split_ms(&self, a: &crate::BoxRecord, b: &crate::BoxRecord) -> Result<u64, ManagerError> {
        let made = |r: &crate::BoxRecord| self.db(|s| s.created_ms(&r.id)).map(|ms| ms.unwrap_or(r.created_at * 1000));
        Ok(made(a)?.max(made(b)?))
    }
}
