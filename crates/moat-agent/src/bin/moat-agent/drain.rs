//! Output nobody reads any more, read and dropped until its writers close it.
//!
//! A session ends a little after its command exits although background jobs
//! still hold its output pipes (`ssh box 'server &'` returns; sshd would wait
//! for them). Closing the pipes then would kill those jobs at their next
//! line (SIGPIPE: a dev server died at the first request it logged), and
//! leaving them unread would stop them once a pipe's 64 KiB filled. So the
//! pipes are handed here: one thread, only while any are held, reads them
//! and drops what it reads, each until its last writer closes it.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, PoisonError};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

struct Held {
    /// Pipes handed over since the thread last looked.
    adopted: Vec<OwnedFd>,
    /// Wakes the thread (its write end), while it runs.
    wake: Option<OwnedFd>,
}

static HELD: Mutex<Held> = Mutex::new(Held { adopted: Vec::new(), wake: None });

fn held() -> MutexGuard<'static, Held> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reads `pipe` until its writers close it, dropping what comes. Without a
/// thread to be had (the box's pids limit) it is closed, as before.
pub fn adopt(pipe: OwnedFd) {
    let mut held = held();
    held.adopted.push(pipe);
    if let Some(wake) = &held.wake {
        let _ = nix::unistd::write(wake, &[1]);
        return;
    }
    let Ok((wake_read, wake_write)) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK) else {
        held.adopted.clear();
        return;
    };
    match std::thread::Builder::new().spawn(move || drain(&wake_read)) {
        Ok(_) => held.wake = Some(wake_write),
        Err(_) => held.adopted.clear(),
    }
}

/// The thread: ends once every pipe it held has closed.
fn drain(wake: &OwnedFd) {
    let mut pipes: Vec<OwnedFd> = Vec::new();
    let mut buf = vec![0u8; 16 << 10];
    loop {
        {
            let mut held = held();
            pipes.append(&mut held.adopted);
            if pipes.is_empty() {
                // Under the lock: a pipe adopted after this starts a new thread.
                held.wake = None;
                return;
            }
        }
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd> = std::iter::once(wake.as_fd())
                .chain(pipes.iter().map(AsFd::as_fd))
                .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
                .collect();
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => fds.iter().map(|fd| fd.revents().is_some_and(|r| !r.is_empty())).collect(),
                Err(Errno::EINTR) => continue,
                Err(_) => return,
            }
        };
        if ready.first() == Some(&true) {
            while nix::unistd::read(wake, &mut buf).is_ok_and(|n| n > 0) {}
        }
        let mut ready = ready.into_iter().skip(1);
        pipes.retain(|pipe| {
            if ready.next() != Some(true) {
                return true;
            }
            match nix::unistd::read(pipe, &mut buf) {
                Ok(0) => false, // every writer closed it
                Ok(_) | Err(Errno::EINTR | Errno::EAGAIN) => true,
                Err(_) => false,
            }
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::Write;
    use std::time::{Duration, Instant};

    use super::*;

    /// A writer whose reader went to the drain keeps writing far past a
    /// pipe's size (no SIGPIPE, no stall), and the drain lets the pipe go,
    /// and its thread end, once the writer closes it.
    #[test]
    fn a_writer_outlives_its_reader_and_the_drain_ends_after_it() {
        let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).unwrap();
        adopt(r);
        let mut w = std::fs::File::from(w);
        for _ in 0..64 {
            w.write_all(&[7; 16 << 10]).unwrap();
        }
        drop(w);
        let deadline = Instant::now() + Duration::from_secs(5);
        while held().wake.is_some() {
            assert!(Instant::now() < deadline, "the drain still runs");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
