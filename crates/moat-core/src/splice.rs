//! Bytes both ways between two connections (the web edge's WebSocket
//! tunnels), as sshd carries a port forward's: each direction ends at its
//! reader's end (the other writer is then shut down: a half-close) or at a
//! failure; a failure one way does not cut the other short. A server that answers and
//! closes while the client is still sending loses no byte of its answer;
//! `tokio::io::copy_bidirectional` stops both ways at the first failure.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// How long the other direction may go on after one failed (the peer that
/// stopped taking bytes may still have sent its last).
const AFTER_A_FAILURE: Duration = Duration::from_secs(5);

/// Copies `a` to `b` and `b` to `a` until both directions have ended.
pub async fn both_ways<A, B>(a: A, b: B)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut a_r, mut a_w) = tokio::io::split(a);
    let (mut b_r, mut b_w) = tokio::io::split(b);
    let a_to_b = one_way(&mut a_r, &mut b_w);
    let b_to_a = one_way(&mut b_r, &mut a_w);
    tokio::pin!(a_to_b, b_to_a);
    tokio::select! {
        first = &mut a_to_b => rest(first, b_to_a).await,
        first = &mut b_to_a => rest(first, a_to_b).await,
    }
}

/// One direction, to its reader's end (then a half-close) or a failure.
async fn one_way<R, W>(from: &mut R, to: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    tokio::io::copy(from, to).await?;
    to.shutdown().await
}

/// The other direction, once one has ended (`first`).
async fn rest(first: io::Result<()>, other: Pin<&mut impl Future<Output = io::Result<()>>>) {
    match first {
        Ok(()) => {
            let _ = other.await;
        }
        Err(_) => {
            let _ = tokio::time::timeout(AFTER_A_FAILURE, other).await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixStream;

    /// The server answers and closes while the client is still sending: the
    /// client gets the whole answer.
    #[tokio::test]
    async fn an_answer_sent_before_a_close_arrives_whole() {
        for _ in 0..20 {
            let (client_side, mut client) = UnixStream::pair().unwrap();
            let (server_side, mut server) = UnixStream::pair().unwrap();
            let splicing = tokio::spawn(both_ways(client_side, server_side));
            server.write_all(&vec![7u8; 300_000]).await.unwrap();
            drop(server);
            // The client sends on (its writes fail once the splice is done)
            // while it reads.
            let (mut client_r, mut client_w) = client.split();
            let mut got = Vec::new();
            let sending = client_w.write_all(&[1u8; 300_000]);
            // (Its unread bytes make the end a reset, after the answer.)
            let _ = tokio::join!(sending, client_r.read_to_end(&mut got));
            assert_eq!(got.len(), 300_000, "the answer was cut");
            tokio::time::timeout(Duration::from_secs(10), splicing).await.unwrap().unwrap();
        }
    }

    /// A half-close one way leaves the other way open.
    #[tokio::test]
    async fn a_half_close_is_passed_on_and_the_other_way_goes_on() {
        let (client_side, mut client) = UnixStream::pair().unwrap();
        let (server_side, mut server) = UnixStream::pair().unwrap();
        let splicing = tokio::spawn(both_ways(client_side, server_side));
        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        let mut request = Vec::new();
        server.read_to_end(&mut request).await.unwrap();
        assert_eq!(request, b"request");
        server.write_all(b"answer").await.unwrap();
        drop(server);
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"answer");
        splicing.await.unwrap();
    }
}
