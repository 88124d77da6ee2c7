//! Boxes booted ahead of demand. `new` takes one of the image, limits and
//! backend it asks for, if one is ready, and gives it its owner, name and
//! policy: the root, identity, cgroup, namespaces and agent were made before
//! anyone asked. The pool holds one box of each of the kinds `new` asked
//! for last, as many kinds as the operator allows; a kind other than an
//! image's default keeps its box only while it is asked for
//! ([`ManagerConfig::warm_kept`](super::ManagerConfig)). A warm box is a real box
//! in state `creating`, owned by an account no key can be, so a crash or a
//! restart rolls it back like any half-made box, and it holds a uid slot
//! like any other.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use super::{now, BoxManager, BoxSpec, ManagerError};
use crate::backend::BackendError;
use crate::ids::{AccountId, BoxId, Name};
use crate::limits::Limits;
use crate::policy::Policy;
use crate::record::{BackendKind, BoxRecord, BoxState};

pub use crate::ids::WARM_ACCOUNT;

/// How long after a `new` its image's warm box starts being made: a script's
/// `new`s back to back are not slowed by one being made beside them.
const REFILL_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// How many kinds `new` asked for are remembered (a pool of more keeps the
/// kinds it holds, but may forget how often they were asked for).
const KINDS_REMEMBERED: usize = 64;

/// What a warm box must be to be given for a `new`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Kind {
    image: Name,
    limits: Limits,
    backend: BackendKind,
}

/// The warm boxes, by kind, the kinds one is being made of, and the kinds
/// `new` asked for, the latest last.
#[derive(Default)]
pub(super) struct Warm {
    ready: HashMap<Kind, BoxRecord>,
    making: HashSet<Kind>,
    asked: Vec<Asked>,
}

/// A kind `new` asked for: how often, and when last.
struct Asked {
    kind: Kind,
    times: u32,
    last: Instant,
}

impl Warm {
    /// When `kind` was last asked for (`None`: not remembered).
    fn last_asked(&self, kind: &Kind) -> Option<Instant> {
        self.asked.iter().find(|a| &a.kind == kind).map(|a| a.last)
    }
}

fn warm_account() -> AccountId {
    AccountId(WARM_ACCOUNT.to_string())
}

impl BoxManager {
    fn warm(&self) -> std::sync::MutexGuard<'_, Warm> {
        self.warm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The kind of box `spec` asks for.
    pub(super) fn kind_of(&self, spec: &BoxSpec) -> Kind {
        Kind { image: spec.image.clone(), limits: spec.limits, backend: self.backend_of(spec) }
    }

    /// The kind of a `new` of `image` with nothing else said.
    fn default_kind(&self, image: &Name) -> Kind {
        Kind {
            image: image.clone(),
            limits: self.defaults_within_max(Limits::default()),
            backend: self.config.default_backend,
        }
    }

    /// Makes a warm box of `image` with the default limits in the background
    /// (as after a `new` of it), if the operator allows warm boxes and the
    /// image is built.
    pub fn prepare_warm(self: &Arc<Self>, image: &Name) {
        self.refill_warm(self.default_kind(image));
    }

    /// Whether a warm box of `image` with the default limits is ready.
    pub fn warm_ready(&self, image: &Name) -> bool {
        self.warm().ready.contains_key(&self.default_kind(image))
    }

    /// Whether a warm box of the kind `spec` asks for is ready.
    #[cfg(test)]
    pub(super) fn warm_ready_for(&self, spec: &BoxSpec) -> bool {
        self.warm().ready.contains_key(&self.kind_of(spec))
    }

    /// Makes the box `spec` asks for of a warm one, if one of its kind is
    /// ready (`None`: make it the usual way). A warm box that cannot be
    /// given is removed.
    pub(super) async fn take_warm(
        self: &Arc<Self>,
        account: &AccountId,
        spec: &BoxSpec,
    ) -> Option<Result<BoxRecord, ManagerError>> {
        let kind = self.kind_of(spec);
        let warm = self.warm().ready.remove(&kind)?;
        // Held throughout: the box is nobody's to touch until it is given or gone.
        let lock = self.lock_for(&warm.id);
        let guard = lock.lock().await;
        let made = self.adopt(&warm, account, spec).await;
        let outcome = match made {
            Ok(rec) => Some(Ok(rec)),
            Err(e) => {
                self.discard_warm(&warm).await;
                match e {
                    ManagerError::Store(crate::store::StoreError::NameTaken(n)) => {
                        Some(Err(crate::store::StoreError::NameTaken(n).into()))
                    }
                    e => {
                        tracing::warn!(box_id = %warm.id, error = %e, "a warm box could not be given; making one anew");
                        None
                    }
                }
            }
        };
        drop(guard);
        self.refill_warm(kind);
        outcome
    }

    /// Gives warm box `warm` to `account` as `spec` says (its lock held).
    /// The box is given its owner and name first, while the store still
    /// says it is a warm box being made: a crash before the store's one
    /// transaction rolls the whole box back, and after it the box is whole.
    async fn adopt(
        self: &Arc<Self>,
        warm: &BoxRecord,
        account: &AccountId,
        spec: &BoxSpec,
    ) -> Result<BoxRecord, ManagerError> {
        let given = BoxRecord { account: account.clone(), name: spec.name.clone(), ..warm.clone() };
        let (r, from) = (given.clone(), warm.account.clone());
        let handle = self
            .blocking(move |b| {
                b.adopt(&r, &from)?;
                b.handle(&r).ok_or_else(|| BackendError::msg("the warm box is not running"))
            })
            .await??;
        let rec = self.db(|s| s.adopt(&warm.id, account, &spec.name, now(), &spec.policy, warm.pid))?;
        self.network_up(&rec, &handle, false);
        self.schedule_idle(&rec.id);
        tracing::info!(box_id = %rec.id, name = %rec.name, pid = ?rec.pid, "box created (warm)");
        Ok(rec)
    }

    /// Removes every ready warm box, so that a box asked for has their room
    /// on a full node; whether there was any.
    pub(super) async fn give_way_warm(&self) -> bool {
        let ready: Vec<BoxRecord> = self.warm().ready.drain().map(|(_, rec)| rec).collect();
        for rec in &ready {
            let lock = self.lock_for(&rec.id);
            let _guard = lock.lock().await;
            self.discard_warm(rec).await;
        }
        !ready.is_empty()
    }

    /// Removes a warm box the store still records as one (its lock held).
    /// If its files or processes cannot be removed, the record stays, and
    /// the next start rolls it back as any half-made box.
    async fn discard_warm(&self, warm: &BoxRecord) {
        let w = warm.clone();
        let destroyed = self
            .blocking(move |b| {
                let _ = b.stop(&w);
                b.destroy(&w)
            })
            .await;
        match destroyed.and_then(|d| d.map_err(ManagerError::from)) {
            Ok(()) => {
                if let Err(e) = self.db(|s| s.delete(&warm.id)) {
                    tracing::error!(box_id = %warm.id, error = %e, "cannot forget a discarded warm box");
                }
                self.box_locks.lock().unwrap_or_else(PoisonError::into_inner).remove(&warm.id);
            }
            Err(e) => tracing::error!(box_id = %warm.id, error = %e, "a warm box is left for the next start"),
        }
    }

    /// Makes a warm box of `kind` in the background, if none is ready or
    /// being made. With the operator's number held already, a ready box of
    /// another kind makes room (the kinds `new` asked for last are kept).
    pub(super) fn refill_warm(self: &Arc<Self>, kind: Kind) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        // An image not built takes no place in the pool (one that did held
        // it against the image a `new` asked for meanwhile).
        if self.config.warm_boxes == 0 || !super::in_place(|| self.backend.has_image(&kind.image)) {
            return;
        }
        let evicted = {
            let mut warm = self.warm();
            let asks = warm.asked.iter().position(|a| a.kind == kind).map_or(0, |i| warm.asked.remove(i).times);
            let asks = asks.saturating_add(1);
            warm.asked.push(Asked { kind: kind.clone(), times: asks, last: Instant::now() });
            if warm.asked.len() > KINDS_REMEMBERED {
                warm.asked.remove(0);
            }
            // A kind other than the default's is booted ahead once asked for
            // again: one-off limits would each cost a box made and thrown
            // away (and another kind's place).
            let wanted = asks >= 2 || kind == self.default_kind(&kind.image);
            if !wanted || warm.ready.contains_key(&kind) || warm.making.contains(&kind) {
                return;
            }
            let mut evicted = None;
            if warm.ready.len() + warm.making.len() >= self.config.warm_boxes {
                // The ready box of the kind asked for longest ago (a kind
                // forgotten, first of all).
                let remembered = |k: &&Kind| warm.last_asked(k).is_some();
                let forgotten = warm.ready.keys().find(|k| !remembered(k)).cloned();
                let oldest = || warm.asked.iter().map(|a| &a.kind).find(|k| warm.ready.contains_key(*k)).cloned();
                let Some(other) = forgotten.or_else(oldest) else { return };
                evicted = warm.ready.remove(&other);
            }
            warm.making.insert(kind.clone());
            evicted
        };
        let manager = Arc::clone(self);
        runtime.spawn(async move {
            if let Some(old) = evicted {
                let lock = manager.lock_for(&old.id);
                let _guard = lock.lock().await;
                manager.discard_warm(&old).await;
            }
            tokio::time::sleep(REFILL_AFTER).await;
            let made = manager.make_warm(&kind).await;
            let kept = {
                let mut warm = manager.warm();
                warm.making.remove(&kind);
                match made {
                    Ok(Some(rec)) => {
                        let id = rec.id.clone();
                        warm.ready.insert(kind.clone(), rec);
                        Some(id)
                    }
                    Ok(None) => None,
                    Err(e) => {
                        tracing::warn!(image = %kind.image, error = %e, "could not make a warm box");
                        None
                    }
                }
            };
            if let Some(id) = kept.filter(|_| kind != manager.default_kind(&kind.image)) {
                manager.expire_warm(kind, id).await;
            }
        });
    }

    /// Removes warm box `id` of `kind` once its kind has gone unasked for
    /// [`warm_kept`](super::ManagerConfig::warm_kept) (unless it was taken
    /// or replaced first).
    async fn expire_warm(&self, kind: Kind, id: BoxId) {
        let kept = self.config.warm_kept;
        let expired = loop {
            let due = {
                let mut warm = self.warm();
                // Taken or replaced: whoever made the next one watches it.
                if warm.ready.get(&kind).is_none_or(|rec| rec.id != id) {
                    return;
                }
                let due = warm.last_asked(&kind).map(|at| at + kept).filter(|due| *due > Instant::now());
                let Some(due) = due else { break warm.ready.remove(&kind) };
                due
            };
            tokio::time::sleep_until(due.into()).await;
        };
        if let Some(rec) = expired {
            let lock = self.lock_for(&rec.id);
            let _guard = lock.lock().await;
            self.discard_warm(&rec).await;
            tracing::info!(box_id = %rec.id, image = %kind.image, "a warm box of a kind no longer asked for is removed");
        }
    }

    /// Makes and boots a box of `kind`, owned by [`WARM_ACCOUNT`]; `None` if
    /// the image is not built (a warm box never builds one).
    async fn make_warm(&self, kind: &Kind) -> Result<Option<BoxRecord>, ManagerError> {
        let i = kind.image.clone();
        if !self.blocking(move |b| b.has_image(&i)).await? {
            return Ok(None);
        }
        let mut id = [0u8; 6];
        let _ = getrandom::fill(&mut id);
        let name =
            Name::new(&format!("warm-{}", hex::encode(id))).map_err(|_| ManagerError::NameTooLong("warm".into()))?;
        let made = (&kind.image, kind.limits, kind.backend);
        let rec = self.db(|s| s.insert_new(&warm_account(), &name, made, now(), &Policy::default()))?;
        let r = rec.clone();
        let booted = self
            .blocking(move |b| {
                b.create(&r)?;
                b.start(&r).inspect_err(|_| {
                    let _ = b.destroy(&r);
                })
            })
            .await;
        match booted {
            Ok(Ok(handle)) => {
                // Still `creating`: a restart rolls it back.
                self.db(|s| s.set_state(&rec.id, BoxState::Creating, Some(handle.pid)))?;
                Ok(Some(BoxRecord { pid: Some(handle.pid), ..rec }))
            }
            Ok(Err(e)) => {
                self.db(|s| s.delete(&rec.id))?;
                Err(e.into())
            }
            Err(e) => {
                self.db(|s| s.delete(&rec.id))?;
                Err(e)
            }
        }
    }
}
