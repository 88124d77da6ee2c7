//! Fake addresses: each name a box may reach gets one address of
//! [`FAKE_NET`], the same every time it is asked for (derived from the name,
//! so the same after a gateway restart unless two names collided), and the
//! address a connection was made to says which name the box dialled.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use moat_core::egress::FAKE_NET;
use moat_core::policy::HostName;

/// Most names one box may have addresses for (each is ~100 bytes here).
pub const MAX_NAMES: usize = 16 << 10;

/// One box's names and their addresses.
#[derive(Debug, Default)]
pub struct FakeAddrs {
    by_name: HashMap<HostName, Ipv4Addr>,
    by_addr: HashMap<Ipv4Addr, HostName>,
}

/// Addresses in the range, less the network and broadcast ones and the box's
/// own ([`moat_core::egress::BOX_SOURCE`], the first).
const SLOTS: u32 = (1 << (32 - FAKE_NET.1)) - 3;

impl FakeAddrs {
    /// The address for `name`, given out now if it had none; `None` once the
    /// box holds [`MAX_NAMES`].
    pub fn addr_for(&mut self, name: &HostName) -> Option<Ipv4Addr> {
        if let Some(addr) = self.by_name.get(name) {
            return Some(*addr);
        }
        if self.by_name.len() >= MAX_NAMES {
            return None;
        }
        let base = u32::from(FAKE_NET.0);
        let start = fnv1a(name.as_str().as_bytes()) % SLOTS;
        // With at most MAX_NAMES of SLOTS taken, a free one is near.
        let addr = (0..SLOTS)
            .map(|i| Ipv4Addr::from(base + 2 + (start + i) % SLOTS))
            .find(|a| !self.by_addr.contains_key(a))?;
        self.by_name.insert(name.clone(), addr);
        self.by_addr.insert(addr, name.clone());
        Some(addr)
    }

    /// The name `addr` was given to, if any.
    pub fn name_for(&self, addr: Ipv4Addr) -> Option<&HostName> {
        self.by_addr.get(&addr)
    }
}

/// Whether `addr` is in the fake range.
pub fn is_fake(addr: Ipv4Addr) -> bool {
    u32::from(addr) >> (32 - FAKE_NET.1) == u32::from(FAKE_NET.0) >> (32 - FAKE_NET.1)
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn stable_distinct_and_bounded() {
        let mut a = FakeAddrs::default();
        let mut b = FakeAddrs::default();
        let names: Vec<HostName> = (0..2000).map(|i| HostName::parse(&format!("h{i}.example")).unwrap()).collect();
        let addrs: Vec<Ipv4Addr> = names.iter().map(|n| a.addr_for(n).unwrap()).collect();
        for (n, addr) in names.iter().zip(&addrs) {
            assert!(is_fake(*addr) && *addr != moat_core::egress::BOX_SOURCE);
            assert_eq!(a.addr_for(n), Some(*addr));
            assert_eq!(a.name_for(*addr), Some(n));
        }
        let mut unique = addrs.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), addrs.len());
        // Another box (or a restarted gateway) gives the first name the same address.
        assert_eq!(b.addr_for(&names[0]), Some(addrs[0]));
        assert!(!is_fake(Ipv4Addr::new(198, 20, 0, 1)) && is_fake(Ipv4Addr::new(198, 19, 255, 1)));
        for i in 0..MAX_NAMES {
            let _ = b.addr_for(&HostName::parse(&format!("x{i}.example")).unwrap());
        }
        assert_eq!(b.addr_for(&HostName::parse("one-more.example").unwrap()), None);
    }
}
