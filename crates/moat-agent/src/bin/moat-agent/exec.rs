//! `Exec`: run a command or a login shell, with pipes or a terminal, and stream
//! its I/O over the host connection until it exits.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use moat_agent::protocol::{AgentMsg, ExecRequest, HostMsg, Run, WinSize};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::pty::{openpty, Winsize};
use nix::sys::signal::{kill, Signal};
use nix::unistd::pipe2;

use crate::box_file::read_text;
use crate::frames::{self, FrameReader};
use crate::reaper::Reaper;
use crate::spawn::{self, ChildIo, Program};
use crate::stdin::Stdin;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

nix::ioctl_write_ptr_bad!(set_winsize, libc::TIOCSWINSZ, Winsize);

/// What the session's threads tell each other.
#[derive(Default)]
struct Flags {
    /// The process has exited: pumps drain what is buffered and stop.
    exited: AtomicBool,
    /// The host connection is gone: pumps stop at once.
    host_gone: AtomicBool,
    /// The client reads no more output: the stdout pump stops, closing the
    /// pipe's reading end.
    output_closed: AtomicBool,
}

type Shared = Arc<Mutex<UnixStream>>;

/// Runs one session's program, streaming its output until it exits. A session
/// that could not start for want of a thread or a process (the box's pids
/// limit) is told so.
pub fn run(req: ExecRequest, reader: FrameReader, stream: UnixStream, reaper: &Reaper) -> io::Result<()> {
    let told = stream.try_clone()?;
    let result = session(req, reader, stream, reaper);
    if let Err(e) = &result {
        if e.raw_os_error() == Some(libc::EAGAIN) {
            let _ = frames::send(&told, &AgentMsg::Error(crate::no_room(e)));
        }
    }
    result
}

fn session(req: ExecRequest, mut reader: FrameReader, stream: UnixStream, reaper: &Reaper) -> io::Result<()> {
    // A box named since it booted answers to its new name from its first session.
    crate::login::alias_root_as_host_name();
    let mut program = program_for(&req);
    let writer: Shared = Arc::new(Mutex::new(stream.try_clone()?));
    let flags = Arc::new(Flags::default());

    // Our ends of the child's stdio: where stdin goes, where output comes from.
    let mut stdin: Stdin;
    let mut pumps: Vec<JoinHandle<()>> = Vec::new();
    let terminal: Option<OwnedFd>;
    let spawned = match &req.pty {
        Some(pty) => {
            let ws = winsize(pty.size);
            let pair = openpty(Some(&ws), None)?;
            for fd in [&pair.master, &pair.slave] {
                nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))?;
            }
            // As sshd sets it for a session with a terminal.
            if let Ok(tty) = nix::unistd::ttyname(&pair.slave) {
                program.envp.push(cstring(format!("SSH_TTY={}", tty.display())));
            }
            let io = ChildIo { stdin: &pair.slave, stdout: &pair.slave, stderr: &pair.slave, controlling_tty: true };
            let spawned = reaper.spawn_watched(|| spawn::spawn(&program, &io));
            stdin = Stdin::new(File::from(pair.master.try_clone()?));
            pumps.push(start_pump(pair.master.try_clone()?, Output::Terminal, &writer, &flags)?);
            terminal = Some(pair.master);
            spawned
        }
        None => {
            let (in_r, in_w) = pipe2(OFlag::O_CLOEXEC)?;
            let (out_r, out_w) = pipe2(OFlag::O_CLOEXEC)?;
            let (err_r, err_w) = pipe2(OFlag::O_CLOEXEC)?;
            let io = ChildIo { stdin: &in_r, stdout: &out_w, stderr: &err_w, controlling_tty: false };
            let spawned = reaper.spawn_watched(|| spawn::spawn(&program, &io));
            stdin = Stdin::new(File::from(in_w));
            pumps.push(start_pump(out_r, Output::Stdout, &writer, &flags)?);
            pumps.push(start_pump(err_r, Output::Stderr, &writer, &flags)?);
            terminal = None;
            spawned
        }
    };
    let (pid, exit) = match spawned {
        Ok(ok) => ok,
        Err(e) => {
            flags.host_gone.store(true, Ordering::Relaxed);
            // A fork refused for want of pids: `run` says so, as for a thread.
            if e.raw_os_error() == Some(libc::EAGAIN) {
                return Err(e);
            }
            let shell = program.path.to_string_lossy().into_owned();
            return frames::send(&stream, &AgentMsg::Error(format!("cannot run {shell}: {e}")));
        }
    };
    send(&writer, &AgentMsg::Started { pid: pid.as_raw() as u32 })?;

    // The waiter reports the exit once all output before it has been sent.
    let waiter = {
        let (writer, flags) = (Arc::clone(&writer), Arc::clone(&flags));
        std::thread::Builder::new().spawn(move || {
            let Ok(status) = exit.recv() else { return };
            flags.exited.store(true, Ordering::Relaxed);
            for pump in pumps {
                let _ = pump.join();
            }
            let _ = send(&writer, &AgentMsg::Exit(status));
            // Ends the input loop below and tells the host that nothing follows.
            let guard = writer.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = guard.shutdown(Shutdown::Both);
        })?
    };

    loop {
        match reader.next() {
            // Queued (a writer thread of the session's writes it): a program
            // not reading holds back neither its signals nor its resizes.
            Ok(Some(HostMsg::Stdin(data))) => stdin.write(data),
            Ok(Some(HostMsg::StdinEof)) if terminal.is_none() => stdin.eof(),
            Ok(Some(HostMsg::OutputClosed)) => flags.output_closed.store(true, Ordering::Relaxed),
            Ok(Some(HostMsg::Resize(size))) => {
                if let Some(master) = &terminal {
                    // SAFETY: TIOCSWINSZ reads one Winsize from a valid pointer on an
                    // open pty master.
                    let _ = unsafe { set_winsize(master.as_raw_fd(), &winsize(size)) };
                }
            }
            Ok(Some(HostMsg::Signal(signo))) => {
                if let Ok(sig) = Signal::try_from(signo) {
                    let _ = kill(pid, sig);
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    if !flags.exited.load(Ordering::Relaxed) {
        // The client went away first. As with sshd, its process keeps running, but
        // a terminal is hung up once our end of it closes (and SIGHUP follows).
        flags.host_gone.store(true, Ordering::Relaxed);
    }
    drop(stdin);
    drop(terminal);
    // The waiter finishes on its own once the process exits.
    drop(waiter);
    Ok(())
}

fn send(writer: &Shared, msg: &AgentMsg) -> io::Result<()> {
    let guard = writer.lock().unwrap_or_else(PoisonError::into_inner);
    frames::send(&guard, msg)
}

fn winsize(size: WinSize) -> Winsize {
    Winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 }
}

/// What a pump reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    Stdout,
    Stderr,
    /// A terminal's master: stdout and stderr in one, and stdin's way in too.
    Terminal,
}

/// Copies one output fd to the host, as frames of its kind.
///
/// Once the process has exited, a pump forwards only what is already buffered:
/// a background job that keeps the pipe open must not hold the session open
/// (OpenSSH would wait for it; `ssh box 'server &'` should return). A stdout
/// pump stops when the client reads no more output (a terminal's is left:
/// sshd leaves it too).
/// How long output may go quiet after the command exits before the session
/// ends anyway: what its background jobs print within it (`(sleep 1; echo
/// done) &`) still reaches the client, as with sshd, which waits for the
/// output's end however long that takes.
const LINGER: Duration = Duration::from_millis(1500);
/// The longest the session lingers after the command exits, however its
/// jobs go on printing (`ssh box 'server &'` returns, as an issue asked).
const LINGER_MOST: Duration = Duration::from_secs(5);

fn start_pump(fd: OwnedFd, kind: Output, writer: &Shared, flags: &Arc<Flags>) -> io::Result<JoinHandle<()>> {
    let wrap = match kind {
        Output::Stdout | Output::Terminal => AgentMsg::Stdout,
        Output::Stderr => AgentMsg::Stderr,
    };
    let (writer, flags) = (Arc::clone(writer), Arc::clone(flags));
    // Builder, not thread::spawn: at the box's pids.max the agent must fail the
    // session, not panic.
    std::thread::Builder::new().spawn(move || {
        let mut buf = vec![0u8; moat_agent::protocol::MAX_CHUNK];
        // Since the command exited, or its output last came, whichever is
        // later; and since it exited.
        let mut heard = Instant::now();
        let mut exited_at: Option<Instant> = None;
        loop {
            let unread = kind == Output::Stdout && flags.output_closed.load(Ordering::Relaxed);
            if flags.host_gone.load(Ordering::Relaxed) || unread {
                return;
            }
            if exited_at.is_none() && flags.exited.load(Ordering::Relaxed) {
                exited_at = Some(Instant::now());
                heard = Instant::now();
            }
            let exited = exited_at.is_some();
            // A job that keeps talking (a dev server's log) holds the
            // session no longer than this after the command.
            if exited_at.is_some_and(|at| at.elapsed() >= LINGER_MOST) {
                break;
            }
            let timeout = PollTimeout::from(if exited { 50u16 } else { 200u16 });
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                // The command exited, and what it left in the background has
                // been quiet a while: the session ends though it holds the
                // output open (`nohup server &`; sshd would wait for it).
                Ok(0) if exited && heard.elapsed() >= LINGER => break,
                Ok(0) | Err(Errno::EINTR) => continue,
                Ok(_) => {}
                Err(_) => return,
            }
            match nix::unistd::read(&fd, &mut buf) {
                // EIO: every holder of the terminal's other end has closed it.
                Ok(0) | Err(Errno::EIO) => return,
                Ok(n) => {
                    heard = Instant::now();
                    let chunk = buf.get(..n).unwrap_or_default().to_vec();
                    if send(&writer, &wrap(chunk)).is_err() {
                        flags.host_gone.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(_) => return,
            }
        }
        // The session ends before the jobs that hold its output do: their
        // output goes nowhere from here, and they live on (see
        // [`crate::drain`]). A terminal is hung up instead, as sshd does.
        if kind != Output::Terminal {
            crate::drain::adopt(fd);
        }
    })
}

/// Root's home and shell from the box's own /etc/passwd.
fn root_account() -> (String, String) {
    let passwd = read_text("/etc/passwd").unwrap_or_default();
    passwd
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&"root"))
        .and_then(|f| Some((f.get(5)?.to_string(), f.get(6)?.to_string())))
        .filter(|(home, shell)| !home.is_empty() && !shell.is_empty())
        .unwrap_or_else(|| ("/root".into(), "/bin/sh".into()))
}

/// The variables `/etc/environment` sets (as pam_env reads it: `NAME=VALUE`
/// lines, `export ` allowed, one pair of quotes stripped), which every session
/// gets, before what the client sent.
fn system_environment(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let line = line.strip_prefix("export ").unwrap_or(line);
            let (name, value) = line.split_once('=')?;
            let valid = name
                .bytes()
                .enumerate()
                .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
            if name.is_empty() || !valid {
                return None;
            }
            Some((name.to_string(), unquote(value).to_string()))
        })
        .collect()
}

fn unquote(value: &str) -> &str {
    ['"', '\''].iter().find_map(|q| value.strip_prefix(*q)?.strip_suffix(*q)).unwrap_or(value)
}

fn cstring(s: impl Into<Vec<u8>>) -> CString {
    let mut bytes: Vec<u8> = s.into();
    bytes.retain(|b| *b != 0);
    CString::new(bytes).unwrap_or_default()
}

/// Variables of `/etc/environment` the host writes for a box of a pulled
/// image: the image's `User` and `WorkingDir`, which every session takes on
/// (and never sees as variables).
pub const IMAGE_USER: &str = "MOAT_IMAGE_USER";
/// See [`IMAGE_USER`].
pub const IMAGE_WORKDIR: &str = "MOAT_IMAGE_WORKDIR";

/// Who a session runs as: ids (`None`: root, as the agent), home, shell, name.
struct Account {
    ids: Option<(u32, u32)>,
    home: String,
    shell: String,
    name: String,
}

/// An image's `User` (`NAME`, `UID`, `NAME:GROUP` or `UID:GID`) as the box's
/// /etc/passwd and /etc/group have it; a number needs no line (as OCI
/// runtimes take it), a name without one runs as nobody.
fn image_account(user: &str) -> Account {
    let passwd = read_text("/etc/passwd").unwrap_or_default();
    let group = read_text("/etc/group").unwrap_or_default();
    account_in(&passwd, &group, user)
}

/// [`image_account`] with the files' texts.
fn account_in(passwd: &str, group: &str, user: &str) -> Account {
    let (who, grp) = user.split_once(':').map_or((user, None), |(u, g)| (u, Some(g)));
    let entry = passwd
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&who) || (who.parse::<u32>().is_ok() && f.get(2) == Some(&who)));
    let field = |i: usize| entry.as_ref().and_then(|f| f.get(i)).map(|s| s.to_string());
    let uid = field(2).and_then(|u| u.parse().ok()).or_else(|| who.parse().ok()).unwrap_or(65534);
    let mut gid = field(3).and_then(|g| g.parse().ok()).unwrap_or(uid);
    if let Some(grp) = grp {
        gid = grp
            .parse()
            .ok()
            .or_else(|| {
                group
                    .lines()
                    .map(|l| l.split(':').collect::<Vec<_>>())
                    .find(|f| f.first() == Some(&grp))?
                    .get(2)?
                    .parse()
                    .ok()
            })
            .unwrap_or(65534);
    }
    let home = field(5).filter(|h| !h.is_empty()).unwrap_or_else(|| "/".into());
    let shell = field(6).filter(|s| !s.is_empty()).unwrap_or_else(|| "/bin/sh".into());
    let name = field(0).unwrap_or_else(|| who.to_string());
    let ids = (uid != 0 || gid != 0).then_some((uid, gid));
    Account { ids, home, shell, name }
}

/// The uid and gid the box's sessions run as (the image's `User`), or
/// `None` for root.
pub fn session_ids() -> Option<(u32, u32)> {
    Setting::read(&[], None).account.ids
}

/// `word` found on `path` (a program named with a `/` is taken as it is).
fn on_path(word: &str, path: &str) -> String {
    if word.contains('/') {
        return word.to_string();
    }
    path.split(':')
        .map(|dir| format!("{dir}/{word}"))
        .find(|p| std::path::Path::new(p).is_file())
        .unwrap_or_else(|| word.to_string())
}

/// What every program run for the box's users starts from: who it runs as
/// (the image's `User`, or root), its environment (the session's base, then
/// `/etc/environment`, then `extra`) and its directory (the image's
/// `WorkingDir`, or the account's home).
struct Setting {
    account: Account,
    env: Vec<(String, String)>,
    workdir: String,
}

impl Setting {
    fn read(extra: &[(String, String)], term: Option<&str>) -> Self {
        let system = read_text("/etc/environment").unwrap_or_default();
        let mut system = system_environment(&system);
        let mut take = |key: &str| {
            let found = system.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone());
            system.retain(|(k, _)| k != key);
            found.filter(|v| !v.is_empty())
        };
        let (user, workdir) = (take(IMAGE_USER), take(IMAGE_WORKDIR));
        let account = match &user {
            Some(user) => image_account(user),
            None => {
                let (home, shell) = root_account();
                Account { ids: None, home, shell, name: "root".into() }
            }
        };
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), DEFAULT_PATH.into()),
            ("HOME".into(), account.home.clone()),
            ("USER".into(), account.name.clone()),
            ("LOGNAME".into(), account.name.clone()),
            ("SHELL".into(), account.shell.clone()),
            ("LANG".into(), "C.UTF-8".into()),
        ];
        if let Some(term) = term {
            env.push(("TERM".into(), term.to_string()));
        }
        for (key, value) in system.into_iter().chain(extra.iter().cloned()) {
            env.retain(|(k, _)| *k != key);
            env.push((key, value));
        }
        let workdir = workdir.unwrap_or_else(|| account.home.clone());
        Self { account, env, workdir }
    }

    /// `PATH` as the program will have it.
    fn path(&self) -> String {
        self.env.iter().rev().find(|(k, _)| k == "PATH").map_or(DEFAULT_PATH.to_string(), |(_, v)| v.clone())
    }

    fn program(self, path: String, argv: Vec<CString>) -> Program {
        Program {
            path: cstring(path),
            argv,
            envp: self.env.into_iter().map(|(k, v)| cstring(format!("{k}={v}"))).collect(),
            cwd: cstring(self.workdir),
            ids: self.account.ids,
        }
    }
}

/// Where images keep OpenSSH's `sftp-server`.
const SFTP_SERVERS: [&str; 4] = [
    "/usr/lib/openssh/sftp-server",
    "/usr/libexec/openssh/sftp-server",
    "/usr/lib/sftp-server",
    "/usr/libexec/sftp-server",
];

/// The agent's own binary, as the child it forked sees it: it is in no
/// directory of the box (the host execs it from a descriptor).
const AGENT_ITSELF: &str = "/proc/self/exe";

fn program_for(req: &ExecRequest) -> Program {
    let setting = Setting::read(&req.env, req.pty.as_ref().map(|p| p.term.as_str()));
    let shell = setting.account.shell.clone();
    let has_shell = std::path::Path::new(&shell).is_file();
    let (path, argv) = match &req.run {
        Run::Sftp => {
            // The image's own server, where images put it; else the agent's.
            let own = SFTP_SERVERS.iter().find(|p| std::path::Path::new(p).is_file());
            match own {
                Some(path) => (path.to_string(), vec![cstring(*path)]),
                None => (AGENT_ITSELF.into(), vec![cstring(crate::sftp::ARGV0)]),
            }
        }
        // An image without a shell still runs its own programs: the words of
        // the command, the first found on PATH.
        Run::Command(cmd) if !has_shell && !String::from_utf8_lossy(cmd).trim().is_empty() => {
            let text = String::from_utf8_lossy(cmd).into_owned();
            let words: Vec<&str> = text.split_whitespace().collect();
            let program = on_path(words.first().copied().unwrap_or_default(), &setting.path());
            (program, words.iter().map(|w| cstring(*w)).collect())
        }
        Run::Command(cmd) => (shell.clone(), vec![cstring(shell.clone()), cstring("-c"), cstring(cmd.clone())]),
        Run::Shell => {
            // A leading '-' in argv[0] is how a shell learns it is a login shell.
            let name = shell.rsplit('/').next().unwrap_or("sh");
            (shell.clone(), vec![cstring(format!("-{name}"))])
        }
    };
    setting.program(path, argv)
}

/// The box's service (see `service`): `argv` as given, its first word found
/// on `PATH`, run as a session's command would be.
pub fn service_program(argv: &[String]) -> Program {
    let setting = Setting::read(&[], None);
    let path = on_path(argv.first().map_or("", String::as_str), &setting.path());
    setting.program(path, argv.iter().map(|a| cstring(a.as_str())).collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_images_user_is_found_as_oci_runtimes_find_it() {
        let passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:app:/home/app:/bin/bash\n";
        let group = "root:x:0:\nstaff:x:50:\n";
        let app = super::account_in(passwd, group, "app");
        assert_eq!((app.ids, app.home.as_str(), app.shell.as_str()), (Some((1000, 1001)), "/home/app", "/bin/bash"));
        assert_eq!(super::account_in(passwd, group, "1000").name, "app");
        assert_eq!(super::account_in(passwd, group, "app:staff").ids, Some((1000, 50)));
        assert_eq!(super::account_in(passwd, group, "4242:7").ids, Some((4242, 7)), "numbers need no line");
        assert_eq!(
            super::account_in(passwd, group, "ghost").ids,
            Some((65534, 65534)),
            "a name with no line is nobody"
        );
        assert_eq!(super::account_in(passwd, group, "root").ids, None);
    }

    use super::*;

    #[test]
    fn etc_environment_is_read_as_pam_env_reads_it() {
        let text = "# comment\nLANG=C.UTF-8\nexport A_1=\"x y\"\nB='z'\n1X=no\nbad-name=no\nnovalue\nEMPTY=\n";
        let got = system_environment(text);
        let want = [("LANG", "C.UTF-8"), ("A_1", "x y"), ("B", "z"), ("EMPTY", "")];
        assert_eq!(got, want.map(|(k, v)| (k.to_string(), v.to_string())));
    }
}
