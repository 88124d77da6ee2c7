//! A socket in a namespace box's own network, made by the privileged side
//! for the web edge: moat connects it to the box's port itself, so a request
//! reaches the box's server through the host kernel alone, with no agent
//! relaying its bytes.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;

use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};

/// A non-blocking TCP socket (IPv6 if `v6`) in the network namespace of
/// process `pid`, once `still_the_box` says, after that namespace is open,
/// that `pid` is still one of the box's: a pid the box let go of and another
/// process took would otherwise hand out a socket of that one's network (the
/// host's, at worst), so the host's own namespace is refused outright too.
pub fn box_socket(pid: u32, still_the_box: impl FnOnce() -> bool, v6: bool) -> io::Result<OwnedFd> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    if !still_the_box() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "the box's process ended"));
    }
    let (its, ours) = (ns.metadata()?, std::fs::metadata("/proc/self/ns/net")?);
    if (its.dev(), its.ino()) == (ours.dev(), ours.ino()) {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the process is in the host's own network"));
    }
    let family = if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet };
    super::egress::in_open_netns(&ns, || {
        socket(family, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)
            .map_err(io::Error::from)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_own_network_is_refused() {
        let err = box_socket(std::process::id(), || true, false).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
    }

    #[test]
    fn a_process_no_longer_the_boxs_is_refused() {
        let err = box_socket(std::process::id(), || false, false).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }
}
