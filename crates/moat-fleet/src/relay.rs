//! A session's bytes between a local stream (the box's agent on a node, the
//! front door's end of a socket pair on a router) and a fleet connection.
//! The agent's stream is never half-closed, so either side's end is the
//! session's end: the relay stops, and dropping the streams tells the other
//! side. One exception: a local side that stops reading may still have sent
//! its last words (an agent that ran its command sends the exit status and
//! closes, while a frame from the client, its stdin's end, is still on the
//! way to it), so those are read to their end before the relay stops.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

/// How long what the local side sent before it stopped reading may take to
/// be passed on.
const LAST_WORDS: Duration = Duration::from_secs(5);

/// Carries bytes both ways until either side ends or fails.
pub async fn relay<R, W>(local: UnixStream, remote_r: &mut R, remote_w: &mut W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut local_r, mut local_w) = local.into_split();
    let inbound = async {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match remote_r.read(&mut buf).await {
                Ok(0) | Err(_) => return Ended::Remote,
                Ok(n) => n,
            };
            if local_w.write_all(buf.get(..n).unwrap_or_default()).await.is_err() {
                return Ended::Local;
            }
        }
    };
    {
        let outbound = tokio::io::copy(&mut local_r, &mut *remote_w);
        tokio::pin!(outbound);
        tokio::select! {
            ended = inbound => {
                if ended == Ended::Local {
                    let _ = tokio::time::timeout(LAST_WORDS, &mut outbound).await;
                }
            }
            _ = &mut outbound => {}
        }
    }
    // A clean end (TLS close_notify) where the connection still allows it.
    let _ = remote_w.shutdown().await;
}

/// Which side ended the bytes coming in.
#[derive(PartialEq, Eq)]
enum Ended {
    /// The remote side closed or failed.
    Remote,
    /// The local side would take no more.
    Local,
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

    /// The remote side's end ends the relay, whatever the local side does.
    #[tokio::test]
    async fn the_remote_sides_end_ends_it() {
        let (local, _agent) = UnixStream::pair().unwrap();
        let (remote, relay_end) = tokio::io::duplex(1 << 16);
        let (mut remote_r, mut remote_w) = tokio::io::split(relay_end);
        drop(remote);
        tokio::time::timeout(Duration::from_secs(2), relay(local, &mut remote_r, &mut remote_w)).await.unwrap();
    }
}
