//! Each account's share of the two bounded logs, the egress log and the
//! effects ledger. Past a log's bound the oldest entries of the account
//! holding the most go first, so that one account's boxes together, however
//! hard they flood, never push out another account's entries. The shares
//! are counted in `log_shares` as entries come and go (counting a million
//! rows for every batch would be the cost of a flood); a count found high
//! is put right from the rows.

use super::sql::{args, Exec};
use super::StoreError;
use crate::ids::BoxId;

/// The shares' table.
pub(crate) const LOG_SHARES: &str = "
CREATE TABLE IF NOT EXISTS log_shares (
    log         TEXT NOT NULL,
    account     TEXT NOT NULL,
    entries     INTEGER NOT NULL,
    PRIMARY KEY (log, account)
);
";

/// A log bounded by account.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Log {
    /// The egress log (see [`super::egress_log`]).
    Egress,
    /// The effects ledger (see [`super::effects`]).
    Effects,
}

impl Log {
    /// Both logs.
    pub(crate) const ALL: [Log; 2] = [Log::Egress, Log::Effects];

    /// Its table.
    pub(crate) fn table(self) -> &'static str {
        match self {
            Self::Egress => "egress_log",
            Self::Effects => "effects",
        }
    }

    /// Its name in `log_shares`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Egress => "egress",
            Self::Effects => "effects",
        }
    }

    fn bound(self) -> i64 {
        match self {
            Self::Egress => super::egress_log::MAX_ENTRIES,
            Self::Effects => super::effects::MAX_EFFECTS,
        }
    }
}

/// Takes the logs' turn (PostgreSQL: see [`super::LOG_LOCK`]), first thing
/// in a transaction that writes them.
pub(crate) fn take_turn(tx: &mut dyn Exec) -> Result<(), StoreError> {
    if tx.engine() == super::sql::Engine::Postgres {
        tx.execute("SELECT pg_advisory_xact_lock(?1)", &args![super::LOG_LOCK])?;
    }
    Ok(())
}

/// The account box `id` is of (`''` once the box is gone from the store).
pub(crate) fn account_of(tx: &mut dyn Exec, id: &BoxId) -> Result<String, StoreError> {
    match tx.query_row("SELECT account FROM boxes WHERE id = ?1", &args![id.as_str()])? {
        Some(row) => row.get(0),
        None => Ok(String::new()),
    }
}

/// Counts entries just added to `log` (per account: how many), then drops
/// what is past its bound: the oldest of the account holding the most.
pub(crate) fn added(tx: &mut dyn Exec, log: Log, added: &[(String, i64)]) -> Result<(), StoreError> {
    for (account, n) in added {
        tx.execute(
            "INSERT INTO log_shares (log, account, entries) VALUES (?1, ?2, ?3) \
             ON CONFLICT (log, account) DO UPDATE SET entries = log_shares.entries + excluded.entries",
            &args![log.name(), account.as_str(), *n],
        )?;
    }
    trim(tx, log, log.bound())
}

/// Takes out box `id`'s entries of `log`, and counts them out of its
/// account's share.
pub(crate) fn forget_box(tx: &mut dyn Exec, log: Log, id: &BoxId) -> Result<(), StoreError> {
    take_turn(tx)?;
    let table = log.table();
    let held = tx.query(
        &format!("SELECT account, COUNT(*) FROM {table} WHERE box_id = ?1 GROUP BY account"),
        &args![id.as_str()],
    )?;
    tx.execute(&format!("DELETE FROM {table} WHERE box_id = ?1"), &args![id.as_str()])?;
    for row in held {
        let (account, n): (String, i64) = (row.get(0)?, row.get(1)?);
        count_out(tx, log, &account, n)?;
    }
    Ok(())
}

/// Takes `n` entries out of `account`'s share of `log`.
fn count_out(tx: &mut dyn Exec, log: Log, account: &str, n: i64) -> Result<(), StoreError> {
    tx.execute(
        "UPDATE log_shares SET entries = CASE WHEN entries > ?3 THEN entries - ?3 ELSE 0 END \
         WHERE log = ?1 AND account = ?2",
        &args![log.name(), account, n],
    )?;
    Ok(())
}

/// Drops entries of `log` past `bound`, the largest share's oldest first.
fn trim(tx: &mut dyn Exec, log: Log, bound: i64) -> Result<(), StoreError> {
    let (name, table) = (log.name(), log.table());
    // A batch adds a few thousand entries at most: one round takes them out
    // of the largest share; more only where counts were found high.
    for _ in 0..16 {
        let total: i64 = match tx.query_row(
            "SELECT CAST(COALESCE(SUM(entries), 0) AS BIGINT) FROM log_shares WHERE log = ?1",
            &args![name],
        )? {
            Some(row) => row.get(0)?,
            None => 0,
        };
        let excess = total - bound;
        if excess <= 0 {
            return Ok(());
        }
        let Some(row) = tx.query_row(
            "SELECT account, entries FROM log_shares WHERE log = ?1 ORDER BY entries DESC LIMIT 1",
            &args![name],
        )?
        else {
            return Ok(());
        };
        let (account, held): (String, i64) = (row.get(0)?, row.get(1)?);
        let wanted = excess.min(held);
        let gone = tx.execute(
            &format!(
                "DELETE FROM {table} WHERE rowid IN \
                 (SELECT rowid FROM {table} WHERE account = ?1 ORDER BY rowid LIMIT ?2)"
            ),
            &args![account.as_str(), wanted],
        )?;
        let gone = i64::try_from(gone).unwrap_or(i64::MAX);
        if gone < wanted {
            // The share was counted high (rows taken out some other way):
            // counted again from the rows.
            tx.execute(
                &format!(
                    "UPDATE log_shares SET entries = (SELECT COUNT(*) FROM {table} WHERE account = ?2) \
                     WHERE log = ?1 AND account = ?2"
                ),
                &args![name, account.as_str()],
            )?;
        } else {
            count_out(tx, log, &account, gone)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::{LogEntry, LogKind, LogVerdict};
    use crate::store::testing::{on_both_engines, TestDb};
    use crate::store::Store;

    on_both_engines!(a_flooding_account_pushes_out_only_its_own_entries);

    fn entry(at_ms: u64, name: &str) -> LogEntry {
        LogEntry::new(at_ms, LogKind::Dns, name, 0, LogVerdict::Deny)
    }

    /// A box of `account` in the store, by id.
    fn a_box(store: &Store, account: &str, slot: i64) -> BoxId {
        let id = BoxId::random();
        store
            .execute(
                "INSERT INTO boxes (id, account, name, image, cpus, memory, pids, slot, state, created_at) \
                 VALUES (?1, ?2, ?1, 'busybox', 1, 1, 1, ?3, 'running', 0)",
                &args![id.as_str(), account, slot],
            )
            .unwrap();
        id
    }

    fn shares(store: &Store) -> Vec<(String, i64)> {
        let rows =
            store.query("SELECT account, entries FROM log_shares WHERE log = 'egress' ORDER BY account", &[]).unwrap();
        rows.iter().map(|r| (r.get(0).unwrap(), r.get(1).unwrap())).collect()
    }

    fn names(store: &Store, id: &BoxId) -> Vec<String> {
        store.egress_since(id, 0).unwrap().into_iter().map(|e| e.name).collect()
    }

    fn trimmed(store: &Store, bound: i64) {
        store.transaction(|tx| trim(tx, Log::Egress, bound)).unwrap();
    }

    fn a_flooding_account_pushes_out_only_its_own_entries(db: &TestDb) {
        let store = db.open();
        let quiet = a_box(&store, "SHA256:quiet", 1);
        let (flood, flood2) = (a_box(&store, "SHA256:flood", 2), a_box(&store, "SHA256:flood", 3));
        store.append_egress(&[(quiet.clone(), entry(1, "q1")), (quiet.clone(), entry(2, "q2"))]).unwrap();
        // Two boxes of one account flood after the quiet one's entries.
        let many: Vec<_> = (0..40u64)
            .map(|i| (if i % 2 == 0 { flood.clone() } else { flood2.clone() }, entry(10 + i, &format!("f{i}"))))
            .collect();
        store.append_egress(&many).unwrap();
        assert_eq!(shares(&store), [("SHA256:flood".to_string(), 40), ("SHA256:quiet".to_string(), 2)]);
        trimmed(&store, 30);
        assert_eq!(names(&store, &quiet), ["q1", "q2"], "a flood pushed out another account's entries");
        let kept: Vec<String> = [names(&store, &flood), names(&store, &flood2)].concat();
        assert_eq!(kept.len(), 28);
        assert!(!kept.contains(&"f11".to_string()) && kept.contains(&"f12".to_string()), "{kept:?}");
        assert_eq!(shares(&store), [("SHA256:flood".to_string(), 28), ("SHA256:quiet".to_string(), 2)]);
        // The largest share goes first, whichever account holds it.
        trimmed(&store, 3);
        assert_eq!(shares(&store), [("SHA256:flood".to_string(), 1), ("SHA256:quiet".to_string(), 2)]);
        // A removed box's entries leave its account's share.
        store.forget_egress(&quiet).unwrap();
        assert_eq!(shares(&store), [("SHA256:flood".to_string(), 1), ("SHA256:quiet".to_string(), 0)]);
        // A share counted high (rows taken out behind its back) is counted
        // again from the rows, and the log still ends within its bound.
        store.append_egress(&[(quiet.clone(), entry(90, "q3")), (quiet.clone(), entry(91, "q4"))]).unwrap();
        store.execute("UPDATE log_shares SET entries = 50 WHERE account = 'SHA256:flood'", &[]).unwrap();
        trimmed(&store, 2);
        assert_eq!(names(&store, &quiet), ["q3", "q4"]);
        assert_eq!(shares(&store), [("SHA256:flood".to_string(), 0), ("SHA256:quiet".to_string(), 2)]);
    }
}
