//! Sessions and the idle rule: a box runs while someone is connected to it,
//! is suspended (its processes frozen, its meter stopped) a grace period after
//! the last session ends, and is resumed by the next session. `stop`, `start`
//! and the per-box settings live here too.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use super::{BoxManager, ManagerError};
use crate::backend::BoxHandle;
use crate::ids::{AccountId, BoxId, Name};
use crate::record::{BoxRecord, BoxState};

/// Open sessions of one box.
#[derive(Debug, Default)]
pub(super) struct Sessions {
    open: usize,
    /// Bumped whenever the count changes, so a pending idle timer can tell that
    /// it is stale.
    generation: u64,
}

/// Whether a box the store has is frozen (suspended) or not.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Frozen {
    Yes,
    No,
}

/// Held for as long as an SSH session (shell, exec, sftp, forward) uses a box;
/// dropping the last one starts the box's idle timer.
pub struct SessionGuard {
    pub(super) manager: Arc<BoxManager>,
    pub(super) id: BoxId,
    /// Who signed in, where an account did (see [`super::access`]).
    pub(super) held: Option<super::access::Held>,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.let_go();
        let generation = {
            let mut sessions = self.manager.sessions.lock().unwrap_or_else(PoisonError::into_inner);
            // Gone if the box was removed meanwhile.
            let Some(s) = sessions.get_mut(&self.id) else { return };
            s.open = s.open.saturating_sub(1);
            s.generation += 1;
            (s.open == 0).then_some(s.generation)
        };
        if let Some(generation) = generation {
            self.manager.idle_timer(self.id.clone(), generation);
        }
    }
}

/// How soon an idle box's suspension that failed is tried again, at first;
/// each failure doubles it, up to [`IDLE_RETRY_MOST`].
const IDLE_RETRY_FIRST: Duration = Duration::from_secs(5);
/// The longest wait between tries of an idle box's suspension.
const IDLE_RETRY_MOST: Duration = Duration::from_secs(60);
/// Tries of an idle box's suspension (~25 minutes of failures in all).
const IDLE_TRIES: u32 = 30;

impl BoxManager {
    /// Opens a session on a box: resumes it if suspended, boots it if stopped,
    /// and returns where its agent listens. The box stays up while the guard lives.
    pub async fn open_session(
        self: &Arc<Self>,
        account: &AccountId,
        name: &Name,
    ) -> Result<(BoxHandle, SessionGuard), ManagerError> {
        let (rec, guard) = self.locked(account, name).await?;
        self.open_locked(rec, guard).await
    }

    /// Opens a session on box `rec` as checked (a share's): refused if its
    /// name is another box's by now (promoted over, or removed and made
    /// again), which the check did not let through.
    pub(super) async fn open_session_of(
        self: &Arc<Self>,
        rec: &BoxRecord,
    ) -> Result<(BoxHandle, SessionGuard), ManagerError> {
        let (now, guard) = self.locked(&rec.account, &rec.name).await?;
        if now.id != rec.id {
            return Err(ManagerError::NoSuchBox(rec.name.clone()));
        }
        self.open_locked(now, guard).await
    }

    /// [`open_session`](Self::open_session) once the box is locked.
    async fn open_locked(
        self: &Arc<Self>,
        rec: BoxRecord,
        _guard: tokio::sync::OwnedMutexGuard<()>,
    ) -> Result<(BoxHandle, SessionGuard), ManagerError> {
        let addr = self.bring_up(&rec).await?;
        {
            let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
            let s = sessions.entry(rec.id.clone()).or_default();
            s.open += 1;
            s.generation += 1;
        }
        Ok((addr, SessionGuard { manager: Arc::clone(self), id: rec.id, held: None }))
    }

    /// Makes a box run, whatever state it is in; the caller holds its lock.
    pub(super) async fn bring_up(&self, rec: &BoxRecord) -> Result<BoxHandle, ManagerError> {
        self.known_here(rec);
        if rec.state == BoxState::Suspended {
            let started = std::time::Instant::now();
            // The suspension ends now, whatever the steps below take.
            let now_ms = crate::clock::now_ms();
            self.network_resuming(&rec.id).await;
            let listening = started.elapsed();
            // Its counters are read while it is still frozen, then it thaws:
            // one trip to the blocking pool.
            let r = rec.clone();
            let thaw = self.blocking(move |b| {
                let reading = b.meter(&r);
                b.thaw(&r).map(|()| reading)
            });
            let reading = match thaw.await.and_then(|r| r.map_err(ManagerError::from)) {
                Ok(reading) => reading,
                Err(e) => {
                    // What serves it lets go again, for the next resume to make.
                    self.tell_network(|hooks| hooks.suspended(&rec.id));
                    return Err(e);
                }
            };
            let thawed = started.elapsed();
            // The suspension billed and the box marked running: one commit.
            let billed = self.sample(rec, reading, now_ms).and_then(|(sample, meter)| {
                let metered = started.elapsed();
                self.db(|s| s.record_resume(rec, &sample, meter))?;
                Ok(metered)
            });
            let metered = match billed {
                Ok(metered) => metered,
                Err(e) => {
                    // Undone, so that the box is what the store says: frozen
                    // again, and what serves it let go.
                    self.put_back(rec, Frozen::Yes).await;
                    self.tell_network(|hooks| hooks.suspended(&rec.id));
                    return Err(e);
                }
            };
            tracing::info!(
                box_id = %rec.id, name = %rec.name, listen = ?listening, thaw = ?(thawed - listening),
                meter = ?(metered - thawed), store = ?(started.elapsed() - metered), "box resumed"
            );
        }
        if !self.still_serving(rec) {
            return Err(ManagerError::Fenced(self.node.clone()));
        }
        let r = rec.clone();
        if let Some(handle) = self.blocking(move |b| b.handle(&r)).await? {
            return Ok(handle);
        }
        self.meter_box(rec).await?;
        let r = rec.clone();
        let handle = self.blocking(move |b| b.start(&r)).await??;
        self.db(|s| s.set_state(&rec.id, BoxState::Running, Some(handle.pid)))?;
        self.network_up(rec, &handle, false);
        self.tell_service(rec).await;
        // The new cgroup's CPU counter starts from zero.
        self.db(|s| s.reset_meter_cpu(&rec.id))?;
        tracing::info!(box_id = %rec.id, name = %rec.name, pid = handle.pid, "box booted");
        if !self.still_serving(rec) {
            return Err(ManagerError::Fenced(self.node.clone()));
        }
        Ok(handle)
    }

    /// Starts the idle timer of a box that has no session (after it is created,
    /// started, or found running at daemon start).
    pub(super) fn schedule_idle(self: &Arc<Self>, id: &BoxId) {
        let generation = {
            let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
            let s = sessions.entry(id.clone()).or_default();
            if s.open > 0 {
                return;
            }
            s.generation += 1;
            s.generation
        };
        self.idle_timer(id.clone(), generation);
    }

    /// Suspends box `id` once it has been without a session for its idle
    /// grace (unless one came meanwhile: `generation` moved on). A suspension
    /// that fails (the store away for a while) is tried again, later each
    /// time: an idle box left running is billed and holds its memory.
    fn idle_timer(self: &Arc<Self>, id: BoxId, generation: u64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let manager = Arc::clone(self);
        runtime.spawn(async move {
            let mut wait = match manager.store.get_by_id(&id) {
                Ok(Some(rec)) => rec.idle.map_or(manager.config.idle_grace, |s| Duration::from_secs(u64::from(s))),
                Ok(None) => return,
                Err(_) => manager.config.idle_grace,
            };
            let mut retry = IDLE_RETRY_FIRST;
            for _ in 0..IDLE_TRIES {
                tokio::time::sleep(wait).await;
                match manager.suspend_if_idle(&id, generation).await {
                    Ok(()) => return,
                    Err(e) => {
                        tracing::warn!(box_id = %id, error = %e, retry_in = ?retry, "could not suspend an idle box");
                    }
                }
                (wait, retry) = (retry, (retry * 2).min(IDLE_RETRY_MOST));
            }
        });
    }

    async fn suspend_if_idle(&self, id: &BoxId, generation: u64) -> Result<(), ManagerError> {
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let still_idle = {
            let sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
            sessions.get(id).is_none_or(|s| s.open == 0 && s.generation == generation)
        };
        let Some(rec) = self.db(|s| s.get_by_id(id))? else { return Ok(()) };
        if !still_idle || rec.state != BoxState::Running || rec.keep_running {
            return Ok(());
        }
        self.suspend_locked(&rec, "no session").await
    }

    /// Suspends a running box now, whatever its sessions (they resume it on
    /// their next request to the box).
    pub async fn suspend(&self, account: &AccountId, name: &Name) -> Result<(), ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        if rec.state != BoxState::Running {
            return Ok(());
        }
        self.suspend_locked(&rec, "asked").await
    }

    async fn suspend_locked(&self, rec: &BoxRecord, why: &str) -> Result<(), ManagerError> {
        self.meter_box(rec).await?;
        let r = rec.clone();
        self.blocking(move |b| b.suspend(&r)).await??;
        if let Err(e) = self.db(|s| s.set_state(&rec.id, BoxState::Suspended, rec.pid)) {
            // Thawed again, so that the box is what the store says: running
            // (a frozen box the store calls running would take sessions and
            // never answer them).
            self.put_back(rec, Frozen::No).await;
            return Err(e.into());
        }
        self.tell_network(|hooks| hooks.suspended(&rec.id));
        self.tell_durable(&rec.id);
        tracing::info!(box_id = %rec.id, name = %rec.name, why, "box suspended");
        Ok(())
    }

    /// Freezes or thaws box `rec` again after a step of its suspension or
    /// resume failed, so that it is what the store still says. A failure here
    /// is logged: the caller returns the first one.
    async fn put_back(&self, rec: &BoxRecord, frozen: Frozen) {
        let r = rec.clone();
        let done = self.blocking(move |b| if frozen == Frozen::Yes { b.suspend(&r) } else { b.thaw(&r) }).await;
        if let Err(e) = done.and_then(|r| r.map_err(ManagerError::from)) {
            tracing::error!(box_id = %rec.id, error = %e, frozen = frozen == Frozen::Yes, "cannot put a box back as the store has it");
        }
    }

    /// Ends every process of a box; its files stay. The next session boots it.
    pub async fn stop(&self, account: &AccountId, name: &Name) -> Result<(), ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        self.stop_locked(&rec, false).await
    }

    /// Stops a box (`park`: only to release its memory, which a backend
    /// that can keeps for the next start).
    pub(super) async fn stop_locked(&self, rec: &BoxRecord, park: bool) -> Result<(), ManagerError> {
        if rec.state == BoxState::Creating {
            return Err(ManagerError::Busy(rec.name.clone()));
        }
        self.meter_box(rec).await?;
        let r = rec.clone();
        self.blocking(move |b| if park { b.park(&r) } else { b.stop(&r) }).await??;
        self.network_down(&rec.id);
        self.db(|s| s.set_state(&rec.id, BoxState::Stopped, None))?;
        tracing::info!(box_id = %rec.id, name = %rec.name, "box stopped");
        Ok(())
    }

    /// Boots (or resumes) a box without a session; the idle rule then applies.
    pub async fn start(self: &Arc<Self>, account: &AccountId, name: &Name) -> Result<(), ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        self.bring_up(&rec).await?;
        self.schedule_idle(&rec.id);
        Ok(())
    }

    /// Sets how long the box may go without a session before it is suspended.
    pub async fn set_idle(
        self: &Arc<Self>,
        account: &AccountId,
        name: &Name,
        seconds: u32,
    ) -> Result<(), ManagerError> {
        let rec = self.get(account, name)?;
        self.db(|s| s.set_idle(&rec.id, Some(seconds)))?;
        self.schedule_idle(&rec.id);
        Ok(())
    }

    /// Exempts a box from suspension (resuming it if it is suspended), or
    /// subjects it to the idle rule again.
    pub async fn set_keep_running(
        self: &Arc<Self>,
        account: &AccountId,
        name: &Name,
        on: bool,
    ) -> Result<(), ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        self.db(|s| s.set_keep_running(&rec.id, on))?;
        if on && rec.state == BoxState::Suspended {
            self.bring_up(&rec).await?;
        }
        if !on {
            self.schedule_idle(&rec.id);
        }
        Ok(())
    }
}
