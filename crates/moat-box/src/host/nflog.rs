//! The netlink log socket through which a box's namespace reports the UDP
//! and ICMP packets it drops (its nftables rules log them to
//! [`DROPPED_GROUP`]). Made and bound to the group here, with the privileges
//! that takes, inside the box's namespace; read by the gateway.

use std::os::fd::OwnedFd;

use std::io;

use moat_core::egress::{DROPPED_GROUP, NFNL_SUBSYS_ULOG};
use nix::sys::socket::{
    bind, recv, send, setsockopt, socket, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol,
    SockType,
};

const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;
/// Bytes of each packet copied: the IP and UDP or ICMP headers and a little.
const COPY_RANGE: u32 = 96;

/// A netlink socket, in the calling thread's network namespace, that
/// receives the packets logged to [`DROPPED_GROUP`] there.
pub fn dropped_packets() -> io::Result<OwnedFd> {
    let fd = socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::NetlinkNetFilter)
        .map_err(context("netlink socket"))?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &NetlinkAddr::new(0, 0)).map_err(context("bind netlink socket"))?;
    setsockopt(&fd, sockopt::RcvBuf, &(1 << 20)).map_err(context("netlink buffer"))?;
    // A reply never waits long; a kernel that does not answer is an error.
    setsockopt(&fd, sockopt::ReceiveTimeout, &nix::sys::time::TimeVal::new(1, 0))?;
    configure(&fd, 1, NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]).map_err(context("bind the log group"))?;
    let mut mode = COPY_RANGE.to_be_bytes().to_vec();
    mode.extend([NFULNL_COPY_PACKET, 0]);
    configure(&fd, 2, NFULA_CFG_MODE, &mode).map_err(context("set the copy mode"))?;
    Ok(fd)
}

/// Sends one configuration message for the group and waits for its ack.
fn configure(fd: &OwnedFd, seq: u32, attr: u16, value: &[u8]) -> io::Result<()> {
    let attr_len = 4 + value.len();
    let padded = (attr_len + 3) & !3;
    let len = 16 + 4 + padded;
    let mut msg = Vec::with_capacity(len);
    msg.extend((len as u32).to_ne_bytes());
    msg.extend(((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG).to_ne_bytes());
    msg.extend((NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg.extend(seq.to_ne_bytes());
    msg.extend(0u32.to_ne_bytes());
    // nfgenmsg: any family, version 0, the group (big-endian).
    msg.extend([0, 0]);
    msg.extend(DROPPED_GROUP.to_be_bytes());
    msg.extend((attr_len as u16).to_ne_bytes());
    msg.extend(attr.to_ne_bytes());
    msg.extend(value);
    msg.resize(len, 0);
    let raw = std::os::fd::AsRawFd::as_raw_fd(fd);
    send(raw, &msg, MsgFlags::empty()).map_err(context("send"))?;
    let mut reply = [0u8; 256];
    let n = recv(raw, &mut reply, MsgFlags::empty()).map_err(context("no answer"))?;
    let kind = reply.get(4..6).map(|b| u16::from_ne_bytes([b[0], b[1]]));
    let error = reply.get(16..20).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    match (n >= 20, kind, error) {
        (true, Some(NLMSG_ERROR), Some(0)) => Ok(()),
        (true, Some(NLMSG_ERROR), Some(e)) => Err(io::Error::from_raw_os_error(-e)),
        _ => Err(io::Error::other("unexpected reply")),
    }
}

/// Names what failed, keeping the kernel's error.
fn context<E: Into<io::Error> + std::fmt::Display>(what: &'static str) -> impl Fn(E) -> io::Error {
    move |e| {
        let message = format!("{what}: {e}");
        io::Error::new(e.into().kind(), message)
    }
}
