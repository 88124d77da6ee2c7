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

/// Reaps children on a thread of its own.
pub struct Reaper {
    waiters: Arc<(Mutex<Waiters>, Condvar)>,
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
        Self { waiters: Arc::new((Mutex::new(Waiters::default()), Condvar::new())) }
    }

    /// Reaps every child that has ended, without waiting for more.
    pub fn reap(&self) {
        while let Ok(status) = waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            if status == WaitStatus::StillAlive {
                return;
            }
            deliver(&self.waiters.0, status);
        }
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
            Ok(status) => deliver(lock, status),
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
fn deliver(lock: &Mutex<Waiters>, status: WaitStatus) {
    let (pid, status) = match status {
        WaitStatus::Exited(pid, code) => (pid, ExitStatus::Code(code)),
        WaitStatus::Signaled(pid, sig, core_dumped) => (pid, ExitStatus::Signal { signo: sig as i32, core_dumped }),
        _ => return,
    };
    // Orphans reparented to PID 1 have no waiter; reaping them is the point.
    if let Some(tx) = lock_ignoring_poison(lock).by_pid.remove(&pid.as_raw()) {
        let _ = tx.send(status);
    }
}
