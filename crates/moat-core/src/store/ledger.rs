//! The usage ledger: what each box consumed, from host-side counters only.
//!
//! The meter appends one row per box per interval (and at every state change,
//! so each interval is billed to the state it was spent in). Raw counters that
//! the meter last saw are kept too, so a daemon restart neither loses nor
//! double-counts anything, and totals never run backwards.

use serde::{Deserialize, Serialize};

use super::sql::{args, Exec};
use super::{Store, StoreError};
use crate::ids::{AccountId, BoxId, Name};

/// One interval of one box's consumption.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// End of the interval, milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// CPU time used.
    pub cpu_ns: u64,
    /// Resident memory integrated over the interval.
    pub mem_byte_ms: f64,
    /// Time spent running.
    pub running_ms: u64,
    /// Time spent suspended.
    pub suspended_ms: u64,
    /// Bytes the box kept in the object store, integrated over the interval.
    pub stored_byte_ms: f64,
}

/// What the meter last read for a box.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeterState {
    /// The box's cumulative CPU counter at that time.
    pub last_cpu_ns: u64,
    /// When, in milliseconds since the Unix epoch.
    pub last_at_ms: u64,
}

/// Totals for one box over a period.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// The box's name at its latest sample.
    pub name: Name,
    /// CPU seconds.
    pub cpu_seconds: f64,
    /// Average resident memory times running time, in GiB-seconds.
    pub memory_gib_seconds: f64,
    /// Seconds running.
    pub running_seconds: f64,
    /// Seconds suspended.
    pub suspended_seconds: f64,
    /// Bytes the box sent through the egress gateway.
    #[serde(default)]
    pub egress_sent_bytes: u64,
    /// Bytes the box received through the egress gateway.
    #[serde(default)]
    pub egress_received_bytes: u64,
    /// Bytes it kept in the object store times how long, in GiB-seconds.
    #[serde(default)]
    pub stored_gib_seconds: f64,
}

impl Store {
    /// What the meter last read for box `id`.
    pub fn meter_state(&self, id: &BoxId) -> Result<Option<MeterState>, StoreError> {
        let sql = "SELECT last_cpu_ns, last_at_ms FROM meter_state WHERE box_id = ?1";
        let row = self.query_row(sql, &args![id.as_str()])?;
        row.map(|r| Ok(MeterState { last_cpu_ns: r.get(0)?, last_at_ms: r.get(1)? })).transpose()
    }

    /// Records a sample and the new meter state, in one transaction.
    ///
    /// The meter's writes do not wait for the disk: a machine crash that
    /// loses one loses its meter state with it, so that the next sample bills
    /// the interval again.
    pub fn record_usage(
        &self,
        id: &BoxId,
        account: &AccountId,
        name: &Name,
        sample: &Sample,
        state: MeterState,
    ) -> Result<(), StoreError> {
        self.transaction_unsynced(|tx| write_usage(tx, id, account, name, sample, state))
    }

    /// Records a sample and the new meter state for each box, in one
    /// transaction.
    pub fn record_usages(&self, samples: &[(crate::record::BoxRecord, Sample, MeterState)]) -> Result<(), StoreError> {
        if samples.is_empty() {
            return Ok(());
        }
        self.transaction_unsynced(|tx| {
            samples
                .iter()
                .try_for_each(|(rec, sample, state)| write_usage(tx, &rec.id, &rec.account, &rec.name, sample, *state))
        })
    }

    /// Records the sample that closes box `rec`'s suspension and marks it
    /// running (with its PID 1), in one transaction (one commit on the
    /// resume path, not waiting for the disk: lost in a machine crash, it
    /// leaves a box the store calls suspended, as every box is after one).
    pub fn record_resume(
        &self,
        rec: &crate::record::BoxRecord,
        sample: &Sample,
        state: MeterState,
    ) -> Result<(), StoreError> {
        self.transaction_unsynced(|tx| {
            write_usage(tx, &rec.id, &rec.account, &rec.name, sample, state)?;
            super::set_state_in(tx, &rec.id, crate::record::BoxState::Running, rec.pid)
        })
    }

    /// Bills bytes a box moved through the egress gateway (a row of their own,
    /// with no time or CPU in it).
    pub fn record_egress_bytes(
        &self,
        id: &BoxId,
        account: &AccountId,
        name: &Name,
        at_ms: u64,
        sent: u64,
        received: u64,
    ) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO usage_samples (at, box_id, account, name, cpu_ns, mem_byte_ms, running_ms, suspended_ms, \
             egress_sent, egress_received) VALUES (?1, ?2, ?3, ?4, 0, 0, 0, 0, ?5, ?6)",
            &args![at_ms / 1000, id.as_str(), &account.0, name.as_str(), sent, received],
        )?;
        Ok(())
    }

    /// The account's usage per box since `since` (seconds since the epoch),
    /// optionally for one box name only, ordered by name. A sample that bills
    /// a suspension (one may bill a whole night, taken at the resume) counts
    /// only its part after `since`.
    pub fn usage(&self, account: &AccountId, since: u64, name: Option<&Name>) -> Result<Vec<Usage>, StoreError> {
        // Sums of integers are cast back to integers: PostgreSQL makes them `numeric`.
        let rows = self.query(
            "SELECT (SELECT s2.name FROM usage_samples s2 WHERE s2.box_id = s.box_id \
                     ORDER BY s2.at DESC, s2.rowid DESC LIMIT 1), \
                    CAST(SUM(cpu_ns) AS BIGINT), SUM(mem_byte_ms), CAST(SUM(running_ms) AS BIGINT), \
                    CAST(SUM(CASE WHEN suspended_ms > (at - ?2) * 1000 THEN (at - ?2) * 1000 \
                                  ELSE suspended_ms END) AS BIGINT), \
                    CAST(SUM(egress_sent) AS BIGINT), \
                    CAST(SUM(egress_received) AS BIGINT), SUM(stored_byte_ms) \
             FROM usage_samples s WHERE account = ?1 AND at >= ?2 GROUP BY box_id",
            &args![&account.0, since],
        )?;
        let mut out = Vec::new();
        for row in rows {
            let Ok(box_name) = Name::new(&row.get::<String>(0)?) else { continue };
            if name.is_some_and(|n| *n != box_name) {
                continue;
            }
            let (cpu, mem, running, suspended): (i64, f64, i64, i64) =
                (row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?);
            let (sent, received, stored): (i64, i64, f64) = (row.get(5)?, row.get(6)?, row.get(7)?);
            out.push(Usage {
                name: box_name,
                cpu_seconds: cpu as f64 / 1e9,
                memory_gib_seconds: mem / 1000.0 / f64::from(1u32 << 30),
                running_seconds: running as f64 / 1000.0,
                suspended_seconds: suspended as f64 / 1000.0,
                egress_sent_bytes: sent.max(0) as u64,
                egress_received_bytes: received.max(0) as u64,
                stored_gib_seconds: stored / 1000.0 / f64::from(1u32 << 30),
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Notes that box `id`'s CPU counter restarted from zero (it rebooted).
    pub fn reset_meter_cpu(&self, id: &BoxId) -> Result<(), StoreError> {
        self.execute("UPDATE meter_state SET last_cpu_ns = 0 WHERE box_id = ?1", &args![id.as_str()])?;
        Ok(())
    }

    /// Forgets the meter's last reading of a removed box (its samples stay).
    pub fn forget_meter(&self, id: &BoxId) -> Result<(), StoreError> {
        self.execute("DELETE FROM meter_state WHERE box_id = ?1", &args![id.as_str()])?;
        Ok(())
    }
}

/// A sample and the meter's state after it, in `tx`.
fn write_usage(
    tx: &mut dyn Exec,
    id: &BoxId,
    account: &AccountId,
    name: &Name,
    sample: &Sample,
    state: MeterState,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO usage_samples (at, box_id, account, name, cpu_ns, mem_byte_ms, running_ms, suspended_ms, \
         stored_byte_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        &args![
            sample.at_ms / 1000,
            id.as_str(),
            &account.0,
            name.as_str(),
            sample.cpu_ns,
            sample.mem_byte_ms,
            sample.running_ms,
            sample.suspended_ms,
            sample.stored_byte_ms
        ],
    )?;
    tx.execute(
        "INSERT INTO meter_state (box_id, last_cpu_ns, last_at_ms) VALUES (?1, ?2, ?3) \
         ON CONFLICT (box_id) DO UPDATE SET last_cpu_ns = ?2, last_at_ms = ?3",
        &args![id.as_str(), state.last_cpu_ns, state.last_at_ms],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(
        samples_add_up_per_box_and_survive_reopen,
        an_unsynced_commit_is_a_commit_and_later_ones_wait_for_the_disk
    );

    fn samples_add_up_per_box_and_survive_reopen(db: &TestDb) {
        let a = AccountId("a".into());
        let (web, data) = (Name::new("web").unwrap(), Name::new("db").unwrap());
        let (w, d) = (BoxId::random(), BoxId::random());
        {
            let store = db.open();
            let s = |at_ms, cpu_ns, running_ms, suspended_ms| Sample {
                at_ms,
                cpu_ns,
                mem_byte_ms: (1u64 << 30) as f64 * running_ms as f64,
                running_ms,
                suspended_ms,
                stored_byte_ms: (1u64 << 30) as f64 * 500.0,
            };
            let st = MeterState { last_cpu_ns: 0, last_at_ms: 0 };
            store.record_usage(&w, &a, &web, &s(1_000_000, 2_000_000_000, 10_000, 0), st).unwrap();
            store.record_usage(&w, &a, &web, &s(2_000_000, 1_000_000_000, 0, 5_000), st).unwrap();
            store.record_usage(&d, &a, &data, &s(3_000_000, 500_000_000, 1_000, 0), st).unwrap();
            store.record_usage(&d, &AccountId("b".into()), &data, &s(3_000_000, 9, 9, 9), st).unwrap();
        }
        let store = db.open();
        let all = store.usage(&a, 0, None).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].name, web);
        assert_eq!(all[1].cpu_seconds, 3.0);
        assert_eq!(all[1].running_seconds, 10.0);
        assert_eq!(all[1].suspended_seconds, 5.0);
        assert_eq!(all[1].memory_gib_seconds, 10.0);
        assert_eq!(all[1].stored_gib_seconds, 1.0, "half a second of a GiB in each of two samples");
        // --since drops older samples; a name filter keeps one box.
        let recent = store.usage(&a, 1_500, Some(&web)).unwrap();
        assert_eq!(recent.len(), 1);
        assert_eq!(recent[0].cpu_seconds, 1.0);
        assert_eq!(recent[0].suspended_seconds, 5.0);
        // A sample billing a whole suspension counts only its part since then.
        let last_two = store.usage(&a, 1_998, Some(&web)).unwrap();
        assert_eq!(last_two[0].suspended_seconds, 2.0);
    }

    fn an_unsynced_commit_is_a_commit_and_later_ones_wait_for_the_disk(db: &TestDb) {
        let store = db.open();
        let (a, web, w) = (AccountId("a".into()), Name::new("web").unwrap(), BoxId::random());
        let sample =
            Sample { at_ms: 5_000, cpu_ns: 0, mem_byte_ms: 0.0, running_ms: 7, suspended_ms: 0, stored_byte_ms: 0.0 };
        store.record_usage(&w, &a, &web, &sample, MeterState { last_cpu_ns: 3, last_at_ms: 5_000 }).unwrap();
        // Seen by another connection, as any commit.
        let other = db.open();
        assert_eq!(other.meter_state(&w).unwrap(), Some(MeterState { last_cpu_ns: 3, last_at_ms: 5_000 }));
        // A failed one leaves nothing behind, and the store as it was opened.
        let failed = store.transaction_unsynced(|tx| {
            tx.execute("DELETE FROM meter_state", &[])?;
            Err::<(), _>(StoreError::NoSlot)
        });
        assert!(failed.is_err());
        assert!(other.meter_state(&w).unwrap().is_some(), "rolled back");
        if let crate::store::sql::Db::Sqlite(conn) = &store.db {
            let conn = conn.lock().unwrap();
            let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
            assert_eq!(sync, 2, "FULL again after it");
        }
    }
}
