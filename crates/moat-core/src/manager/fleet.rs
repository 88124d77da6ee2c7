//! The manager as one node of a fleet: the lease it keeps in the shared
//! store, and the fence that keeps it from acting on a box that is not its
//! own, or on any box once its lease has lapsed (another node may then be
//! given its boxes: never two live copies of one box).
//!
//! On a single host the node has no name (`''`), every box is its own and
//! the fence never closes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::{in_place, BoxManager, ManagerError};
use crate::clock::now_ms;
use crate::record::{BoxRecord, BoxState};
use crate::store::nodes::{NodeOffer, NodeRow, LEASE_MS};

/// How long a lease lasts after its last renewal; nodes renew it every
/// [`LEASE_RENEW`].
pub const LEASE: Duration = Duration::from_millis(LEASE_MS);

/// How often a node renews its lease.
pub const LEASE_RENEW: Duration = Duration::from_secs(2);

/// Whether this node may act on its boxes (closed while its lease is lapsed,
/// until it has renewed it and reconciled).
#[derive(Debug)]
pub(super) struct Fence {
    open: AtomicBool,
    /// This node's boxes as the store last listed them: the fence closes
    /// when the store cannot be reached, so what it freezes comes from here.
    known: Mutex<Vec<BoxRecord>>,
    /// The boxes the fence froze; those still this node's and running by
    /// the store are thawed when it opens.
    frozen: Mutex<Vec<crate::ids::BoxId>>,
    /// Held while the fence closes or opens, and while a box thawed as it
    /// closed is frozen again (see [`BoxManager::still_serving`]), so that
    /// an opening thaws every box frozen before it.
    turn: Mutex<()>,
}

impl Default for Fence {
    fn default() -> Self {
        Self { open: AtomicBool::new(true), known: Mutex::default(), frozen: Mutex::default(), turn: Mutex::default() }
    }
}

/// Seconds since `node`'s lease lapsed, if it has.
fn lapsed_for(node: &NodeRow, now_ms: u64) -> Option<u64> {
    (!node.is_live(now_ms)).then(|| now_ms.saturating_sub(node.lease_until_ms) / 1000)
}

impl BoxManager {
    /// The node this manager is (`""` on a single host).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Renews this node's lease, offering `offer`'s capacity.
    pub fn renew_lease(&self, offer: &NodeOffer) -> Result<(), ManagerError> {
        Ok(self.db(|s| s.renew_lease(offer))?)
    }

    /// Tells the store what each account with boxes here holds of this
    /// node's disk, for disk budgets counted across the fleet.
    pub fn report_disk(&self) -> Result<(), ManagerError> {
        if self.node.is_empty() {
            return Ok(());
        }
        let here = self.db(crate::store::Store::list_here)?;
        let accounts: std::collections::HashSet<_> = here.iter().map(|b| b.account.clone()).collect();
        // Read anyway every renewal: kept for the fence.
        *self.fence.known.lock().unwrap_or_else(PoisonError::into_inner) = here;
        let usage: Vec<_> =
            accounts.into_iter().filter_map(|a| self.backend.account_disk_usage(&a).map(|bytes| (a, bytes))).collect();
        Ok(self.db(|s| s.set_account_disk(&self.node, &usage, now_ms()))?)
    }

    /// Notes a box brought up here since the store last listed this node's
    /// boxes, so that the fence freezes it too.
    pub(super) fn known_here(&self, rec: &BoxRecord) {
        if self.node.is_empty() {
            return;
        }
        let mut known = self.fence.known.lock().unwrap_or_else(PoisonError::into_inner);
        if !known.iter().any(|k| k.id == rec.id) {
            known.push(rec.clone());
        }
    }

    /// Closes the fence: this node's lease may have lapsed, and another node
    /// may be given its boxes. Every box it runs is frozen where it stands
    /// (its processes, its network, its writes) and every session on it
    /// ends, so that no copy goes on here while another starts elsewhere;
    /// the store is not needed for that (it may be what is gone). Blocking.
    pub fn close_fence(&self) {
        let _turn = self.fence.turn.lock().unwrap_or_else(PoisonError::into_inner);
        if !self.fence.open.swap(false, Ordering::SeqCst) {
            return;
        }
        let known = self.fence.known.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let sessions = self.end_all_sessions();
        let mut frozen = Vec::new();
        for rec in known.into_iter().filter(|rec| self.backend.is_running(rec)) {
            match self.backend.suspend(&rec) {
                Ok(()) => frozen.push(rec.id),
                Err(e) => tracing::error!(box_id = %rec.id, name = %rec.name, error = %e, "cannot freeze a fenced box"),
            }
        }
        tracing::warn!(
            frozen = frozen.len(),
            sessions,
            "this node's boxes are fenced off: frozen, their sessions ended"
        );
        self.fence.frozen.lock().unwrap_or_else(PoisonError::into_inner).extend(frozen);
    }

    /// Whether the fence is still open after box `rec` was thawed or started
    /// here. The fence freezes what it finds running as it closes, which may
    /// be before this box ran: if it closed, the box is frozen again (the
    /// fence's opening thaws it) and the caller refuses what it was doing.
    pub(super) fn still_serving(&self, rec: &BoxRecord) -> bool {
        // The fence is marked closed before it freezes anything: open here
        // means it had not begun, and it will find this box running.
        if self.serving() {
            return true;
        }
        in_place(|| {
            let _turn = self.fence.turn.lock().unwrap_or_else(PoisonError::into_inner);
            if self.serving() {
                return true;
            }
            if let Err(e) = self.backend.suspend(rec) {
                tracing::error!(box_id = %rec.id, name = %rec.name, error = %e, "cannot freeze a fenced box");
            }
            let mut frozen = self.fence.frozen.lock().unwrap_or_else(PoisonError::into_inner);
            if !frozen.contains(&rec.id) {
                frozen.push(rec.id.clone());
            }
            false
        })
    }

    /// Opens the fence (the lease renewed, and the copies of boxes given to
    /// other nodes meanwhile discarded): the boxes it froze that are still
    /// this node's, and running by the store, run again. Blocking.
    pub fn open_fence(&self) -> Result<(), ManagerError> {
        let _turn = self.fence.turn.lock().unwrap_or_else(PoisonError::into_inner);
        let frozen = self.fence.frozen.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if !frozen.is_empty() {
            let here = self.db(crate::store::Store::list_here)?;
            for rec in here.iter().filter(|r| r.state == BoxState::Running && frozen.contains(&r.id)) {
                if let Err(e) = self.backend.thaw(rec) {
                    tracing::error!(box_id = %rec.id, name = %rec.name, error = %e, "cannot thaw a box the fence froze");
                }
            }
            self.fence.frozen.lock().unwrap_or_else(PoisonError::into_inner).clear();
        }
        if !self.fence.open.swap(true, Ordering::SeqCst) {
            tracing::warn!("this node's boxes are served again");
        }
        Ok(())
    }

    /// Whether the fence is open.
    pub fn serving(&self) -> bool {
        self.fence.open.load(Ordering::SeqCst)
    }

    /// Every node of the fleet (none on a single host).
    pub fn nodes(&self) -> Result<Vec<NodeRow>, ManagerError> {
        Ok(self.db(|s| s.nodes())?)
    }

    /// The account a key imported with `moat fleet keys add` (`TYPE BASE64`)
    /// is, if it is one (none on a single host, or with the store away).
    pub fn account_for_fleet_key(&self, key: &str) -> Option<crate::ids::AccountId> {
        self.db(|s| s.account_for_fleet_key(key)).ok().flatten()
    }

    /// Whether the fleet's keys list a key of `account`.
    ///
    /// A store that cannot be read counts as listing it: what asks (a
    /// request, the sweep that ends the sessions of removed keys) must not
    /// take an outage of the store for every key taken out (running
    /// sessions outlive an outage).
    pub fn fleet_lists(&self, account: &crate::ids::AccountId) -> bool {
        self.db(|s| s.fleet_keys()).map_or(true, |keys| keys.iter().any(|k| k.account == *account))
    }

    /// The nodes whose lease lapsed.
    pub fn lost_nodes(&self) -> Result<Vec<String>, ManagerError> {
        let now = now_ms();
        Ok(self.nodes()?.into_iter().filter(|n| !n.is_live(now)).map(|n| n.offer.name).collect())
    }

    /// Refuses to act on `rec` unless it is this node's and the fence is open.
    pub(super) fn here(&self, rec: &BoxRecord) -> Result<(), ManagerError> {
        if rec.node != self.node {
            let lapsed = self.db(|s| s.node(&rec.node)).ok().flatten().and_then(|n| lapsed_for(&n, now_ms()));
            return Err(ManagerError::OnOtherNode { name: rec.name.clone(), node: rec.node.clone(), lapsed });
        }
        if !self.serving() {
            return Err(ManagerError::Fenced(self.node.clone()));
        }
        Ok(())
    }
}
