//! A box connection that hands its event loop back now and then. hyper's
//! client reads a response's informational (1xx) answers in a loop that
//! never waits while bytes keep coming, so a box answering `100 Continue`
//! without end held the loop it ran on: every other request that loop
//! carried, and its answer deadline, waited (measured: 12.9 s of CPU, a
//! request to another box 12-15 s late).
//!
//! Turns alone did not bound it: hyper parses every 1xx head its buffer
//! holds before it reads again, so one read of tiny heads (`100 Continue`
//! 10,000 times) held the loop for seconds. Past [`MAX_INFORMATIONAL`] such
//! answers to one request the connection fails instead (the visitor gets a
//! 502), and the buffer, so one parse, is kept to [`MAX_BUFFER`].

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read between two turns given back.
const TURN: usize = 256 << 10;
/// Most informational answers a box may give one request (a server sends
/// a `100 Continue` or a `103 Early Hints` or two).
pub const MAX_INFORMATIONAL: u32 = 16;
/// Most bytes of a box's answer held unparsed, its head included (nginx
/// refuses an upstream's head past 4-8 KiB).
pub const MAX_BUFFER: usize = 64 << 10;

/// How many informational answers the request in flight on a connection
/// has had (hyper counts them; the connection's reads look).
#[derive(Clone, Default)]
pub struct Informational(Arc<AtomicU32>);

impl Informational {
    /// Counts `req`'s informational answers, from none.
    pub fn count<B>(&self, req: &mut hyper::Request<B>) {
        self.0.store(0, Ordering::Relaxed);
        let count = Arc::clone(&self.0);
        hyper::ext::on_informational(req, move |_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
    }

    fn too_many(&self) -> bool {
        self.0.load(Ordering::Relaxed) > MAX_INFORMATIONAL
    }
}

/// `T`, giving its task's turn back after every [`TURN`] bytes read, and
/// failing once the request in flight had too many informational answers.
pub struct Yielding<T> {
    inner: T,
    since: usize,
    informational: Informational,
}

impl<T> Yielding<T> {
    /// Wraps `inner`, whose requests' informational answers `informational` counts.
    pub fn new(inner: T, informational: Informational) -> Self {
        Self { inner, since: 0, informational }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Yielding<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.informational.too_many() {
            let why = format!("it sent more than {MAX_INFORMATIONAL} informational (1xx) answers to one request");
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, why)));
        }
        if self.since >= TURN {
            self.since = 0;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = read {
            self.since += buf.filled().len() - before;
        }
        read
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Yielding<T> {
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    /// Bytes as fast as they are asked for, never a wait (as hyper's
    /// buffer of 1xx answers is).
    struct Endless;

    impl AsyncRead for Endless {
        fn poll_read(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            let n = buf.remaining().min(4096);
            buf.put_slice(&[b'x'; 4096][..n]);
            Poll::Ready(Ok(()))
        }
    }

    #[test]
    fn an_endless_reader_lets_the_loop_run_others() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            runtime.block_on(async {
                let reader = tokio::spawn(async {
                    let (mut endless, mut buf) =
                        (Yielding::new(Endless, Informational::default()), vec![0u8; 64 << 10]);
                    loop {
                        let _ = endless.read(&mut buf).await;
                    }
                });
                // A timer on the same loop fires: the reader gave turns back.
                tokio::time::sleep(Duration::from_millis(20)).await;
                reader.abort();
            });
            let _ = done.send(());
        });
        assert!(finished.recv_timeout(Duration::from_secs(10)).is_ok(), "the reader held the loop");
    }
}
