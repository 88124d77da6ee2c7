//! Blocking frame I/O over the host connection.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;

use moat_agent::protocol::{AgentMsg, HostMsg};

/// Reads [`HostMsg`] frames, keeping whatever bytes follow the last one.
pub struct FrameReader {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl FrameReader {
    pub fn new(stream: UnixStream) -> Self {
        Self { stream, buf: Vec::new() }
    }

    /// The next message, or `None` at a clean end of stream.
    pub fn next(&mut self) -> io::Result<Option<HostMsg>> {
        loop {
            match HostMsg::decode(&self.buf) {
                Ok(Some((msg, used))) => {
                    self.buf.drain(..used);
                    return Ok(Some(msg));
                }
                Ok(None) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.stream.read(&mut chunk)?;
            if n == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    }

    /// Bytes received after the last decoded frame, and the stream itself.
    pub fn into_parts(self) -> (Vec<u8>, UnixStream) {
        (self.buf, self.stream)
    }
}

/// Writes one message. Frames are written whole, so threads sharing a stream
/// (by `&UnixStream`, which implements `Write`) must hold a lock around this.
pub fn send(mut stream: &UnixStream, msg: &AgentMsg) -> io::Result<()> {
    stream.write_all(&msg.encode())
}
