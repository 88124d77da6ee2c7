//! Packets on a unix `SOCK_SEQPACKET` socket: message boundaries survive, and
//! a file descriptor travels attached to the message it belongs to.
//!
//! A message larger than one packet goes as fragments, each led by one byte
//! that says whether more follow; descriptors ride on the last. The receiver
//! bounds the whole message, so a hostile peer cannot make it buffer more than
//! it asked for, and refuses descriptors where none belong.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Payload bytes per packet: well under the default socket buffer (208 KiB),
/// which bounds one packet.
const FRAGMENT: usize = 32 << 10;
/// Most descriptors one message carries (a box's six gateway listeners, a
/// batch of sockets in a box's network for the HTTP edge).
pub const MAX_FDS: usize = 32;

const MORE: u8 = 0;
const LAST: u8 = 1;

/// One end of a packet socket.
#[derive(Debug)]
pub struct Packets {
    fd: AsyncFd<OwnedFd>,
}

/// A whole message and the descriptors that came with it.
#[derive(Debug)]
pub struct Message {
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Descriptors attached to it (closed when dropped).
    pub fds: Vec<OwnedFd>,
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl Packets {
    /// A connected pair of blocking-free, close-on-exec packet sockets.
    pub fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        Ok(rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)?)
    }

    /// Wraps a packet socket (it is made non-blocking). Needs a tokio runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        Ok(Self { fd: moat_core::async_fd::register(fd, Interest::READABLE | Interest::WRITABLE)? })
    }

    /// Sends one message, `fds` attached. Messages from concurrent senders on
    /// one socket could interleave their fragments: each socket has one writer.
    pub async fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for one message"));
        }
        let mut chunks = bytes.chunks(FRAGMENT).peekable();
        if chunks.peek().is_none() {
            return self.send_packet(LAST, &[], fds).await;
        }
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            let (head, attached) = if last { (LAST, fds) } else { (MORE, &[][..]) };
            self.send_packet(head, chunk, attached).await?;
        }
        Ok(())
    }

    async fn send_packet(&self, head: u8, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let head = [head];
        let iov = [IoSlice::new(&head), IoSlice::new(payload)];
        loop {
            let mut guard = self.fd.writable().await?;
            let sent = guard.try_io(|fd| {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                if !fds.is_empty() {
                    control.push(SendAncillaryMessage::ScmRights(fds));
                }
                Ok(rustix::net::sendmsg(fd.get_ref(), &iov, &mut control, SendFlags::NOSIGNAL)?)
            });
            match sent {
                Ok(result) => return result.map(|_| ()),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one whole message of at most `max` bytes; `None` when the peer
    /// has closed its end. A larger message, a cut packet, or descriptors on
    /// other than the last fragment are errors (the descriptors are closed).
    pub async fn recv(&self, max: usize) -> io::Result<Option<Message>> {
        let mut bytes = Vec::new();
        let mut buf = vec![0u8; FRAGMENT + 1];
        loop {
            let (len, fds) = match self.recv_packet(&mut buf).await? {
                Some(packet) => packet,
                None if bytes.is_empty() => return Ok(None),
                None => return Err(invalid("peer closed in the middle of a message")),
            };
            let (head, payload) =
                buf.get(..len).and_then(<[u8]>::split_first).ok_or_else(|| invalid("empty packet"))?;
            if bytes.len() + payload.len() > max {
                return Err(invalid("message too large"));
            }
            bytes.extend_from_slice(payload);
            match *head {
                LAST => return Ok(Some(Message { bytes, fds })),
                MORE if fds.is_empty() => {}
                _ => return Err(invalid("malformed packet")),
            }
        }
    }

    async fn recv_packet(&self, buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
        loop {
            let mut guard = self.fd.readable().await?;
            let received = guard.try_io(|fd| {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let mut iov = [IoSliceMut::new(buf)];
                let msg = rustix::net::recvmsg(fd.get_ref(), &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
                let mut fds = Vec::new();
                for cmsg in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(received) = cmsg {
                        fds.extend(received);
                    }
                }
                Ok((msg.bytes, msg.flags, fds))
            });
            let Ok(result) = received else { continue };
            let (len, flags, fds) = result?;
            if flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC) {
                return Err(invalid("packet larger than expected"));
            }
            // Every packet carries a header byte, so zero bytes is the peer's close.
            return Ok((len > 0).then_some((len, fds)));
        }
    }
}

impl AsFd for Packets {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pair() -> (Packets, Packets) {
        let (a, b) = Packets::pair().unwrap();
        (Packets::new(a).unwrap(), Packets::new(b).unwrap())
    }

    #[tokio::test]
    async fn messages_keep_their_bounds_and_descriptors() {
        let (a, b) = pair();
        let big: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let (x, _y) = Packets::pair().unwrap();
        let sender = tokio::spawn(async move {
            a.send(b"", &[]).await.unwrap();
            a.send(&big, &[x.as_fd()]).await.unwrap();
            a.send(b"hi", &[]).await.unwrap();
            a
        });
        assert_eq!(b.recv(16).await.unwrap().unwrap().bytes, b"");
        let m = b.recv(1 << 20).await.unwrap().unwrap();
        assert_eq!(m.bytes.len(), 200_000);
        assert!(m.bytes.iter().enumerate().all(|(i, v)| *v == i as u8));
        assert_eq!(m.fds.len(), 1);
        assert_eq!(b.recv(16).await.unwrap().unwrap().bytes, b"hi");
        drop(sender.await.unwrap());
        assert!(b.recv(16).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn oversized_messages_are_refused() {
        let (a, b) = pair();
        tokio::spawn(async move { a.send(&[7u8; 100_000], &[]).await });
        assert!(b.recv(50_000).await.is_err());
    }
}
