//! Bodies that stream through the edge: the response the browser reads
//! (counted, and told when it ends, for the log and the connection's return
//! to the pool), and the request body the box reads (given up when the
//! client goes quiet mid-body: the slowloris of bodies).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::Full;

/// Any error a body may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body the edge sends either way.
pub type ResBody = UnsyncBoxBody<Bytes, BoxError>;

/// A whole body.
pub fn full(bytes: Bytes) -> Full<Bytes> {
    Full::new(bytes)
}

/// Passes a body on, counting its data bytes, and calls its `done` once,
/// with the count and whether it ended cleanly, when it ends or is dropped.
pub struct Counted<B, F: FnOnce(u64, bool)> {
    inner: B,
    bytes: u64,
    done: Option<F>,
}

impl<B, F: FnOnce(u64, bool)> Counted<B, F> {
    /// Counts `inner`.
    pub fn new(inner: B, done: F) -> Self {
        Self { inner, bytes: 0, done: Some(done) }
    }

    fn finish(&mut self, clean: bool) {
        if let Some(done) = self.done.take() {
            done(self.bytes, clean);
        }
    }
}

impl<B, F: FnOnce(u64, bool)> Drop for Counted<B, F> {
    fn drop(&mut self) {
        self.finish(false);
    }
}

impl<B, F> Body for Counted<B, F>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    F: FnOnce(u64, bool) + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.bytes = this.bytes.saturating_add(data.len() as u64);
                }
                // A body of known length ends with its last frame: hyper
                // drops it then without asking for the end.
                if this.inner.is_end_stream() {
                    this.finish(true);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish(false);
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                this.finish(true);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The client went quiet in the middle of its body.
#[derive(Debug, thiserror::Error)]
#[error("the request body stalled for {0:?}")]
pub struct Stalled(pub Duration);

/// Passes a body on, failing it if no frame comes for `quiet`; `failed`
/// turns true if it fails (stalled, or not well formed), which tells a
/// visitor's doing from the box's.
pub struct Deadlined<B> {
    inner: B,
    quiet: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<B> Deadlined<B> {
    /// `inner`, given up after `quiet` without a frame.
    pub fn new(inner: B, quiet: Duration, failed: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Self {
        Self { inner, quiet, timer: Box::pin(tokio::time::sleep(quiet)), failed }
    }
}

impl<B> Body for Deadlined<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let failed = |e: BoxError| {
            this.failed.store(true, std::sync::atomic::Ordering::Relaxed);
            e
        };
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                let deadline = tokio::time::Instant::now() + this.quiet;
                this.timer.as_mut().reset(deadline);
                Poll::Ready(frame.map(|f| f.map_err(|e| failed(e.into()))))
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(failed(Box::new(Stalled(this.quiet)))))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn counted_tells_once_with_the_bytes() {
        let seen = Arc::new(AtomicU64::new(0));
        let s = Arc::clone(&seen);
        let body = Counted::new(full(Bytes::from_static(b"hello")), move |n, clean| {
            assert!(clean);
            s.fetch_add(n + 1000, Ordering::SeqCst);
        });
        assert_eq!(body.collect().await.unwrap().to_bytes(), "hello");
        assert_eq!(seen.load(Ordering::SeqCst), 1005);
    }

    #[tokio::test]
    async fn a_body_of_known_length_ends_clean_with_its_last_frame() {
        let seen = Arc::new(AtomicU64::new(0));
        let s = Arc::clone(&seen);
        let mut body = Counted::new(full(Bytes::from_static(b"hello")), move |n, clean| {
            s.store(if clean { n } else { u64::MAX }, Ordering::SeqCst);
        });
        // As hyper does: the last frame, then the body dropped unasked.
        assert!(body.frame().await.unwrap().unwrap().is_data());
        drop(body);
        assert_eq!(seen.load(Ordering::SeqCst), 5);
    }

    /// One frame, then silence.
    struct OneThenQuiet(bool);

    impl Body for OneThenQuiet {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if std::mem::replace(&mut self.0, true) {
                return Poll::Pending;
            }
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"a")))))
        }
    }

    #[tokio::test]
    async fn a_quiet_body_fails() {
        let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut body = Deadlined::new(OneThenQuiet(false), Duration::from_millis(50), Arc::clone(&failed));
        assert!(body.frame().await.unwrap().is_ok());
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.to_string().contains("stalled"), "{err}");
    }
}
