//! The one way moat hands a descriptor it owns to tokio: sockets tokio has
//! no type for (a unix packet socket, a netlink socket) registered for
//! readiness, owned by the registration for its whole life.

use std::io;
use std::os::fd::OwnedFd;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// `fd`, made non-blocking and registered with the current tokio runtime
/// for `interest`. Needs a tokio runtime.
#[allow(unsafe_code)]
pub fn register(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    rustix::io::ioctl_fionbio(&fd, true)?;
    // SAFETY: an `OwnedFd` is open, and stays the same descriptor, until it
    // is dropped, which happens only when the `AsyncFd` that owns it is.
    unsafe { AsyncFd::register_with_interest(fd, interest) }.map_err(io::Error::from)
}
