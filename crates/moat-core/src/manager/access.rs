//! Taking access away ends what it opened. Every session (ssh, sftp, a
//! forward, a web session) is held by the account that signed in; `unshare`
//! ends that account's sessions on the box at once, and a key taken out of
//! the keys ends its account's sessions within [`SWEEP`]. What holds the
//! session (the API connection that opened it) waits on
//! [`SessionGuard::revoked`] and lets go.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::{BoxManager, SessionGuard};
use crate::ids::{AccountId, BoxId};

/// How often the keys are read again for the accounts holding sessions.
pub const SWEEP: Duration = Duration::from_secs(1);

/// Who holds each open session, and which accounts were found listed lately.
#[derive(Default)]
pub(super) struct Holders {
    next: AtomicU64,
    held: std::sync::Mutex<HashMap<u64, Holder>>,
    /// When each account's key was last found listed: trusted for a
    /// [`SWEEP`] (the keys are not read again on every request of a busy
    /// account; a removed key is refused as soon as its sessions end).
    listed_at: std::sync::Mutex<HashMap<AccountId, Instant>>,
}

struct Holder {
    box_id: BoxId,
    /// Who signed in (none: a public URL's visitor).
    account: Option<AccountId>,
    /// The port of a web session: exposed no more (or no longer as it
    /// was), the port's sessions end.
    web_port: Option<u16>,
    end: Arc<Notify>,
}

/// A session's place among the holders (in its [`SessionGuard`]).
pub(super) struct Held {
    key: u64,
    end: Arc<Notify>,
}

impl Holders {
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Holder>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the sessions `which` picks (their holders see it; each lets go
    /// in its own time, and its guard leaves the table then).
    fn end(&self, which: impl Fn(&Holder) -> bool) -> usize {
        let held = self.held();
        let ended: Vec<_> = held.values().filter(|h| which(h)).collect();
        for holder in &ended {
            // A permit is kept if nobody waits yet: the holder sees it when it does.
            holder.end.notify_one();
        }
        ended.len()
    }
}

impl SessionGuard {
    /// Marks the session as `account`'s (who signed in, the box's owner or
    /// an account it is shared with): taking that account's access away ends it.
    pub fn held_by(self, account: &AccountId) -> Self {
        self.hold(Some(account.clone()), None)
    }

    /// Marks the session as a web session of `port`, by `account` (none for
    /// a public URL's visitor): taking the account's access away, or the
    /// port's exposure, ends it.
    pub fn held_for_web(self, account: Option<&AccountId>, port: u16) -> Self {
        self.hold(account.cloned(), Some(port))
    }

    fn hold(mut self, account: Option<AccountId>, web_port: Option<u16>) -> Self {
        let holders = &self.manager.holders;
        let key = holders.next.fetch_add(1, Ordering::Relaxed);
        let end = Arc::new(Notify::new());
        let holder = Holder { box_id: self.id.clone(), account, web_port, end: Arc::clone(&end) };
        holders.held().insert(key, holder);
        self.held = Some(Held { key, end });
        self
    }

    /// Resolves once the account that holds the session lost its access to
    /// the box (never, for a session held by no account).
    pub async fn revoked(&self) {
        match &self.held {
            Some(held) => held.end.notified().await,
            None => std::future::pending().await,
        }
    }

    /// Leaves the table of holders (the guard is being dropped).
    pub(super) fn let_go(&mut self) {
        if let Some(held) = self.held.take() {
            self.manager.holders.held().remove(&held.key);
        }
    }
}

impl BoxManager {
    /// Ends `account`'s sessions on box `id` (a share taken back).
    pub(super) fn end_sessions_of(&self, id: &BoxId, account: &AccountId) -> usize {
        self.holders.end(|h| h.box_id == *id && h.account.as_ref() == Some(account))
    }

    /// Ends every session on this node's boxes (its fence closed).
    pub(super) fn end_all_sessions(&self) -> usize {
        self.holders.end(|_| true)
    }

    /// Ends the web sessions of port `port` of box `id` (its exposure taken
    /// away or changed): the tunnels they carry end; a visitor still let in
    /// opens a new one.
    pub(super) fn end_web_sessions(&self, id: &BoxId, port: u16) -> usize {
        self.holders.end(|h| h.box_id == *id && h.web_port == Some(port))
    }

    /// Ends the sessions of every account whose key is no longer listed.
    /// One look at the keys per account holding a session.
    pub fn end_unlisted_sessions(&self) -> usize {
        let Some(listed) = self.accounts.get() else { return 0 };
        let accounts: HashSet<AccountId> = self.holders.held().values().filter_map(|h| h.account.clone()).collect();
        let gone: HashSet<AccountId> = accounts.into_iter().filter(|a| !listed(a)).collect();
        if gone.is_empty() {
            return 0;
        }
        self.holders.listed_at.lock().unwrap_or_else(PoisonError::into_inner).retain(|a, _| !gone.contains(a));
        let ended = self.holders.end(|h| h.account.as_ref().is_some_and(|a| gone.contains(a)));
        tracing::info!(sessions = ended, accounts = gone.len(), "ended the sessions of keys no longer listed");
        ended
    }

    /// Whether `account`'s key is listed (every account is where no check
    /// was set); read again at most once a [`SWEEP`] for an account found listed.
    pub fn account_listed(&self, account: &AccountId) -> bool {
        let Some(listed) = self.accounts.get() else { return true };
        let now = Instant::now();
        let mut listed_at = self.holders.listed_at.lock().unwrap_or_else(PoisonError::into_inner);
        if listed_at.get(account).is_some_and(|at| now.duration_since(*at) < SWEEP) {
            return true;
        }
        listed_at.retain(|_, at| now.duration_since(*at) < SWEEP);
        drop(listed_at);
        let yes = listed(account);
        if yes {
            self.holders.listed_at.lock().unwrap_or_else(PoisonError::into_inner).insert(account.clone(), now);
        }
        yes
    }

    /// Looks at the keys every [`SWEEP`], on a thread of its own (the keys
    /// file and the store are read blocking), for as long as the manager lives.
    pub fn spawn_access_sweep(self: &Arc<Self>) {
        let manager = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("access-sweep".into()).spawn(move || loop {
            std::thread::sleep(SWEEP);
            let Some(manager) = manager.upgrade() else { return };
            manager.end_unlisted_sessions();
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to end the sessions of removed keys");
        }
    }
}
