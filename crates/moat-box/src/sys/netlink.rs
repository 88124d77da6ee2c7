//! Netlink requests built by hand and sent from the calling thread's network
//! namespace, each acknowledged by the kernel: what a box's namespace needs
//! of rtnetlink and nf_tables without running `ip` and `nft` (starting the
//! two tools cost ~7.5 ms of CPU a box, far more than the work they did).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::socket::{
    bind, recv, send, setsockopt, socket, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol,
    SockType,
};

/// A request (every message sent is one).
pub const NLM_F_REQUEST: u16 = 0x1;
/// Answer it, even when it succeeds.
pub const NLM_F_ACK: u16 = 0x4;
/// Refuse it if what it makes exists.
pub const NLM_F_EXCL: u16 = 0x200;
/// Make what it names.
pub const NLM_F_CREATE: u16 = 0x400;
/// After what is there (a rule, last in its chain).
pub const NLM_F_APPEND: u16 = 0x800;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const HEADER: usize = 16;

/// One netlink message: its header, a family header, then attributes.
pub struct Message {
    buf: Vec<u8>,
    /// Where each attribute still open (a nest) begins.
    open: Vec<usize>,
    /// What it asks, for an error that names it.
    what: &'static str,
}

impl Message {
    /// A message of type `kind` with `flags` (acknowledged if they ask it),
    /// and the family header `family` (`ifaddrmsg`, `rtmsg`, `nfgenmsg`).
    pub fn new(what: &'static str, kind: u16, flags: u16, family: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(256);
        buf.extend(0u32.to_ne_bytes()); // length, set when sent
        buf.extend(kind.to_ne_bytes());
        buf.extend(flags.to_ne_bytes());
        buf.extend(0u32.to_ne_bytes()); // sequence number, set when sent
        buf.extend(0u32.to_ne_bytes()); // port: the kernel's
        buf.extend(family);
        pad(&mut buf);
        Self { buf, open: Vec::new(), what }
    }

    /// Adds attribute `kind` holding `value`.
    pub fn attr(&mut self, kind: u16, value: &[u8]) -> &mut Self {
        let len = 4 + value.len();
        self.buf.extend(u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.buf.extend(kind.to_ne_bytes());
        self.buf.extend(value);
        pad(&mut self.buf);
        self
    }

    /// A NUL-terminated string attribute.
    pub fn string(&mut self, kind: u16, value: &str) -> &mut Self {
        let mut bytes = value.as_bytes().to_vec();
        bytes.push(0);
        self.attr(kind, &bytes)
    }

    /// A big-endian `u32` attribute (nf_tables' integers are).
    pub fn be32(&mut self, kind: u16, value: u32) -> &mut Self {
        self.attr(kind, &value.to_be_bytes())
    }

    /// A native-endian `u32` attribute (rtnetlink's are).
    pub fn ne32(&mut self, kind: u16, value: u32) -> &mut Self {
        self.attr(kind, &value.to_ne_bytes())
    }

    /// Opens nested attribute `kind`; what follows is inside it until
    /// [`Message::end`].
    pub fn nest(&mut self, kind: u16) -> &mut Self {
        self.open.push(self.buf.len());
        self.buf.extend(0u16.to_ne_bytes());
        self.buf.extend((kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    /// Closes the nest opened last.
    pub fn end(&mut self) -> &mut Self {
        if let Some(start) = self.open.pop() {
            let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
            self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    fn acked(&self) -> bool {
        u16::from_ne_bytes([self.buf[6], self.buf[7]]) & NLM_F_ACK != 0
    }

    /// The bytes to send, as message `seq`.
    fn sealed(&mut self, seq: u32) -> &[u8] {
        let len = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        &self.buf
    }
}

fn pad(buf: &mut Vec<u8>) {
    buf.resize((buf.len() + 3) & !3, 0);
}

/// Sends `messages` in one datagram over a new netlink socket of `protocol`
/// and waits until the kernel has acknowledged each that asks it; the
/// first refusal is the error, naming the message refused.
pub fn request(protocol: SockProtocol, mut messages: Vec<Message>) -> io::Result<()> {
    let fd: OwnedFd = socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, Some(protocol))?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
    // A kernel that does not answer is an error, not a hang.
    setsockopt(&fd, sockopt::ReceiveTimeout, &nix::sys::time::TimeVal::new(2, 0))?;
    let mut datagram = Vec::new();
    let mut waiting = Vec::new();
    for (seq, message) in (1u32..).zip(messages.iter_mut()) {
        if message.acked() {
            waiting.push(seq);
        }
        datagram.extend(message.sealed(seq));
    }
    send(fd.as_raw_fd(), &datagram, MsgFlags::empty())?;
    let mut reply = vec![0u8; 16 << 10];
    while !waiting.is_empty() {
        let n = recv(fd.as_raw_fd(), &mut reply, MsgFlags::empty())
            .map_err(|e| io::Error::new(io::Error::from(e).kind(), "netlink: no answer from the kernel"))?;
        let mut at = 0;
        while at + HEADER <= n {
            let word =
                |i: usize| reply.get(at + i..at + i + 4).map_or(0, |b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
            let len = word(0) as usize;
            let kind = (word(4) & 0xffff) as u16;
            let seq = word(8);
            if len < HEADER {
                return Err(io::Error::other("netlink: a malformed answer"));
            }
            if kind == NLMSG_ERROR {
                let code = word(HEADER) as i32;
                if code != 0 {
                    let what = seq.checked_sub(1).and_then(|i| messages.get(i as usize)).map_or("?", |m| m.what);
                    let e = io::Error::from_raw_os_error(code.wrapping_neg());
                    return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
                }
                waiting.retain(|s| *s != seq);
            }
            at += (len + 3) & !3;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nests_hold_their_length() {
        let mut m = Message::new("test", 16, NLM_F_REQUEST | NLM_F_ACK, &[2, 0, 0, 0]);
        m.string(1, "lo").nest(2).be32(1, 7).end();
        let bytes = m.sealed(9).to_vec();
        assert_eq!(bytes.len(), 16 + 4 + 8 + 4 + 8);
        assert_eq!(u32::from_ne_bytes(bytes[0..4].try_into().unwrap_or_default()), 40);
        assert_eq!(u32::from_ne_bytes(bytes[8..12].try_into().unwrap_or_default()), 9);
        // "lo\0" padded to 4.
        assert_eq!(&bytes[20..28], &[7, 0, 1, 0, b'l', b'o', 0, 0]);
        // The nest: its length covers its one attribute, and it says it nests.
        assert_eq!(&bytes[28..32], &[12, 0, 2, 0x80]);
        assert_eq!(&bytes[32..40], &[8, 0, 1, 0, 0, 0, 0, 7]);
        assert!(m.acked());
    }
}
