//! The edge's accept loop: connections counted per source address and in
//! all, TLS with a deadline, then hyper (HTTP/1.1 or HTTP/2, as ALPN chose)
//! with bounded heads, a deadline on each head, and a connection that goes
//! quiet closed. A slow or hostile client holds only its own connection:
//! every wait on it is bounded, and nothing it does blocks another's.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use moat_api::ApiClient;
use moat_core::web::WebHost;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::hello::{EdgeLimits, WebHello};
use crate::proxy::{self, Ctx};
use crate::site::{self, SiteError};
use moat_core::slots::Slots;

/// The edge could not start.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    /// Its certificate.
    #[error(transparent)]
    Site(#[from] SiteError),
    /// Its listener, or a thread for an event loop.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// How often idle connections to boxes are let go.
const SWEEP: Duration = Duration::from_millis(250);

/// What the edge's event loops share.
struct Shared {
    tls: TlsAcceptor,
    api: ApiClient,
    domain: String,
    limits: EdgeLimits,
    sources: Arc<Slots<IpAddr>>,
    all: Arc<Semaphore>,
    per_box: Arc<Slots<WebHost>>,
    per_visitor: Arc<Slots<(IpAddr, WebHost)>>,
}

/// Serves box URLs on `listener` (non-blocking) until the process ends, in
/// `loops` event loops: this one, and threads of their own each running one
/// (a single-threaded runtime) on a copy of the listener, each connection
/// served wholly by the loop that accepted it, with the loop's own pool of
/// box connections and sessions (shared, they bounced requests between
/// threads); the limits are the loops' together.
pub async fn serve(
    listener: std::net::TcpListener,
    hello: WebHello,
    api: ApiClient,
    loops: usize,
) -> Result<(), EdgeError> {
    let limits = hello.limits;
    let shared = Arc::new(Shared {
        tls: TlsAcceptor::from(site::server_config(&hello.cert_pem, &hello.key_pem)?),
        api,
        domain: hello.domain.to_ascii_lowercase(),
        limits,
        sources: Slots::new(limits.per_source),
        all: Arc::new(Semaphore::new(limits.connections)),
        per_box: Slots::new(limits.per_box),
        per_visitor: Slots::new(crate::limits::visitor_share(limits.per_box)),
    });
    for _ in 1..loops {
        let (listener, shared) = (listener.try_clone()?, Arc::clone(&shared));
        std::thread::Builder::new().name("moat-web-loop".into()).spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let served =
                runtime.and_then(|r| r.block_on(async { accept(TcpListener::from_std(listener)?, &shared).await }));
            if let Err(e) = served {
                tracing::warn!(error = %e, "an event loop of the edge could not start");
            }
        })?;
    }
    Ok(accept(TcpListener::from_std(listener)?, &shared).await?)
}

/// One event loop: accepts connections on `listener` and serves each.
async fn accept(listener: TcpListener, shared: &Shared) -> io::Result<()> {
    let Shared { tls, api, domain, limits, sources, all, per_box, per_visitor } = shared;
    let limits = *limits;
    let ctx = Ctx::new(api.clone(), domain.clone(), limits, Arc::clone(per_box), Arc::clone(per_visitor));
    let pool = Arc::clone(&ctx.pool);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(SWEEP);
        loop {
            every.tick().await;
            pool.sweep();
        }
    });
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, most likely: wait for some to close.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let from = crate::limits::source_of(peer.ip());
        let (Some(source), Ok(permit)) = (sources.take(&from), Arc::clone(all).try_acquire_owned()) else {
            // Closed at once: its other connections, or everyone's, are at the limit.
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (tls, ctx) = (tls.clone(), Arc::clone(&ctx));
        tokio::spawn(async move {
            let io = Quiet::new(tcp, limits.idle());
            let Ok(Ok(stream)) = tokio::time::timeout(limits.head(), tls.accept(io)).await else { return };
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.head())
                .max_buf_size(limits.head_bytes.max(8192))
                .max_headers(limits.headers);
            builder
                .http2()
                .timer(TokioTimer::new())
                .max_header_list_size(u32::try_from(limits.head_bytes).unwrap_or(u32::MAX))
                // No keep-alive pings: they would keep a quiet connection
                // from ever being closed as one.
                .max_concurrent_streams(100);
            let ip = crate::limits::source_of(peer.ip());
            let service = service_fn(move |req| {
                let ctx = Arc::clone(&ctx);
                async move { Ok::<_, Infallible>(proxy::handle(req, ctx, ip).await) }
            });
            if let Err(e) = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).await {
                tracing::debug!(error = %e, %peer, "web connection ended");
            }
            drop((source, permit));
        });
    }
}

/// A connection that fails once nothing was read or written on it for
/// `quiet` (an idle keep-alive connection, a client that stopped reading).
struct Quiet<S> {
    inner: S,
    quiet: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl<S> Quiet<S> {
    fn new(inner: S, quiet: Duration) -> Self {
        Self { inner, quiet, timer: Box::pin(tokio::time::sleep(quiet)) }
    }

    fn moved(&mut self) {
        let deadline = tokio::time::Instant::now() + self.quiet;
        self.timer.as_mut().reset(deadline);
    }

    fn lapsed(&mut self, cx: &mut Context<'_>) -> bool {
        self.timer.as_mut().poll(cx).is_ready()
    }
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the connection went quiet")
}

impl<S: AsyncRead + Unpin> AsyncRead for Quiet<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.moved();
                Poll::Ready(r)
            }
            Poll::Pending if this.lapsed(cx) => Poll::Ready(Err(timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Quiet<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                this.moved();
                Poll::Ready(r)
            }
            Poll::Pending if this.lapsed(cx) => Poll::Ready(Err(timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_quiet_connection_fails_and_a_busy_one_lives() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut quiet = Quiet::new(ours, Duration::from_millis(100));
        let mut buf = [0u8; 8];
        for _ in 0..4 {
            // Bytes every 50 ms: never quiet for 100.
            tokio::time::sleep(Duration::from_millis(50)).await;
            theirs.write_all(b"x").await.unwrap();
            assert_eq!(quiet.read(&mut buf).await.unwrap(), 1);
        }
        let started = std::time::Instant::now();
        let err = quiet.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(90));
    }
}
