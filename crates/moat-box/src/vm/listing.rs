//! A running guest's file system as its agent lists it (`Walk`), read as
//! a stream of entries for [`crate::diff::diff_listings`]. The guest may
//! lie or stall: the whole listing has a deadline and a byte budget, and
//! what is held at once is bounded.

// Reads what a box or its QEMU sends, as root: it cannot panic.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use moat_agent::protocol::{AgentMsg, ExitStatus, HostMsg};
use moat_agent::walk;

use crate::diff::Listed;

/// Most bytes one listing may take (a tree within diff's entry limit
/// takes far less).
const MAX_BYTES: u64 = 1 << 30;

/// One guest's listing, entry by entry.
pub struct Listing {
    conn: UnixStream,
    /// Bytes read and not yet a whole frame.
    frames: Vec<u8>,
    /// Record bytes, of which those before `at` are taken.
    records: Vec<u8>,
    at: usize,
    done: bool,
    deadline: Instant,
    /// Bytes read so far.
    read: u64,
    /// The path listed last (each must come after it in tree order).
    last: Vec<u8>,
}

impl Listing {
    /// Asks the agent at `socket` to list its root, all of it within `timeout`.
    pub fn open(socket: &Path, timeout: Duration) -> io::Result<Self> {
        let mut conn = UnixStream::connect(socket)?;
        conn.set_write_timeout(Some(timeout))?;
        conn.write_all(&HostMsg::Walk.encode())?;
        let deadline = Instant::now() + timeout;
        Ok(Self {
            conn,
            frames: Vec::new(),
            records: Vec::new(),
            at: 0,
            done: false,
            deadline,
            read: 0,
            last: b"/".to_vec(),
        })
    }

    fn next_entry(&mut self) -> io::Result<Option<Listed>> {
        loop {
            let rest = self.records.get(self.at..).unwrap_or_default();
            if let Some((path, entry, target, used)) = walk::decode(rest).map_err(io::Error::other)? {
                self.at += used;
                if let Err(why) = in_order(&self.last, &path) {
                    let shown = String::from_utf8_lossy(&path).escape_debug().to_string();
                    return Err(io::Error::other(format!("the guest's listing is malformed: {shown:.200} {why}")));
                }
                self.last.clone_from(&path);
                return Ok(Some((path, (entry, target).into())));
            }
            // What is taken goes once per frame, not once per record.
            self.records.drain(..self.at);
            self.at = 0;
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
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the guest's listing took too long"));
            }
            self.conn.set_read_timeout(Some(left))?;
            let mut chunk = [0u8; 64 << 10];
            let n = match self.conn.read(&mut chunk) {
                // The time ran out: said so above.
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => continue,
                read => read?,
            };
            if n == 0 {
                return Err(io::Error::other("the guest ended its listing early"));
            }
            self.read += n as u64;
            if self.read > MAX_BYTES {
                return Err(io::Error::other(format!("the guest's listing is over {} MiB", MAX_BYTES >> 20)));
            }
            self.frames.extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    }
}

/// Whether `path` may follow `last` in a listing as the agent makes it:
/// absolute, every part a name (no empty part, `.` or `..`), and after
/// `last` in tree order (a guest that invented paths, repeated them or
/// listed them out of order was shown as if it had changed them).
fn in_order(last: &[u8], path: &[u8]) -> Result<(), &'static str> {
    let Some(rest) = path.strip_prefix(b"/") else { return Err("is not absolute") };
    if rest.split(|b| *b == b'/').any(|part| matches!(part, b"" | b"." | b"..")) {
        return Err("has a part that is no name");
    }
    match crate::diff::tree_order(last, path) {
        std::cmp::Ordering::Less => Ok(()),
        _ => Err("comes out of order"),
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_the_agent_could_list_are_taken() {
        let root = b"/".as_slice();
        assert_eq!(in_order(root, b"/bin"), Ok(()));
        assert_eq!(in_order(b"/bin", b"/bin/sh"), Ok(()));
        assert_eq!(in_order(b"/bin/sh", b"/boot"), Ok(()));
        // Tree order, not byte order: a directory's entries before its next sibling.
        assert_eq!(in_order(b"/a/b", b"/a-b"), Ok(()));
        for (last, bad) in [
            (root, b"relative/no/slash".as_slice()),
            (root, b"//double"),
            (root, b"/a/../etc"),
            (root, b"/a/./b"),
            (root, b"/trailing/"),
            (b"/bin".as_slice(), b"/bin"),
            (b"/zz".as_slice(), b"/aa"),
            (b"/etc".as_slice(), b"/bin/sh"),
            (b"/a-b".as_slice(), b"/a/b"),
        ] {
            assert!(
                in_order(last, bad).is_err(),
                "{:?} after {:?}",
                String::from_utf8_lossy(bad),
                String::from_utf8_lossy(last)
            );
        }
    }
}
