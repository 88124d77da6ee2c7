//! Spares made ahead, a few per key, refilled by one batch at a time per
//! key: a burst of creates that each take a spare starts one refill, not
//! one each. (One each made a spare per create, all but one thrown away,
//! and their kernel work, a cgroup join or a btrfs commit each, slowed the
//! creates in flight.) A batch's spares are made at once, so that the
//! kernel work they wait on is shared: concurrent btrfs snapshots go in one
//! transaction commit, concurrent cgroup joins wait out one RCU grace
//! period. And a batch waits for a quiet moment, no spare taken for
//! [`QUIET`]: made during a burst, its kernel work would hold up the
//! creates in flight (a btrfs commit stalls every rename of a spare root
//! meanwhile).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How long no spare of a key is taken before its refill starts.
pub const QUIET: Duration = Duration::from_millis(100);

/// The spares of one kind, by key.
pub struct Stock<K, T> {
    slots: Arc<Mutex<HashMap<K, Slot<T>>>>,
    /// How many spares of a key a refill makes ready.
    depth: usize,
    /// How long no spare is taken before a refill starts.
    quiet: Duration,
}

struct Slot<T> {
    ready: Vec<T>,
    making: bool,
    last_taken: Option<Instant>,
}

impl<T> Slot<T> {
    fn empty() -> Self {
        Self { ready: Vec::new(), making: false, last_taken: None }
    }
}

impl<K: Hash + Eq + Clone + Send + 'static, T: Send + 'static> Stock<K, T> {
    /// A stock refilled up to `depth` spares a key.
    pub fn new(depth: usize) -> Self {
        Self { slots: Arc::default(), depth: depth.max(1), quiet: QUIET }
    }

    fn slots(slots: &Mutex<HashMap<K, Slot<T>>>) -> MutexGuard<'_, HashMap<K, Slot<T>>> {
        slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A spare of `key`, if one is ready.
    pub fn take(&self, key: &K) -> Option<T> {
        let mut slots = Self::slots(&self.slots);
        let slot = slots.entry(key.clone()).or_insert_with(Slot::empty);
        slot.last_taken = Some(Instant::now());
        slot.ready.pop()
    }

    /// Makes spares of `key` with `make`, once none has been taken for
    /// [`QUIET`], all at once on threads of their own, until `depth` are
    /// ready; unless that many are, or a batch is waiting or being made.
    pub fn refill(&self, key: K, make: impl Fn() -> Option<T> + Send + Sync + 'static) {
        {
            let mut slots = Self::slots(&self.slots);
            let slot = slots.entry(key.clone()).or_insert_with(Slot::empty);
            if slot.making || slot.ready.len() >= self.depth {
                return;
            }
            slot.making = true;
        }
        let (slots, depth, quiet) = (Arc::clone(&self.slots), self.depth, self.quiet);
        std::thread::spawn(move || {
            let missing = loop {
                let (last_taken, ready) = {
                    let slots = Self::slots(&slots);
                    let slot = slots.get(&key);
                    (slot.and_then(|s| s.last_taken), slot.map_or(0, |s| s.ready.len()))
                };
                match last_taken.map(|t| quiet.saturating_sub(t.elapsed())) {
                    Some(wait) if !wait.is_zero() => std::thread::sleep(wait),
                    _ => break depth.saturating_sub(ready),
                }
            };
            let made: Vec<T> = std::thread::scope(|s| {
                let batch: Vec<_> = (0..missing).map(|_| s.spawn(&make)).collect();
                batch.into_iter().filter_map(|spare| spare.join().ok().flatten()).collect()
            });
            let mut slots = Self::slots(&slots);
            let slot = slots.entry(key).or_insert_with(Slot::empty);
            slot.making = false;
            slot.ready.extend(made);
        });
    }

    /// How many spares of `key` are ready.
    #[cfg(test)]
    fn ready(&self, key: &K) -> usize {
        Self::slots(&self.slots).get(key).map_or(0, |slot| slot.ready.len())
    }

    /// Every spare ready (a batch still being made is kept when done).
    pub fn drain(&self) -> Vec<T> {
        Self::slots(&self.slots).values_mut().flat_map(|slot| std::mem::take(&mut slot.ready)).collect()
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
        let stock: Stock<u8, usize> = Stock::new(3);
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
        let stock: Stock<u8, usize> = Stock::new(1);
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
    fn keys_are_apart_and_drained_spares_are_gone() {
        let stock: Stock<u8, usize> = Stock::new(2);
        stock.refill(2, || Some(2));
        stock.refill(3, || Some(3));
        assert_eq!(wait_for(&stock, 2, 2), [2, 2]);
        assert_eq!(stock.take(&2), None, "a spare is taken once");
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut drained = Vec::new();
        while drained.len() < 2 && Instant::now() < deadline {
            drained.extend(stock.drain());
        }
        assert_eq!(drained, vec![3, 3]);
        assert_eq!(stock.take(&3), None);
    }

    #[test]
    fn a_refill_waits_for_takes_to_stop() {
        // Quiet for long, so that a slow test machine's pause is no gap.
        let stock: Stock<u8, usize> = Stock { quiet: Duration::from_millis(500), ..Stock::new(2) };
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
