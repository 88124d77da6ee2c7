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
        Ok(self.db(|s| s.package_entries(&rec.id))?)
    }
}
