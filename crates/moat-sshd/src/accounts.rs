//! What one account may hold of the front door at once, across all its
//! connections. Each channel holds a connection to the privileged side (and
//! most a box's agent): one key's 660 connections, each with 32 `log
//! --follow` channels, held all 16,384 of the privileged side's, and then no
//! one could log in (checking a key takes one too). Per connection, channels
//! are bounded as OpenSSH bounds them (see `handler.rs`); here, per account.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use moat_core::slots::{Slot, Slots};
use moat_core::AccountId;
use russh::WindowBudget;

/// Most connections one account may have open at once.
pub const CONNECTIONS_PER_ACCOUNT: usize = 256;

/// Most channels (sessions, forwards, verbs) one account may have open at
/// once, over all its connections.
pub const CHANNELS_PER_ACCOUNT: usize = 512;

/// Most window one account's channels may be given at once, over all its
/// connections: what the front door may have to hold of what it sent to
/// boxes that read none of it (64 channels at OpenSSH's 2 MiB; past it, a
/// channel gets a window of one packet until some of it frees).
pub const WINDOW_PER_ACCOUNT: usize = 128 << 20;

/// Most window every account's channels may be given at once.
pub const WINDOW_IN_ALL: usize = 1 << 30;

/// Each account's connections, channels and window.
pub struct AccountLoad {
    connections: Arc<Slots<AccountId>>,
    channels: Arc<Slots<AccountId>>,
    windows: AccountWindows,
}

impl Default for AccountLoad {
    fn default() -> Self {
        Self {
            connections: Slots::new(CONNECTIONS_PER_ACCOUNT),
            channels: Slots::new(CHANNELS_PER_ACCOUNT),
            windows: AccountWindows::new(WINDOW_PER_ACCOUNT, WINDOW_IN_ALL),
        }
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

    /// The window budget `account`'s connections share.
    pub fn window(&self, account: &AccountId) -> Arc<WindowBudget> {
        self.windows.of(account)
    }
}

/// One window budget per account with a connection open, inside one for
/// all.
struct AccountWindows {
    each: usize,
    all: Arc<WindowBudget>,
    accounts: Mutex<HashMap<AccountId, Weak<WindowBudget>>>,
}

impl AccountWindows {
    fn new(each: usize, all: usize) -> Self {
        Self { each, all: WindowBudget::new(all, None), accounts: Mutex::default() }
    }

    /// `account`'s budget: the one its open connections hold, or a new one.
    fn of(&self, account: &AccountId) -> Arc<WindowBudget> {
        let mut accounts = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(budget) = accounts.get(account).and_then(Weak::upgrade) {
            return budget;
        }
        // Accounts whose connections all closed hold nothing: forget them.
        accounts.retain(|_, budget| budget.strong_count() > 0);
        let budget = WindowBudget::new(self.each, Some(Arc::clone(&self.all)));
        accounts.insert(account.clone(), Arc::downgrade(&budget));
        budget
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use russh::WindowHold;

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

    const MIB: usize = 1 << 20;

    #[test]
    fn an_account_past_its_window_gets_the_floor_and_others_are_untouched() {
        let windows = AccountWindows::new(5 * MIB, 8 * MIB);
        let (greedy, other) = (AccountId("SHA256:g".into()), AccountId("SHA256:o".into()));
        let (budget, again) = (windows.of(&greedy), windows.of(&greedy));
        assert!(Arc::ptr_eq(&budget, &again), "one budget for all its connections");
        let floor = WindowBudget::FLOOR as usize;
        let granted: Vec<usize> = (0..4).map(|_| budget.take(2 * MIB, floor)).collect();
        assert_eq!(granted, [2 * MIB, 2 * MIB, MIB, floor], "the floor past its budget");
        let other = windows.of(&other);
        assert_eq!(other.take(4 * MIB, floor), 3 * MIB - floor, "another account has what all have left");
        assert_eq!(other.take(MIB, floor), floor, "and the floor past that");
        budget.give(2 * MIB);
        assert_eq!(budget.take(4 * MIB, 0), 2 * MIB - floor, "what it gave back");
        assert_eq!((budget.held(), other.held(), windows.all.held()), (5 * MIB, 3 * MIB, 8 * MIB));
    }

    #[test]
    fn a_channel_starts_small_and_grows_as_its_reader_takes() {
        let windows = AccountWindows::new(3 * MIB, 8 * MIB);
        let budget = windows.of(&AccountId("SHA256:a".into()));
        let (most, start) = (2 * MIB as u32, WindowHold::START);
        let mut idle = WindowHold::of(Some(&budget));
        assert_eq!(idle.open(most), start, "an idle channel holds little");
        // The peer sends the whole window each time, and the reader takes it.
        let ramp = |hold: &mut WindowHold, rounds: usize| {
            let mut window = hold.open(most);
            (0..rounds)
                .map(|_| {
                    window = hold.took(window as usize, most);
                    window
                })
                .collect::<Vec<u32>>()
        };
        let mut bulk = WindowHold::of(Some(&budget));
        assert_eq!(ramp(&mut bulk, 7), [2 * start, 4 * start, 8 * start, 16 * start, most, most, most]);
        // A third channel ramps until the budget runs out, then keeps what it has.
        let mut third = WindowHold::of(Some(&budget));
        let left = 3 * MIB as u32 - start - most;
        assert_eq!(ramp(&mut third, 5), [2 * start, 4 * start, 8 * start, left, left]);
        let mut fourth = WindowHold::of(Some(&budget));
        assert_eq!(fourth.open(most), WindowBudget::FLOOR, "past the budget, the floor");
        drop((idle, bulk, third, fourth));
        assert_eq!(budget.held(), 0);
        let mut unbudgeted = WindowHold::of(None);
        assert_eq!(unbudgeted.open(most), most, "without a budget, a channel starts at its most");
    }

    #[test]
    fn requests_waiting_for_a_reader_come_out_of_the_budget_past_a_channels_own() {
        let windows = AccountWindows::new(MIB, 8 * MIB);
        let budget = windows.of(&AccountId("SHA256:a".into()));
        let free = WindowHold::FREE_REQUESTS;
        let mut hold = WindowHold::of(Some(&budget));
        assert!(hold.charge(free), "a channel's own room");
        assert_eq!(budget.held(), 0);
        assert!(hold.charge(MIB / 2) && hold.charge(MIB / 2), "then the budget's");
        assert!(!hold.charge(1), "and no more");
        assert_eq!(budget.held(), MIB, "a refused request takes nothing");
        hold.discharge(MIB / 2);
        assert_eq!(budget.held(), MIB / 2, "taken requests give it back");
        let mut other = WindowHold::of(Some(&budget));
        assert!(other.charge(free + MIB / 2), "another channel: its own room, then what the budget has left");
        assert!(!other.charge(1));
        drop((hold, other));
        assert_eq!(budget.held(), 0, "a closed channel gives back all it held");
    }

    #[test]
    fn an_account_with_no_connection_left_is_forgotten() {
        let windows = AccountWindows::new(MIB, 8 * MIB);
        let held = windows.of(&AccountId("SHA256:a".into()));
        held.take(MIB, 0);
        drop(held);
        windows.of(&AccountId("SHA256:b".into()));
        assert_eq!(windows.accounts.lock().unwrap().len(), 1);
        assert_eq!(windows.all.held(), MIB, "until its channels give their window back");
    }
}
