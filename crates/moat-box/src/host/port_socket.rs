//! Sockets in a namespace box's own network, made by the privileged side for
//! the HTTP edge, which connects them to the box's ports itself: a request
//! then reaches the box's server through the host kernel alone, with no agent
//! round trip per connection and no socket the box ever held (a box that
//! made the socket could change its options under the edge, lingering on
//! close among them).

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;

use nix::sys::socket::{setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType};

/// `count` non-blocking, unconnected TCP sockets in the network namespace of
/// process `pid`, made on this thread (it goes back after), once
/// `still_the_box` says, after that namespace is open, that `pid` is still
/// one of the box's: a pid the box let go of and another process took would
/// otherwise hand out sockets of that one's network (the host's, at worst,
/// which is refused outright too). IPv6 sockets that take IPv4 too (mapped
/// addresses): one kind reaches a server on 127.0.0.1 or on ::1.
pub fn box_sockets(pid: u32, still_the_box: impl FnOnce() -> bool, count: usize) -> io::Result<Vec<OwnedFd>> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    if !still_the_box() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "the box's process ended"));
    }
    super::egress::briefly_in_open_netns(&ns, || {
        (0..count)
            .map(|_| {
                let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
                let fd = socket(AddressFamily::Inet6, SockType::Stream, flags, None)?;
                setsockopt(&fd, sockopt::Ipv6V6Only, &false)?;
                Ok(fd)
            })
            .collect::<nix::Result<Vec<_>>>()
            .map_err(io::Error::from)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {

    use super::*;

    #[test]
    fn the_hosts_own_network_is_refused() {
        let err = box_sockets(std::process::id(), || true, 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
    }

    #[test]
    fn a_process_no_longer_the_boxs_is_refused() {
        let err = box_sockets(std::process::id(), || false, 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }

    /// A process in a network namespace of its own (as a box's first one
    /// is) gets sockets of that namespace that reach its IPv4 loopback.
    #[test]
    fn sockets_reach_the_boxs_own_loopback() {
        let port = 47613;
        let listen = format!(
            "ip link set lo up && exec /usr/bin/python3 -c 'import socket,time; s=socket.socket(); \
             s.bind((\"127.0.0.1\", {port})); s.listen(); time.sleep(30)'"
        );
        let mut child = std::process::Command::new("unshare").args(["--net", "sh", "-c", &listen]).spawn().unwrap();
        let to = nix::sys::socket::SockaddrIn6::from(std::net::SocketAddrV6::new(
            std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
            port,
            0,
            0,
        ));
        let connects = |fd: OwnedFd| {
            let tcp = std::net::TcpStream::from(fd);
            tcp.set_nonblocking(false).unwrap();
            nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&tcp), &to).is_ok()
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut reached = false;
        while !reached && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
            reached = box_sockets(child.id(), || true, 2).is_ok_and(|made| made.into_iter().all(connects));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(reached, "no socket reached the server in the box's network");
        // The host's own loopback has no such server.
        let host = socket(AddressFamily::Inet6, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        assert!(!connects(host));
    }
}
