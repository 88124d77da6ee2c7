//! Per-source penalties, after OpenSSH's PerSourcePenalties but gentler.
//!
//! A source (an IPv4 address, or an IPv6 /64) whose unauthenticated
//! connections misbehave runs up a penalty: each offence adds time, and once
//! the penalty passes [`THRESHOLD`] it is in force until it runs out (at most
//! [`MAX`] ahead). OpenSSH refuses a penalized source outright; that would
//! also lock out an honest client behind the same address (a NAT, or every
//! test on one loopback address), so here a penalized source is never refused:
//! it gets [`PENALIZED_SLOTS`] handshake slots instead of ten, its connections
//! waiting their turn, and a silent socket of its is cut after a short grace,
//! a stalled key exchange sooner.
//! Other sources are untouched.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What a connection did wrong before authenticating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offence {
    /// Sent nothing, or did not authenticate, before its deadline.
    Deadline,
    /// Ended unauthenticated after a key was refused.
    AuthFailed,
    /// Ended unauthenticated without trying (a probe, a scanner).
    NoAuth,
}

impl Offence {
    fn cost(self) -> Duration {
        Duration::from_secs(match self {
            Offence::Deadline => 10,
            Offence::AuthFailed => 5,
            Offence::NoAuth => 1,
        })
    }
}

/// Accrued penalty before it is in force.
pub const THRESHOLD: Duration = Duration::from_secs(15);
/// The longest penalty.
pub const MAX: Duration = Duration::from_secs(600);
/// Handshake slots a penalized source has.
pub const PENALIZED_SLOTS: usize = 2;
/// How long a penalized source's socket may stay silent.
pub const PENALIZED_GRACE: Duration = Duration::from_secs(2);
/// How long a penalized source's connection may hold a handshake slot
/// before its key exchange is done.
pub const PENALIZED_KEX_TIME: Duration = Duration::from_secs(3);
/// Most sources tracked; past it, new sources go unrecorded until old
/// penalties run out (a flood of addresses cannot grow the table).
const MAX_SOURCES: usize = 65_536;

#[derive(Debug, Clone, Copy)]
struct Penalty {
    until: Instant,
    in_force: bool,
}

/// Every source's penalty.
#[derive(Default)]
pub struct Penalties {
    sources: Mutex<HashMap<IpAddr, Penalty>>,
}

impl Penalties {
    /// Adds `offence` to `source`'s penalty.
    pub fn record(&self, source: IpAddr, offence: Offence) {
        self.record_at(source, offence, Instant::now());
    }

    /// Whether `source` is penalized now.
    pub fn is_penalized(&self, source: IpAddr) -> bool {
        self.is_penalized_at(source, Instant::now())
    }

    fn record_at(&self, source: IpAddr, offence: Offence, now: Instant) {
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        if sources.len() >= MAX_SOURCES {
            sources.retain(|_, p| p.until > now);
        }
        let key = key(source);
        if sources.len() >= MAX_SOURCES && !sources.contains_key(&key) {
            return;
        }
        let penalty = sources.entry(key).or_insert(Penalty { until: now, in_force: false });
        if penalty.until <= now {
            *penalty = Penalty { until: now, in_force: false };
        }
        penalty.until = (penalty.until + offence.cost()).min(now + MAX);
        if penalty.until.duration_since(now) >= THRESHOLD {
            penalty.in_force = true;
        }
    }

    fn is_penalized_at(&self, source: IpAddr, now: Instant) -> bool {
        let sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        sources.get(&key(source)).is_some_and(|p| p.in_force && p.until > now)
    }
}

/// Whom a penalty is kept for: an IPv4 address, or an IPv6 /64 (one host
/// usually has a whole /64 to pick addresses from).
fn key(source: IpAddr) -> IpAddr {
    match source {
        IpAddr::V4(_) => source,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn penalties_accrue_take_force_and_run_out() {
        let p = Penalties::default();
        let (x, t0) = ("192.0.2.7".parse().unwrap(), Instant::now());
        p.record_at(x, Offence::Deadline, t0);
        assert!(!p.is_penalized_at(x, t0), "one offence is under the threshold");
        p.record_at(x, Offence::AuthFailed, t0);
        assert!(p.is_penalized_at(x, t0), "15 s accrued");
        assert!(p.is_penalized_at(x, t0 + Duration::from_secs(14)));
        assert!(!p.is_penalized_at(x, t0 + Duration::from_secs(15)), "and then it runs out");
        // Probes alone take 15 in a row; and no penalty outlasts MAX.
        let y: IpAddr = "192.0.2.8".parse().unwrap();
        for _ in 0..14 {
            p.record_at(y, Offence::NoAuth, t0);
        }
        assert!(!p.is_penalized_at(y, t0));
        for _ in 0..1000 {
            p.record_at(y, Offence::Deadline, t0);
        }
        assert!(p.is_penalized_at(y, t0 + MAX - Duration::from_secs(1)));
        assert!(!p.is_penalized_at(y, t0 + MAX));
    }

    #[test]
    fn an_ipv6_64_is_one_source() {
        let p = Penalties::default();
        let t0 = Instant::now();
        for i in 0..2 {
            p.record_at(format!("2001:db8:1:2::{i}").parse().unwrap(), Offence::Deadline, t0);
        }
        assert!(p.is_penalized_at("2001:db8:1:2:ffff::1".parse().unwrap(), t0));
        assert!(!p.is_penalized_at("2001:db8:1:3::1".parse().unwrap(), t0));
    }
}
