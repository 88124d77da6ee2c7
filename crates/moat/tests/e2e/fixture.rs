//! The test daemon, keys and ssh helpers.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where the test run keeps its files.
pub fn scratch_root() -> PathBuf {
    PathBuf::from(format!("/tmp/moat-e2e-{}", std::process::id()))
}

/// The moat binary under test.
pub fn moat_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_moat"))
}

/// An SSH identity.
pub struct Key {
    pub path: PathBuf,
    pub public: String,
}

impl Key {
    pub fn generate(dir: &Path, name: &str) -> Key {
        let path = dir.join(name);
        let status = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
            .arg(&path)
            .status()
            .expect("run ssh-keygen");
        assert!(status.success());
        let public = std::fs::read_to_string(path.with_extension("pub")).expect("read public key");
        Key { path, public }
    }
}

/// Signals the test daemons start with ignored: what nohup and `&` ignore
/// (1 to 3), SIGPIPE, and 32, 34 and 64 (libc's `signal()` cannot reset 32
/// to 34; 33 the daemon's libc takes over for itself). Not SIGCHLD or
/// SIGTERM, which the daemon itself relies on.
pub const IGNORED_BY_THE_DAEMON: &[u32] = &[1, 2, 3, 13, 32, 34, 64];
/// Signals the test daemons start with blocked (none the daemon waits for).
pub const BLOCKED_BY_THE_DAEMON: &[u32] = &[34, 64];

/// A Python program that execs its arguments with the signals above ignored
/// and blocked, as a careless parent leaves them. Raw system calls, as libc
/// refuses 32 to 34. (nohup ignores SIGHUP alone: this is a superset.)
fn signals_left_behind() -> String {
    format!(
        r#"
IGNORED, BLOCKED = {IGNORED_BY_THE_DAEMON:?}, {BLOCKED_BY_THE_DAEMON:?}
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
def raw(*args):
    return libc.syscall(*(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
SYS_rt_sigaction, SYS_rt_sigprocmask, SIG_IGN, SIG_BLOCK = 13, 14, 1, 0
for signo in IGNORED:
    if raw(SYS_rt_sigaction, signo, struct.pack("QQQQ", SIG_IGN, 0, 0, 0), None, 8) != 0:
        sys.exit(f"ignore {{signo}}: {{os.strerror(ctypes.get_errno())}}")
mask = struct.pack("Q", sum(1 << (signo - 1) for signo in BLOCKED))
if raw(SYS_rt_sigprocmask, SIG_BLOCK, mask, None, 8) != 0:
    sys.exit(f"block: {{os.strerror(ctypes.get_errno())}}")
os.execv(sys.argv[1], sys.argv[1:])
"#
    )
}

/// The port a just-started `moat serve` or `moat front` says it listens on
/// (its first line on stdout); panics with its log (at `log`) if it never does.
pub fn listening_port(child: &mut Child, log: &Path, what: &str) -> u16 {
    listening_lines(child, log, what).0
}

/// As [`listening_port`], with the lines printed before it (the HTTP edge's).
pub fn listening_lines(child: &mut Child, log: &Path, what: &str) -> (u16, Vec<String>) {
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut before = Vec::new();
    loop {
        let mut line = String::new();
        out.read_line(&mut line).expect("read listen line");
        if let Some(addr) = line.trim().strip_prefix("listening on ") {
            return (addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port"), before);
        }
        if line.is_empty() || before.len() > 8 {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            panic!("{what} did not start: {before:?} {line:?}\n{log}")
        }
        before.push(line.trim().to_string());
    }
}

/// Where a daemon's HTTP edge listens, and the CA its certificate chains to.
#[derive(Clone, Debug)]
pub struct Edge {
    pub port: u16,
    pub ca: PathBuf,
}

/// A running `moat serve`.
pub struct Daemon {
    pub state_dir: PathBuf,
    pub keys_file: PathBuf,
    pub port: u16,
    /// The HTTP edge, if started with `--http-listen`.
    pub edge: Option<Edge>,
    child: Option<Child>,
    extra: Vec<String>,
    /// Extra environment for the next (re)start, e.g. `MOAT_FAULT`.
    pub env: Vec<(String, String)>,
}

impl Daemon {
    /// Starts a daemon on a free port.
    pub fn start(state_dir: PathBuf, keys_file: PathBuf, extra: &[&str]) -> Daemon {
        let mut d = Daemon {
            state_dir,
            keys_file,
            port: 0,
            edge: None,
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
        };
        d.restart();
        d
    }

    /// The daemon's pid (`moat serve`, the privileged side).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("daemon running")
    }

    /// (Re)starts the process on a new free port, with the same state.
    pub fn restart(&mut self) {
        self.kill();
        // Appended to: a restarted daemon's log keeps what came before it.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state_dir.with_extension("log"))
            .expect("daemon log");
        // Started as `moat serve &` from a script or under nohup starts it
        // (SIGINT, SIGQUIT and SIGHUP ignored), and worse: see
        // [`signals_left_behind`]. Boxes must not inherit any of it
        // (pty_shell_resize_and_ctrl_c types Ctrl-C;
        // exec_programs_start_with_default_signals reads the rest).
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(signals_left_behind())
            .arg(moat_bin())
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--state-dir"])
            .arg(&self.state_dir)
            .arg("--authorized-keys")
            .arg(&self.keys_file)
            .args(&self.extra)
            // Guests run on TCG here; the probe for KVM (seconds) is the doctor's test.
            .args(if self.extra.iter().any(|a| a == "--vm-accel") { &[][..] } else { &["--vm-accel", "tcg"][..] })
            // The agent embedded in moat, as a plain `cargo build` makes it.
            .env_remove("MOAT_AGENT")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start moat serve");
        let (port, before) = listening_lines(&mut child, &self.state_dir.with_extension("log"), "daemon");
        self.port = port;
        let http = before.iter().find_map(|l| l.strip_prefix("http listening on "));
        let http = http.and_then(|a| a.rsplit(':').next()?.parse().ok());
        let ca = before.iter().find_map(|l| l.strip_prefix("web CA ")).map(PathBuf::from);
        self.edge = http.map(|port| Edge { port, ca: ca.unwrap_or_default() });
        self.child = Some(child);
    }

    /// Whether the process is still running (not killed, not ended by a
    /// fault point).
    pub fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Kills the process (boxes keep running).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the process and removes every box and all state.
    pub fn purge(&mut self) {
        let out = self.try_purge();
        assert!(out.status.success(), "purge failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn try_purge(&mut self) -> Output {
        self.kill();
        Command::new(moat_bin()).arg("purge").arg("--state-dir").arg(&self.state_dir).output().expect("purge")
    }

    /// The common ssh options (see [`ssh_opts`]).
    pub fn ssh_opts(&self, key: &Key) -> Vec<String> {
        ssh_opts(key)
    }

    /// `ssh -p PORT [user@]127.0.0.1 ARGS...`
    pub fn ssh(&self, key: &Key, user: Option<&str>, args: &[&str]) -> Command {
        self.ssh_with(key, user, &[], args)
    }

    /// `ssh OPTS -p PORT [user@]127.0.0.1 ARGS...` (see [`ssh_to`]).
    pub fn ssh_with(&self, key: &Key, user: Option<&str>, opts: &[&str], args: &[&str]) -> Command {
        ssh_to(self.port, key, user, opts, args)
    }
}

/// The common ssh options: no config, no known hosts, batch mode, `key` only.
pub fn ssh_opts(key: &Key) -> Vec<String> {
    let mut v: Vec<String> = [
        "-F",
        "/dev/null",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=20",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push("-i".into());
    v.push(key.path.display().to_string());
    v
}

/// `ssh OPTS -p PORT [user@]127.0.0.1 ARGS...` (ssh takes options only before the command),
/// cut off after 15 minutes: a guard against a hang, not a bound on time (the first
/// `new` builds the debian image, several minutes on a loaded machine).
pub fn ssh_to(port: u16, key: &Key, user: Option<&str>, opts: &[&str], args: &[&str]) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.arg("900").arg("ssh").args(ssh_opts(key)).args(opts).arg("-p").arg(port.to_string());
    cmd.arg(match user {
        Some(u) => format!("{u}@127.0.0.1"),
        None => "127.0.0.1".into(),
    });
    cmd.args(args);
    cmd.stdin(Stdio::null());
    cmd
}

impl Drop for Daemon {
    /// A test that fails part-way still leaves no boxes, mounts or cgroups.
    fn drop(&mut self) {
        if self.state_dir.exists() {
            let _ = self.try_purge();
        }
    }
}

/// What a command printed, with its status.
pub struct Ran {
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Ran {
    fn from(o: Output) -> Ran {
        Ran {
            status: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

impl Ran {
    #[track_caller]
    pub fn ok(self) -> Ran {
        assert_eq!(self.status, Some(0), "command failed\nstdout: {}\nstderr: {}", self.stdout, self.stderr);
        self
    }
}

pub fn run(cmd: &mut Command) -> Ran {
    cmd.output().expect("spawn").into()
}

/// Runs `cmd` cut off after two minutes: a box that hangs fails a test that
/// checks it answers, rather than holding it for the ssh guard's fifteen.
pub fn run_briefly(cmd: &Command) -> Ran {
    let mut cut = Command::new("timeout");
    cut.args(["-k", "5", "120"]).arg(cmd.get_program()).args(cmd.get_args()).stdin(Stdio::null());
    run(&mut cut)
}

/// A fresh box name, unique within the test run.
pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Starts `cmd` with its stdin piped (for writing to, as an `ask` session's
/// answers) and its stdout read a line at a time as it comes (stderr as the
/// caller set it).
pub fn spawn_with_lines(cmd: &mut Command) -> (Child, std::process::ChildStdin, std::sync::mpsc::Receiver<String>) {
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn");
    let stdin = child.stdin.take().expect("stdin");
    let out = child.stdout.take().expect("stdout");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(BufReader::new(out)).map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, stdin, lines)
}
