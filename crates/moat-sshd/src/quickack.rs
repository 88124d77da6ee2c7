//! A TCP stream that acknowledges at once during the SSH handshake.
//!
//! OpenSSH's client leaves Nagle on for non-interactive sessions, so its small
//! KEX_ECDH_INIT waits until we acknowledge its KEXINIT. We have nothing to send
//! at that moment, so Linux delays the ACK by up to 40 ms, on every connection.
//! Re-arming TCP_QUICKACK after each read (the kernel clears it as it sees fit)
//! for the first few reads removes that stall; after the handshake the flag is
//! left to the kernel.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Reads during which quick ACKs are forced: covers version exchange, key
/// exchange and authentication.
const HANDSHAKE_READS: u32 = 16;

/// A [`TcpStream`] that forces quick ACKs for its first reads.
pub struct QuickAck {
    inner: TcpStream,
    reads_left: u32,
}

impl QuickAck {
    /// Wraps an accepted connection.
    pub fn new(inner: TcpStream) -> Self {
        let _ = socket2::SockRef::from(&inner).set_tcp_quickack(true);
        Self { inner, reads_left: HANDSHAKE_READS }
    }
}

impl AsyncRead for QuickAck {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if result.is_ready() && self.reads_left > 0 {
            self.reads_left -= 1;
            let _ = socket2::SockRef::from(&self.inner).set_tcp_quickack(true);
        }
        result
    }
}

impl AsyncWrite for QuickAck {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
