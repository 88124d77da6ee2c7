//! Locks by key (an account, a layer being made): each made on first use
//! and forgotten once nobody holds it or waits for it, so the table is as
//! large as what is held.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OwnedMutexGuard;

/// One lock per key.
pub struct KeyedLocks<K>(Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>);

impl<K> Default for KeyedLocks<K> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<K: Eq + Hash + Clone> KeyedLocks<K> {
    /// Waits for `key`'s lock and holds it until the guard is dropped.
    pub async fn hold(&self, key: &K) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            locks.retain(|_, lock| Arc::strong_count(lock) > 1);
            Arc::clone(locks.entry(key.clone()).or_default())
        };
        lock.lock_owned().await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_per_key_and_the_table_forgets() {
        let locks = KeyedLocks::default();
        let a = locks.hold(&"a").await;
        let _b = locks.hold(&"b").await;
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), locks.hold(&"a")).await.is_err());
        drop(a);
        let _a = locks.hold(&"a").await;
        drop(_a);
        drop(_b);
        let _c = locks.hold(&"c").await;
        assert_eq!(locks.0.lock().unwrap().len(), 1, "keys nobody holds are forgotten");
    }
}
