//! UDP (other than DNS) and ICMP from a box go nowhere: its namespace has no
//! way out for them. Its nftables rules copy their heads to a netlink log
//! socket (NFLOG) that the privileged side made in the box's namespace; here
//! each becomes a log entry. The bytes are the box's own packets: they are
//! read as untrusted input, bounded, and never trusted for anything but the
//! entry they become.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use moat_core::egress::{LogEntry, LogKind, LogVerdict, NFNL_SUBSYS_ULOG};

use crate::boxnet::BoxNet;
use crate::log::entry;

/// Its packet message.
const NFULNL_MSG_PACKET: u16 = 0;
/// The attribute holding the packet.
const NFULA_PAYLOAD: u16 = 9;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
const PROTO_ICMP: u8 = 1;
const PROTO_UDP: u8 = 17;
const PROTO_ICMPV6: u8 = 58;

/// Reads the box's dropped-packet reports on `fd` until the task is dropped.
pub async fn serve(net: Arc<BoxNet>, fd: OwnedFd) {
    let Ok(fd) = moat_core::async_fd::register(fd, tokio::io::Interest::READABLE) else {
        return;
    };
    loop {
        let Ok(mut ready) = fd.readable().await else { return };
        let got = ready.try_io(|fd| {
            crate::scratch::with(|buf| {
                let (n, _) = rustix::net::recv(fd.get_ref(), &mut *buf, rustix::net::RecvFlags::DONTWAIT)?;
                Ok::<_, std::io::Error>(entries(buf.get(..n).unwrap_or_default()))
            })
        });
        match got {
            Ok(Ok(entries)) => {
                for entry in entries {
                    net.log(entry);
                }
            }
            // Reports lost to a full buffer are lost (the rules also cap
            // the rate); anything else, wait a little and go on.
            Ok(Err(e)) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
            Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(_would_block) => {}
        }
    }
}

/// The log entries in one read of the netlink socket.
pub fn entries(mut msgs: &[u8]) -> Vec<LogEntry> {
    let mut out = Vec::new();
    while msgs.len() >= NLMSG_HDRLEN {
        let (Some(len), Some(kind)) = (ne_u32(msgs, 0), ne_u16(msgs, 4)) else { break };
        let len = len as usize;
        let Some(body) = msgs.get(NLMSG_HDRLEN..len) else { break };
        if kind == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET {
            if let Some(packet) = payload(body) {
                out.extend(describe(packet));
            }
        }
        msgs = msgs.get(align(len)..).unwrap_or_default();
    }
    out
}

/// The `u32` in host order at `at`, if `bytes` holds it.
fn ne_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

/// The `u16` in host order at `at`, if `bytes` holds it.
fn ne_u16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(bytes.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// The packet attribute of one log message.
fn payload(msg: &[u8]) -> Option<&[u8]> {
    let mut attrs = msg.get(NFGENMSG_LEN..)?;
    while attrs.len() >= 4 {
        let len = usize::from(ne_u16(attrs, 0)?);
        let kind = ne_u16(attrs, 2)? & 0x3fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if kind == NFULA_PAYLOAD {
            return attrs.get(4..len);
        }
        attrs = attrs.get(align(len)..).unwrap_or_default();
    }
    None
}

/// What a dropped packet was: a log entry, if it is UDP or ICMP.
fn describe(packet: &[u8]) -> Option<LogEntry> {
    let (proto, dst, transport) = match packet.first()? >> 4 {
        4 => {
            let ihl = usize::from(packet.first()? & 0x0f) * 4;
            let dst: [u8; 4] = packet.get(16..20)?.try_into().ok()?;
            (*packet.get(9)?, IpAddr::V4(Ipv4Addr::from(dst)), packet.get(ihl..)?)
        }
        6 => {
            let dst: [u8; 16] = packet.get(24..40)?.try_into().ok()?;
            (*packet.get(6)?, IpAddr::V6(Ipv6Addr::from(dst)), packet.get(40..)?)
        }
        _ => return None,
    };
    let (kind, port, detail) = match proto {
        PROTO_UDP => {
            let port = u16::from_be_bytes([*transport.get(2)?, *transport.get(3)?]);
            (LogKind::Udp, port, None)
        }
        PROTO_ICMP | PROTO_ICMPV6 => {
            let kind = *transport.first()?;
            (LogKind::Icmp, 0, Some(icmp_name(proto, kind)))
        }
        _ => return None,
    };
    let mut e = entry(kind, dst.to_string(), port, LogVerdict::Deny);
    e.method = detail;
    e.reason = Some("UDP and ICMP go nowhere (only DNS, answered by the gateway)".into());
    Some(e)
}

fn icmp_name(proto: u8, kind: u8) -> String {
    match (proto, kind) {
        (PROTO_ICMP, 8) | (PROTO_ICMPV6, 128) => "echo-request".into(),
        (_, kind) => format!("type {kind}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    /// A log message as the kernel sends it, holding `packet`.
    fn message(packet: &[u8]) -> Vec<u8> {
        let mut attrs = Vec::new();
        // A prefix attribute first, as the kernel may send others before the payload.
        attrs.extend(8u16.to_ne_bytes());
        attrs.extend(10u16.to_ne_bytes());
        attrs.extend(b"abc\0");
        attrs.extend(((4 + packet.len()) as u16).to_ne_bytes());
        attrs.extend(NFULA_PAYLOAD.to_ne_bytes());
        attrs.extend(packet);
        while attrs.len() % 4 != 0 {
            attrs.push(0);
        }
        let len = NLMSG_HDRLEN + NFGENMSG_LEN + attrs.len();
        let mut m = Vec::new();
        m.extend((len as u32).to_ne_bytes());
        m.extend(((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET).to_ne_bytes());
        m.extend([0u8; 10]);
        m.extend([2, 0, 0, 1]);
        m.extend(attrs);
        m
    }

    fn udp4(dst: [u8; 4], port: u16) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 28, 0, 0, 0, 0, 64, PROTO_UDP, 0, 0, 198, 18, 0, 1];
        p.extend(dst);
        p.extend([0x30, 0x39]);
        p.extend(port.to_be_bytes());
        p.extend([0, 8, 0, 0]);
        p
    }

    #[test]
    fn udp_and_ping_become_entries() {
        let mut read = message(&udp4([203, 0, 113, 10], 9999));
        let mut ping = vec![0x60, 0, 0, 0, 0, 8, PROTO_ICMPV6, 64];
        ping.extend([0u8; 16]);
        ping.extend(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).octets());
        ping.extend([128, 0, 0, 0, 0, 0, 0, 0]);
        read.extend(message(&ping));
        let got = entries(&read);
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].kind, got[0].name.as_str(), got[0].port), (LogKind::Udp, "203.0.113.10", 9999));
        assert_eq!((got[1].kind, got[1].name.as_str()), (LogKind::Icmp, "2001:db8::1"));
        assert_eq!(got[1].method.as_deref(), Some("echo-request"));
    }

    #[test]
    fn hostile_or_cut_messages_are_skipped_not_panics() {
        let good = message(&udp4([1, 2, 3, 4], 53));
        for cut in 0..good.len() {
            let _ = entries(&good[..cut]);
        }
        let mut bad = good.clone();
        bad[0] = 0xff;
        assert!(entries(&bad).is_empty());
        // A header length past the packet, a zero-length attribute.
        let mut short = udp4([1, 2, 3, 4], 53);
        short[0] = 0x4f;
        assert!(entries(&message(&short)).is_empty());
        let mut zero = good;
        zero[NLMSG_HDRLEN + NFGENMSG_LEN] = 0;
        zero[NLMSG_HDRLEN + NFGENMSG_LEN + 1] = 0;
        assert!(entries(&zero).is_empty());
    }
}
