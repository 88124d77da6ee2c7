//! A running guest's file system as its agent lists it (`Walk`), read as
//! a stream of entries for [`crate::diff::diff_listings`]. The guest may
//! lie or stall: every read waits a bounded time and holds a bounded amount.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use moat_agent::protocol::{AgentMsg, ExitStatus, HostMsg};
use moat_agent::walk;

use crate::diff::Listed;

/// One guest's listing, entry by entry.
pub struct Listing {
    conn: UnixStream,
    /// Bytes read and not yet a whole frame.
    frames: Vec<u8>,
    /// Record bytes not yet a whole record.
    records: Vec<u8>,
    done: bool,
}

impl Listing {
    /// Asks the agent at `socket` to list its root; each read waits at most `timeout`.
    pub fn open(socket: &Path, timeout: Duration) -> io::Result<Self> {
        let mut conn = UnixStream::connect(socket)?;
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        conn.write_all(&HostMsg::Walk.encode())?;
        Ok(Self { conn, frames: Vec::new(), records: Vec::new(), done: false })
    }

    fn next_entry(&mut self) -> io::Result<Option<Listed>> {
        loop {
            if let Some((path, entry, target, used)) = walk::decode(&self.records).map_err(io::Error::other)? {
                self.records.drain(..used);
                return Ok(Some((path, (entry, target).into())));
            }
            if self.done {
                return match self.records.is_empty() {
                    true => Ok(None),
                    false => Err(io::Error::other("the guest's listing ends in the middle of an entry")),
                };
            }
            self.read_frame()?;
        }
    }

    /// Takes one frame's worth from the agent.
    fn read_frame(&mut self) -> io::Result<()> {
        loop {
            if let Some((msg, used)) = AgentMsg::decode(&self.frames).map_err(io::Error::other)? {
                self.frames.drain(..used);
                return match msg {
                    AgentMsg::Stdout(data) => {
                        self.records.extend_from_slice(&data);
                        Ok(())
                    }
                    AgentMsg::Exit(ExitStatus::Code(0)) => {
                        self.done = true;
                        Ok(())
                    }
                    AgentMsg::Error(e) => Err(io::Error::other(format!("the guest could not list its files: {e}"))),
                    other => Err(io::Error::other(format!("unexpected answer to a listing: {other:?}"))),
                };
            }
            let mut chunk = [0u8; 64 << 10];
            let n = self.conn.read(&mut chunk)?;
            if n == 0 {
                return Err(io::Error::other("the guest ended its listing early"));
            }
            self.frames.extend_from_slice(&chunk[..n]);
        }
    }
}

impl Iterator for Listing {
    type Item = io::Result<Listed>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.next_entry() {
            Ok(entry) => entry.map(Ok),
            Err(e) => {
                self.done = true;
                self.records.clear();
                Some(Err(e))
            }
        }
    }
}
