//! Short requests to a running box's agent from the privileged side, over
//! the socket where it listens (the namespace box's own, or a VM's link to
//! its guest): each a connection of its own, with a deadline for the whole
//! answer, since the box is hostile and may answer slowly or never.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use moat_agent::protocol::{AgentMsg, HostMsg};

/// Most bytes of output one request takes from the agent.
const MAX_OUTPUT: usize = 1 << 20;

/// Sends `msg` as a connection of its own and waits at most `timeout` in
/// all for its `Pong` (an agent that answers a byte at a time is cut off).
pub fn ask(socket: &Path, msg: &HostMsg, timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut conn = connect(socket, timeout)?;
    conn.write_all(&msg.encode())?;
    Answers::default().pong(&mut conn, deadline)
}

/// Sends `msg` and gathers the `Stdout` that answers it until `Exit`,
/// within `timeout` in all and [`MAX_OUTPUT`] bytes.
pub fn output(socket: &Path, msg: &HostMsg, timeout: Duration) -> io::Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut conn = connect(socket, timeout)?;
    conn.write_all(&msg.encode())?;
    let (mut answers, mut out) = (Answers::default(), Vec::new());
    loop {
        match answers.next(&mut conn, deadline)? {
            AgentMsg::Stdout(data) if out.len() + data.len() <= MAX_OUTPUT => out.extend_from_slice(&data),
            AgentMsg::Stdout(_) => return Err(io::Error::other("the box's agent sent too much")),
            AgentMsg::Exit(_) => return Ok(out),
            AgentMsg::Error(e) => return Err(io::Error::other(e)),
            other => return Err(io::Error::other(format!("unexpected answer {other:?}"))),
        }
    }
}

/// A connection to the agent at `socket`, its reads and writes bounded by `timeout`.
pub fn connect(socket: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let conn = UnixStream::connect(socket)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    Ok(conn)
}

/// The agent's answers on one connection, read one at a time.
#[derive(Default)]
pub struct Answers {
    buf: Vec<u8>,
}

impl Answers {
    /// The next answer, which must be `Pong`, by `deadline`.
    pub fn pong(&mut self, conn: &mut UnixStream, deadline: Instant) -> io::Result<()> {
        match self.next(conn, deadline)? {
            AgentMsg::Pong => Ok(()),
            AgentMsg::Error(e) => Err(io::Error::other(e)),
            other => Err(io::Error::other(format!("unexpected answer {other:?}"))),
        }
    }

    /// The next answer, by `deadline`.
    pub fn next(&mut self, conn: &mut UnixStream, deadline: Instant) -> io::Result<AgentMsg> {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            if let Some((msg, used)) = AgentMsg::decode(&self.buf).map_err(io::Error::other)? {
                self.buf.drain(..used);
                return Ok(msg);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the box's agent did not answer in time"));
            }
            conn.set_read_timeout(Some(left))?;
            let n = match conn.read(&mut chunk) {
                // The time ran out: said so above.
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => continue,
                read => read?,
            };
            if n == 0 || self.buf.len() > moat_agent::protocol::MAX_FRAME {
                return Err(io::Error::other("the box's agent did not answer"));
            }
            self.buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_agent_is_told_as_one() {
        let (mut ours, _silent) = UnixStream::pair().unwrap();
        let deadline = Instant::now() + Duration::from_millis(100);
        let err = Answers::default().next(&mut ours, deadline).unwrap_err();
        assert_eq!(
            (err.kind(), err.to_string()),
            (io::ErrorKind::TimedOut, "the box's agent did not answer in time".into())
        );
    }
}
