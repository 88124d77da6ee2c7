//! The host side of the protocol, over any async byte stream.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::protocol::{AgentMsg, HostMsg};

/// Reads [`AgentMsg`] frames from the agent.
///
/// The agent is the box's (a microVM guest's root can speak for it), so its
/// frames are hostile input: a read of many tiny frames is decoded in one
/// pass (the buffer is moved once per read, not once per frame: that was
/// quadratic), each frame spends the task's cooperative budget (a flood
/// yields the thread to other sessions), and a buffer a big frame grew is
/// given back.
pub struct AgentReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// Where the frames not decoded yet start in `buf`.
    start: usize,
}

/// What an emptied buffer keeps once a big frame (at most 1 MiB) grew it past
/// 16 times this (a session's buffer stayed that large for nothing).
const KEPT_CAPACITY: usize = 64 << 10;

impl<R: AsyncRead + Unpin> AgentReader<R> {
    /// Wraps the read half of a connection.
    pub fn new(inner: R) -> Self {
        Self { inner, buf: Vec::new(), start: 0 }
    }

    /// The next message; `None` when the agent closed the connection cleanly.
    pub async fn recv(&mut self) -> io::Result<Option<AgentMsg>> {
        loop {
            let pending = self.buf.get(self.start..).unwrap_or_default();
            match AgentMsg::decode(pending) {
                Ok(Some((msg, used))) => {
                    self.start += used;
                    tokio::task::coop::consume_budget().await;
                    return Ok(Some(msg));
                }
                Ok(None) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            self.buf.drain(..self.start);
            self.start = 0;
            if self.buf.is_empty() && self.buf.capacity() > 16 * KEPT_CAPACITY {
                self.buf.shrink_to(KEPT_CAPACITY);
            }
            if self.inner.read_buf(&mut self.buf).await? == 0 {
                return if self.buf.is_empty() { Ok(None) } else { Err(io::ErrorKind::UnexpectedEof.into()) };
            }
        }
    }

    /// Bytes that arrived after the last frame, and the read half.
    pub fn into_parts(mut self) -> (Vec<u8>, R) {
        self.buf.drain(..self.start);
        (self.buf, self.inner)
    }
}

/// Writes one message to the agent.
pub async fn send<W: AsyncWrite + Unpin>(writer: &mut W, msg: &HostMsg) -> io::Result<()> {
    writer.write_all(&msg.encode()).await
}

/// Asks the agent on `stream` for a connection to `port` on the box's
/// loopback that it carries the bytes of ([`HostMsg::Connect`]); returns the
/// bytes that came after its `Connected` (the stream is the connection now),
/// or why it could not.
pub async fn connect(stream: &mut tokio::net::UnixStream, port: u16) -> io::Result<Vec<u8>> {
    connected(stream, &HostMsg::Connect { port }).await
}

/// As [`connect`], to the unix socket at `path` in the box ([`HostMsg::ConnectPath`]).
pub async fn connect_path(stream: &mut tokio::net::UnixStream, path: &str) -> io::Result<Vec<u8>> {
    connected(stream, &HostMsg::ConnectPath { path: path.as_bytes().to_vec() }).await
}

/// As [`connect`], for the connection the agent told as `Arrived` with `id`
/// ([`HostMsg::Take`]).
pub async fn take(stream: &mut tokio::net::UnixStream, id: u64) -> io::Result<Vec<u8>> {
    connected(stream, &HostMsg::Take { id }).await
}

/// Asks the agent on `stream` to listen on `port` of the box's loopback (0:
/// any free one) for as long as `stream` stays open ([`HostMsg::Listen`]);
/// returns the port listened on, and the reader of the `Arrived` messages
/// that follow.
pub async fn listen(
    mut stream: tokio::net::UnixStream,
    port: u16,
) -> io::Result<(u16, AgentReader<tokio::net::UnixStream>)> {
    send(&mut stream, &HostMsg::Listen { port }).await?;
    let mut reader = AgentReader::new(stream);
    match reader.recv().await? {
        Some(AgentMsg::Listening { port: bound }) if bound != 0 && (port == 0 || bound == port) => Ok((bound, reader)),
        Some(AgentMsg::Error(why)) => Err(io::Error::new(io::ErrorKind::AddrInUse, why)),
        other => Err(io::Error::new(io::ErrorKind::InvalidData, format!("the box's agent answered {other:?}"))),
    }
}

/// As [`listen`], on a unix socket made at `path` in the box
/// ([`HostMsg::ListenPath`]).
pub async fn listen_path(
    mut stream: tokio::net::UnixStream,
    path: &str,
) -> io::Result<AgentReader<tokio::net::UnixStream>> {
    send(&mut stream, &HostMsg::ListenPath { path: path.as_bytes().to_vec() }).await?;
    let mut reader = AgentReader::new(stream);
    match reader.recv().await? {
        Some(AgentMsg::Listening { port: 0 }) => Ok(reader),
        Some(AgentMsg::Error(why)) => Err(io::Error::new(io::ErrorKind::AddrInUse, why)),
        other => Err(io::Error::new(io::ErrorKind::InvalidData, format!("the box's agent answered {other:?}"))),
    }
}

async fn connected(stream: &mut tokio::net::UnixStream, ask: &HostMsg) -> io::Result<Vec<u8>> {
    send(stream, ask).await?;
    let mut reader = AgentReader::new(&mut *stream);
    match reader.recv().await? {
        Some(AgentMsg::Connected) => Ok(reader.into_parts().0),
        Some(AgentMsg::Error(why)) => Err(io::Error::new(io::ErrorKind::ConnectionRefused, why)),
        other => Err(io::Error::new(io::ErrorKind::InvalidData, format!("the box's agent answered {other:?}"))),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    use super::*;

    /// What the host makes of an agent that sends `bytes` and closes; with
    /// what the host asked.
    async fn answer(bytes: &[u8]) -> (io::Result<Vec<u8>>, Vec<u8>) {
        let (host, mut agent) = UnixStream::pair().unwrap();
        agent.write_all(bytes).unwrap();
        agent.shutdown(std::net::Shutdown::Write).unwrap();
        host.set_nonblocking(true).unwrap();
        let mut host = tokio::net::UnixStream::from_std(host).unwrap();
        let answer = connect(&mut host, 8000).await;
        drop(host);
        let mut asked = Vec::new();
        agent.read_to_end(&mut asked).unwrap();
        (answer, asked)
    }

    #[tokio::test]
    async fn connected_carries_what_came_after_and_an_error_is_refused() {
        let mut connected = AgentMsg::Connected.encode();
        connected.extend_from_slice(b"early");
        let (early, asked) = answer(&connected).await;
        assert_eq!(early.unwrap(), b"early");
        assert_eq!(asked, HostMsg::Connect { port: 8000 }.encode());
        let error = AgentMsg::Error("nothing listens on port 8000 in the box".into()).encode();
        assert_eq!(answer(&error).await.0.unwrap_err().kind(), io::ErrorKind::ConnectionRefused);
        for hostile in [AgentMsg::Pong.encode(), AgentMsg::Connected.encode()[..3].to_vec(), vec![0xff; 9]] {
            assert!(answer(&hostile).await.0.is_err(), "{hostile:?}");
        }
    }
    /// A guest that floods tiny frames into one read: every frame comes out,
    /// in order, and the reading task yields to others while they do (it
    /// held its thread for the whole read before).
    #[test]
    fn a_flood_of_frames_is_read_whole_and_yields() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut flood = Vec::new();
            for _ in 0..20_000 {
                flood.extend_from_slice(&AgentMsg::Pong.encode());
            }
            flood.extend_from_slice(&AgentMsg::Stdout(b"last".to_vec()).encode());
            let other_ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let other = {
                let other_ran = std::sync::Arc::clone(&other_ran);
                tokio::spawn(async move { other_ran.store(true, std::sync::atomic::Ordering::SeqCst) })
            };
            // A byte slice is always ready: only the budget makes this task yield.
            let mut reader = AgentReader::new(&flood[..]);
            let mut ran_meanwhile = false;
            for _ in 0..20_000 {
                assert!(matches!(reader.recv().await.unwrap(), Some(AgentMsg::Pong)));
                ran_meanwhile |= other_ran.load(std::sync::atomic::Ordering::SeqCst);
            }
            assert!(matches!(reader.recv().await.unwrap(), Some(AgentMsg::Stdout(last)) if last == b"last"));
            assert!(reader.recv().await.unwrap().is_none());
            assert!(ran_meanwhile, "the other task waited for the whole flood");
            other.await.unwrap();
        });
    }
}
