//! A stream that first yields bytes already read from it: what a reader
//! took past the part it parsed (a TLS ClientHello peeked by the gateway,
//! the agent's answer read before a box port's bytes by the HTTP edge).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner`, read as `early` then the rest.
pub struct Rewind<S> {
    early: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Rewind<S> {
    /// Yields `early`, then what `inner` reads.
    pub fn new(early: Vec<u8>, inner: S) -> Self {
        Self { early, at: 0, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Some(early) = self.early.get(self.at..).filter(|e| !e.is_empty()) {
            let n = buf.remaining().min(early.len());
            buf.put_slice(early.get(..n).unwrap_or_default());
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    // TLS writes its records as one vectored write: passed on whole, not
    // one buffer (a syscall) at a time.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn early_bytes_come_first() {
        let mut r = Rewind::new(b"ab".to_vec(), &b"cd"[..]);
        let mut all = String::new();
        r.read_to_string(&mut all).await.unwrap_or_default();
        assert_eq!(all, "abcd");
    }

    /// TLS hands its records over as one vectored write; a wrapper that
    /// took only the first of them made a syscall of each.
    #[tokio::test]
    async fn a_vectored_write_goes_on_whole() {
        use tokio::io::AsyncWriteExt;
        let mut w = Rewind::new(Vec::new(), Vec::<u8>::new());
        assert!(w.is_write_vectored());
        let n = w.write_vectored(&[io::IoSlice::new(b"ab"), io::IoSlice::new(b"cd")]).await.unwrap_or_default();
        assert_eq!(n, 4);
        assert_eq!(w.inner, b"abcd");
    }
}
