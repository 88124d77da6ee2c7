//! moat: a bound on what peers may have in flight to a server's channels.
//!
//! What a peer sends a channel whose reader has stopped waits in the
//! server's memory, up to the window the peer was given: 2 MiB a channel by
//! default, so one client's hundreds of channels to stalled programs could
//! hold gigabytes. A [`WindowBudget`] bounds the sum of the windows its
//! channels were given and have not yet been taken from them (what the
//! server may have to hold): a channel's window is given, at its open and
//! as its reader takes data, only out of what the budget (and its parent,
//! where it has one) has left. Every channel keeps a small floor, so none
//! stalls for good; past the budget a channel is only slower.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A bound on the window held by a set of channels (one account's, say),
/// inside an optional larger one (every account's).
#[derive(Debug)]
pub struct WindowBudget {
    limit: usize,
    held: AtomicUsize,
    parent: Option<Arc<WindowBudget>>,
}

impl WindowBudget {
    /// The least window a channel is always given, budget or not: one full
    /// packet (russh's default maximum), so every channel moves.
    pub const FLOOR: u32 = 32 * 1024;

    /// A budget of `limit` bytes, drawn also from `parent` when given.
    pub fn new(limit: usize, parent: Option<Arc<WindowBudget>>) -> Arc<Self> {
        Arc::new(Self { limit, held: AtomicUsize::new(0), parent })
    }

    /// The bytes of window its channels hold now (floors included).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Takes up to `want` bytes, and at least `floor` (over the limit if
    /// need be); what was taken.
    pub fn take(&self, want: usize, floor: usize) -> usize {
        let floor = floor.min(want);
        let mut taken = 0;
        let _ = self.held.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
            taken = self.limit.saturating_sub(held).min(want).max(floor);
            Some(held + taken)
        });
        if let Some(parent) = &self.parent {
            let granted = parent.take(taken, floor);
            self.held.fetch_sub(taken - granted, Ordering::SeqCst);
            taken = granted;
        }
        taken
    }

    /// Gives back `n` bytes taken.
    pub fn give(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::SeqCst);
        if let Some(parent) = &self.parent {
            parent.give(n);
        }
    }
}

/// What one channel holds of a budget: the window its peer may still use
/// plus what arrived and was not yet given back. Given back on drop (the
/// channel closed, or the connection ended).
#[derive(Debug, Default)]
pub(crate) struct Held {
    budget: Option<Arc<WindowBudget>>,
    bytes: usize,
}

impl Held {
    /// A channel's hold of `budget`, empty so far; no budget holds nothing
    /// back.
    pub(crate) fn of(budget: Option<&Arc<WindowBudget>>) -> Self {
        Self { budget: budget.cloned(), bytes: 0 }
    }

    /// Grows the hold towards `target` bytes in all (at least to the
    /// floor); the bytes added, which the channel may give as window.
    pub(crate) fn grow_to(&mut self, target: u32) -> u32 {
        let want = (target as usize).saturating_sub(self.bytes);
        let added = match &self.budget {
            None => want,
            Some(budget) => budget.take(want, (WindowBudget::FLOOR.min(target) as usize).saturating_sub(self.bytes)),
        };
        self.bytes += added;
        u32::try_from(added).unwrap_or(u32::MAX)
    }

    /// The reader took `n` bytes: they are no longer held.
    pub(crate) fn release(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        if let Some(budget) = &self.budget {
            budget.give(n);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.release(self.bytes);
    }
}
