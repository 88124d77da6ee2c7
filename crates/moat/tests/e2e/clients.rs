//! Client software nobody here wrote, used the way it is by default: git over
//! ssh, OpenSSH's env passing and ControlMaster, paramiko, asyncssh, Ansible
//! and PuTTY (Debian's packages, installed by scripts/deps.sh); and the rules by
//! which an SSH user name picks a box or the control plane.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::fixture::{run, unique, Ran};
use crate::Env;

/// The Python the client libraries are installed for (Debian's, not a pyenv one).
const PYTHON: &str = "/usr/bin/python3";

fn clients_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/clients"))
}

/// `ssh` with the suite's options, as one string for GIT_SSH_COMMAND.
fn ssh_command(env: &Env) -> String {
    format!("ssh {}", env.daemon.ssh_opts(&env.alice).join(" "))
}

fn git(env: &Env, dir: &Path, args: &[&str]) -> Ran {
    let mut cmd = Command::new("timeout");
    cmd.arg("120").arg("git").args(args).current_dir(dir);
    cmd.env("GIT_SSH_COMMAND", ssh_command(env));
    cmd.env("GIT_AUTHOR_NAME", "t").env("GIT_AUTHOR_EMAIL", "t@e").env("GIT_COMMITTER_NAME", "t");
    cmd.env("GIT_COMMITTER_EMAIL", "t@e").env("HOME", dir);
    run(&mut cmd)
}

/// git's defaults pass GIT_PROTOCOL with `-o SendEnv` (protocol v2): clone,
/// push and pull all work.
pub fn git_clone_push_pull_with_defaults(env: &Env) {
    let name = unique("git");
    env.new_box(&name, &[]);
    env.alice(Some(&name), &["git init -q --bare -b main /root/repo.git"]).ok();
    let work = env.dir.join(&name);
    std::fs::create_dir_all(&work).unwrap();
    let url = format!("ssh://{name}@127.0.0.1:{}/root/repo.git", env.daemon.port);
    git(env, &work, &["clone", "-q", &url, "a"]).ok();
    let a = work.join("a");
    std::fs::write(a.join("README"), "hello\n").unwrap();
    git(env, &a, &["add", "README"]).ok();
    git(env, &a, &["commit", "-qm", "first"]).ok();
    git(env, &a, &["push", "-q", "origin", "HEAD:main"]).ok();
    git(env, &work, &["clone", "-q", &url, "b"]).ok();
    assert_eq!(std::fs::read_to_string(work.join("b/README")).unwrap(), "hello\n");
    std::fs::write(a.join("README"), "hello again\n").unwrap();
    git(env, &a, &["commit", "-qam", "second"]).ok();
    git(env, &a, &["push", "-q"]).ok();
    git(env, &work.join("b"), &["pull", "-q"]).ok();
    assert_eq!(std::fs::read_to_string(work.join("b/README")).unwrap(), "hello again\n");
    env.alice(None, &["rm", &name]).ok();
}

/// An env request the server refuses (asked with no reply wanted) must not be
/// taken for the exec's answer; accepted variables reach the command.
pub fn unaccepted_env_still_runs_the_command(env: &Env) {
    let name = unique("env");
    env.new_box(&name, &[]);
    for opt in ["SendEnv=NOT_ACCEPTED", "SetEnv=NOT_ACCEPTED=1", "SetEnv=LD_PRELOAD=/x.so"] {
        let mut cmd = env.daemon.ssh_with(&env.alice, Some(&name), &["-o", opt], &["echo ran:${NOT_ACCEPTED:-}"]);
        cmd.env("NOT_ACCEPTED", "x");
        let out = run(&mut cmd).ok();
        assert_eq!(out.stdout, "ran:\n", "{opt}");
    }
    let set = ["-o", "SetEnv=GIT_PROTOCOL=version=2 LC_MOAT=yes"];
    let out = run(&mut env.daemon.ssh_with(&env.alice, Some(&name), &set, &["echo $GIT_PROTOCOL $LC_MOAT"])).ok();
    assert_eq!(out.stdout, "version=2 yes\n");
    env.alice(None, &["rm", &name]).ok();
}

/// One ControlMaster connection runs 100 commands (each channel frees its
/// slot when it closes), then 400 four at a time, each with its own exit
/// status; a master with no open channel does not keep the box awake: it
/// suspends, and the next command through the master resumes it.
pub fn controlmaster_100_commands_then_idle_suspends(env: &Env) {
    let name = unique("mux");
    env.new_box(&name, &["--idle", "2"]);
    let socket = env.dir.join(format!("{name}.mux"));
    let path = format!("ControlPath={}", socket.display());
    let master = ["-o", "ControlMaster=yes", "-o", &path, "-o", "ControlPersist=120", "-f", "-N"];
    run(&mut env.daemon.ssh_with(&env.alice, Some(&name), &master, &[])).ok();
    let through = |cmd: &str| run(&mut env.daemon.ssh_with(&env.alice, Some(&name), &["-o", &path], &[cmd]));
    for i in 0..100 {
        let out = through(&format!("echo {i}")).ok();
        assert_eq!(out.stdout, format!("{i}\n"), "command {i} through the master");
    }
    // Four at a time, every exit status arrives: one sent after our EOF was
    // lost about one time in thirty (the client closes once it has both
    // EOFs, and exits 255 without a word).
    std::thread::scope(|s| {
        for t in 0..4 {
            let through = &through;
            s.spawn(move || {
                for i in 0..100 {
                    let want = 3 + (i + t) % 4;
                    let ran = through(&format!("echo {i}; exit {want}"));
                    assert_eq!(
                        (ran.status, ran.stdout.as_str()),
                        (Some(want), format!("{i}\n").as_str()),
                        "{}",
                        ran.stderr
                    );
                }
            });
        }
    });
    wait_suspended(env, &name, "with only an idle master connected");
    run(&mut env.daemon.ssh_with(&env.alice, Some(&name), &["-o", &path, "-O", "check"], &[])).ok();
    assert_eq!(through("echo back").ok().stdout, "back\n");
    let _ = run(&mut env.daemon.ssh_with(&env.alice, Some(&name), &["-o", &path, "-O", "exit"], &[]));
    env.alice(None, &["rm", &name]).ok();
}

pub(crate) fn python_client(env: &Env, script: &str, user: &str) -> Ran {
    python_client_at(env.daemon.port, &env.alice, script, user)
}

/// Runs a client script against the SSH server on `port`, as `key`.
pub(crate) fn python_client_at(port: u16, key: &crate::fixture::Key, script: &str, user: &str) -> Ran {
    python_client_with(port, key, script, user, &[])
}

/// [`python_client_at`], with `more` arguments after the user.
fn python_client_with(port: u16, key: &crate::fixture::Key, script: &str, user: &str, more: &[&str]) -> Ran {
    let mut cmd = Command::new("timeout");
    cmd.arg("180").arg(PYTHON).arg(clients_dir().join(script));
    cmd.args(["127.0.0.1", &port.to_string()]).arg(&key.path).arg(user).args(more);
    cmd.env("PYTHONWARNINGS", "ignore");
    run(&mut cmd)
}

/// Runs client `script` against a fresh busybox box of alice's (a VM box in
/// the VM pass), checks that it says `says`, then removes the box.
fn busybox_client_says(env: &Env, prefix: &str, script: &str, says: &str) {
    let name = unique(prefix);
    env.new_box(&name, &["--image", "busybox"]);
    let out = python_client_with(env.daemon.port, &env.alice, script, &name, &[]).ok();
    assert!(out.stdout.contains(says), "{}", out.stdout);
    env.alice(None, &["rm", &name]).ok();
}

/// paramiko and asyncssh each run 100 commands, an SFTP session and port
/// forwards to a server in the box (sequential, concurrent, 8 MiB, a closed
/// port; asyncssh a local listener too) on one connection.
pub fn paramiko_and_asyncssh_reuse_one_connection(env: &Env) {
    let name = unique("py");
    env.new_box(&name, &[]);
    let out = python_client(env, "paramiko_session.py", &name).ok();
    assert!(out.stdout.contains("paramiko: 100 commands, env, sftp, forwards ok"), "{}", out.stdout);
    let out = python_client(env, "asyncssh_session.py", &name).ok();
    assert!(
        out.stdout.contains("asyncssh: 100 commands, 10 concurrent, env, sftp, forwards, socket forwards ok"),
        "{}",
        out.stdout
    );
    env.alice(None, &["rm", &name]).ok();
}

/// Requests flooded at a channel whose reader stopped: the channel's backlog
/// holds 1,024, then the connection ends (at the flood, not on a later EOF).
pub fn a_request_flood_at_a_stopped_reader_ends_its_connection(env: &Env) {
    busybox_client_says(env, "flood", "request_flood.py", "a request flood at a stopped reader ends its connection");
}

/// asyncssh re-keys in the middle of an upload (it sends the packet that set
/// off the re-key after its KEXINIT): russh reset the connection there, so
/// every asyncssh upload died at its 1 GB re-key.
pub fn asyncssh_rekeys_while_it_sends(env: &Env) {
    busybox_client_says(env, "rekey", "asyncssh_rekey.py", "asyncssh re-keys while it sends");
}

/// A signal and a resize sent after stdin the program never read reach it
/// at once (asyncssh's `send_signal`, `change_terminal_size`), as under
/// sshd: the agent wrote stdin inline, and both waited behind it for good.
pub fn signals_and_resizes_pass_unread_stdin(env: &Env) {
    busybox_client_says(env, "sigs", "signals_past_unread_stdin.py", "signals and resizes pass unread stdin");
}

/// A program that does not read its stdin holds back only its own channel:
/// the others of the connection answer meanwhile (russh granted the window as
/// data arrived and then waited for the channel's queue inside the session
/// loop: `echo` beside it took 12.7 s).
pub fn an_unread_channel_stalls_no_other(env: &Env) {
    busybox_client_says(env, "unread", "unread_stdin.py", "unread stdin stalls no other channel");
}

/// Clients that stop reading and then leave without a word, or close their
/// channels (sessions and forwards whose windows are full): the processes
/// writing to them end (their pipes and sockets close, as under sshd), the
/// connection that closed more channels than it may hold open still opens
/// one, and the box, with no session left, suspends (billing stops).
pub fn abandoned_channels_free_the_box(env: &Env) {
    let name = unique("gone");
    env.new_box(&name, &["--image", "busybox", "--idle", "2"]);
    let vm: &[&str] = if crate::in_vm_pass() { &["vm"] } else { &[] };
    let out = python_client_with(env.daemon.port, &env.alice, "abandoned_channels.py", &name, vm).ok();
    assert!(out.stdout.contains("abandoned channels freed"), "{}", out.stdout);
    wait_suspended(env, &name, "after its clients left");
    env.alice(None, &["rm", &name]).ok();
}

/// Waits (at most 30 s) for `name` to be suspended, reading `info` (which
/// opens no session on it).
fn wait_suspended(env: &Env, name: &str, when: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info: serde_json::Value =
            serde_json::from_str(&env.alice(None, &["info", name, "--json"]).ok().stdout).unwrap();
        if info["state"] == "suspended" {
            return;
        }
        assert!(Instant::now() < deadline, "the box never suspended {when}: {info}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// An Ansible playbook (copy, template, shell) against two boxes, leaving no
/// `~NAME` directory behind.
pub fn ansible_playbook_on_two_boxes(env: &Env) {
    let (a, b) = (unique("ans"), unique("ans"));
    env.new_box(&a, &[]);
    env.new_box(&b, &[]);
    let mut cmd = Command::new("timeout");
    cmd.arg("300").arg("bash").arg(clients_dir().join("run_playbook.sh"));
    cmd.args(["127.0.0.1", &env.daemon.port.to_string()]).arg(&env.alice.path).args([&a, &b]);
    let out = run(&mut cmd);
    assert_eq!(out.status, Some(0), "ansible failed\nstdout: {}\nstderr: {}", out.stdout, out.stderr);
    env.alice(None, &["rm", &a]).ok();
    env.alice(None, &["rm", &b]).ok();
}

/// PuTTY's tools (not OpenSSH's code, nor a Python library's): `plink` runs
/// a command, `psftp` a batch and `pscp` copies both ways, against a box
/// whose image has no sftp-server (the agent's answers).
pub fn putty_plink_psftp_and_pscp(env: &Env) {
    let name = unique("putty");
    env.new_box(&name, &["--image", "busybox"]);
    let ppk = env.dir.join(format!("{name}.ppk"));
    let made = Command::new("puttygen").arg(&env.alice.path).args(["-O", "private", "-o"]).arg(&ppk).output().unwrap();
    assert!(made.status.success(), "puttygen: {}", String::from_utf8_lossy(&made.stderr));
    // PuTTY pins the host key by its fingerprint (it has no known_hosts file here).
    let keyscan = format!("ssh-keyscan -p {} -t ed25519 127.0.0.1 | ssh-keygen -l -E sha256 -f -", env.daemon.port);
    let scanned = run(Command::new("sh").arg("-c").arg(keyscan)).ok();
    let fingerprint = scanned.stdout.split_whitespace().nth(1).expect("a fingerprint").to_string();
    let putty = |tool: &str| {
        let mut cmd = Command::new("timeout");
        cmd.args(["120", tool, "-batch", "-P", &env.daemon.port.to_string(), "-hostkey", &fingerprint, "-i"]).arg(&ppk);
        cmd
    };
    let out = run(putty("plink").arg(format!("{name}@127.0.0.1")).arg("echo plink:$(id -u)")).ok();
    assert_eq!(out.stdout, "plink:0\n");

    let data: Vec<u8> = (0..2_000_000u32).map(|i| (i * 31 % 253) as u8).collect();
    let (src, back, batch) =
        (env.dir.join(format!("{name}.src")), env.dir.join(format!("{name}.back")), env.dir.join(format!("{name}.b")));
    std::fs::write(&src, &data).unwrap();
    let script = format!(
        "mkdir pd\nput {} pd/a\nren pd/a pd/b\nchmod 600 pd/b\nls pd\nget pd/b {}\n",
        src.display(),
        back.display()
    );
    std::fs::write(&batch, script).unwrap();
    let out = run(putty("psftp").arg("-b").arg(&batch).arg(format!("{name}@127.0.0.1"))).ok();
    assert!(out.stdout.contains("-rw-------") && out.stdout.contains(" b\n"), "{}", out.stdout);
    assert_eq!(std::fs::read(&back).unwrap(), data);

    let (up, down) = (format!("{name}@127.0.0.1:/tmp/pscp.bin"), env.dir.join(format!("{name}.pscp")));
    run(putty("pscp").arg("-q").arg(&src).arg(&up)).ok();
    run(putty("pscp").arg("-q").arg(&up).arg(&down)).ok();
    assert_eq!(std::fs::read(&down).unwrap(), data);
    env.alice(None, &["rm", &name]).ok();
}

/// A command meant for a box never acts on the control plane.
pub fn user_names_never_misroute(env: &Env) {
    let name = unique("route");
    env.new_box(&name, &[]);
    let victim = unique("victim");
    env.new_box(&victim, &[]);

    // A name that is no box: control commands run, anything else is refused.
    let out = env.alice(Some("nosuchbox"), &["make", "test"]);
    assert_eq!(out.status, Some(255));
    assert!(out.stderr.contains("no box named \"nosuchbox\""), "{}", out.stderr);
    assert!(env.alice(Some("nosuchbox"), &["ls"]).ok().stdout.contains(&victim));

    // A removed box's name runs nothing at all, control commands included.
    env.alice(None, &["rm", &name]).ok();
    let out = env.alice(Some(&name), &["rm", &victim]);
    assert_eq!(out.status, Some(255), "{}", out.stderr);
    assert!(out.stderr.contains(&format!("no box named \"{name}\"")), "{}", out.stderr);
    env.alice(None, &["info", &victim]).ok();
    let out = run(&mut env.daemon.ssh_with(&env.alice, Some(&name), &["-s"], &["sftp"]));
    assert_ne!(out.status, Some(0));

    // A name promote took away is retired the same way.
    let child = unique("child");
    env.alice(None, &["dup", &victim, &child]).ok();
    env.alice(None, &["promote", &child]).ok();
    let out = env.alice(Some(&child), &["ls"]);
    assert!(out.stderr.contains("no box named"), "{}", out.stderr);

    // `new` refuses the control plane's name and the name it came in as.
    let out = env.alice(None, &["new", "moat"]);
    assert_eq!(out.status, Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("control plane"), "{}", out.stderr);
    let me = unique("me");
    let out = env.alice(Some(&me), &["new", &me]);
    assert_eq!(out.status, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("you are connected as"), "{}", out.stderr);
    let out = env.alice(Some(&me), &["dup", &victim, &me]);
    assert_eq!(out.status, Some(2), "{}", out.stderr);
    let ls = env.alice(None, &["ls"]).ok().stdout;
    assert!(!ls.contains(&me) && !ls.lines().any(|l| l.starts_with("moat ")), "{ls}");
    env.alice(None, &["rm", &victim]).ok();
    env.alice(None, &["rm", &format!("{victim}-prev")]).ok();
}

/// A box's /proc totals and CPU count are its own limits, not the host's.
pub fn box_sees_its_own_totals(env: &Env) {
    let name = unique("totals");
    env.new_box(&name, &["--cpus", "1", "--memory", "1G", "--disk", "2G"]);
    let out = env.alice(Some(&name), &["nproc; free -b | awk '/^Mem:/ {print $2}'"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"1"), "nproc: {}", out.stdout);
    assert_eq!(lines.get(1), Some(&(1u64 << 30).to_string().as_str()), "free: {}", out.stdout);
    // A process's age is its own: uptime and start times agree (LXCFS's
    // uptime, counted from the box's start, made `ps -o etime` negative).
    let ages = env.alice(Some(&name), &["sleep 2 & sleep 1; ps -o etimes=,comm= | awk '$2 == \"sleep\" {print $1}'"]);
    let age: i64 = ages.ok().stdout.trim().parse().unwrap();
    assert!((0..60).contains(&age), "a second-old process is {age} s old");
    // /proc/cpuinfo and the online CPUs list count the box's CPU, not the host's.
    let cpus = "grep -c ^processor /proc/cpuinfo; cat /sys/devices/system/cpu/online";
    assert_eq!(env.alice(Some(&name), &[cpus]).ok().stdout, "1\n0\n");
    // df / is the box's --disk, from / or from a directory fd; other mounts are theirs.
    let df = "df -B1 --output=size / | tail -1; cd /etc && python3 -c \
              'import os; s = os.fstatvfs(os.open(\".\", os.O_RDONLY)); print(s.f_blocks * s.f_frsize)'; \
              df -B1 --output=size /proc | tail -1; \
              df -B1 --output=size /dev/shm | tail -1; cd /run && python3 -c \
              'import os; s = os.fstatvfs(os.open(\".\", os.O_RDONLY)); print(s.f_blocks * s.f_frsize)'";
    let sizes = env.alice(Some(&name), &[df]).ok().stdout;
    let sizes: Vec<&str> = sizes.lines().map(str::trim).collect();
    // /dev/shm and /run (a tmpfs every box shares) are the box's --memory.
    assert_eq!(sizes, ["2147483648", "2147483648", "0", "1073741824", "1073741824"], "df");
    // LXCFS serves these files (each mounted over /proc's own).
    let mounts = env.alice(Some(&name), &["cat /proc/self/mounts"]).ok().stdout;
    for file in ["meminfo", "stat", "diskstats", "swaps", "cpuinfo"] {
        let over = format!(" /proc/{file} fuse.lxcfs ");
        assert!(mounts.lines().any(|l| l.contains(&over)), "/proc/{file} is not LXCFS's:\n{mounts}");
    }
    // /proc/stat: the box's one CPU, and the CPU time its cgroup uses.
    // LXCFS counts it from the box's first read of the file, so what is
    // compared is what both count between two reads, the box's busy loop
    // between them (the host's would count the whole machine's).
    let id = serde_json::from_str::<serde_json::Value>(&env.alice(None, &["info", &name, "--json"]).ok().stdout)
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let read = || {
        let before = crate::isolation::cgroup_cpu_ns(&id);
        let stat = env.alice(Some(&name), &["grep ^cpu /proc/stat"]).ok().stdout;
        let after = crate::isolation::cgroup_cpu_ns(&id);
        let cpus: Vec<&str> = stat.lines().filter_map(|l| l.split_whitespace().next()).collect();
        assert_eq!(cpus, ["cpu", "cpu0"], "{stat}");
        let ticks: Vec<u64> =
            stat.lines().next().unwrap().split_whitespace().skip(1).map(|n| n.parse().unwrap()).collect();
        // user, nice and system, in hundredths of a second.
        ((ticks[0] + ticks[1] + ticks[2]) * 10_000_000, before, after)
    };
    let (first, first_before, first_after) = read();
    env.alice(Some(&name), &["timeout 1 sh -c 'while :; do :; done'; true"]).ok();
    let (second, second_before, second_after) = read();
    let (seen, least, most) =
        (second.saturating_sub(first), second_before.saturating_sub(first_after), second_after - first_before);
    // 50 ms either way for the ticks both readings round down to.
    assert!(
        seen + 50_000_000 >= least && seen <= most + 50_000_000 && least > 0,
        "between two reads the box's /proc/stat counted {seen} ns of CPU, its cgroup {least}..{most} ns"
    );
    // No swap in the box (none beside its memory limit). /proc/diskstats is
    // the host's: boxes have no blkio cgroup (see the README's Limitations).
    assert_eq!(env.alice(Some(&name), &["cat /proc/swaps"]).ok().stdout.lines().count(), 1, "a swap device in the box");
    env.alice(None, &["rm", &name]).ok();
}

/// One account's channels over 20 connections stop at its share (512),
/// and another account logs in and runs a verb meanwhile; a command
/// holding a NUL is refused (asyncssh: run alone, it holds bob's share).
pub fn an_account_holds_at_most_its_share_of_channels(env: &Env) {
    let name = crate::fixture::unique("share");
    let out = run(&mut env.daemon.ssh(&env.bob, None, &["new", &name, "--image", "busybox"])).ok();
    assert_eq!(out.stdout.trim(), name);
    let other = env.alice.path.to_str().unwrap();
    let out = python_client_with(env.daemon.port, &env.bob, "account_share.py", "moat", &[other, &name, "512"]).ok();
    assert!(out.stdout.contains("held 512, refused 128"), "{}", out.stdout);
    run(&mut env.daemon.ssh(&env.bob, None, &["rm", &name])).ok();
}

/// One account's 96 channels to a program that reads nothing, each pushed
/// 4 MiB: the windows they are given stay within the account's budget
/// (without it, 2 MiB each: one key's 512 such channels held 1.1 GiB of the
/// front door), another account's upload still gets a full window, and the
/// first account's does again once its connections close.
pub fn stalled_channels_hold_at_most_the_accounts_window(env: &Env) {
    let (mine, theirs) = (unique("stall"), unique("upload"));
    let out = run(&mut env.daemon.ssh(&env.bob, None, &["new", &mine, "--image", "busybox"])).ok();
    assert_eq!(out.stdout.trim(), mine);
    env.new_box(&theirs, &["--image", "busybox"]);
    let other = env.alice.path.to_str().unwrap();
    let out = python_client_with(env.daemon.port, &env.bob, "window_budget.py", &mine, &[other, &theirs]).ok();
    assert!(out.stdout.contains("the budget held"), "{}", out.stdout);
    run(&mut env.daemon.ssh(&env.bob, None, &["rm", &mine])).ok();
    env.alice(None, &["rm", &theirs]).ok();
}

/// Floods no window bounds, at what does not read: channel opens during a
/// re-key the client never finishes (each refusal waited for its end: 590
/// MiB a connection), and data alternating with extended data at a reader
/// that reads none (a backlog entry each): the connection is cut early, and
/// the next one is served.
pub fn floods_at_a_stalled_reader_or_rekey_are_cut_off(env: &Env) {
    busybox_client_says(env, "floods", "stalled_floods.py", "stalled floods cut off");
}

/// paramiko with several keys, the listed one last: it asks for the
/// authentication service again before each key, and the fourth gets in
/// (russh ignored the second ask: paramiko waited 30 s and failed).
pub fn paramiko_tries_its_keys_in_turn(env: &Env) {
    let name = crate::fixture::unique("keys");
    env.new_box(&name, &["--image", "busybox"]);
    let out = python_client(env, "paramiko_keys.py", &name).ok();
    assert!(out.stdout.contains("the fourth key got in"), "{}", out.stdout);
    env.alice(None, &["rm", &name]).ok();
}
