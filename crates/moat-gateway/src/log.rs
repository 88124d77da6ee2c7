//! The gateway's log: every connection, request and query of a box becomes an
//! entry sent to the privileged side, which stores it and bills from it. The
//! way there is bounded, so that a flooding box loses its own entries rather
//! than stalling its traffic or the gateway's memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
}

impl Logger {
    /// Entries of box `box_id`, into `sink`.
    pub fn new(box_id: BoxId, sink: LogSink) -> Self {
        Self { box_id, sink, lost: Arc::default() }
    }

    /// Records an entry; a full backlog loses it.
    pub fn log(&self, entry: LogEntry) {
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

/// An entry with the fields every kind has.
pub fn entry(kind: LogKind, name: impl Into<String>, port: u16, verdict: LogVerdict) -> LogEntry {
    LogEntry {
        at_ms: now_ms(),
        kind,
        name: name.into(),
        port,
        method: None,
        target: None,
        verdict,
        rule: None,
        reason: None,
        sent: 0,
        received: 0,
        secret: None,
        tokens: None,
        status: None,
        opaque: false,
        package: None,
    }
}
