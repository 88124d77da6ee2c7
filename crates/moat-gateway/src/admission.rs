//! How many connections the gateway carries at once: a box at most
//! [`PER_BOX`], an account's boxes together a share of the whole, and the
//! whole sized from the gateway's descriptor limit. Without the last two,
//! one account's boxes (each under its own limit) used up the descriptors
//! every other account's connections need: the gateway's `accept` failed
//! for everyone.

use std::sync::Arc;

use moat_core::slots::{Slot, Slots};
use moat_core::AccountId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::refusal::Refusal;

/// Most connections one box may have open through the gateway at once.
pub const PER_BOX: usize = 512;

/// Descriptors a connection may hold: the box's socket and a copy, the
/// host's, and a registry's or a push's on the side.
const FDS_PER_CONNECTION: u64 = 8;

/// Connections get half the descriptors; the rest are the running boxes'
/// listeners (seven each, passed in) and the gateway's own.
const FOR_CONNECTIONS: u64 = 2;

/// An account may hold this part of the whole (a quarter).
const ACCOUNT_SHARE: usize = 4;

/// The gateway's connection limits, and each account's count.
pub struct Admission {
    all: Arc<Semaphore>,
    accounts: Arc<Slots<AccountId>>,
}

impl Admission {
    /// Limits for a gateway that may open `descriptors` files.
    pub fn for_descriptors(descriptors: u64) -> Self {
        let all = usize::try_from(descriptors / FOR_CONNECTIONS / FDS_PER_CONNECTION)
            .unwrap_or(usize::MAX)
            .clamp(64, Semaphore::MAX_PERMITS);
        Self { all: Arc::new(Semaphore::new(all)), accounts: Slots::new((all / ACCOUNT_SHARE).max(16)) }
    }

    /// Limits for this process's descriptor limit (its soft one: what it
    /// can open).
    pub fn for_this_process() -> Self {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        Self::for_descriptors(limit.current.unwrap_or(u64::MAX))
    }

    /// The counts a new box of `account` answers to.
    pub fn gate(&self, account: &AccountId) -> Gate {
        Gate {
            own: Arc::new(Semaphore::new(PER_BOX)),
            account: account.clone(),
            accounts: Arc::clone(&self.accounts),
            all: Arc::clone(&self.all),
        }
    }
}

/// One box's way in: its own count, its account's and the gateway's.
pub struct Gate {
    own: Arc<Semaphore>,
    account: AccountId,
    accounts: Arc<Slots<AccountId>>,
    all: Arc<Semaphore>,
}

/// A connection's places in each count, given back when dropped.
pub struct Admitted {
    _places: (OwnedSemaphorePermit, Slot<AccountId>, OwnedSemaphorePermit),
}

impl Gate {
    /// The account whose box this is.
    pub fn account(&self) -> &AccountId {
        &self.account
    }

    /// A place for one more connection, or which limit refused it.
    pub fn admit(&self) -> Result<Admitted, Refusal> {
        let own = Arc::clone(&self.own).try_acquire_owned().map_err(|_| Refusal::TooManyConnections)?;
        let account = self.accounts.take(&self.account).ok_or(Refusal::AccountConnections)?;
        let all = Arc::clone(&self.all).try_acquire_owned().map_err(|_| Refusal::GatewayFull)?;
        Ok(Admitted { _places: (own, account, all) })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn one_account_cannot_take_every_place() {
        // 20,000 descriptors (this machine's limit): 1,250 connections, 312
        // an account.
        let admission = Admission::for_descriptors(20_000);
        let greedy = AccountId("SHA256:greedy".into());
        let mut held = Vec::new();
        let mut refused = None;
        for _ in 0..6 {
            let gate = admission.gate(&greedy);
            for _ in 0..PER_BOX {
                match gate.admit() {
                    Ok(place) => held.push(place),
                    Err(why) => refused = Some(why),
                }
            }
        }
        assert_eq!(held.len(), 312);
        assert_eq!(refused, Some(Refusal::AccountConnections));
        // Another account's box still gets in; a box at its own limit is told so.
        let other = admission.gate(&AccountId("SHA256:other".into()));
        let mut mine = Vec::new();
        while let Ok(place) = other.admit() {
            mine.push(place);
        }
        assert_eq!(mine.len(), 312);
        drop(mine);
        // Places come back when connections end.
        held.clear();
        let again = admission.gate(&greedy);
        assert!(again.admit().is_ok());
        // The whole: four accounts fill it, a fifth is refused as the gateway's.
        let whole = Admission::for_descriptors(20_000);
        let mut all = Vec::new();
        for n in 0..5 {
            let gate = whole.gate(&AccountId(format!("SHA256:{n}")));
            loop {
                match gate.admit() {
                    Ok(place) => all.push(place),
                    Err(why) => {
                        if n == 4 {
                            assert_eq!(why, Refusal::GatewayFull);
                        }
                        break;
                    }
                }
            }
        }
        assert_eq!(all.len(), 1250);
        // A box's own limit binds where the account's is larger.
        let _unlimited = Admission::for_descriptors(u64::MAX);
        let roomy = Admission::for_descriptors(1 << 20);
        let gate = roomy.gate(&greedy);
        let places: Vec<_> = std::iter::from_fn(|| gate.admit().ok()).collect();
        assert_eq!(places.len(), PER_BOX);
        assert_eq!(gate.admit().err(), Some(Refusal::TooManyConnections));
    }
}
