//! Network interface calls: loopback up, a tap device for a guest, and a
//! socket's unread bytes.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own, on an open
    // socket; the union member used is ifru_flags, as the ioctls define.
    unsafe {
        if libc::ioctl(sock.as_fd().as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_fd().as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `TUNSETIFF`: `_IOW('T', 202, int)`.
const TUNSETIFF: libc::Ioctl = 0x4004_54ca;

/// Makes tap device `name` in the caller's network namespace, for as long as
/// the returned descriptor (its only queue) stays open.
pub fn open_tap(name: &str) -> io::Result<OwnedFd> {
    let tun = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun")?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(io::Error::other(format!("device name {name} too long")));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF reads the ifreq we own (name and flags), on the open
    // tun device.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tun.into())
}

/// Bytes written to a socket that its peer has not read yet (`SIOCOUTQ`).
pub fn unread_by_peer(sock: BorrowedFd<'_>) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int we own, on an open socket.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::TIOCOUTQ, &mut n) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}
