//! What came in: every package file a box asked a registry for, from the
//! host's own log (the box cannot edit it), as `packages NAME` lists it.

use std::sync::Arc;

use super::{BoxManager, ManagerError};
use crate::egress::LogEntry;
use crate::ids::{AccountId, Name};

impl BoxManager {
    /// Box `name`'s package file requests, oldest first: the log entries
    /// that name a package file, allowed or refused.
    pub async fn packages(self: &Arc<Self>, account: &AccountId, name: &Name) -> Result<Vec<LogEntry>, ManagerError> {
        let rec = self.get(account, name)?;
        Ok(self.db(|s| s.package_entries(&rec.id, 0))?)
    }

    /// The package files `a` and `b` each let in since they split (see
    /// [`BoxManager::split_effects`]), oldest first.
    pub async fn split_packages(
        self: &Arc<Self>,
        account: &AccountId,
        a: &Name,
        b: &Name,
    ) -> Result<(Vec<LogEntry>, Vec<LogEntry>), ManagerError> {
        let (ra, rb) = (self.get(account, a)?, self.get(account, b)?);
        let split_ms = self.split_ms(&ra, &rb)?;
        let allowed = |id: &crate::ids::BoxId| -> Result<Vec<LogEntry>, ManagerError> {
            let all = self.db(|s| s.package_entries(id, split_ms))?;
            Ok(all.into_iter().filter(|e| e.verdict == crate::egress::LogVerdict::Allow).collect())
        };
        Ok((allowed(&ra.id)?, allowed(&rb.id)?))
    }
}
