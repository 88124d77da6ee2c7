//! Spares made ahead, a few per key, refilled by one batch at a time per
//! key: a burst of creates that each take a spare starts one refill, not
//! one each. (One each made a spare per create, all but one thrown away,
//! and their kernel work, a cgroup join or a btrfs commit each, slowed the
//! creates in flight.) A batch's spares are made at once, so that the
//! kernel work they wait on is shared: concurrent btrfs snapshots go in one
//! transaction commit, concurrent cgroup joins wait out one RCU grace
//! period. And a batch waits for a quiet moment, no spare taken for
//! [`QUIET`] (or [`MOST_WAIT`] at most, so that steady demand still gets
//! spares): made during a burst, its kernel work would hold up the creates
//! in flight (a btrfs commit stalls every rename of a spare root meanwhile).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How long no spare of a key is taken before its refill starts.
pub const QUIET: Duration = Duration::from_millis(100);

/// How long a refill waits for quiet at most.
pub const MOST_WAIT: Duration = Duration::from_secs(1);

type Discard<T> = Arc<dyn Fn(T) + Send + Sync>;

/// The spares of one kind, by key.
pub struct Stock<K, T> {
    shared: Arc<Mutex<Shared<K, T>>>,
    /// How a spare no longer wanted is undone.
    discard: Discard<T>,
    /// How many spares of a key a refill makes ready.
    depth: usize,
    /// How long no spare is taken before a refill starts.
    quiet: Duration,
}

struct Shared<K, T> {
    slots: HashMap<K, Slot<T>>,
    /// No spare is made or kept any more: what a batch makes is discarded.
    closed: bool,
}

struct Slot<T> {
    ready: Vec<T>,
    making: bool,
    /// The batch being made was forgotten: what it makes is discarded.
    forgotten: bool,
    last_taken: Option<Instant>,
}

impl<T> Slot<T> {
    fn empty() -> Self {
        Self { ready: Vec::new(), making: false, forgotten: false, last_taken: None }
    }
}

impl<K: Hash + Eq + Clone + Send + 'static, T: Send + 'static> Stock<K, T> {
    /// A stock refilled up to `depth` spares a key; a spare not wanted any
    /// more is given to `discard`.
    pub fn new(depth: usize, discard: impl Fn(T) + Send + Sync + 'static) -> Self {
        let shared = Shared { slots: HashMap::new(), closed: false };
        Self { shared: Arc::new(Mutex::new(shared)), discard: Arc::new(discard), depth: depth.max(1), quiet: QUIET }
    }

    fn lock(shared: &Mutex<Shared<K, T>>) -> MutexGuard<'_, Shared<K, T>> {
        shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A spare of `key`, if one is ready.
    pub fn take(&self, key: &K) -> Option<T> {
        let mut shared = Self::lock(&self.shared);
        let slot = shared.slots.entry(key.clone()).or_insert_with(Slot::empty);
        slot.last_taken = Some(Instant::now());
        slot.ready.pop()
    }

    /// Makes spares of `key` with `make`, once none has been taken for
    /// [`QUIET`], all at once on threads of their own, until `depth` are
    /// ready; unless that many are, or a batch is waiting or being made.
    pub fn refill(&self, key: K, make: impl Fn() -> Option<T> + Send + Sync + 'static) {
        {
            let mut shared = Self::lock(&self.shared);
            if shared.closed {
                return;
            }
            let slot = shared.slots.entry(key.clone()).or_insert_with(Slot::empty);
            if slot.making || slot.ready.len() >= self.depth {
                return;
            }
            slot.making = true;
        }
        let (shared, discard, depth, quiet) =
            (Arc::clone(&self.shared), Arc::clone(&self.discard), self.depth, self.quiet);
        let key_again = key.clone();
        let batch = move || {
            let asked = Instant::now();
            let missing = loop {
                let (last_taken, ready) = {
                    let shared = Self::lock(&shared);
                    let slot = shared.slots.get(&key);
                    (slot.and_then(|s| s.last_taken), slot.map_or(0, |s| s.ready.len()))
                };
                let wait = last_taken.map_or(Duration::ZERO, |t| quiet.saturating_sub(t.elapsed()));
                if wait.is_zero() || asked.elapsed() >= MOST_WAIT {
                    break depth.saturating_sub(ready);
                }
                std::thread::sleep(wait.min(MOST_WAIT.saturating_sub(asked.elapsed())));
            };
            let made: Vec<T> = std::thread::scope(|s| {
                let batch: Vec<_> =
                    (0..missing).filter_map(|_| std::thread::Builder::new().spawn_scoped(s, &make).ok()).collect();
                batch.into_iter().filter_map(|spare| spare.join().ok().flatten()).collect()
            });
            let mut shared = Self::lock(&shared);
            let closed = shared.closed;
            let slot = shared.slots.entry(key).or_insert_with(Slot::empty);
            slot.making = false;
            let forgotten = std::mem::take(&mut slot.forgotten);
            if closed || forgotten {
                drop(shared);
                made.into_iter().for_each(|spare| discard(spare));
            } else {
                slot.ready.extend(made);
            }
        };
        // Without a thread, no batch: the next refill may try again.
        if std::thread::Builder::new().spawn(batch).is_err() {
            if let Some(slot) = Self::lock(&self.shared).slots.get_mut(&key_again) {
                slot.making = false;
            }
        }
    }

    /// How many spares of `key` are ready.
    #[cfg(test)]
    fn ready(&self, key: &K) -> usize {
        Self::lock(&self.shared).slots.get(key).map_or(0, |slot| slot.ready.len())
    }

    /// Discards every spare of `key` (made of something that changed or
    /// went since): those ready now, and those a batch being made makes.
    pub fn forget(&self, key: &K) {
        let stale = Self::lock(&self.shared).slots.get_mut(key).map(|slot| {
            slot.forgotten = slot.making;
            std::mem::take(&mut slot.ready)
        });
        stale.into_iter().flatten().for_each(|spare| (self.discard)(spare));
    }

    /// Discards every spare ready, and from now on every spare a batch
    /// still being made makes; no refill starts again.
    pub fn close(&self) {
        let ready: Vec<T> = {
            let mut shared = Self::lock(&self.shared);
            shared.closed = true;
            shared.slots.values_mut().flat_map(|slot| std::mem::take(&mut slot.ready)).collect()
        };
        ready.into_iter().for_each(|spare| (self.discard)(spare));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::*;

    /// Waits for `n` spares of `key` to be ready (a take would put off
    /// the refill), then takes them.
    fn wait_for(stock: &Stock<u8, usize>, key: u8, n: usize) -> Vec<usize> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while stock.ready(&key) < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut taken: Vec<usize> = (0..n).filter_map(|_| stock.take(&key)).collect();
        taken.sort_unstable();
        taken
    }

    #[test]
    fn a_burst_of_refills_makes_one_batch() {
        let stock: Stock<u8, usize> = Stock::new(3, drop);
        let made = Arc::new(AtomicUsize::new(0));
        let (gate, opened) = std::sync::mpsc::channel::<()>();
        let opened = Arc::new(Mutex::new(opened));
        for _ in 0..20 {
            let (made, opened) = (Arc::clone(&made), Arc::clone(&opened));
            stock.refill(1, move || {
                let _ = opened.lock().unwrap_or_else(PoisonError::into_inner).recv();
                Some(made.fetch_add(1, Ordering::SeqCst))
            });
        }
        assert_eq!(stock.take(&1), None, "nothing is ready while it is being made");
        for _ in 0..3 {
            gate.send(()).unwrap_or_default();
        }
        assert_eq!(wait_for(&stock, 1, 3), [0, 1, 2]);
        assert_eq!(made.load(Ordering::SeqCst), 3, "one batch of three was made for twenty refills");
        assert_eq!(stock.take(&1), None);
    }

    #[test]
    fn a_failed_make_can_be_made_again() {
        let stock: Stock<u8, usize> = Stock::new(1, drop);
        stock.refill(1, || None);
        // Once the failed make has ended, a refill is accepted again.
        let deadline = Instant::now() + Duration::from_secs(5);
        while stock.ready(&1) == 0 && Instant::now() < deadline {
            stock.refill(1, || Some(1));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(stock.take(&1), Some(1));
    }

    #[test]
    fn keys_are_apart_and_forgotten_or_closed_spares_are_discarded() {
        let discarded = Arc::new(Mutex::new(Vec::new()));
        let d = Arc::clone(&discarded);
        let stock: Stock<u8, usize> =
            Stock::new(2, move |spare| d.lock().unwrap_or_else(PoisonError::into_inner).push(spare));
        let discarded = || discarded.lock().unwrap_or_else(PoisonError::into_inner).clone();
        stock.refill(2, || Some(2));
        stock.refill(3, || Some(3));
        stock.refill(4, || Some(4));
        assert_eq!(wait_for(&stock, 2, 2), [2, 2]);
        assert_eq!(stock.take(&2), None, "a spare is taken once");
        let deadline = Instant::now() + Duration::from_secs(5);
        while (stock.ready(&3) < 2 || stock.ready(&4) < 2) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        stock.forget(&3);
        assert_eq!(discarded(), [3, 3]);
        assert_eq!(stock.take(&3), None);
        // A batch of `key` whose two spares are made once the gate it gives
        // back is opened.
        let gated_refill = |key: u8| {
            let (gate, opened) = std::sync::mpsc::channel::<()>();
            let opened = Mutex::new(opened);
            let make = move || opened.lock().unwrap_or_else(PoisonError::into_inner).recv().ok().map(|()| key.into());
            stock.refill(key, make);
            move || {
                gate.send(()).unwrap_or_default();
                gate.send(()).unwrap_or_default();
            }
        };
        let wait_discarded = |n: usize| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while discarded().len() < n && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        // A batch still being made when its key is forgotten is discarded
        // when done; the next batch of it is kept.
        let open = gated_refill(7);
        stock.forget(&7);
        open();
        wait_discarded(4);
        assert_eq!(discarded(), [3, 3, 7, 7]);
        assert_eq!(stock.ready(&7), 0, "a forgotten batch's spares were kept");
        stock.refill(7, || Some(8));
        assert_eq!(wait_for(&stock, 7, 2), [8, 8]);
        // A batch still being made when the stock closes is discarded when done.
        let open = gated_refill(5);
        stock.close();
        assert_eq!(discarded(), [3, 3, 7, 7, 4, 4]);
        open();
        wait_discarded(8);
        assert_eq!(discarded(), [3, 3, 7, 7, 4, 4, 5, 5]);
        assert_eq!(stock.take(&5), None, "a closed stock keeps nothing");
        stock.refill(6, || Some(6));
        std::thread::sleep(QUIET * 2);
        assert_eq!(stock.take(&6), None, "a closed stock makes nothing");
    }

    #[test]
    fn steady_takes_put_a_refill_off_for_a_second_at_most() {
        let stock: Stock<u8, usize> = Stock::new(1, drop);
        let started = Instant::now();
        stock.refill(1, move || usize::try_from(started.elapsed().as_millis()).ok());
        let mut made = None;
        while made.is_none() && started.elapsed() < Duration::from_secs(5) {
            made = stock.take(&1);
            std::thread::sleep(Duration::from_millis(10));
        }
        let made = made.expect("a spare made under steady takes");
        assert!(made as u128 >= MOST_WAIT.as_millis() - 5, "made after {made} ms");
    }

    #[test]
    fn a_refill_waits_for_takes_to_stop() {
        // Quiet for long, so that a slow test machine's pause is no gap.
        let stock: Stock<u8, usize> = Stock { quiet: Duration::from_millis(500), ..Stock::new(2, drop) };
        let started = Instant::now();
        // Takes every 10 ms for 300 ms: the refill asked for at the first
        // starts only once they stop.
        assert_eq!(stock.take(&1), None);
        stock.refill(1, move || usize::try_from(started.elapsed().as_millis()).ok());
        let mut last_take = 0;
        while started.elapsed() < Duration::from_millis(300) {
            last_take = started.elapsed().as_millis();
            assert_eq!(stock.take(&1), None, "made during the takes");
            std::thread::sleep(Duration::from_millis(10));
        }
        let made = wait_for(&stock, 1, 2);
        assert_eq!(made.len(), 2);
        assert!(made.iter().all(|ms| *ms as u128 >= last_take + 500), "{made:?} after {last_take}");
    }
}
