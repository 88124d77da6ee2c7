//! What an agent gives back once its sessions end. A suspended box is its
//! agent, frozen with whatever it held at its busiest: each ended session's
//! thread stack (glibc keeps up to 40 MiB of them for reuse) and the free
//! pages of its heap. The host starts the agent with glibc's stack cache
//! off and one malloc arena (`GLIBC_TUNABLES`, see moat-box's ns/enforce.rs);
//! here ended session threads are joined, which unmaps their stacks, and the
//! heap is trimmed. Measured after 24 sessions at once, each streaming 4 MB
//! (e2e `exec_sessions_leave_the_agent_small`): 3,440 KiB of private memory
//! held before, ~210 KiB now; a fresh box's agent 96 KiB (120 before).

use std::thread::JoinHandle;

/// The threads serving the host's connections.
#[derive(Default)]
pub struct Sessions(Vec<JoinHandle<()>>);

impl Sessions {
    /// Keeps `session` (if its thread was made) to join when it ends.
    pub fn add(&mut self, session: Option<JoinHandle<()>>) {
        self.0.extend(session);
    }

    /// Joins the sessions that ended and returns the heap's free pages.
    /// Cheap when none ended: the idle loop calls it on every wake.
    pub fn reclaim(&mut self) {
        if !self.0.iter().any(JoinHandle::is_finished) {
            return;
        }
        let (ended, running) = std::mem::take(&mut self.0).into_iter().partition(JoinHandle::is_finished);
        self.0 = running;
        for session in ended {
            // A session that panicked has nothing left to give.
            let _ = session.join();
        }
        trim_heap();
    }
}

#[cfg(target_env = "gnu")]
fn trim_heap() {
    // SAFETY: malloc_trim takes no pointers; it only returns free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(target_env = "gnu"))]
fn trim_heap() {}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ended_sessions_are_joined_and_running_ones_kept() {
        let mut sessions = Sessions::default();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        sessions.add(Some(std::thread::spawn(|| {})));
        sessions.add(Some(std::thread::spawn(move || {
            let _ = wait.recv();
        })));
        sessions.add(None);
        while !sessions.0.first().unwrap().is_finished() {
            std::thread::yield_now();
        }
        sessions.reclaim();
        assert_eq!(sessions.0.len(), 1);
        assert!(!sessions.0.first().unwrap().is_finished());
        release.send(()).unwrap();
        while !sessions.0.iter().all(JoinHandle::is_finished) {
            std::thread::yield_now();
        }
        sessions.reclaim();
        assert!(sessions.0.is_empty());
    }
}
