//! A session's bytes between a local stream (the box's agent on a node, the
//! front door's end of a socket pair on a router) and a fleet connection.
//! The agent's stream is never half-closed, so either side's end is the
//! session's end: the relay stops, and dropping the streams tells the other
//! side.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

/// Carries bytes both ways until either side ends or fails.
pub async fn relay<R, W>(local: UnixStream, remote_r: &mut R, remote_w: &mut W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut local_r, mut local_w) = local.into_split();
    let inbound = tokio::io::copy(remote_r, &mut local_w);
    let outbound = tokio::io::copy(&mut local_r, remote_w);
    tokio::select! {
        _ = inbound => {}
        _ = outbound => {}
    }
    // A clean end (TLS close_notify) where the connection still allows it.
    let _ = remote_w.shutdown().await;
}

/// A descriptor received with a session's outcome, as a tokio stream.
pub fn unix_stream(fd: std::os::fd::OwnedFd) -> std::io::Result<UnixStream> {
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}
