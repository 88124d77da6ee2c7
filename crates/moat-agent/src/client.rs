//! The host side of the protocol, over any async byte stream.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::protocol::{AgentMsg, HostMsg};

/// Reads [`AgentMsg`] frames from the agent.
pub struct AgentReader<R> {
    inner: R,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> AgentReader<R> {
    /// Wraps the read half of a connection.
    pub fn new(inner: R) -> Self {
        Self { inner, buf: Vec::new() }
    }

    /// The next message; `None` when the agent closed the connection cleanly.
    pub async fn recv(&mut self) -> io::Result<Option<AgentMsg>> {
        loop {
            match AgentMsg::decode(&self.buf) {
                Ok(Some((msg, used))) => {
                    self.buf.drain(..used);
                    return Ok(Some(msg));
                }
                Ok(None) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            if self.inner.read_buf(&mut self.buf).await? == 0 {
                return if self.buf.is_empty() { Ok(None) } else { Err(io::ErrorKind::UnexpectedEof.into()) };
            }
        }
    }

    /// Bytes that arrived after the last frame, and the read half.
    pub fn into_parts(self) -> (Vec<u8>, R) {
        (self.buf, self.inner)
    }
}

/// Writes one message to the agent.
pub async fn send<W: AsyncWrite + Unpin>(writer: &mut W, msg: &HostMsg) -> io::Result<()> {
    writer.write_all(&msg.encode()).await
}
