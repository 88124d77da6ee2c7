//! HTTP/1.x as the gateway reads it: request heads from boxes, response heads
//! from hosts whose answers it checks, and chunked bodies both ways. These
//! parse hostile bytes: anything that could be read two ways is refused.

pub mod chunked;
pub mod request;
pub mod response;

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Whether `c` may be in a token (a header's name, a method): RFC 9110's `tchar`.
pub fn is_tchar(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)
}

/// Writes `data` and flushes it, for a write after which the gateway waits
/// on something else: TLS keeps a write's last records when the socket is
/// full, and the peer would wait on them (an answer's tail, a streamed
/// event, a request's last bytes) while the gateway waits on the other side.
pub async fn write_flushed<W: AsyncWrite + Unpin + ?Sized>(w: &mut W, data: &[u8]) -> std::io::Result<()> {
    w.write_all(data).await?;
    w.flush().await
}
