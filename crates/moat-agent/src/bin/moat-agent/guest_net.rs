//! A microVM guest's network: `lo`, and its one virtio network device with
//! address [`GUEST_ADDR`] and every route through [`GUEST_ROUTER`], the host
//! end of the link. Set with the classic interface ioctls, so no tool need
//! be in the image. What leaves goes where the host's side of the link
//! sends it (the egress gateway); nothing here is a control.
//!
//! [`GUEST_ADDR`]: moat_agent::GUEST_ADDR
//! [`GUEST_ROUTER`]: moat_agent::GUEST_ROUTER

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};

/// Brings up `lo` and the first ethernet device, and routes everything
/// through the router. A guest without a network device reaches nothing,
/// which is not an error.
pub fn configure() -> io::Result<()> {
    let sock = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    set_up(&sock, "lo")?;
    let Some(dev) = first_ethernet() else { return Ok(()) };
    set_addr(&sock, &dev, libc::SIOCSIFADDR, moat_agent::GUEST_ADDR)?;
    set_addr(&sock, &dev, libc::SIOCSIFNETMASK, Ipv4Addr::BROADCAST)?;
    set_up(&sock, &dev)?;
    let host = Ipv4Addr::BROADCAST;
    add_route(&sock, &dev, moat_agent::GUEST_ROUTER, host, None)?;
    add_route(&sock, &dev, Ipv4Addr::UNSPECIFIED, Ipv4Addr::UNSPECIFIED, Some(moat_agent::GUEST_ROUTER))
}

/// The first network device that is not loopback, by name.
fn first_ethernet() -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n != "lo")
        .collect();
    names.sort();
    names.into_iter().next()
}

fn request(dev: &str) -> io::Result<libc::ifreq> {
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if dev.len() >= req.ifr_name.len() {
        return Err(io::Error::other(format!("device name {dev} too long")));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(dev.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size, and every bit
    // pattern is a valid sockaddr.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn set_up(sock: &OwnedFd, dev: &str) -> io::Result<()> {
    let mut req = request(dev)?;
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own, on an
    // open socket; the union member used is ifru_flags, as the ioctls define.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn set_addr(sock: &OwnedFd, dev: &str, op: libc::Ioctl, ip: Ipv4Addr) -> io::Result<()> {
    let mut req = request(dev)?;
    req.ifr_ifru.ifru_addr = sockaddr(ip);
    // SAFETY: SIOCSIFADDR/SIOCSIFNETMASK read the ifreq we own, whose union
    // member ifru_addr holds an AF_INET address, as the ioctls define.
    if unsafe { libc::ioctl(sock.as_raw_fd(), op, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn add_route(sock: &OwnedFd, dev: &str, dst: Ipv4Addr, mask: Ipv4Addr, via: Option<Ipv4Addr>) -> io::Result<()> {
    let mut name: Vec<libc::c_char> = dev.bytes().map(|b| b as libc::c_char).collect();
    name.push(0);
    // SAFETY: rtentry is plain old data; all-zero is a valid value.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr(dst);
    rt.rt_genmask = sockaddr(mask);
    rt.rt_flags = libc::RTF_UP;
    if mask == Ipv4Addr::BROADCAST {
        rt.rt_flags |= libc::RTF_HOST;
    }
    if let Some(gw) = via {
        rt.rt_gateway = sockaddr(gw);
        rt.rt_flags |= libc::RTF_GATEWAY;
    }
    rt.rt_dev = name.as_mut_ptr();
    // SAFETY: SIOCADDRT reads the rtentry we own; rt_dev points at `name`, a
    // NUL-terminated string alive across the call.
    match unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT, &rt) } {
        0 => Ok(()),
        _ => match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            e => Err(e),
        },
    }
}
