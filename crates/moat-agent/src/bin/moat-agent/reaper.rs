//! The PID 1 duty: reap every child, and hand each exit status to whoever waits
//! for that pid.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use moat_agent::protocol::ExitStatus;
use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

#[derive(Default)]
struct Waiters {
    by_pid: HashMap<i32, Sender<ExitStatus>>,
}

/// Reaps children, on a thread of its own or when its owner says.
pub struct Reaper {
    waiters: Arc<(Mutex<Waiters>, Condvar)>,
    /// Statuses reaped while a spawn held the waiters (driven reaping only).
    undelivered: Mutex<Vec<WaitStatus>>,
}

impl Reaper {
    /// Reaps on a thread of its own.
    pub fn start() -> Self {
        let reaper = Self::driven();
        let shared = Arc::clone(&reaper.waiters);
        std::thread::spawn(move || reap_forever(&shared));
        reaper
    }

    /// Reaps when its owner calls [`Reaper::reap`] (on SIGCHLD): no thread.
    pub fn driven() -> Self {
        Self { waiters: Arc::new((Mutex::new(Waiters::default()), Condvar::new())), undelivered: Mutex::default() }
    }

    /// Reaps every child that has ended, without waiting for more, and hands
    /// each status to its waiter. Never waits for the waiters' lock (a spawn
    /// holds it until its child has exec'd, which a stopped child never
    /// does): `false` if statuses wait for it, to be tried again soon.
    pub fn reap(&self) -> bool {
        let mut undelivered = lock_ignoring_poison(&self.undelivered);
        while let Ok(status) = waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            if status == WaitStatus::StillAlive {
                break;
            }
            undelivered.push(status);
        }
        let mut waiters = match self.waiters.0.try_lock() {
            Ok(waiters) => waiters,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return undelivered.is_empty(),
        };
        for status in undelivered.drain(..) {
            deliver(&mut waiters, status);
        }
        true
    }

    /// Runs `spawn` (which forks) with the waiter table locked, so that the child's
    /// exit cannot be reaped before its waiter is registered.
    pub fn spawn_watched<E>(&self, spawn: impl FnOnce() -> Result<Pid, E>) -> Result<(Pid, Receiver<ExitStatus>), E> {
        let (lock, wake) = &*self.waiters;
        let mut waiters = lock_ignoring_poison(lock);
        let pid = spawn()?;
        let (tx, rx) = mpsc::channel();
        waiters.by_pid.insert(pid.as_raw(), tx);
        wake.notify_one();
        Ok((pid, rx))
    }
}

fn lock_ignoring_poison<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn reap_forever(waiters: &(Mutex<Waiters>, Condvar)) {
    let (lock, wake) = waiters;
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(status) => deliver(&mut lock_ignoring_poison(lock), status),
            Err(Errno::EINTR) => {}
            Err(_) => {
                // No children at all: sleep until a spawn (or a while) passes.
                let guard = lock_ignoring_poison(lock);
                let _ = wake.wait_timeout(guard, Duration::from_secs(1));
            }
        }
    }
}

/// Hands an ended child's status to whoever waits for it.
fn deliver(waiters: &mut Waiters, status: WaitStatus) {
    let (pid, status) = match status {
        WaitStatus::Exited(pid, code) => (pid, ExitStatus::Code(code)),
        WaitStatus::Signaled(pid, sig, core_dumped) => (pid, ExitStatus::Signal { signo: sig as i32, core_dumped }),
        _ => return,
    };
    // Orphans reparented to PID 1 have no waiter; reaping them is the point.
    if let Some(tx) = waiters.by_pid.remove(&pid.as_raw()) {
        let _ = tx.send(status);
    }
}
