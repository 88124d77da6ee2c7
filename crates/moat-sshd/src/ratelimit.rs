//! Rate limits for log lines that clients can trigger at will (a refused
//! forward, a rejected key): at most one line per interval per call site, with
//! a count of what was left out, so a flood cannot fill the operator's logs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// One call site's budget.
pub struct LogLimit {
    interval_ms: u64,
    next_ms: AtomicU64,
    dropped: AtomicU64,
}

impl LogLimit {
    /// At most one line every `interval_ms`.
    pub const fn every(interval_ms: u64) -> Self {
        Self { interval_ms, next_ms: AtomicU64::new(0), dropped: AtomicU64::new(0) }
    }

    /// `Some(lines left out since the last one)` if a line may be logged now.
    pub fn allow(&self) -> Option<u64> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self.next_ms.compare_exchange(next, now + self.interval_ms, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            return Some(self.dropped.swap(0, Ordering::Relaxed));
        }
        self.dropped.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_a_count_of_the_rest() {
        let limit = LogLimit::every(60_000);
        assert_eq!(limit.allow(), Some(0));
        for _ in 0..5 {
            assert_eq!(limit.allow(), None);
        }
        limit.next_ms.store(0, Ordering::Relaxed);
        assert_eq!(limit.allow(), Some(5));
    }
}
