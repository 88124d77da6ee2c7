//! A session's way into its program's stdin, written by a thread of its own,
//! so that the session's input loop goes on reading the host while the
//! program is not reading: a signal or a terminal's resize sent after stdin
//! the program has not read reaches it at once, as under sshd (which keeps
//! such stdin in the channel's buffer and handles requests as they come).
//! Written inline, a full pipe stopped the loop, and `kill` from an asyncssh
//! client waited behind its own unread bytes for good.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// Most stdin held for a program that is not reading it (in the box's own
/// memory). Past it the input loop waits for the program, and what the host
/// sends after (signals, resizes) waits with it.
pub const MAX_HELD: usize = 4 << 20;
/// What a session may always hold, whatever the box's sessions hold together.
const FLOOR: usize = 64 << 10;
/// How often a session held back by the box's budget looks again (another
/// session's program reading frees it, and says nothing).
const BUDGET_LOOK: Duration = Duration::from_millis(20);

/// What every session of a box holds together: at most `max`, past which
/// each holds at most [`FLOOR`]. One client's 128 stalled sessions held 4 MiB
/// each, 512 MiB of the box's memory, where its agent (PID 1) lives too.
pub struct Budget {
    held: AtomicUsize,
    max: usize,
}

impl Budget {
    pub const fn new(max: usize) -> Self {
        Self { held: AtomicUsize::new(0), max }
    }
}

/// The box's: 16 MiB.
static BOX: Budget = Budget::new(16 << 20);

#[derive(Default)]
struct Queue {
    chunks: VecDeque<Vec<u8>>,
    /// Bytes queued or being written.
    held: usize,
    /// No more comes: write what is queued, then close (an EOF).
    ending: bool,
    /// The program's end closed (EPIPE): what comes is dropped.
    broken: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
    budget: &'static Budget,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        self.changed.wait(guard).unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `queue` may take more: under its own most, and under the
    /// box's budget or its floor.
    fn room(&self, queue: &Queue) -> bool {
        queue.held < MAX_HELD && (queue.held < FLOOR || self.budget.held.load(Ordering::Relaxed) < self.budget.max)
    }

    /// The queue, once it has room (or its program's end closed).
    fn wait_for_room(&self) -> MutexGuard<'_, Queue> {
        let mut queue = self.lock();
        while !self.room(&queue) && !queue.broken {
            queue = match queue.held >= MAX_HELD {
                true => self.wait(queue),
                // Held back by the box's budget, which frees without a word.
                false => self.changed.wait_timeout(queue, BUDGET_LOOK).unwrap_or_else(PoisonError::into_inner).0,
            };
        }
        queue
    }

    /// `data` joins the queue.
    fn taken(&self, queue: &mut Queue, data: Vec<u8>) {
        queue.held += data.len();
        self.budget.held.fetch_add(data.len(), Ordering::Relaxed);
        queue.chunks.push_back(data);
        self.changed.notify_all();
    }

    /// `n` bytes leave the queue (written, or dropped).
    fn gone(&self, queue: &mut Queue, n: usize) {
        queue.held -= n;
        self.budget.held.fetch_sub(n, Ordering::Relaxed);
    }
}

enum State {
    /// Nothing written yet: no thread (most sessions never send stdin).
    Idle(File),
    Writing {
        shared: Arc<Shared>,
        thread: Option<JoinHandle<()>>,
    },
    Closed,
}

/// The program's stdin (a pipe, or a terminal's master).
pub struct Stdin(State, &'static Budget);

impl Stdin {
    pub fn new(file: File) -> Self {
        Self::within(file, &BOX)
    }

    /// Holding what its program has not read within `budget`.
    fn within(file: File, budget: &'static Budget) -> Self {
        Self(State::Idle(file), budget)
    }

    /// Queues `data` for the program; waits while the session holds
    /// [`MAX_HELD`], or its floor with the box's budget held.
    pub fn write(&mut self, data: Vec<u8>) {
        if let State::Idle(_) = self.0 {
            self.start();
        }
        match &mut self.0 {
            // No thread to be had (the box's pids limit): written here.
            // EPIPE once the process stopped reading is not an error of ours.
            State::Idle(file) => {
                let _ = file.write_all(&data);
            }
            State::Writing { shared, .. } => {
                let mut queue = shared.wait_for_room();
                if !queue.broken && !queue.ending {
                    shared.taken(&mut queue, data);
                }
            }
            State::Closed => {}
        }
    }

    /// The end of stdin: the program reads EOF once it has read what came.
    pub fn eof(&mut self) {
        match &self.0 {
            State::Writing { shared, .. } => {
                shared.lock().ending = true;
                shared.changed.notify_all();
            }
            State::Idle(_) => self.0 = State::Closed,
            State::Closed => {}
        }
    }

    fn start(&mut self) {
        let State::Idle(file) = std::mem::replace(&mut self.0, State::Closed) else { return };
        let Ok(copy) = file.try_clone() else {
            self.0 = State::Idle(file);
            return;
        };
        let shared = Arc::new(Shared { queue: Mutex::default(), changed: Condvar::new(), budget: self.1 });
        let theirs = Arc::clone(&shared);
        // Builder, not thread::spawn: at the box's pids.max the session goes
        // on writing inline rather than panic.
        match std::thread::Builder::new().spawn(move || write_out(copy, &theirs)) {
            Ok(thread) => self.0 = State::Writing { shared, thread: Some(thread) },
            Err(_) => self.0 = State::Idle(file),
        }
    }
}

/// The session is over (the client closed the channel, or went): what it
/// sent before is still written, as sshd drains a closed channel's buffer
/// into the program, then stdin closes.
impl Drop for Stdin {
    fn drop(&mut self) {
        self.eof();
        if let State::Writing { thread, .. } = &mut self.0 {
            // Joined if done (its stack is given back); one still writing to a
            // program that reads slowly, or not at all, ends on its own.
            if thread.as_ref().is_some_and(JoinHandle::is_finished) {
                let _ = thread.take().map(JoinHandle::join);
            }
        }
    }
}

/// The writer thread: writes what is queued, in order, until the end.
fn write_out(mut file: File, shared: &Shared) {
    loop {
        let mut queue = shared.lock();
        while queue.chunks.is_empty() && !queue.ending {
            queue = shared.wait(queue);
        }
        let Some(chunk) = queue.chunks.pop_front() else { return };
        drop(queue);
        let written = file.write_all(&chunk);
        let mut queue = shared.lock();
        shared.gone(&mut queue, chunk.len());
        if written.is_err() {
            queue.broken = true;
            let dropped = std::mem::take(&mut queue.chunks).iter().map(Vec::len).sum();
            shared.gone(&mut queue, dropped);
        }
        shared.changed.notify_all();
        if queue.broken {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::io::Read;
    use std::time::{Duration, Instant};

    use super::*;

    fn pipe() -> (File, File) {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        (File::from(r), File::from(w))
    }

    /// Far more than a pipe holds goes in without a reader, and comes out
    /// whole and in order once one reads, then the EOF.
    #[test]
    fn writes_past_a_full_pipe_do_not_wait_and_arrive_in_order() {
        let (mut r, w) = pipe();
        let chunks: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i; 16 << 10]).collect();
        let (done, written) = std::sync::mpsc::channel();
        let sent = chunks.clone();
        std::thread::spawn(move || {
            let mut stdin = Stdin::new(w);
            sent.into_iter().for_each(|chunk| stdin.write(chunk));
            stdin.eof();
            let _ = done.send(stdin);
        });
        // Nothing reads yet: 1 MiB against a pipe's 64 KiB.
        let stdin = written.recv_timeout(Duration::from_secs(5)).expect("the writes waited for a reader");
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, chunks.concat());
        drop(stdin);
    }

    /// Past MAX_HELD a write waits for the program to read.
    #[test]
    fn past_the_most_held_a_write_waits_for_the_reader() {
        let (mut r, w) = pipe();
        let mut stdin = Stdin::new(w);
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let mut got = Vec::new();
            r.read_to_end(&mut got).unwrap();
            got.len()
        });
        let started = Instant::now();
        let total = MAX_HELD + (1 << 20);
        for _ in 0..total / (64 << 10) {
            stdin.write(vec![7; 64 << 10]);
        }
        assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());
        stdin.eof();
        assert_eq!(reader.join().unwrap(), total);
    }

    /// A session that ends (its client closed the channel) with stdin the
    /// program has not read yet: the program still gets all of it, then EOF.
    #[test]
    fn what_was_sent_before_the_session_ended_is_still_written() {
        let (mut r, w) = pipe();
        let mut stdin = Stdin::new(w);
        stdin.write(vec![3; 1 << 20]);
        drop(stdin);
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, vec![3; 1 << 20]);
    }

    /// Past the box's budget a session holds its floor, and the budget
    /// comes back as programs read (or their pipes close).
    #[test]
    fn sessions_together_hold_at_most_the_boxs_budget() {
        static SMALL: Budget = Budget::new(1 << 20);
        let (r1, w1) = pipe();
        let mut first = Stdin::within(w1, &SMALL);
        first.write(vec![1; 2 << 20]);
        let (done, written) = std::sync::mpsc::channel();
        let (r2, w2) = pipe();
        std::thread::spawn(move || {
            let mut second = Stdin::within(w2, &SMALL);
            // A pipe's worth, and then its floor, held.
            second.write(vec![2; 2 * FLOOR]);
            let _ = done.send("floor");
            second.write(vec![2; FLOOR]);
            let _ = done.send("more");
        });
        assert_eq!(written.recv_timeout(Duration::from_secs(5)), Ok("floor"));
        assert!(written.recv_timeout(Duration::from_millis(300)).is_err(), "held past the box's budget");
        // The first program goes away: its bytes leave the budget.
        drop(r1);
        assert_eq!(written.recv_timeout(Duration::from_secs(5)), Ok("more"));
        drop((first, r2));
    }

    /// A reader that went away: writes are dropped, never waited on.
    #[test]
    fn a_closed_reader_drops_what_comes() {
        let (r, w) = pipe();
        drop(r);
        let mut stdin = Stdin::new(w);
        for _ in 0..(2 * MAX_HELD) / (64 << 10) {
            stdin.write(vec![1; 64 << 10]);
        }
        stdin.eof();
    }
}
