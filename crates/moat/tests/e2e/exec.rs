//! Running commands in a box: streams, status, stdin, signals, survivors.

use std::io::Write;
use std::process::Stdio;

use crate::fixture::{run, unique, BLOCKED_BY_THE_DAEMON, IGNORED_BY_THE_DAEMON};
use crate::Env;

pub fn streams_status_and_stderr(env: &Env) {
    let name = unique("exec");
    env.new_box(&name, &["--image", "busybox"]);
    let out = env.alice(Some(&name), &["echo out; echo err >&2; exit 7"]);
    assert_eq!(out.status, Some(7));
    assert_eq!(out.stdout, "out\n");
    assert_eq!(out.stderr, "err\n");
    // Arguments are joined with spaces and run by the box's shell, as sshd does.
    let out = env.alice(Some(&name), &["printf", "'%s|'", "a", "b c"]).ok();
    assert_eq!(out.stdout, "a|b|c|");
    // What a background job prints soon after the command exits still
    // comes (sshd waits for the output's end; the session ends once it has
    // been quiet a while, though a job holds it open).
    let out = env.alice(Some(&name), &["(sleep 1; echo late; echo late-err >&2) & echo early"]).ok();
    assert_eq!((out.stdout.as_str(), out.stderr.as_str()), ("early\nlate\n", "late-err\n"));
    // A command that does not exist: the shell's 127.
    assert_eq!(env.alice(Some(&name), &["no-such-command"]).status, Some(127));
    // One past what execve takes in one argument (128 KiB): the shell never
    // starts, said as sshd says it, with sshd's status 1.
    let out = env.alice(Some(&name), &[&"a".repeat(100_000), &"b".repeat(100_000)]);
    assert_eq!(out.status, Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("Argument list too long"), "{}", out.stderr);
}

pub fn death_by_signal_is_reported_as_openssh(env: &Env) {
    let name = unique("sig");
    env.new_box(&name, &["--image", "busybox"]);
    // sshd sends exit-signal, and the OpenSSH client exits with 255.
    let out = env.alice(Some(&name), &["kill -TERM $$"]);
    assert_eq!(out.status, Some(255), "{}", out.stderr);
    // A signal that kills a child, caught by the shell, is just a status.
    let out = env.alice(Some(&name), &["sh -c 'kill -9 $$'; echo status=$?"]).ok();
    assert_eq!(out.stdout, "status=137\n");
}

/// `ssh box yes | head -c N`: once what the client writes to closes, it
/// says so (eow@openssh.com) and the program's output is closed as sshd
/// closes it: the command ends (SIGPIPE) and ssh returns, where before both
/// ran on for good; and `| grep -m1` of a command that keeps printing.
pub fn a_reader_that_closes_ends_the_command(env: &Env) {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let name = unique("eow");
    env.new_box(&name, &["--image", "busybox"]);
    // `ssh box REMOTE | TAIL`: what TAIL printed, and how long ssh took.
    // REMOTE ends by itself within 30 s, so a failure here is slow, not stuck.
    let piped = |remote: &str, tail: &[&str]| {
        let started = Instant::now();
        let mut ssh = env.daemon.ssh(&env.alice, Some(&name), &[remote]);
        let mut ssh = ssh.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
        let (program, args) = tail.split_first().unwrap();
        let printed =
            std::process::Command::new(program).args(args).stdin(ssh.stdout.take().unwrap()).output().unwrap();
        ssh.wait().unwrap();
        (printed.stdout, started.elapsed())
    };
    let (printed, took) = piped("timeout 30 yes", &["head", "-c", "100000"]);
    assert_eq!(printed.len(), 100_000);
    assert!(took < Duration::from_secs(20), "ssh ran on for {took:?} after head left");
    let marker = "i=0; while [ $i -lt 150 ]; do i=$((i+1)); echo line $i; [ $i = 3 ] && echo ready; sleep 0.2; done";
    let (printed, took) = piped(marker, &["grep", "-m1", "ready"]);
    assert_eq!(printed, b"ready\n");
    assert!(took < Duration::from_secs(20), "ssh ran on for {took:?} after grep left");
    // Nothing of either is left running in the box.
    let left = env.alice(Some(&name), &["sleep 1; ps -o comm | grep -c '^yes$' || true"]).ok();
    assert_eq!(left.stdout, "0\n");
    env.alice(None, &["rm", &name]).ok();
}

/// A session gets `SSH_CLIENT` and `SSH_CONNECTION` (and `SSH_TTY` with a
/// terminal) as under sshd, so bash reads `~/.bashrc` for a command (where
/// nvm and pyenv put themselves on `PATH`); a client cannot set them.
pub fn sessions_get_sshs_variables_and_bashrc(env: &Env) {
    let name = unique("sshvars");
    env.new_box(&name, &[]);
    let port = env.daemon.port;
    let out = env.alice(Some(&name), &["echo $SSH_CLIENT; echo $SSH_CONNECTION; echo tty=$SSH_TTY"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    let client: Vec<&str> = lines[0].split(' ').collect();
    assert_eq!((client.len(), client[0], client[2]), (3, "127.0.0.1", port.to_string().as_str()), "{}", out.stdout);
    assert_eq!(lines[1], format!("127.0.0.1 {} 127.0.0.1 {port}", client[1]), "{}", out.stdout);
    assert_eq!(lines[2], "tty=");
    let mut cmd = env.daemon.ssh_with(&env.alice, Some(&name), &["-tt"], &["echo tty=$SSH_TTY"]);
    let out = crate::fixture::run(&mut cmd).ok();
    assert!(out.stdout.starts_with("tty=/dev/pts/"), "{:?}", out.stdout);
    let mut cmd =
        env.daemon.ssh_with(&env.alice, Some(&name), &["-o", "SetEnv=SSH_CLIENT=forged"], &["echo $SSH_CLIENT"]);
    let out = crate::fixture::run(&mut cmd).ok();
    assert!(out.stdout.starts_with("127.0.0.1 "), "{:?}", out.stdout);
    env.alice(Some(&name), &["sed -i '1i export FROM_BASHRC=yes' ~/.bashrc"]).ok();
    assert_eq!(env.alice(Some(&name), &["echo $FROM_BASHRC"]).ok().stdout, "yes\n");
    env.alice(None, &["rm", &name]).ok();
}

/// Whatever the daemon was started with (see `fixture::signals_left_behind`),
/// a program in a box starts with every signal at its default and none
/// blocked, as under sshd.
pub fn programs_start_with_default_signals(env: &Env) {
    // The daemon was started so: else this test would prove nothing.
    let status = std::fs::read_to_string(format!("/proc/{}/status", env.daemon.pid())).unwrap();
    let mask = |field: &str, text: &str| {
        let line = text.lines().find_map(|l| l.strip_prefix(field)).unwrap_or_else(|| panic!("no {field}: {text}"));
        u64::from_str_radix(line.trim(), 16).unwrap()
    };
    let bits = |signals: &[u32]| signals.iter().fold(0u64, |m, s| m | 1 << (s - 1));
    let (ignored, blocked) = (bits(IGNORED_BY_THE_DAEMON), bits(BLOCKED_BY_THE_DAEMON));
    assert_eq!(mask("SigIgn:", &status) & ignored, ignored, "{status}");
    assert_eq!(mask("SigBlk:", &status) & blocked, blocked, "{status}");

    // The default image: busybox's ash leaves SIGQUIT ignored in a program
    // it execs in its own place (`sh -c 'cat ...'`), whatever it was given.
    let name = unique("signals");
    env.new_box(&name, &[]);
    // A command, a program it starts, and a login shell's.
    for command in ["cat /proc/self/status", "sh -c 'cat /proc/self/status'"] {
        let out = env.alice(Some(&name), &[command]).ok();
        assert_eq!((mask("SigIgn:", &out.stdout), mask("SigBlk:", &out.stdout)), (0, 0), "{command}: {}", out.stdout);
    }
    let mut shell = env.daemon.ssh_with(&env.alice, Some(&name), &["-tt"], &[]);
    shell.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut shell = shell.spawn().unwrap();
    shell.stdin.take().unwrap().write_all(b"cat /proc/self/status; exit\n").unwrap();
    let out = shell.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "");
    assert_eq!((mask("SigIgn:", &text), mask("SigBlk:", &text)), (0, 0), "{text}");
    env.alice(None, &["rm", &name]).ok();
}

pub fn tar_100mb_through_stdin(env: &Env) {
    let name = unique("tar");
    env.new_box(&name, &[]);
    let src = env.dir.join(format!("{name}-src"));
    std::fs::create_dir_all(&src).unwrap();
    let mut data = vec![0u8; 100 << 20];
    // Incompressible, reproducible bytes (xorshift), so nothing along the way can shortcut.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    std::fs::write(src.join("big.bin"), &data).unwrap();
    std::fs::write(src.join("small.txt"), "hello\n").unwrap();
    let local_sum = run(std::process::Command::new("sha256sum").arg(src.join("big.bin"))).ok().stdout;

    let mut ssh = env.daemon.ssh(&env.alice, Some(&name), &["mkdir -p /work && tar x -C /work && echo done"]);
    ssh.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = ssh.spawn().unwrap();
    let mut tar =
        std::process::Command::new("tar").arg("c").arg("-C").arg(&src).arg(".").stdout(Stdio::piped()).spawn().unwrap();
    let mut tar_out = tar.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::io::copy(&mut tar_out, &mut stdin).unwrap();
    drop(stdin);
    assert!(tar.wait().unwrap().success());
    let out: crate::fixture::Ran = child.wait_with_output().unwrap().into();
    let out = out.ok();
    assert_eq!(out.stdout, "done\n");
    let remote = env.alice(Some(&name), &["sha256sum /work/big.bin; cat /work/small.txt"]).ok().stdout;
    assert_eq!(remote.split_whitespace().next(), local_sum.split_whitespace().next());
    assert!(remote.ends_with("hello\n"));
    std::fs::remove_dir_all(src).unwrap();
    let _ = std::io::stdout().flush();
}

pub fn processes_outlive_the_session(env: &Env) {
    let name = unique("bg");
    env.new_box(&name, &[]);
    // Exactly the command: nohup keeps the pipe; the session still ends.
    env.alice(Some(&name), &["nohup sleep 1000 &"]).ok();
    let out = env.alice(Some(&name), &["pgrep -x sleep"]).ok();
    assert_eq!(out.stdout.lines().count(), 1, "sleep is gone: {}", out.stdout);
    // A job that keeps printing (a dev server's log) holds the session a
    // few seconds at most.
    let started = std::time::Instant::now();
    let out = env.alice(Some(&name), &["(while :; do echo tick; sleep 0.5; done) & echo started"]).ok();
    assert!(out.stdout.contains("started") && out.stdout.matches("tick").count() >= 3, "{}", out.stdout);
    assert!(started.elapsed() < std::time::Duration::from_secs(9), "held {:?}", started.elapsed());
    // A job that prints after the session has ended lives on (its line goes
    // nowhere): the pipe closed under it, its first line killed it (SIGPIPE).
    env.alice(Some(&name), &["(sleep 3; echo late; echo late >&2; touch /tmp/survived) & echo early"]).ok();
    std::thread::sleep(std::time::Duration::from_secs(4));
    let survived = env.alice(Some(&name), &["test -f /tmp/survived && echo yes"]).ok();
    assert_eq!(survived.stdout, "yes\n", "the job died at its first line after the session");
}

/// FIFOs the box planted where its agent reads on every session's way in
/// (`/etc/environment`, `/etc/passwd`, `/etc/group`) lock nobody out: the
/// agent opened them as files, waited for a writer, and every later session
/// hung (across a restart too, the FIFOs being the box's files).
pub fn fifos_in_etc_lock_nobody_out(env: &Env) {
    let name = unique("fifo");
    env.new_box(&name, &["--image", "busybox"]);
    env.alice(Some(&name), &["for f in environment passwd group; do rm -f /etc/$f; mkfifo /etc/$f; done"]).ok();
    let ran = crate::fixture::run_briefly(&env.daemon.ssh(&env.alice, Some(&name), &["echo in"]));
    assert_eq!((ran.status, ran.stdout.as_str()), (Some(0), "in\n"), "{}", ran.stderr);
    env.alice(None, &["rm", &name]).ok();
}

/// A suspended box costs what its agent holds at rest, so the agent gives
/// back what its sessions held once they end (their thread stacks, its heap):
/// after 24 sessions at once, each streaming 4 MB, it holds about what a
/// fresh one does (~100-250 KiB private; it held megabytes when glibc kept
/// every ended thread's stack and an arena per busy thread). Read from the
/// host, so no session of the test's own is counted.
pub fn sessions_leave_the_agent_small(env: &Env) {
    let name = unique("rest");
    env.new_box(&name, &["--image", "busybox"]);
    let sessions: Vec<_> = (0..24)
        .map(|_| {
            let mut ssh = env.daemon.ssh(&env.alice, Some(&name), &["head -c 4000000 /dev/zero"]);
            ssh.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap()
        })
        .collect();
    let peak = agent_private_kib(env, &name);
    for session in sessions {
        let out = session.wait_with_output().unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout.len(), 4_000_000);
    }
    // The agent's idle loop gives back within a second of a session's end.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut held = agent_private_kib(env, &name);
    while held > 512 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(250));
        held = agent_private_kib(env, &name);
    }
    assert!(held <= 512, "the agent holds {held} KiB of private memory after its sessions ended (peak {peak} KiB)");
}

/// The private (anonymous) memory of `name`'s PID 1, from the host.
fn agent_private_kib(env: &Env, name: &str) -> u64 {
    let procs = std::fs::read_to_string(crate::isolation::pids_dir(env, name).join("cgroup.procs")).unwrap();
    // PID 1 is the process of the box whose parent is outside it.
    let pids: Vec<&str> = procs.lines().collect();
    let agent = pids
        .iter()
        .find(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let parent = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1)).unwrap_or("");
            !pids.contains(&parent)
        })
        .unwrap_or_else(|| panic!("no PID 1 among {procs}"));
    let status = std::fs::read_to_string(format!("/proc/{agent}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("RssAnon:")?.trim().strip_suffix(" kB")?.parse().ok()).unwrap()
}
