//! `Service` and `ServiceLog`: the box's one long-running program (`new
//! --run`: an image's Entrypoint and Cmd), kept running by PID 1 whatever
//! the host does. It is started again whenever it exits, after a pause that
//! doubles from 1 s to 30 s while it keeps ending within 10 s of its start.
//! Its output (stdout and stderr together, as a journal keeps them) and a
//! line of the agent's at each start and end are kept in memory, the last
//! [`LOG_BYTES`] of them, for the host to read.

use std::collections::VecDeque;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use moat_agent::protocol::{AgentMsg, ExitStatus, MAX_CHUNK};
use nix::fcntl::OFlag;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::{pipe2, Pid};

use crate::frames;
use crate::reaper::Reaper;
use crate::spawn::{self, ChildIo};

/// How much of the service's output is kept (the newest).
const LOG_BYTES: usize = 256 * 1024;
/// The pause before the first start again.
const FIRST_PAUSE: Duration = Duration::from_secs(1);
/// The longest pause between starts of a service that keeps failing.
const LONGEST_PAUSE: Duration = Duration::from_secs(30);
/// A run at least this long was not a crash: the next pause starts over.
const HEALTHY_RUN: Duration = Duration::from_secs(10);
/// How long a replaced service has between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The service running now, if any.
static CURRENT: Mutex<Option<Current>> = Mutex::new(None);
/// Its output, and the agent's lines about it.
static LOG: Mutex<VecDeque<u8>> = Mutex::new(VecDeque::new());

struct Current {
    argv: Vec<String>,
    control: Arc<Control>,
}

/// What the supervisor of one service shares with whoever replaces it.
#[derive(Default)]
struct Control {
    ended: AtomicBool,
    /// The running process (its process group: it leads a session of its own).
    pid: Mutex<Option<Pid>>,
}

impl Control {
    /// Ends this service for good: its process group is asked to stop, and
    /// killed if it has not after [`STOP_GRACE`].
    fn end(self: &Arc<Self>) {
        self.ended.store(true, Ordering::Relaxed);
        let Some(pid) = *lock(&self.pid) else { return };
        let _ = killpg(pid, Signal::SIGTERM);
        let control = Arc::clone(self);
        let _ = std::thread::Builder::new().spawn(move || {
            std::thread::sleep(STOP_GRACE);
            // Only while it is still this service's (the supervisor clears
            // the pid once it reaped it: the number may be another's later).
            if *lock(&control.pid) == Some(pid) {
                let _ = killpg(pid, Signal::SIGKILL);
            }
        });
    }

    fn ended(&self) -> bool {
        self.ended.load(Ordering::Relaxed)
    }

    /// Sleeps `pause`, or less if the service is ended meanwhile.
    fn pause(&self, pause: Duration) {
        let until = Instant::now() + pause;
        while !self.ended() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes `argv` the box's service (an empty one: none), answering `Pong`.
pub fn set(argv: Vec<String>, reaper: &Arc<Reaper>, stream: &UnixStream) -> io::Result<()> {
    let mut current = lock(&CURRENT);
    if current.as_ref().is_some_and(|c| c.argv == argv) {
        return frames::send(stream, &AgentMsg::Pong);
    }
    if let Some(old) = current.take() {
        note(&format!("the service is replaced: ending {}", shown(&old.argv)));
        old.control.end();
    }
    if !argv.is_empty() {
        let control = Arc::new(Control::default());
        let (args, c, r) = (argv.clone(), Arc::clone(&control), Arc::clone(reaper));
        // Builder: at the box's pids.max the host hears why, PID 1 lives on.
        if let Err(e) = std::thread::Builder::new().spawn(move || supervise(&args, &c, &r)) {
            return frames::send(stream, &AgentMsg::Error(format!("cannot start the service: {e}")));
        }
        *current = Some(Current { argv, control });
    }
    frames::send(stream, &AgentMsg::Pong)
}

/// Sends what the log holds, then `Exit`.
pub fn send_log(stream: &UnixStream) -> io::Result<()> {
    let bytes: Vec<u8> = lock(&LOG).iter().copied().collect();
    for chunk in bytes.chunks(MAX_CHUNK) {
        frames::send(stream, &AgentMsg::Stdout(chunk.to_vec()))?;
    }
    frames::send(stream, &AgentMsg::Exit(ExitStatus::Code(0)))
}

/// Runs the service until it is ended, starting it again each time it exits.
fn supervise(argv: &[String], control: &Arc<Control>, reaper: &Reaper) {
    let mut pause = FIRST_PAUSE;
    while !control.ended() {
        let started = Instant::now();
        run_once(argv, control, reaper);
        if control.ended() {
            break;
        }
        let wait = if started.elapsed() >= HEALTHY_RUN { FIRST_PAUSE } else { pause };
        note(&format!("starting it again in {} s", wait.as_secs()));
        control.pause(wait);
        pause = (wait * 2).min(LONGEST_PAUSE);
    }
}

/// Starts the service once and waits for it to exit.
fn run_once(argv: &[String], control: &Control, reaper: &Reaper) {
    let io = || -> io::Result<(OwnedFd, OwnedFd, OwnedFd)> {
        let null = OwnedFd::from(std::fs::File::open("/dev/null")?);
        let (out_r, out_w) = pipe2(OFlag::O_CLOEXEC)?;
        Ok((null, out_r, out_w))
    };
    let (null, out_r, out_w) = match io() {
        Ok(fds) => fds,
        Err(e) => return note(&format!("cannot start {}: {e}", shown(argv))),
    };
    let program = crate::exec::service_program(argv);
    let child = ChildIo { stdin: &null, stdout: &out_w, stderr: &out_w, controlling_tty: false };
    let (pid, exit) = {
        // Held across the start, so that an `end` sees the pid or the flag.
        let mut running = lock(&control.pid);
        if control.ended() {
            return;
        }
        match reaper.spawn_watched(|| spawn::spawn(&program, &child)) {
            Ok((pid, exit)) => {
                *running = Some(pid);
                (pid, exit)
            }
            Err(e) => return note(&format!("cannot start {}: {e}", shown(argv))),
        }
    };
    drop(out_w);
    note(&format!("started {} (pid {pid})", shown(argv)));
    // The copier ends when every holder of the pipe's other end has closed
    // it: not waited for, as a daemon the service left behind may hold it.
    if std::thread::Builder::new().spawn(move || copy_output(&out_r)).is_err() {
        note("its output is lost: no thread to read it");
    }
    let status = exit.recv();
    *lock(&control.pid) = None;
    match status {
        Ok(ExitStatus::Code(code)) => note(&format!("it exited with status {code}")),
        Ok(ExitStatus::Signal { signo, .. }) => note(&format!("it was ended by signal {signo}")),
        Err(_) => note("it was lost"),
    }
}

fn copy_output(fd: &OwnedFd) {
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        match nix::unistd::read(fd, &mut buf) {
            Ok(0) => return,
            Ok(n) => append(buf.get(..n).unwrap_or_default()),
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return,
        }
    }
}

/// Adds bytes to the log, dropping its oldest past [`LOG_BYTES`].
fn append(bytes: &[u8]) {
    let mut log = lock(&LOG);
    log.extend(bytes);
    let over = log.len().saturating_sub(LOG_BYTES);
    log.drain(..over);
}

/// A line of the agent's about the service, with the time.
fn note(what: &str) {
    let line = format!("[moat {}] {what}\n", utc_now());
    let mut log = lock(&LOG);
    // Its own line, even if the service's last output ended mid-line.
    if log.back().is_some_and(|b| *b != b'\n') {
        log.push_back(b'\n');
    }
    drop(log);
    append(line.as_bytes());
}

/// `argv` as a person would type it.
fn shown(argv: &[String]) -> String {
    argv.iter()
        .map(|a| if a.is_empty() || a.contains(char::is_whitespace) { format!("{a:?}") } else { a.clone() })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The time now, as `YYYY-MM-DD HH:MM:SS` in UTC.
fn utc_now() -> String {
    let secs = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rest / 3600, rest % 3600 / 60, rest % 60)
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`, for days after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn dates_are_the_calendars() {
        assert_eq!(super::civil_from_days(0), (1970, 1, 1));
        assert_eq!(super::civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(super::civil_from_days(20_790), (2026, 12, 3));
    }

    #[test]
    fn commands_are_shown_as_typed() {
        let argv: Vec<String> = ["python3", "-m", "http.server", "a b", ""].iter().map(|s| s.to_string()).collect();
        assert_eq!(super::shown(&argv), r#"python3 -m http.server "a b" """#);
    }
}
