//! Waiting for a unix stream to be shut both ways: its peer closed it whole,
//! or each direction has ended. Poll reports a hangup only then, not at a
//! half close, so a relay can tell a peer that merely ended its writing (and
//! still reads) from one that is gone.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// Returns once `socket` is shut both ways (or cannot be polled).
pub fn wait(socket: &UnixStream) {
    loop {
        let mut fds = [PollFd::new(socket.as_fd(), PollFlags::empty())];
        let woken = poll(&mut fds, PollTimeout::NONE);
        let revents = fds.first().and_then(PollFd::revents).unwrap_or(PollFlags::empty());
        match woken {
            Err(Errno::EINTR) => {}
            Ok(_) if revents.is_empty() => {}
            _ => return,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::net::Shutdown;
    use std::time::{Duration, Instant};

    #[test]
    fn a_half_close_is_no_hangup_and_a_whole_close_is() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        theirs.shutdown(Shutdown::Write).unwrap();
        let waiting = std::thread::spawn(move || {
            wait(&ours);
            Instant::now()
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(!waiting.is_finished(), "a half close was taken for a hangup");
        let closed = Instant::now();
        drop(theirs);
        assert!(waiting.join().unwrap() >= closed);
    }
}
