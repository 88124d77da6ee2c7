//! What one account may hold of the front door at once, across all its
//! connections. Each channel holds a connection to the privileged side (and
//! most a box's agent): one key's 660 connections, each with 32 `log
//! --follow` channels, held all 16,384 of the privileged side's, and then no
//! one could log in (checking a key takes one too). Per connection, channels
//! are bounded as OpenSSH bounds them (see `handler.rs`); here, per account.

use std::sync::Arc;

use moat_core::slots::{Slot, Slots};
use moat_core::AccountId;

/// Most connections one account may have open at once.
pub const CONNECTIONS_PER_ACCOUNT: usize = 256;

/// Most channels (sessions, forwards, verbs) one account may have open at
/// once, over all its connections.
pub const CHANNELS_PER_ACCOUNT: usize = 512;

/// Each account's connections and channels.
pub struct AccountLoad {
    connections: Arc<Slots<AccountId>>,
    channels: Arc<Slots<AccountId>>,
}

impl Default for AccountLoad {
    fn default() -> Self {
        Self { connections: Slots::new(CONNECTIONS_PER_ACCOUNT), channels: Slots::new(CHANNELS_PER_ACCOUNT) }
    }
}

impl AccountLoad {
    /// A place for one more connection of `account`, if it has one left.
    pub fn connection(&self, account: &AccountId) -> Option<Slot<AccountId>> {
        self.connections.take(account)
    }

    /// A place for one more channel of `account`, if it has one left.
    pub fn channel(&self, account: &AccountId) -> Option<Slot<AccountId>> {
        self.channels.take(account)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn each_account_has_its_own_places() {
        let load = AccountLoad::default();
        let (greedy, other) = (AccountId("SHA256:g".into()), AccountId("SHA256:o".into()));
        let held: Vec<_> = std::iter::from_fn(|| load.channel(&greedy)).take(10_000).collect();
        assert_eq!(held.len(), CHANNELS_PER_ACCOUNT);
        assert!(load.channel(&other).is_some());
        let conns: Vec<_> = std::iter::from_fn(|| load.connection(&greedy)).take(10_000).collect();
        assert_eq!(conns.len(), CONNECTIONS_PER_ACCOUNT);
        assert!(load.connection(&other).is_some());
        drop(held);
        assert!(load.channel(&greedy).is_some(), "places come back");
    }
}
