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
//! stalls for good; past the budget a channel is only slower. Requests
//! waiting for a reader (no window bounds them) are charged to it too.

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
///
/// Under a budget a channel starts with a window of [`Self::START`], which
/// doubles whenever its reader takes data after the peer used over half of
/// it, up to the most the server gives: an idle channel (a forward no one
/// uses, a shell's keystrokes) holds little of the budget, one carrying an
/// upload soon holds its most.
#[derive(Debug, Default)]
pub struct WindowHold {
    budget: Option<Arc<WindowBudget>>,
    bytes: usize,
    goal: u32,
    /// Bytes of requests waiting for the channel's reader.
    requests: usize,
}

impl WindowHold {
    /// The window a channel starts with under a budget: two packets.
    pub const START: u32 = 64 * 1024;

    /// Bytes of requests (not data) a channel may have waiting for its
    /// reader beside its budget; more come out of the budget, or are refused.
    pub const FREE_REQUESTS: usize = 64 * 1024;

    /// A channel's hold of `budget`, empty so far; no budget holds nothing
    /// back (and starts a channel at its most).
    pub fn of(budget: Option<&Arc<WindowBudget>>) -> Self {
        Self { budget: budget.cloned(), bytes: 0, goal: 0, requests: 0 }
    }

    /// The window a new channel is given, `most` at most.
    pub fn open(&mut self, most: u32) -> u32 {
        self.goal = if self.budget.is_some() { Self::START.min(most) } else { most };
        self.grow_to(self.goal)
    }

    /// The channel's reader took `took` bytes, and the peer has used over
    /// half its window: the bytes are no longer held, and the channel grows.
    /// The window to give back, keeping window and what is not yet taken
    /// within `most`.
    pub fn took(&mut self, took: usize, most: u32) -> u32 {
        self.release(took);
        if took > 0 {
            self.goal = self.goal.saturating_mul(2);
        }
        self.goal = self.goal.clamp(Self::START.min(most), most);
        self.grow_to(self.goal)
    }

    /// A request of `n` bytes waits for the reader: whether there is room
    /// for it (beyond [`Self::FREE_REQUESTS`], in the budget).
    pub fn charge(&mut self, n: usize) -> bool {
        let over = Self::over_free(self.requests + n) - Self::over_free(self.requests);
        if let (Some(budget), true) = (&self.budget, over > 0) {
            let taken = budget.take(over, 0);
            if taken < over {
                budget.give(taken);
                return false;
            }
        }
        self.requests += n;
        true
    }

    /// The reader took `n` bytes of requests.
    pub fn discharge(&mut self, n: usize) {
        let n = n.min(self.requests);
        let over = Self::over_free(self.requests) - Self::over_free(self.requests - n);
        self.requests -= n;
        if let (Some(budget), true) = (&self.budget, over > 0) {
            budget.give(over);
        }
    }

    fn over_free(requests: usize) -> usize {
        requests.saturating_sub(Self::FREE_REQUESTS)
    }

    /// The window and untaken data the channel grows towards now.
    pub fn goal(&self) -> u32 {
        self.goal
    }

    /// Grows the hold towards `target` bytes in all (at least to the
    /// floor); the bytes added, which the channel may give as window.
    fn grow_to(&mut self, target: u32) -> u32 {
        let want = (target as usize).saturating_sub(self.bytes);
        let added = match &self.budget {
            None => want,
            Some(budget) => budget.take(want, (WindowBudget::FLOOR.min(target) as usize).saturating_sub(self.bytes)),
        };
        self.bytes += added;
        u32::try_from(added).unwrap_or(u32::MAX)
    }

    fn release(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        if let Some(budget) = &self.budget {
            budget.give(n);
        }
    }
}

impl Drop for WindowHold {
    fn drop(&mut self) {
        self.release(self.bytes);
        self.discharge(self.requests);
    }
}
