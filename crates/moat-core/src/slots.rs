//! Counted slots: at most so many holders per key at once (connections per
//! address or per account, requests in flight per box port). A slot is given
//! back when its holder is dropped, so nothing leaks on an error path, and a
//! key that holds none is forgotten, so the table is as large as what is held.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// At most `max` holders per key at once.
pub struct Slots<K: Eq + Hash + Clone> {
    max: usize,
    held: Mutex<HashMap<K, usize>>,
}

/// One slot of a key, given back on drop.
pub struct Slot<K: Eq + Hash + Clone> {
    slots: Arc<Slots<K>>,
    key: K,
}

impl<K: Eq + Hash + Clone> Slots<K> {
    /// At most `max` per key.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { max, held: Mutex::new(HashMap::new()) })
    }

    /// A slot of `key`, if it has one free.
    pub fn take(self: &Arc<Self>, key: &K) -> Option<Slot<K>> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(Slot { slots: Arc::clone(self), key: key.clone() })
    }

    /// How many `key` holds.
    pub fn held(&self, key: &K) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).get(key).copied().unwrap_or(0)
    }
}

impl<K: Eq + Hash + Clone> Drop for Slot<K> {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn slots_come_back() {
        let slots = Slots::new(2);
        let a = slots.take(&"a").unwrap();
        let _b = slots.take(&"a").unwrap();
        assert!(slots.take(&"a").is_none());
        assert!(slots.take(&"b").is_some(), "per key");
        drop(a);
        assert!(slots.take(&"a").is_some());
        assert_eq!(slots.held(&"a"), 1);
    }
}
