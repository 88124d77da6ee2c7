//! A VM box's supervisor: the host process that owns its QEMU. Run by the
//! daemon as `moat box-vm`, which starts it (a fork of itself), waits for
//! its word that the guest is up, prints its pid and exits; the supervisor
//! lives as long as the machine, in the box's cgroup, and outlives a restart
//! of the daemon as a namespace box's PID 1 does.
//!
//! It makes the box's network namespace and enters it (the gateway attaches
//! there, see [`crate::vm::net`]), opens every file QEMU needs and hands the
//! descriptors to QEMU, run as the box's own host uid with no privilege to
//! gain; then, before it reads a byte the guest or QEMU sends, it drops to
//! that uid itself, with no capability, no_new_privs and a seccomp allow
//! list ([`crate::confine::supervisor`]): what it does as root (join the
//! cgroup, make the namespace, open files, bind its sockets) is done by then,
//! and what root still does to a VM (freeze, save) the daemon does itself,
//! never on the supervisor's word. It is the host end of the guest agent's virtio-serial port: each
//! connection to `agent.sock` in its run directory becomes a stream over the
//! port ([`moat_agent::mux`]), so the rest of moat reaches a VM's agent
//! exactly as a namespace box's. QMP is `qmp.sock` beside it.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::sys;
use crate::vm::qemu::{self, Fds, MachineSpec};

/// What a supervisor is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmPlan {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// The guest kernel.
    pub kernel: PathBuf,
    /// The guest's initramfs.
    pub initramfs: PathBuf,
    /// The guest's root disk (a raw file).
    pub disk: PathBuf,
    /// Where its sockets and console log go.
    pub run_dir: PathBuf,
    /// The machine.
    pub machine: MachineSpec,
    /// The host uid and gid QEMU runs as.
    pub uid: u32,
    /// The cgroup.procs files the supervisor joins (with QEMU after it).
    pub cgroup_procs: Vec<PathBuf>,
    /// A saved machine to resume rather than boot.
    pub incoming: Option<PathBuf>,
    /// The file that is the guest's memory (with [`MachineSpec::memory_file`]).
    #[serde(default)]
    pub memory: Option<PathBuf>,
    /// How long the guest may take to come up.
    pub boot_timeout_ms: u64,
}

/// The last 4 KiB of a log (open before the supervisor gave up opening
/// files), as text.
fn tail_of(file: &std::fs::File) -> String {
    use std::os::unix::fs::FileExt;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut bytes = vec![0; 4096.min(len) as usize];
    let read = file.read_at(&mut bytes, len.saturating_sub(4096)).unwrap_or(0);
    bytes.truncate(read);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The agent's socket in a run directory.
pub fn agent_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("agent.sock")
}

/// The supervisor's control socket in a run directory (`hold`, `go`: see [`Hold`]).
pub fn control_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("ctl.sock")
}

/// The QMP socket in a run directory.
pub fn qmp_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("qmp.sock")
}

/// What the guest wrote on its console, last boot (bounded: [`MAX_CONSOLE`]).
pub fn console_log(run_dir: &Path) -> PathBuf {
    run_dir.join("console.log")
}

/// The most of a guest's console kept: it is the guest's to fill.
const MAX_CONSOLE: u64 = 1 << 20;

/// `moat box-vm`: the process's exit code.
pub fn helper_main() -> i32 {
    let mut input = Vec::new();
    if let Err(e) = io::stdin().read_to_end(&mut input) {
        eprintln!("box-vm: read plan: {e}");
        return 1;
    }
    let plan: VmPlan = match serde_json::from_slice(&input) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("box-vm: bad plan: {e}");
            return 1;
        }
    };
    match launch(&plan) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("box-vm: {e}");
            1
        }
    }
}

/// Starts a supervisor, relays its first word (its pid once the guest is
/// up) and leaves it running. The supervisor is a fork of this helper, which
/// is single-threaded (running moat again cost each boot ~15 ms).
#[allow(unsafe_code)]
fn launch(plan: &VmPlan) -> io::Result<()> {
    use nix::unistd::ForkResult;
    let (word_read, word_write) = nix::unistd::pipe()?;
    let (err_read, err_write) = nix::unistd::pipe()?;
    // SAFETY: `moat box-vm` starts no thread before this (see main), so
    // the child may do anything after the fork.
    match unsafe { nix::unistd::fork() }? {
        ForkResult::Child => {
            drop((word_read, err_read));
            let null = std::fs::File::open("/dev/null")?;
            for (fd, target) in [(null.as_fd(), 0), (word_write.as_fd(), 1), (err_write.as_fd(), 2)] {
                sys::dup_onto(fd, target)?;
            }
            drop((null, word_write, err_write));
            // What its starter left open without close-on-exec is not the
            // supervisor's to hold: a guest that took it over would.
            sys::close_from(3)?;
            let code = match supervise_machine(plan) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("box-vm: {e}");
                    1
                }
            };
            std::process::exit(code);
        }
        ForkResult::Parent { child } => {
            drop((word_write, err_write));
            let mut word = String::new();
            BufReader::new(std::fs::File::from(word_read)).take(4096).read_line(&mut word)?;
            if let Some(pid) = word.trim().strip_prefix("up ") {
                println!("{pid}");
                return Ok(());
            }
            // Any other word: it is ended. No word at all: it is ending, or
            // was ended by a signal (which leaves no message of its own, so
            // its name is the message).
            let silent = word.is_empty();
            if !silent {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
            }
            let mut err = String::new();
            let _ = std::fs::File::from(err_read).take(64 << 10).read_to_string(&mut err);
            let ended = match nix::sys::wait::waitpid(child, None) {
                Ok(nix::sys::wait::WaitStatus::Signaled(_, signal, _)) => format!("ended by {signal}"),
                Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => format!("exited with {code}"),
                other => format!("ended: {other:?}"),
            };
            let err = err.trim().trim_start_matches("box-vm: ");
            Err(io::Error::other(if silent && err.is_empty() {
                format!("the machine's supervisor {ended} before the guest was up")
            } else {
                err.to_string()
            }))
        }
    }
}

fn context(what: &'static str) -> impl Fn(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn supervise_machine(plan: &VmPlan) -> io::Result<()> {
    // A session of its own: the daemon's terminal signals are not its.
    let _ = nix::unistd::setsid();
    for procs in &plan.cgroup_procs {
        std::fs::write(procs, "0").map_err(context("join the box's cgroup"))?;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| io::Error::other(format!("unshare: {e}")))?;
    let tap = crate::vm::net::prepare()?;
    let kernel = std::fs::File::open(&plan.kernel).map_err(context("open the kernel"))?;
    let initramfs = std::fs::File::open(&plan.initramfs).map_err(context("open the initramfs"))?;
    let disk = std::fs::OpenOptions::new().read(true).write(true).open(&plan.disk).map_err(context("open the disk"))?;
    let disk_read = std::fs::File::open(&plan.disk).map_err(context("open the disk"))?;
    let incoming =
        plan.incoming.as_ref().map(std::fs::File::open).transpose().map_err(context("open saved machine"))?;
    let memory = plan
        .memory
        .as_ref()
        .map(|path| std::fs::OpenOptions::new().read(true).write(true).open(path))
        .transpose()
        .map_err(context("open the guest's memory"))?;
    let (agent_link, qemu_agent) = UnixStream::pair()?;
    let qmp_path = qmp_socket(&plan.run_dir);
    let qmp = listen(&qmp_path).map_err(context("listen for QMP"))?;
    // Made now: once confined the supervisor makes no socket and opens no file.
    let resume_qmp = plan.incoming.as_ref().map(|_| UnixStream::connect(&qmp_path)).transpose()?;
    let control = listen(&control_socket(&plan.run_dir)).map_err(context("listen for control"))?;
    let listener = listen(&agent_socket(&plan.run_dir)).map_err(context("listen for the host"))?;
    let logs = [console_log(&plan.run_dir), plan.run_dir.join("qemu.log")]
        .map(|path| std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path));
    let [console_file, errors_file] = logs;
    let (console_file, errors_file) = (console_file?, errors_file?);

    let mut cmd = Command::new(&plan.qemu);
    cmd.args(qemu::args(&plan.machine))
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::uid(&mut cmd, plan.uid);
    std::os::unix::process::CommandExt::gid(&mut cmd, plan.uid);
    let mut fds = vec![
        (kernel.as_fd(), Fds::KERNEL),
        (initramfs.as_fd(), Fds::INITRAMFS),
        (disk.as_fd(), Fds::DISK),
        (disk_read.as_fd(), Fds::DISK_READ),
        (qemu_agent.as_fd(), Fds::AGENT),
        (tap.as_fd(), Fds::TAP),
        (qmp.as_fd(), Fds::QMP),
    ];
    if let Some(saved) = &incoming {
        fds.push((saved.as_fd(), Fds::INCOMING));
    }
    if let Some(memory) = &memory {
        fds.push((memory.as_fd(), Fds::MEMORY));
    }
    // QEMU reads its program, libraries and firmware, the kernel and its
    // initramfs, and uses /dev/kvm; it writes no file but the guest's memory
    // (reopened through its descriptor) and makes none (its disk, sockets and
    // saved machines are descriptors it is handed).
    let (kernel_path, initramfs_path) = (plan.kernel.as_path(), plan.initramfs.as_path());
    let read: Vec<&Path> = ["/usr", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev"]
        .iter()
        .map(Path::new)
        .chain([kernel_path, initramfs_path])
        .collect();
    let written: Vec<&Path> =
        [Path::new("/dev/kvm"), Path::new("/dev/null")].into_iter().chain(plan.memory.as_deref()).collect();
    let ruleset = sys::landlock(&read, &written).map_err(context("confine qemu with landlock"))?;
    // No file QEMU writes grows longer than the box's disk or its memory
    // (with room for a save holding it all: a page's header every 4 KiB, the
    // devices' state): its memory file and saves are outside the disk quota.
    let guest = plan.machine.memory_mib << 20;
    let longest = disk.metadata()?.len().max(guest + guest / 256 + (64 << 20));
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_FSIZE, longest, longest)
        .map_err(|e| io::Error::other(format!("limit qemu's file sizes: {e}")))?;
    sys::child_setup(&mut cmd, &fds, qemu::filter(), ruleset.as_ref().map(AsFd::as_fd))?;
    let mut child = cmd.spawn().map_err(context("run qemu"))?;
    drop(cmd);
    drop((kernel, initramfs, disk, disk_read, qemu_agent, tap, qmp, incoming, memory, ruleset));
    // From here on everything it reads is hostile: no privilege left to lose.
    crate::confine::supervisor(plan.uid, plan.uid, child.id()).map_err(context("confine the supervisor"))?;

    let (up_tx, up) = mpsc::channel();
    let logs = (console_file.try_clone()?, errors_file.try_clone()?);
    let console = child.stdout.take();
    std::thread::spawn(move || keep_console(console, logs.0, Some(up_tx)));
    // QEMU's own complaints, which a guest can provoke at will: capped too.
    let errors = child.stderr.take();
    std::thread::spawn(move || keep_console(errors, logs.1, None));
    let timeout = Duration::from_millis(plan.boot_timeout_ms);
    let came_up = match resume_qmp {
        Some(qmp) => resumed(qmp, plan.machine.memory_file, timeout),
        None => booted(&up, timeout),
    };
    if let Err(e) = came_up {
        let _ = child.kill();
        let _ = child.wait();
        let tail = console_tail(&console_file, &errors_file);
        return Err(io::Error::other(format!("{e}{tail}")));
    }

    let reader = agent_link.try_clone()?;
    let watched = agent_link.try_clone()?;
    let mux = moat_agent::mux::Mux::start(Box::new(reader), Box::new(agent_link), None)?;
    // A link that can no longer be read (the guest broke its framing, or
    // stopped the port) ends the machine, as a guest's panic does, so that
    // the next session boots it again: left up, every session waited for
    // good on a link nothing reads, and its checkpoints timed out.
    let ending = mux.clone();
    let qemu = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(0));
    std::thread::spawn(move || {
        ending.wait_ended();
        // QEMU is this process's child, unreaped until `wait` below returns.
        let _ = nix::sys::signal::kill(qemu, nix::sys::signal::Signal::SIGKILL);
    });
    let held = mux.clone();
    std::thread::spawn(move || serve_control(&control, &held, &watched));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            match conn {
                Ok(conn) => {
                    // Too many streams: this connection is dropped, others go on.
                    let _ = mux.open_on(conn);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    println!("up {}", std::process::id());
    let _ = io::stdout().flush();
    // Its sockets stay behind (it may unlink nothing now): the next boot
    // replaces them, and removing the box removes its run directory.
    let _ = child.wait();
    Ok(())
}

/// A listening socket at `path` (replacing what was there), for root alone
/// to connect to.
fn listen(path: &Path) -> io::Result<UnixListener> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// How long `hold` waits for QEMU to take what was written to the link.
const DRAIN: Duration = Duration::from_secs(2);

/// Answers the daemon's `hold` (before the machine is saved: no frame to the
/// guest half written, and every byte written taken by QEMU, so that the
/// saved guest holds whole frames only). A hold lasts as long as the
/// connection that asked for it, until `go` on it or its end: a daemon
/// killed in the middle of a save (its end closed by the kernel) leaves no
/// box whose link stays held. A `go` on a connection of its own is
/// answered too (what daemons before this one sent).
fn serve_control(control: &UnixListener, mux: &moat_agent::mux::Mux, link: &UnixStream) {
    for conn in control.incoming() {
        let Ok(mut conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        let answer = match read_word(&conn).as_str() {
            "hold" if !mux.hold_within(DRAIN) => "busy: the guest reads nothing of its link\n",
            "hold" => {
                let deadline = std::time::Instant::now() + DRAIN;
                while sys::unread_by_peer(link.as_fd()).is_ok_and(|n| n > 0) && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                // Held until the holder says `go` or is gone, however long
                // its save takes.
                let told = conn.write_all(b"held\n").and_then(|()| conn.set_read_timeout(None));
                let word = if told.is_ok() { read_word(&conn) } else { String::new() };
                mux.go();
                if word != "go" {
                    continue;
                }
                "going\n"
            }
            "go" => {
                mux.go();
                "going\n"
            }
            _ => "?\n",
        };
        let _ = conn.write_all(answer.as_bytes());
    }
}

/// The next word on a control connection (empty at its end or on an error).
/// Each side waits for the other's answer before it says more, so no word
/// is read ahead and lost with the buffer.
fn read_word(conn: &UnixStream) -> String {
    let mut word = String::new();
    let _ = BufReader::new(conn).take(16).read_line(&mut word);
    word.trim().to_string()
}

/// The supervisor's link to its guest held between frames (see
/// [`serve_control`]) while this lives; [`Hold::release`] lets it go, as
/// does the holder's end (a crash included).
pub struct Hold {
    conn: UnixStream,
    run_dir: PathBuf,
}

impl Hold {
    /// Asks the supervisor in `run_dir` to hold its guest's link.
    pub fn take(run_dir: &Path) -> io::Result<Hold> {
        let conn = UnixStream::connect(control_socket(run_dir))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        conn.set_write_timeout(Some(Duration::from_secs(5)))?;
        let hold = Hold { conn, run_dir: run_dir.to_path_buf() };
        hold.say("hold", "held")?;
        Ok(hold)
    }

    /// Lets the link go and waits until the supervisor has.
    pub fn release(self) -> io::Result<()> {
        // A supervisor started before holds lasted a connection answered
        // `held` and closed it: it is told `go` on a connection of its own.
        self.say("go", "going").or_else(|_| Hold::word(&self.run_dir, "go", "going"))
    }

    fn say(&self, word: &str, answer: &str) -> io::Result<()> {
        say(&self.conn, word, answer)
    }

    /// Says `word` on a connection of its own and expects `answer`.
    fn word(run_dir: &Path, word: &str, answer: &str) -> io::Result<()> {
        let conn = UnixStream::connect(control_socket(run_dir))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        say(&conn, word, answer)
    }
}

/// Says `word` on `conn` and expects `answer`.
fn say(mut conn: &UnixStream, word: &str, answer: &str) -> io::Result<()> {
    conn.write_all(format!("{word}\n").as_bytes())?;
    match read_word(conn) {
        got if got == answer => Ok(()),
        other => Err(io::Error::other(format!("the supervisor answered {other:?} to {word}"))),
    }
}

/// Copies what QEMU writes (the guest's console, or its own stderr) to a
/// log of at most [`MAX_CONSOLE`] bytes, and says once when the agent
/// reports the guest up.
fn keep_console(console: Option<impl Read>, log: std::fs::File, mut up: Option<mpsc::Sender<()>>) {
    let Some(console) = console else { return };
    let mut log = Some(log);
    let mut written = 0u64;
    let mut reader = BufReader::new(console);
    let mut line = Vec::new();
    loop {
        line.clear();
        // A line is cut at 4 KiB: the guest decides what it prints.
        match (&mut reader).take(4096).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.starts_with(moat_agent::GUEST_UP.as_bytes()) {
            if let Some(up) = up.take() {
                let _ = up.send(());
            }
        }
        if written < MAX_CONSOLE {
            if let Some(log) = log.as_mut() {
                let _ = log.write_all(&line);
            }
            written += line.len() as u64;
        } else {
            log = None;
        }
    }
}

fn booted(up: &mpsc::Receiver<()>, timeout: Duration) -> io::Result<()> {
    up.recv_timeout(timeout).map_err(|e| match e {
        mpsc::RecvTimeoutError::Timeout => io::Error::other(format!("the guest was not up in {timeout:?}")),
        mpsc::RecvTimeoutError::Disconnected => io::Error::other("qemu ended before the guest was up"),
    })
}

/// Waits until QEMU, loading a saved machine, runs it (`qmp`: a connection
/// to its QMP socket made before it ran); one whose memory is its file is
/// told to load first (it was started to wait: see [`qemu::args`]).
fn resumed(qmp: UnixStream, memory_file: bool, timeout: Duration) -> io::Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    let mut conn = qemu::Qmp::on(qmp, timeout)?;
    if memory_file {
        conn.load(Fds::INCOMING)?;
    }
    while std::time::Instant::now() < deadline {
        let status = conn.execute("query-status", serde_json::Value::Null)?;
        match status.get("status").and_then(|s| s.as_str()) {
            Some("running") => return Ok(()),
            Some("inmigrate") => std::thread::sleep(Duration::from_millis(5)),
            // Loaded and paused (it was saved paused): run it.
            Some("paused" | "postmigrate" | "prelaunch") => {
                conn.execute("cont", serde_json::Value::Null)?;
            }
            other => return Err(io::Error::other(format!("the saved machine did not load: {other:?}"))),
        }
    }
    Err(io::Error::other(format!("the saved machine was not running in {timeout:?}")))
}

/// The last lines of the console log and QEMU's, to explain a failed boot.
fn console_tail(console: &std::fs::File, errors: &std::fs::File) -> String {
    let text = tail_of(console);
    let qemu = tail_of(errors);
    let lines: Vec<&str> = text.lines().chain(qemu.lines()).filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(8)..].join(" | ");
    if tail.is_empty() {
        String::new()
    } else {
        format!(" (last words: {tail})")
    }
}
