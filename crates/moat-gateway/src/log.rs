//! The gateway's log: every connection, request and query of a box becomes an
//! entry sent to the privileged side, which stores it and bills from it. The
//! way there is bounded and shared, so what a box can make without limit
//! (queries, refused attempts) is logged at most [`RATE`] a second after a
//! burst of [`BURST`], and the rest counted in one entry: a flooding box loses
//! its own entries, never another box's, nor its own connections' (which
//! carry bytes and effects, and wait their turn).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use moat_core::clock::now_ms;
use moat_core::egress::{LogEntry, LogKind, LogVerdict};
use moat_core::BoxId;
use tokio::sync::mpsc;

/// Where log entries go: (box id, entry). Bounded; when it is full the entry
/// is counted as lost rather than stalling the box's traffic.
pub type LogSink = mpsc::Sender<(BoxId, LogEntry)>;

/// Records one box's log entries; cloned into tasks that outlive a borrow of
/// its [`BoxNet`](crate::boxnet::BoxNet).
#[derive(Clone)]
pub struct Logger {
    /// The box's host-side id.
    pub box_id: BoxId,
    sink: LogSink,
    /// Entries lost to a full backlog.
    lost: Arc<AtomicU64>,
    /// What the box may still log of what it can make without limit.
    bucket: Arc<Mutex<Bucket>>,
}

/// Entries a second a box may log of queries and refusals, after [`BURST`].
pub const RATE: f64 = 100.0;
/// Entries a box may log at once before [`RATE`] holds.
pub const BURST: f64 = 1000.0;

/// A token bucket, and what it held back.
struct Bucket {
    tokens: f64,
    at: Instant,
    skipped: u64,
}

impl Bucket {
    /// Takes a token (after refilling for the time passed), if one is left.
    fn take(&mut self, now: Instant) -> bool {
        self.tokens = (self.tokens + now.saturating_duration_since(self.at).as_secs_f64() * RATE).min(BURST);
        self.at = now;
        let left = self.tokens >= 1.0;
        if left {
            self.tokens -= 1.0;
        }
        left
    }
}

impl Logger {
    /// Entries of box `box_id`, into `sink`.
    pub fn new(box_id: BoxId, sink: LogSink) -> Self {
        let bucket = Bucket { tokens: BURST, at: Instant::now(), skipped: 0 };
        Self { box_id, sink, lost: Arc::default(), bucket: Arc::new(Mutex::new(bucket)) }
    }

    /// Records an entry: an allowed connection or request surely; a query
    /// or a refusal within the box's rate, else counted (and said in the next
    /// entry that passes); a full backlog loses it.
    pub fn log(&self, entry: LogEntry) {
        if entry.verdict == LogVerdict::Allow && entry.kind != LogKind::Dns {
            return self.log_surely(entry);
        }
        let skipped = {
            let mut bucket = self.bucket.lock().unwrap_or_else(PoisonError::into_inner);
            if !bucket.take(Instant::now()) {
                bucket.skipped += 1;
                return;
            }
            std::mem::take(&mut bucket.skipped)
        };
        if skipped > 0 {
            let mut note = crate::log::entry(entry.kind, String::new(), 0, LogVerdict::Deny);
            note.reason =
                Some(format!("{skipped} queries and refusals of this box not logged: more than {RATE} a second"));
            self.send(note);
        }
        self.send(entry);
    }

    /// Sends an entry; a full backlog loses it.
    fn send(&self, entry: LogEntry) {
        if self.sink.try_send((self.box_id.clone(), entry)).is_err() {
            // Said once per thousand, or a flooding box would flood our log too.
            let lost = self.lost.fetch_add(1, Ordering::Relaxed);
            if lost.is_multiple_of(1000) {
                tracing::warn!(box_id = %self.box_id, lost = lost + 1, "egress log backlog full; entries lost");
            }
        }
    }

    /// Records an entry that bills something (a secret's use): with the
    /// backlog full, it waits its turn rather than be lost.
    pub fn log_surely(&self, entry: LogEntry) {
        if let Err(mpsc::error::TrySendError::Full(entry)) = self.sink.try_send((self.box_id.clone(), entry)) {
            let sink = self.sink.clone();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = sink.send(entry).await;
                });
            }
        }
    }
}

/// An entry, now, with the fields every kind has.
pub fn entry(kind: LogKind, name: impl Into<String>, port: u16, verdict: LogVerdict) -> LogEntry {
    LogEntry::new(now_ms(), kind, name, port, verdict)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_flood_of_queries_is_counted_and_connections_always_logged() {
        let (sink, mut rx) = mpsc::channel(1 << 14);
        let logger = Logger::new(BoxId::parse("b1").unwrap(), sink);
        for _ in 0..3000 {
            logger.log(entry(LogKind::Dns, "x.test", 53, LogVerdict::Deny));
        }
        // The box's allowed connection carries its bytes: never held back.
        let mut conn = entry(LogKind::Tcp, "web.test", 443, LogVerdict::Allow);
        conn.sent = 7;
        logger.log(conn);
        let mut got = Vec::new();
        while let Ok((_, e)) = rx.try_recv() {
            got.push(e);
        }
        assert!((1000..1010).contains(&got.len()), "{}", got.len());
        assert_eq!(got.last().unwrap().sent, 7);
        // Once tokens come back, the next query says how many were not logged.
        std::thread::sleep(std::time::Duration::from_millis(50));
        logger.log(entry(LogKind::Dns, "y.test", 53, LogVerdict::Allow));
        let (_, note) = rx.try_recv().unwrap();
        let reason = note.reason.unwrap();
        let skipped: usize = reason.split(' ').next().unwrap().parse().unwrap();
        assert_eq!(skipped + got.len() - 1, 3000, "{reason}");
        assert!(reason.ends_with("queries and refusals of this box not logged: more than 100 a second"), "{reason}");
        assert_eq!(rx.try_recv().unwrap().1.name, "y.test");
    }
}
