//! A session's bytes between a local stream (the box's agent on a node, the
//! front door's end of a socket pair on a router) and a fleet connection.
//! Either side's end is passed on as a half close, and the other direction
//! goes on while bytes move: a port forward's client may end its sending and
//! wait for the answer (the front door then half-closes the agent's stream),
//! and an agent that ran its command sends the exit status and closes while
//! a frame from the client, its stdin's end, is still on the way to it. The
//! other direction gets at most [`LAST_WORDS`] of silence once one has
//! ended, so a side that never ends holds nothing for long.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

/// How long the direction still open may stay silent once the other ended.
const LAST_WORDS: Duration = Duration::from_secs(5);

/// Carries bytes both ways until both sides have ended (or one has, and
/// the other has been silent for [`LAST_WORDS`]), or either fails.
pub async fn relay<R, W>(local: UnixStream, remote_r: &mut R, remote_w: &mut W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut local_r, mut local_w) = local.into_split();
    let (inward, outward) = (AtomicU64::new(0), AtomicU64::new(0));
    {
        let inbound = carry(&mut *remote_r, &mut local_w, &inward);
        let outbound = carry(&mut local_r, &mut *remote_w, &outward);
        tokio::pin!(inbound, outbound);
        tokio::select! {
            () = &mut inbound => while_moving(outbound, &outward).await,
            () = &mut outbound => while_moving(inbound, &inward).await,
        }
    }
    // A clean end (TLS close_notify) where the connection still allows it.
    let _ = remote_w.shutdown().await;
}

/// Copies `from` to `to`, counting what it read into `moved`, until `from`
/// ends (then `to` is half-closed) or either fails.
async fn carry<R, W>(from: &mut R, to: &mut W, moved: &AtomicU64)
where
    R: AsyncRead + Unpin + ?Sized,
    W: AsyncWrite + Unpin + ?Sized,
{
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        moved.fetch_add(n as u64, Ordering::Relaxed);
        let piece = buf.get(..n).unwrap_or_default();
        if to.write_all(piece).await.is_err() || to.flush().await.is_err() {
            return;
        }
    }
    let _ = to.shutdown().await;
}

/// Runs `rest` while it reads bytes (counted in `moved`), at most
/// [`LAST_WORDS`] of silence. (A reader too slow to take them holds it:
/// such a relay's bytes are only ever as many as its buffers.)
async fn while_moving<F: Future<Output = ()>>(mut rest: Pin<&mut F>, moved: &AtomicU64) {
    loop {
        let before = moved.load(Ordering::Relaxed);
        match tokio::time::timeout(LAST_WORDS, rest.as_mut()).await {
            Ok(()) => return,
            Err(_) if moved.load(Ordering::Relaxed) == before => return,
            Err(_) => {}
        }
    }
}

/// A descriptor received with a session's outcome, as a tokio stream.
pub fn unix_stream(fd: std::os::fd::OwnedFd) -> std::io::Result<UnixStream> {
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The local side answers and closes while bytes for it are still
    /// coming: its answer reaches the remote side whole.
    #[tokio::test]
    async fn what_the_local_side_said_before_it_closed_gets_through() {
        for _ in 0..50 {
            let (local, mut agent) = UnixStream::pair().unwrap();
            let (mut remote, relay_end) = tokio::io::duplex(1 << 16);
            let (mut remote_r, mut remote_w) = tokio::io::split(relay_end);
            let relaying = tokio::spawn(async move { relay(local, &mut remote_r, &mut remote_w).await });
            // The agent's last words and its close, then the client's late frame.
            agent.write_all(&vec![7u8; 200_000]).await.unwrap();
            drop(agent);
            remote.write_all(b"stdin's end").await.unwrap();
            let mut got = Vec::new();
            remote.read_to_end(&mut got).await.unwrap();
            assert_eq!(got.len(), 200_000, "the local side's last words were cut");
            relaying.await.unwrap();
        }
    }

    /// The remote side's end ends the relay, whatever the local side does,
    /// once the local side has been silent for [`LAST_WORDS`].
    #[tokio::test]
    async fn the_remote_sides_end_ends_it() {
        let (local, _agent) = UnixStream::pair().unwrap();
        let (remote, relay_end) = tokio::io::duplex(1 << 16);
        let (mut remote_r, mut remote_w) = tokio::io::split(relay_end);
        drop(remote);
        let bound = LAST_WORDS + Duration::from_secs(1);
        tokio::time::timeout(bound, relay(local, &mut remote_r, &mut remote_w)).await.unwrap();
    }

    /// A port forward's client ends its sending and waits: the local side
    /// sees the end of what came, and its answer, sent after that, gets
    /// back whole (a fleet's `ssh -L` lost it: the relay stopped at the
    /// remote side's end).
    #[tokio::test]
    async fn an_answer_after_the_remote_sides_half_close_gets_back() {
        let (local, mut server) = UnixStream::pair().unwrap();
        let (mut remote, relay_end) = tokio::io::duplex(1 << 20);
        let (mut remote_r, mut remote_w) = tokio::io::split(relay_end);
        let relaying = tokio::spawn(async move { relay(local, &mut remote_r, &mut remote_w).await });
        remote.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        remote.shutdown().await.unwrap();
        let mut request = Vec::new();
        server.read_to_end(&mut request).await.unwrap();
        assert_eq!(request, b"GET / HTTP/1.0\r\n\r\n");
        tokio::time::sleep(Duration::from_millis(100)).await;
        server.write_all(&vec![9u8; 300_000]).await.unwrap();
        drop(server);
        let mut got = Vec::new();
        remote.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), 300_000, "the answer after the half close was cut");
        relaying.await.unwrap();
    }
}
