//! The egress audit log, kept by the privileged side: what the gateway saw
//! each box try, and what it decided. Bounded: past [`MAX_ENTRIES`] the
//! oldest entries of the account holding the most go first (see
//! [`super::log_shares`]).

use std::collections::HashMap;

use super::log_shares::{self, Log};
use super::sql::args;
use super::{Store, StoreError};
use crate::effects::Effect;
use crate::egress::LogEntry;
use crate::ids::BoxId;

/// Most entries kept (all accounts together).
pub const MAX_ENTRIES: i64 = 1_000_000;

/// Most entries one read returns (the newest).
pub const MAX_READ: usize = 10_000;

impl Store {
    /// Appends entries, then drops what is past [`MAX_ENTRIES`] (the oldest
    /// of the account holding the most); those that record effects go into
    /// the effects ledger too.
    pub fn append_egress(&self, entries: &[(BoxId, LogEntry)]) -> Result<(), StoreError> {
        self.transaction(|tx| {
            log_shares::take_turn(tx)?;
            let mut accounts: HashMap<&BoxId, String> = HashMap::new();
            let (mut logged, mut effects) = (HashMap::<String, i64>::new(), HashMap::<String, i64>::new());
            for (id, entry) in entries {
                let account = match accounts.get(id) {
                    Some(account) => account.clone(),
                    None => {
                        let account = log_shares::account_of(tx, id)?;
                        accounts.insert(id, account.clone());
                        account
                    }
                };
                let text = serde_json::to_string(entry).map_err(|_| StoreError::Corrupt(id.to_string()))?;
                tx.execute(
                    "INSERT INTO egress_log (box_id, account, at_ms, entry) VALUES (?1, ?2, ?3, ?4)",
                    &args![id.as_str(), account.as_str(), entry.at_ms, text],
                )?;
                *logged.entry(account.clone()).or_default() += 1;
                // What cannot be undone is kept apart, and longer.
                if let Some(effect) = Effect::of(entry) {
                    super::effects::insert(tx, id, &account, &effect)?;
                    *effects.entry(account).or_default() += 1;
                }
            }
            log_shares::added(tx, Log::Egress, &logged.into_iter().collect::<Vec<_>>())?;
            log_shares::added(tx, Log::Effects, &effects.into_iter().collect::<Vec<_>>())
        })
    }

    /// A box's entries since `since_ms`, oldest first (at most [`MAX_READ`], the newest).
    pub fn egress_since(&self, id: &BoxId, since_ms: u64) -> Result<Vec<LogEntry>, StoreError> {
        Ok(self.egress_between(id, since_ms, None)?.0)
    }

    /// A box's entries from `since_ms` to before `until_ms`, oldest first: at
    /// most [`MAX_READ`], the newest, and whether older ones were left out (a
    /// box can make 10,000 entries to push one out of a read: the reader is
    /// told, and pages back with `until_ms`).
    pub fn egress_between(
        &self,
        id: &BoxId,
        since_ms: u64,
        until_ms: Option<u64>,
    ) -> Result<(Vec<LogEntry>, bool), StoreError> {
        let sql = "SELECT entry FROM egress_log WHERE box_id = ?1 AND at_ms >= ?2 AND at_ms < ?4 \
                   ORDER BY rowid DESC LIMIT ?3";
        let mut entries: Vec<LogEntry> = self.newest_json(sql, id, (since_ms, until_ms), MAX_READ + 1)?;
        let cut = entries.len() > MAX_READ;
        if cut {
            entries.remove(0);
        }
        Ok((entries, cut))
    }

    /// A box's entries that name a package file, oldest first (at most
    /// [`MAX_READ`], the newest). (A box's own text in an entry is JSON
    /// escaped: its quotes cannot spell the key.)
    pub fn package_entries(&self, id: &BoxId, since_ms: u64) -> Result<Vec<LogEntry>, StoreError> {
        let sql = "SELECT entry FROM egress_log WHERE box_id = ?1 AND at_ms >= ?2 AND at_ms < ?4 \
                   AND entry LIKE '%\"package\":{%' ORDER BY rowid DESC LIMIT ?3";
        let entries: Vec<LogEntry> = self.newest_json(sql, id, (since_ms, None), MAX_READ)?;
        Ok(entries.into_iter().filter(|e| e.package.is_some()).collect())
    }

    /// The JSON values `sql` selects (box id, since, limit, until: newest
    /// first), oldest first; a row that does not decode (written by a later
    /// moat) is passed over. No `until` is no end.
    pub(crate) fn newest_json<T: serde::de::DeserializeOwned>(
        &self,
        sql: &str,
        id: &BoxId,
        (since_ms, until_ms): (u64, Option<u64>),
        most: usize,
    ) -> Result<Vec<T>, StoreError> {
        let until = until_ms.unwrap_or(i64::MAX as u64).min(i64::MAX as u64);
        let rows = self.query(sql, &args![id.as_str(), since_ms, most as u64, until])?;
        let mut out = Vec::new();
        for row in rows {
            if let Ok(value) = serde_json::from_str(&row.get::<String>(0)?) {
                out.push(value);
            }
        }
        out.reverse();
        Ok(out)
    }

    /// Forgets a removed box's entries.
    pub fn forget_egress(&self, id: &BoxId) -> Result<(), StoreError> {
        self.transaction(|tx| log_shares::forget_box(tx, Log::Egress, id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::{LogKind, LogVerdict};
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(entries_read_back_per_box_oldest_first);

    fn entries_read_back_per_box_oldest_first(db: &TestDb) {
        let store = db.open();
        let entry = |at_ms, name: &str| LogEntry::new(at_ms, LogKind::Dns, name, 0, LogVerdict::Allow);
        let (a, b) = (BoxId::random(), BoxId::random());
        store.append_egress(&[(a.clone(), entry(1, "one")), (b.clone(), entry(2, "other"))]).unwrap();
        store.append_egress(&[(a.clone(), entry(3, "three"))]).unwrap();
        let names = |got: Vec<LogEntry>| got.into_iter().map(|e| e.name).collect::<Vec<_>>();
        assert_eq!(names(store.egress_since(&a, 0).unwrap()), ["one", "three"]);
        assert_eq!(names(store.egress_since(&a, 2).unwrap()), ["three"]);
        store.forget_egress(&a).unwrap();
        assert!(store.egress_since(&a, 0).unwrap().is_empty());
        assert_eq!(names(store.egress_since(&b, 0).unwrap()), ["other"]);

        // An entry pushed out of a read by a flood after it: the read says
        // so, and a read until the oldest shown finds it.
        let mut flood = vec![(a.clone(), entry(10, "exfil"))];
        flood.extend((0..MAX_READ as u64).map(|i| (a.clone(), entry(20 + i, "noise"))));
        store.append_egress(&flood).unwrap();
        let (newest, cut) = store.egress_between(&a, 0, None).unwrap();
        assert!(cut && newest.len() == MAX_READ && newest.iter().all(|e| e.name == "noise"));
        let (older, cut) = store.egress_between(&a, 0, Some(newest[0].at_ms)).unwrap();
        assert_eq!((names(older), cut), (vec!["exfil".to_string()], false));
    }
}
