//! The egress audit log, kept by the privileged side: what the gateway saw
//! each box try, and what it decided. Bounded: the oldest entries go first.

use rusqlite::params;

use super::{Store, StoreError};
use crate::egress::LogEntry;
use crate::ids::BoxId;

/// Most entries kept (all boxes together).
pub const MAX_ENTRIES: i64 = 1_000_000;

/// Most entries one read returns (the newest).
pub const MAX_READ: usize = 10_000;

impl Store {
    /// Appends entries, dropping the oldest beyond [`MAX_ENTRIES`].
    pub fn append_egress(&self, entries: &[(BoxId, LogEntry)]) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        {
            let mut insert = tx.prepare_cached("INSERT INTO egress_log (box_id, at_ms, entry) VALUES (?1, ?2, ?3)")?;
            for (id, entry) in entries {
                let text = serde_json::to_string(entry).map_err(|_| StoreError::Corrupt(id.to_string()))?;
                insert.execute(params![id.as_str(), entry.at_ms as i64, text])?;
            }
        }
        tx.execute("DELETE FROM egress_log WHERE rowid <= (SELECT MAX(rowid) FROM egress_log) - ?1", [MAX_ENTRIES])?;
        tx.commit()?;
        Ok(())
    }

    /// A box's entries since `since_ms`, oldest first (at most [`MAX_READ`], the newest).
    pub fn egress_since(&self, id: &BoxId, since_ms: u64) -> Result<Vec<LogEntry>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "SELECT entry FROM egress_log WHERE box_id = ?1 AND at_ms >= ?2 ORDER BY rowid DESC LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![id.as_str(), since_ms as i64, MAX_READ as i64], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for text in rows {
            if let Ok(entry) = serde_json::from_str(&text?) {
                out.push(entry);
            }
        }
        out.reverse();
        Ok(out)
    }

    /// Forgets a removed box's entries.
    pub fn forget_egress(&self, id: &BoxId) -> Result<(), StoreError> {
        self.conn().execute("DELETE FROM egress_log WHERE box_id = ?1", [id.as_str()])?;
        Ok(())
    }
}
