//! Many byte streams over one link. A microVM guest's agent is reached over
//! a virtio-serial port, which has no connections, while the agent protocol
//! is one operation per connection; so the host opens numbered streams over
//! the port, and each end turns a stream into a connected unix socket pair,
//! which the rest of the code uses as it uses any connection.
//!
//! Frames: stream id (u32), kind (u8), length (u32), payload, big-endian.
//! Each direction of each stream has a window: a sender sends no more than
//! the receiver has granted ([`WINDOW`] at first, then whatever it credits
//! back as its side's reader takes the bytes), so a stream nobody reads
//! holds up only itself. A frame that breaks the rules (too long, past its
//! window) ends its stream; a link that cannot be read ends them all. An
//! end whose socket was closed whole (not just for writing) says so
//! ([`STOP`]): the other end then shuts its own socket, so that what still
//! writes or waits there (a session's output, a forward's relay) is told,
//! where a close of one direction would leave it waiting for good. The
//! other end may be hostile (for the host, the guest is): nothing it sends
//! can make this side allocate more than a window per stream.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, PoisonError};

/// Bytes a sender may have unanswered on one direction of a stream.
pub const WINDOW: u32 = 128 << 10;
/// Largest payload of one frame: a whole frame (head included) fits in one
/// 32 KiB virtio-serial buffer, so that a guest paused at any instant has
/// sent each frame whole or not at all.
pub const MAX_FRAME: u32 = (32 << 10) - 9;
/// Most streams open at once on one link.
pub const MAX_STREAMS: usize = 1024;

const OPEN: u8 = 0;
const DATA: u8 = 1;
const CLOSE: u8 = 2;
const CREDIT: u8 = 3;
/// This end's socket of the stream was closed whole: nothing more is read
/// or taken here. (An end that does not know it ends the stream: the same.)
const STOP: u8 = 4;

/// One end of a link carrying streams.
#[derive(Clone)]
pub struct Mux {
    inner: Arc<Inner>,
}

struct Inner {
    /// Frames for the link, written in order by a thread of their own, so
    /// that a link the other end stops reading holds up only the streams
    /// with data to send, never the reader or the opening of streams.
    outbox: mpsc::SyncSender<Vec<u8>>,
    streams: Mutex<HashMap<u32, Stream>>,
    next_id: AtomicU32,
    /// Whether the writer is held between frames (see [`Mux::hold`]).
    held: Arc<Hold>,
    /// Set once the link can no longer be read (ended, or broke the
    /// framing): no stream opens on it after.
    ended: Mutex<bool>,
    ended_changed: Condvar,
}

/// The writer's hold (see [`Mux::hold`]).
#[derive(Default)]
struct Hold {
    state: Mutex<HoldState>,
    changed: Condvar,
}

#[derive(Default)]
struct HoldState {
    /// Set by [`Mux::hold`]: no frame is to be started.
    held: bool,
    /// A frame is being written.
    writing: bool,
}

/// What this end keeps of one stream: where the other end's bytes go, and
/// what it may still send there.
struct Stream {
    /// `None` once the other end closed its direction.
    inbound: Option<mpsc::Sender<Vec<u8>>>,
    /// Bytes of the other end's not yet credited back (at most WINDOW).
    unanswered: u32,
    credit: Arc<Credit>,
    /// This end's socket, to shut when the other end stops the stream.
    socket: UnixStream,
    /// Directions finished: this end's bytes out, the other end's in.
    out_done: bool,
    in_done: bool,
}

/// Bytes this end may still send on a stream, and its wake-up.
struct Credit {
    left: Mutex<Option<u32>>,
    changed: Condvar,
}

impl Credit {
    fn new() -> Self {
        Self { left: Mutex::new(Some(WINDOW)), changed: Condvar::new() }
    }

    /// Waits for some credit; takes up to `want` of it (`None`: the stream is gone).
    fn take(&self, want: u32) -> Option<u32> {
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match *left {
                None => return None,
                Some(0) => left = self.changed.wait(left).unwrap_or_else(PoisonError::into_inner),
                Some(n) => {
                    let got = n.min(want);
                    *left = Some(n - got);
                    return Some(got);
                }
            }
        }
    }

    fn give(&self, n: u32) {
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = *left {
            // More than a window owed is the other end's error; never overflow.
            *left = Some(l.saturating_add(n).min(WINDOW));
        }
        self.changed.notify_all();
    }

    fn end(&self) {
        *self.left.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.changed.notify_all();
    }
}

/// Frames queued for the link at most (each at most [`MAX_FRAME`] and a head).
const OUTBOX: usize = 64;

/// A frame: stream id, kind, length, payload.
fn frame(id: u32, kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(9 + payload.len());
    frame.extend_from_slice(&id.to_be_bytes());
    frame.push(kind);
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// A stream id unlikely to be in use (std's per-process random hash keys).
fn first_id() -> u32 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::process::id()) as u32
}

impl Mux {
    /// Runs a mux over `link` (read by a thread of its own until it ends).
    /// Streams the other end opens are handed to `accepted` (`None`: this end
    /// refuses them, as the host does).
    pub fn start(
        reader: Box<dyn Read + Send>,
        writer: Box<dyn Write + Send>,
        accepted: Option<mpsc::Sender<UnixStream>>,
    ) -> io::Result<Self> {
        let (outbox, queued) = mpsc::sync_channel::<Vec<u8>>(OUTBOX);
        let inner = Arc::new(Inner {
            outbox,
            streams: Mutex::new(HashMap::new()),
            // Ids start anywhere: a guest resumed as a copy of another still
            // holds its parent's streams, whose ids a new link must not reuse.
            next_id: AtomicU32::new(first_id()),
            held: Arc::default(),
            ended: Mutex::new(false),
            ended_changed: Condvar::new(),
        });
        let held = Arc::clone(&inner.held);
        std::thread::Builder::new().name("mux-write".into()).spawn(move || {
            let mut writer = writer;
            for frame in queued {
                {
                    let mut state = held.state.lock().unwrap_or_else(PoisonError::into_inner);
                    while state.held {
                        state = held.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
                    }
                    state.writing = true;
                }
                let written = writer.write_all(&frame).and_then(|()| writer.flush());
                held.state.lock().unwrap_or_else(PoisonError::into_inner).writing = false;
                held.changed.notify_all();
                if written.is_err() {
                    return;
                }
            }
        })?;
        let mux = Self { inner };
        let reading = mux.clone();
        std::thread::Builder::new().name("mux".into()).spawn(move || reading.read_link(reader, accepted))?;
        Ok(mux)
    }

    /// Stops writing to the link between two frames (returns once no frame
    /// is half written), until [`Mux::go`]: a link about to be saved with
    /// the machine at its other end holds only whole frames.
    pub fn hold(&self) {
        let mut state = self.inner.held.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.held = true;
        while state.writing {
            state = self.inner.held.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// As [`Mux::hold`], for at most `limit`: false, and not held, if a
    /// frame is still half written then (the other end stopped reading the
    /// link: a guest that froze its agent). An unbounded hold kept the
    /// supervisor's one control thread waiting for good.
    pub fn hold_within(&self, limit: std::time::Duration) -> bool {
        let mut state = self.inner.held.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.held = true;
        let (mut state, _) = self
            .inner
            .held
            .changed
            .wait_timeout_while(state, limit, |s| s.writing)
            .unwrap_or_else(PoisonError::into_inner);
        if !state.writing {
            return true;
        }
        state.held = false;
        drop(state);
        self.inner.held.changed.notify_all();
        false
    }

    /// Writes to the link again after [`Mux::hold`].
    pub fn go(&self) {
        self.inner.held.state.lock().unwrap_or_else(PoisonError::into_inner).held = false;
        self.inner.held.changed.notify_all();
    }

    /// Returns once the link can no longer be read: it ended, or the other
    /// end broke the framing (every stream ended with it).
    pub fn wait_ended(&self) {
        let mut ended = self.inner.ended.lock().unwrap_or_else(PoisonError::into_inner);
        while !*ended {
            ended = self.inner.ended_changed.wait(ended).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Opens a stream to the other end; returns this end's socket of it.
    pub fn open(&self) -> io::Result<UnixStream> {
        let (local, ours) = UnixStream::pair()?;
        self.open_on(ours)?;
        Ok(local)
    }

    /// Opens a stream to the other end carried by `conn` (a connection
    /// accepted elsewhere): what is read from it is sent, what arrives is
    /// written to it.
    pub fn open_on(&self, conn: UnixStream) -> io::Result<()> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        self.attach(id, conn, true)
    }

    /// Makes `ours` stream `id`, pumped both ways; with `announce`, tells
    /// the other end first (it drops bytes of a stream it does not know, and
    /// `ours` may hold some already).
    fn attach(&self, id: u32, ours: UnixStream, announce: bool) -> io::Result<()> {
        let (inbound, queued) = mpsc::channel::<Vec<u8>>();
        let credit = Arc::new(Credit::new());
        {
            if *self.inner.ended.lock().unwrap_or_else(PoisonError::into_inner) {
                return Err(io::Error::other("the link is gone"));
            }
            let mut streams = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner);
            if streams.len() >= MAX_STREAMS || streams.contains_key(&id) {
                return Err(io::Error::other("too many streams, or a stream id in use"));
            }
            let stream = Stream {
                inbound: Some(inbound),
                unanswered: 0,
                credit: Arc::clone(&credit),
                socket: ours.try_clone()?,
                out_done: false,
                in_done: false,
            };
            streams.insert(id, stream);
        }
        let started = (|| {
            if announce {
                self.send_now(id, OPEN, &[])?;
            }
            let (reader, writer) = (ours.try_clone()?, ours);
            let (out, back) = (self.clone(), self.clone());
            std::thread::Builder::new().name("mux-out".into()).spawn(move || out.pump_out(id, reader, &credit))?;
            std::thread::Builder::new().name("mux-in".into()).spawn(move || back.pump_in(id, writer, &queued))?;
            Ok(())
        })();
        if started.is_err() {
            self.detach(id);
        }
        started
    }

    /// Ends stream `id` both ways at this end.
    fn detach(&self, id: u32) {
        let gone = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
        if let Some(stream) = gone {
            stream.credit.end();
        }
    }

    /// One direction of stream `id` is finished; with both, it is forgotten.
    fn finished(&self, id: u32, out: bool) {
        let mut streams = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(s) = streams.get_mut(&id) else { return };
        if out {
            s.out_done = true;
        } else {
            s.in_done = true;
        }
        if s.out_done && s.in_done {
            streams.remove(&id);
        }
    }

    /// This end's bytes of stream `id` to the other end, as credit allows;
    /// at their end, a close.
    fn pump_out(&self, id: u32, mut from: UnixStream, credit: &Credit) {
        let mut buf = vec![0u8; MAX_FRAME as usize];
        loop {
            let Some(allowed) = credit.take(MAX_FRAME) else {
                // The stream is gone, or the other end stopped it while this
                // waited for credit: whoever writes here is told so, and this
                // direction is done (a stopped stream must still be forgotten
                // once its other direction ends, or it holds a slot).
                let _ = from.shutdown(std::net::Shutdown::Read);
                self.finished(id, true);
                return;
            };
            let n = match from.read(&mut buf[..allowed as usize]) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // What was taken and not sent goes back.
            credit.give(allowed - n as u32);
            if self.send(id, DATA, &buf[..n]).is_err() {
                return;
            }
        }
        let _ = self.send(id, CLOSE, &[]);
        self.finished(id, true);
        // Poll reports a hangup once the socket is shut both ways: closed
        // whole at this end, or each direction ended. Only the first leaves
        // the other end's bytes with nobody to take them.
        crate::hangup::wait(&from);
        let in_open =
            self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner).get(&id).is_some_and(|s| !s.in_done);
        if in_open {
            let _ = self.send(id, STOP, &[]);
        }
    }

    /// The other end's bytes of stream `id` into this end's socket, each
    /// batch credited back once written; at the other end's close, a shutdown.
    fn pump_in(&self, id: u32, mut to: UnixStream, queued: &mpsc::Receiver<Vec<u8>>) {
        while let Ok(data) = queued.recv() {
            if to.write_all(&data).is_err() {
                break;
            }
            {
                let mut streams = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(s) = streams.get_mut(&id) {
                    s.unanswered = s.unanswered.saturating_sub(data.len() as u32);
                }
            }
            if self.send(id, CREDIT, &(data.len() as u32).to_be_bytes()).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
        self.finished(id, false);
    }

    /// Queues a frame, waiting for room (a stream's own data and credit).
    fn send(&self, id: u32, kind: u8, payload: &[u8]) -> io::Result<()> {
        self.inner.outbox.send(frame(id, kind, payload)).map_err(|_| io::Error::other("the link is gone"))
    }

    /// Queues a frame if there is room now (opens and closes, from threads
    /// that must never wait on the other end).
    fn send_now(&self, id: u32, kind: u8, payload: &[u8]) -> io::Result<()> {
        self.inner.outbox.try_send(frame(id, kind, payload)).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => io::Error::new(io::ErrorKind::WouldBlock, "the link is not being read"),
            mpsc::TrySendError::Disconnected(_) => io::Error::other("the link is gone"),
        })
    }

    /// Reads frames until the link ends; then every stream ends.
    fn read_link(&self, mut link: Box<dyn Read + Send>, accepted: Option<mpsc::Sender<UnixStream>>) {
        let mut head = [0u8; 9];
        let mut payload = vec![0u8; MAX_FRAME as usize];
        while link.read_exact(&mut head).is_ok() {
            let id = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
            let len = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
            if len > MAX_FRAME || link.read_exact(&mut payload[..len as usize]).is_err() {
                break;
            }
            let data = &payload[..len as usize];
            match head[4] {
                OPEN => self.accept(id, accepted.as_ref()),
                DATA => self.receive(id, data),
                CLOSE => {
                    // No more from the other end: the inbound pump drains and shuts down.
                    if let Some(s) = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner).get_mut(&id) {
                        s.inbound = None;
                    }
                }
                STOP => {
                    if let Some(s) = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner).get(&id) {
                        s.credit.end();
                        let _ = s.socket.shutdown(std::net::Shutdown::Read);
                    }
                }
                CREDIT if len == 4 => {
                    let n = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
                    let credit = self.credit_of(id);
                    if let Some(c) = credit {
                        c.give(n);
                    }
                }
                _ => self.refuse(id),
            }
        }
        // Before the streams end: none may open after them on a link whose
        // next frame can never be read (a session would wait for good).
        *self.inner.ended.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.inner.ended_changed.notify_all();
        let all: Vec<u32> = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner).keys().copied().collect();
        for id in all {
            self.detach(id);
        }
    }

    fn credit_of(&self, id: u32) -> Option<Arc<Credit>> {
        self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner).get(&id).map(|s| Arc::clone(&s.credit))
    }

    fn accept(&self, id: u32, accepted: Option<&mpsc::Sender<UnixStream>>) {
        let Some(accepted) = accepted else { return self.refuse(id) };
        match UnixStream::pair().and_then(|(local, ours)| self.attach(id, ours, false).map(|()| local)) {
            Ok(local) => {
                if accepted.send(local).is_err() {
                    self.detach(id);
                }
            }
            Err(_) => {
                let _ = self.send_now(id, CLOSE, &[]);
            }
        }
    }

    /// Data for stream `id`: queued, if within its window (else the stream ends).
    fn receive(&self, id: u32, data: &[u8]) {
        let mut streams = self.inner.streams.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(s) = streams.get_mut(&id) else { return };
        let after = s.unanswered.saturating_add(data.len() as u32);
        let queued = s.inbound.as_ref().is_some_and(|tx| tx.send(data.to_vec()).is_ok());
        if after > WINDOW || !queued {
            drop(streams);
            return self.refuse(id);
        }
        s.unanswered = after;
    }

    /// Ends stream `id` at this end and tells the other.
    fn refuse(&self, id: u32) {
        self.detach(id);
        let _ = self.send_now(id, CLOSE, &[]);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    /// A host end and a guest end over a socket pair; the guest's streams echo.
    fn linked() -> (Mux, mpsc::Receiver<UnixStream>) {
        let (a, b) = UnixStream::pair().unwrap();
        let host = Mux::start(Box::new(a.try_clone().unwrap()), Box::new(a), None).unwrap();
        let (tx, rx) = mpsc::channel();
        Mux::start(Box::new(b.try_clone().unwrap()), Box::new(b), Some(tx)).unwrap();
        (host, rx)
    }

    fn echo(mut s: UnixStream) {
        std::thread::spawn(move || {
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            s.write_all(&got).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
        });
    }

    #[test]
    fn streams_carry_more_than_a_window_both_ways_and_half_close() {
        let (host, accepted) = linked();
        std::thread::spawn(move || accepted.into_iter().for_each(echo));
        let clients: Vec<_> = (0..8u8)
            .map(|i| {
                let mut s = host.open().unwrap();
                std::thread::spawn(move || {
                    let sent: Vec<u8> = (0..(3 * WINDOW as usize)).map(|j| (j as u8) ^ i).collect();
                    let mut w = s.try_clone().unwrap();
                    let data = sent.clone();
                    let writer = std::thread::spawn(move || {
                        w.write_all(&data).unwrap();
                        w.shutdown(std::net::Shutdown::Write).unwrap();
                    });
                    let mut back = Vec::new();
                    s.read_to_end(&mut back).unwrap();
                    writer.join().unwrap();
                    assert!(back == sent, "stream {i} came back different");
                })
            })
            .collect();
        for c in clients {
            c.join().unwrap();
        }
    }

    #[test]
    fn a_close_whole_at_one_end_reaches_the_other_and_a_half_close_does_not() {
        let (host, accepted) = linked();
        let mut ours = host.open().unwrap();
        let mut theirs = accepted.recv_timeout(Duration::from_secs(10)).unwrap();
        // A half close: the other end reads its end, and may still write.
        ours.shutdown(std::net::Shutdown::Write).unwrap();
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).unwrap();
        theirs.write_all(b"still").unwrap();
        let mut back = [0u8; 5];
        ours.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"still");
        let waiting = std::thread::spawn(move || {
            crate::hangup::wait(&theirs);
            theirs
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(!waiting.is_finished(), "a half close was taken for the end's close");
        // Closed whole: the other end's socket is shut both ways, and what
        // it writes there fails rather than waiting for a reader.
        drop(ours);
        let started = std::time::Instant::now();
        while !waiting.is_finished() {
            assert!(started.elapsed() < Duration::from_secs(10), "the close never reached the other end");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut theirs = waiting.join().unwrap();
        assert!(theirs.write_all(&[0u8; 1 << 20]).is_err());
    }

    #[test]
    fn bytes_waiting_on_a_connection_handed_over_all_arrive() {
        // A client that wrote before its connection became a stream (as the
        // supervisor's accepted connections do): its first bytes must not
        // overtake the stream's opening. Many times, for the race.
        let (host, accepted) = linked();
        std::thread::spawn(move || accepted.into_iter().for_each(echo));
        for i in 0..200u32 {
            let (mut client, conn) = UnixStream::pair().unwrap();
            client.write_all(&i.to_be_bytes()).unwrap();
            client.shutdown(std::net::Shutdown::Write).unwrap();
            host.open_on(conn).unwrap();
            client.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut back = Vec::new();
            client.read_to_end(&mut back).unwrap();
            assert_eq!(back, i.to_be_bytes(), "stream {i} lost its first bytes");
        }
    }

    /// Opens up to `streams` streams on `host`, each writing for good, and
    /// returns once its link (whose other end is `probe`'s, never read) is
    /// full: when a byte more would block, waited for rather than guessed.
    fn fill(host: &Mux, probe: &UnixStream, streams: usize) {
        for _ in 0..streams {
            let Ok(mut busy) = host.open() else { break };
            std::thread::spawn(move || {
                let chunk = vec![7u8; 64 << 10];
                while busy.write_all(&chunk).is_ok() {}
            });
        }
        let full = |_: &usize| {
            let sent = nix::sys::socket::send(probe.as_raw_fd(), &[0], nix::sys::socket::MsgFlags::MSG_DONTWAIT);
            sent == Err(nix::errno::Errno::EAGAIN)
        };
        assert!((0..10_000_000).find(full).is_some(), "the link never filled");
    }

    #[test]
    fn a_link_nobody_reads_never_holds_up_opening_a_stream() {
        // The other end never reads the link: once the socket and the queue
        // are full, opening another stream fails at once instead of waiting.
        let (a, _unread) = UnixStream::pair().unwrap();
        let probe = a.try_clone().unwrap();
        let host = Mux::start(Box::new(a.try_clone().unwrap()), Box::new(a), None).unwrap();
        fill(&host, &probe, 1);
        let (done, refused) = mpsc::channel();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            let refused = loop {
                match host.open() {
                    Ok(stream) => held.push(stream),
                    Err(e) => break e.kind(),
                }
            };
            let _ = done.send((held.len(), refused));
        });
        let (opened, why) = refused.recv_timeout(Duration::from_secs(5)).expect("opening a stream waited on the link");
        assert_eq!(why, io::ErrorKind::WouldBlock);
        // The queue's worth, and the frame its writer holds.
        assert!(opened <= OUTBOX + 1, "{opened} streams opened on a full link");
    }

    #[test]
    fn a_hold_on_a_link_nobody_reads_gives_up() {
        let (a, _unread) = UnixStream::pair().unwrap();
        let probe = a.try_clone().unwrap();
        let host = Mux::start(Box::new(a.try_clone().unwrap()), Box::new(a), None).unwrap();
        // Each stream may send a window's worth unanswered: enough of them
        // fill the link, and a frame's write then waits on it.
        fill(&host, &probe, 16);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!host.hold_within(Duration::from_millis(200)), "held a link with a frame half written");
        let (linked, _rx) = linked();
        assert!(linked.hold_within(Duration::from_secs(1)), "a link that is read is held");
        linked.go();
    }

    #[test]
    fn a_stream_nobody_reads_holds_up_only_itself() {
        let (host, accepted) = linked();
        let mut stuck = host.open().unwrap();
        let _unread = accepted.recv_timeout(Duration::from_secs(5)).unwrap();
        stuck.set_write_timeout(Some(Duration::from_millis(500))).unwrap();
        // It takes a window and some socket buffers, then no more.
        let chunk = vec![7u8; 64 << 10];
        let mut sent = 0usize;
        while stuck.write_all(&chunk).is_ok() && sent < (64 << 20) {
            sent += chunk.len();
        }
        assert!(sent < (64 << 20), "an unread stream took {sent} bytes");
        let mut other = host.open().unwrap();
        echo(accepted.recv_timeout(Duration::from_secs(5)).unwrap());
        other.write_all(b"still moving").unwrap();
        other.shutdown(std::net::Shutdown::Write).unwrap();
        other.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut back = String::new();
        other.read_to_string(&mut back).unwrap();
        assert_eq!(back, "still moving");
    }

    #[test]
    fn a_hostile_other_end_ends_streams_not_this_end() {
        // The guest's end written by hand: an open, then more than a window
        // with no credit asked, on a host end that accepts.
        let (a, mut raw) = UnixStream::pair().unwrap();
        let (tx, accepted) = mpsc::channel();
        let mux = Mux::start(Box::new(a.try_clone().unwrap()), Box::new(a), Some(tx)).unwrap();
        let frame = |id: u32, kind: u8, payload: &[u8]| {
            let mut f = id.to_be_bytes().to_vec();
            f.push(kind);
            f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            f.extend_from_slice(payload);
            f
        };
        raw.write_all(&frame(9, OPEN, &[])).unwrap();
        let mut local = accepted.recv_timeout(Duration::from_secs(5)).unwrap();
        // Nobody reads the stream here, so its credit stops once the socket
        // under it is full; a sender that goes on past its window is cut off.
        let block = vec![1u8; MAX_FRAME as usize];
        let sent = 64 * block.len();
        for _ in 0..64 {
            raw.write_all(&frame(9, DATA, &block)).unwrap();
        }
        local.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        local.read_to_end(&mut got).unwrap();
        assert!(got.len() < sent, "took all {} bytes, past its window", got.len());
        // Unknown kinds and ids are refused; a frame too long ends the link.
        raw.write_all(&frame(77, 9, &[])).unwrap();
        raw.write_all(&frame(78, DATA, b"nobody")).unwrap();
        let mut second = {
            raw.write_all(&frame(10, OPEN, &[])).unwrap();
            accepted.recv_timeout(Duration::from_secs(5)).unwrap()
        };
        let mut huge = 11u32.to_be_bytes().to_vec();
        huge.push(DATA);
        huge.extend_from_slice(&(MAX_FRAME + 1).to_be_bytes());
        raw.write_all(&huge).unwrap();
        second.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        second.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        // The link is over: it says so, and no stream opens on it (one
        // would never hear from the other end: a session hung for good).
        let (done, ended) = mpsc::channel();
        let watched = mux.clone();
        std::thread::spawn(move || {
            watched.wait_ended();
            let _ = done.send(());
        });
        ended.recv_timeout(Duration::from_secs(5)).expect("the link's end was not told");
        assert!(mux.open().is_err());
    }
}
