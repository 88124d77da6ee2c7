//! The meter: samples each box's host-side counters into the ledger, on a
//! timer and at every state change, so that each interval is billed to the
//! state it was spent in. Also parks boxes suspended for too long.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{BoxManager, ManagerError};
use crate::backend::MeterReading;
use crate::clock;
use crate::ids::{AccountId, Name};
use crate::record::{BoxRecord, BoxState};
use crate::store::ledger::{MeterState, Sample, Usage};

/// `usage`: per box, and the account's total.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageReport {
    /// One entry per box, removed boxes included.
    pub boxes: Vec<BoxUsage>,
    /// The sum over `boxes`.
    pub total: Usage,
    /// Bytes the account's boxes hold on disk together, including what
    /// removed boxes left shared with their copies (where the backend can tell).
    #[serde(default)]
    pub disk_bytes: Option<u64>,
    /// What each secret was used for, per box (all time).
    #[serde(default)]
    pub secrets: Vec<SecretUsage>,
}

/// One box's use of one secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretUsage {
    /// The secret.
    pub secret: String,
    /// The box.
    pub box_name: String,
    /// What for.
    #[serde(flatten)]
    pub used: crate::secrets::SecretUse,
}

/// One box's usage, with its current disk use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoxUsage {
    /// Counters over the period.
    #[serde(flatten)]
    pub usage: Usage,
    /// Bytes written beyond the image now (`None` for a removed box).
    pub disk_bytes: Option<u64>,
}

/// Boxes sampled in one commit by the periodic meter pass: few enough that
/// a resume meeting one of them held waits only a few milliseconds.
pub(super) const METER_BATCH: usize = 64;

impl BoxManager {
    /// Bills the time since the box's last sample to the state it is in now.
    pub(super) async fn meter_box(&self, rec: &BoxRecord) -> Result<(), ManagerError> {
        let now_ms = clock::now_ms();
        let r = rec.clone();
        let reading = self.blocking(move |b| b.meter(&r)).await?;
        let (sample, state) = self.sample(rec, reading, now_ms)?;
        self.db(|s| s.record_usage(&rec.id, &rec.account, &rec.name, &sample, state))?;
        Ok(())
    }

    /// The sample billing the time from box `rec`'s last sample to `now_ms`
    /// to the state it is in, its counters being `reading`; and the meter's
    /// state after it. Nothing is written.
    pub(super) fn sample(
        &self,
        rec: &BoxRecord,
        reading: Option<MeterReading>,
        now_ms: u64,
    ) -> Result<(Sample, MeterState), ManagerError> {
        let last = self
            .store
            .meter_state(&rec.id)?
            .unwrap_or(MeterState { last_cpu_ns: 0, last_at_ms: rec.created_at * 1000 });
        let dt = now_ms.saturating_sub(last.last_at_ms);
        let cpu_now = reading.map(|r| r.cpu_ns);
        let cpu = match cpu_now {
            Some(c) if c >= last.last_cpu_ns => c - last.last_cpu_ns,
            // A smaller counter is a new cgroup: the box rebooted since.
            Some(c) => c,
            None => 0,
        };
        // What it keeps in the object store costs whatever its state.
        let stored = if self.durable.get().is_some() { self.db(|s| s.durable_bytes(&rec.id))? } else { 0 };
        let mut sample = Sample {
            at_ms: now_ms,
            cpu_ns: cpu,
            mem_byte_ms: 0.0,
            running_ms: 0,
            suspended_ms: 0,
            stored_byte_ms: stored as f64 * dt as f64,
        };
        match rec.state {
            BoxState::Running => {
                sample.running_ms = dt;
                sample.mem_byte_ms = reading.map_or(0.0, |r| r.memory_bytes as f64 * dt as f64);
            }
            BoxState::Suspended => sample.suspended_ms = dt,
            BoxState::Stopped | BoxState::Creating => {}
        }
        Ok((sample, MeterState { last_cpu_ns: cpu_now.unwrap_or(0), last_at_ms: now_ms }))
    }

    /// Samples every running box, and parks boxes suspended past the
    /// operator's limit. A box that fails is logged and skipped; the others
    /// are still served.
    ///
    /// A suspended or stopped box is not sampled (unless what it keeps in the
    /// object store is billed, which can change while it sleeps): its
    /// counters do not move, and its interval is billed whole by its next
    /// sample (its resume, its stop, a `usage` question), which `usage
    /// --since` counts pro rata. Sampled every pass, 10,000 suspended boxes
    /// wrote 1.2 million ledger rows an hour saying nothing.
    ///
    /// Boxes are sampled [`METER_BATCH`] at a time: their counters in one trip
    /// to the blocking pool and their samples in one commit, where a commit
    /// each kept the store's one writer busy for seconds of every pass on a
    /// host of thousands of boxes (and a resume waited behind it). A box is
    /// held from its sample to the commit, so that a resume or stop in between
    /// cannot bill the same interval again; a box busy with something else is
    /// left to the next pass (its interval only grows).
    pub async fn meter_all(self: &Arc<Self>) -> Result<(), ManagerError> {
        let boxes = self.db(crate::store::Store::list_here)?;
        let stored = self.durable.get().is_some();
        let due = |r: &&BoxRecord| r.state == BoxState::Running || (stored && r.state != BoxState::Creating);
        let sampled: Vec<&BoxRecord> = boxes.iter().filter(due).collect();
        for batch in sampled.chunks(METER_BATCH) {
            if let Err(e) = self.meter_batch(batch).await {
                tracing::warn!(error = %e, boxes = batch.len(), "meter pass failed for a batch of boxes");
            }
        }
        let park = |rec: &&BoxRecord| {
            self.config.park_after.is_some_and(|limit| {
                rec.state == BoxState::Suspended && clock::now().saturating_sub(rec.state_since) >= limit.as_secs()
            })
        };
        for rec in boxes.iter().filter(park) {
            if let Err(e) = self.park_if_still_suspended(rec).await {
                tracing::warn!(box_id = %rec.id, name = %rec.name, error = %e, "could not park a box");
            }
        }
        Ok(())
    }

    /// Samples `batch` (as listed) in one commit.
    async fn meter_batch(&self, batch: &[&BoxRecord]) -> Result<(), ManagerError> {
        let now_ms = clock::now_ms();
        let mut held = Vec::with_capacity(batch.len());
        let mut boxes = Vec::with_capacity(batch.len());
        for listed in batch {
            let Ok(guard) = self.lock_for(&listed.id).try_lock_owned() else { continue };
            // Re-read under the lock; it may have changed or gone.
            if let Some(rec) = self.db(|s| s.get_by_id(&listed.id))?.filter(|r| r.state != BoxState::Creating) {
                held.push(guard);
                boxes.push(rec);
            }
        }
        let recs = boxes.clone();
        let readings = self.blocking(move |b| recs.iter().map(|r| b.meter(r)).collect::<Vec<_>>()).await?;
        let mut samples = Vec::with_capacity(boxes.len());
        for (rec, reading) in boxes.into_iter().zip(readings) {
            // One box that cannot be sampled must not hold the others' back.
            match self.sample(&rec, reading, now_ms) {
                Ok((sample, state)) => samples.push((rec, sample, state)),
                Err(e) => tracing::warn!(box_id = %rec.id, name = %rec.name, error = %e, "cannot sample a box"),
            }
        }
        self.db(|s| s.record_usages(&samples))?;
        drop(held);
        Ok(())
    }

    /// Parks `listed` if it is still suspended (memory released).
    async fn park_if_still_suspended(&self, listed: &BoxRecord) -> Result<(), ManagerError> {
        let lock = self.lock_for(&listed.id);
        let _guard = lock.lock().await;
        let Some(rec) = self.db(|s| s.get_by_id(&listed.id))? else { return Ok(()) };
        if rec.state != BoxState::Suspended || rec.state_since != listed.state_since {
            return Ok(());
        }
        tracing::info!(box_id = %rec.id, name = %rec.name, "parking a long-suspended box (memory released)");
        self.stop_locked(&rec, true).await
    }

    /// Runs the meter every `meter_interval` until the process ends.
    pub fn spawn_meter(self: &Arc<Self>) {
        let manager = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(manager.config.meter_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = manager.meter_all().await {
                    tracing::warn!(error = %e, "meter pass failed");
                }
            }
        });
    }

    /// The account's usage since `since` (seconds since the epoch), for one
    /// box or all. Counters are brought up to date first.
    pub async fn usage(
        self: &Arc<Self>,
        account: &AccountId,
        since: u64,
        name: Option<&Name>,
    ) -> Result<UsageReport, ManagerError> {
        let live = self.list(account)?;
        if let Some(name) = name {
            // Only live boxes are named; a removed box's history is in `usage`.
            self.get(account, name)?;
        }
        for rec in live.iter().filter(|r| name.is_none_or(|n| *n == r.name)) {
            let lock = self.lock_for(&rec.id);
            let _guard = lock.lock().await;
            if let Some(rec) = self.db(|s| s.get_by_id(&rec.id))? {
                self.meter_box(&rec).await?;
            }
        }
        let mut boxes = Vec::new();
        let mut total = Usage {
            name: Name::new("total").map_err(|_| ManagerError::NameTooLong("total".into()))?,
            cpu_seconds: 0.0,
            memory_gib_seconds: 0.0,
            running_seconds: 0.0,
            suspended_seconds: 0.0,
            egress_sent_bytes: 0,
            egress_received_bytes: 0,
            stored_gib_seconds: 0.0,
        };
        for usage in self.db(|s| s.usage(account, since, name))? {
            let rec = live.iter().find(|r| r.name == usage.name).cloned();
            let disk_bytes = match rec {
                Some(r) => self.blocking(move |b| b.disk_usage(&r)).await?,
                None => None,
            };
            total.cpu_seconds += usage.cpu_seconds;
            total.memory_gib_seconds += usage.memory_gib_seconds;
            total.running_seconds += usage.running_seconds;
            total.suspended_seconds += usage.suspended_seconds;
            total.egress_sent_bytes += usage.egress_sent_bytes;
            total.egress_received_bytes += usage.egress_received_bytes;
            total.stored_gib_seconds += usage.stored_gib_seconds;
            boxes.push(BoxUsage { usage, disk_bytes });
        }
        let owner = account.clone();
        let disk_bytes = self.blocking(move |b| b.account_disk_usage(&owner)).await?;
        let mut secrets = Vec::new();
        for secret in self.db(|s| s.secrets(account))? {
            for (_, box_name, used) in self.db(|s| s.secret_uses(secret.id))? {
                if name.is_none_or(|n| n.as_str() == box_name) {
                    secrets.push(SecretUsage { secret: secret.spec.name.to_string(), box_name, used });
                }
            }
        }
        Ok(UsageReport { boxes, total, disk_bytes, secrets })
    }
}
