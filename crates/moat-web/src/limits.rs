//! Counted slots: connections per source address and in all, requests in
//! flight per box port. A slot is given back when its holder is dropped, so
//! nothing leaks on an error path.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// The source a limit counts `ip` as: an IPv6 address by its /64 (one
/// host's whole allotment), an IPv4-mapped one as the IPv4 address.
pub fn source_of(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.into(),
            None => std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1)).into(),
        },
        v4 => v4,
    }
}

/// A visitor's share of a box port's requests in flight: three quarters,
/// so one address (with HTTP/2 streams or WebSockets) cannot take them all.
pub fn visitor_share(per_box: usize) -> usize {
    (per_box - per_box / 4).max(1)
}

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

    #[test]
    fn sources_are_hosts_and_visitors_share() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert_eq!(source_of(ip("2001:db8:1:2:aaaa::1")), source_of(ip("2001:db8:1:2:bbbb::9")));
        assert_ne!(source_of(ip("2001:db8:1:2::1")), source_of(ip("2001:db8:1:3::1")));
        assert_eq!(source_of(ip("::ffff:192.0.2.7")), ip("192.0.2.7"));
        assert_eq!(source_of(ip("192.0.2.7")), ip("192.0.2.7"));
        assert_eq!((visitor_share(256), visitor_share(2), visitor_share(1)), (192, 2, 1));
    }
}
