//! What makes a new box directory (a fresh one, or a copy) a box of its
//! own: its disk limit, its charge to its account, and a fresh identity.

use std::path::Path;

use moat_core::{BackendError, BoxRecord};

use crate::identity;
use crate::pool::Pool;

/// Gives a box's new directory (a snapshot, a copy) its disk limit (`limit`
/// bytes of its own) and account charge (`account_disk` in all), and a
/// fresh identity written into `files` (the box's root, or a VM box's
/// mini-root of files), its CA key kept on the host; on failure the
/// directory is deleted again.
pub fn make_own(pool: &Pool, rec: &BoxRecord, files: &Path, limit: u64, account_disk: u64) -> Result<(), BackendError> {
    let result = pool
        .set_disk_limit(&rec.id, limit)
        .and_then(|()| pool.charge_account(&rec.id, &rec.account, account_disk))
        .map_err(|e| BackendError::new("limit disk use", e))
        .and_then(|()| {
            identity::mint(files, &rec.name).map_err(|e| match e.kind() {
                // A new root has written nothing of its own: the account's budget is spent.
                std::io::ErrorKind::QuotaExceeded => BackendError::msg(format!(
                    "your boxes hold all this server allows per account ({}) on disk; remove boxes or files first",
                    moat_core::limits::format_size(account_disk)
                )),
                _ => BackendError::new("mint box identity", e),
            })
        })
        .and_then(|ca_key| {
            pool.store_ca_key(&rec.id, &ca_key).map_err(|e| BackendError::new("store the box's CA key", e))
        });
    if result.is_err() {
        let _ = pool.delete_box(&rec.id);
    }
    result
}
