//! Isolation probed from inside a box.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::fixture::{run, unique};
use crate::Env;

/// Runs a python3 snippet in the box that makes a raw syscall; prints errno.
const SYSCALL_ERRNO: &str = "import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); \
args = [int(a) for a in sys.argv[1:]]; r = libc.syscall(*args); \
print(ctypes.get_errno() if r == -1 else 'allowed')";

fn box_id(env: &Env, name: &str) -> String {
    let info: serde_json::Value =
        serde_json::from_str(&env.alice(None, &["info", name, "--json"]).ok().stdout).unwrap();
    info["id"].as_str().unwrap().to_string()
}

/// The box's pids cgroup (v1's own hierarchy, or v2's).
pub(crate) fn pids_dir(env: &Env, name: &str) -> std::path::PathBuf {
    let id = box_id(env, name);
    ["/sys/fs/cgroup/pids/moat", "/sys/fs/cgroup/moat"]
        .iter()
        .map(|p| std::path::Path::new(p).join(&id))
        .find(|p| p.exists())
        .unwrap()
}

pub fn cannot_see_host(env: &Env) {
    let name = unique("see");
    env.new_box(&name, &[]);
    let marker = env.dir.join("host-marker");
    std::fs::write(&marker, "host secret").unwrap();
    let out = env.alice(Some(&name), &[&format!("test -e {} && echo visible || echo hidden", marker.display())]).ok();
    assert_eq!(out.stdout, "hidden\n");
    // Only the box's own processes, with the agent as PID 1.
    let ps = env.alice(Some(&name), &["ps -e -o pid=,comm="]).ok().stdout;
    assert!(ps.lines().next().unwrap().trim() == "1 moat-agent", "{ps}");
    // The agent, the session's shell and ps itself; nothing of the host's.
    for line in ps.lines() {
        let comm = line.split_whitespace().nth(1).unwrap_or_default();
        assert!(["moat-agent", "sh", "bash", "ps"].contains(&comm), "host process {line:?} visible:\n{ps}");
    }
    // Not the host's root filesystem: the daemon's state dir is not there.
    let out = env.alice(Some(&name), &[&format!("ls {} 2>&1 || true", env.daemon.state_dir.display())]).ok();
    assert!(out.stdout.contains("No such file"), "{}", out.stdout);
}

pub fn cannot_mount_load_modules_or_unshare(env: &Env) {
    let name = unique("priv");
    env.new_box(&name, &[]);
    let out = env.alice(Some(&name), &["mkdir -p /mnt/t && mount -t tmpfs none /mnt/t; echo rc=$?"]).ok();
    assert!(out.stdout.ends_with("rc=32\n") || out.stdout.ends_with("rc=1\n"), "{} {}", out.stdout, out.stderr);
    let errno = |args: &str| {
        env.alice(Some(&name), &[&format!("python3 -c \"{SYSCALL_ERRNO}\" {args}")]).ok().stdout.trim().to_string()
    };
    let eperm = "1";
    assert_eq!(errno("175 0 0 0"), eperm, "init_module"); // init_module(NULL, 0, "")
    assert_eq!(errno("313 0 0 0"), eperm, "finit_module");
    assert_eq!(errno("272 268435456"), eperm, "unshare(CLONE_NEWUSER)");
    assert_eq!(errno("165 0 0 0 0 0"), eperm, "mount");
    assert_eq!(errno("169 0 0 0 0"), eperm, "reboot");
    // The box's own view: root, but with a reduced capability set and no_new_privs.
    let status = env.alice(Some(&name), &["grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status"]).ok().stdout;
    assert!(status.contains("NoNewPrivs:\t1") && status.contains("Seccomp:\t2"), "{status}");
    let cap_eff = status.lines().find(|l| l.starts_with("CapEff")).unwrap().split_whitespace().nth(1).unwrap();
    let caps = u64::from_str_radix(cap_eff, 16).unwrap();
    assert_eq!(caps & (1 << 21), 0, "CAP_SYS_ADMIN kept");
    assert_eq!(caps & (1 << 16), 0, "CAP_SYS_MODULE kept");
    assert_eq!(caps & (1 << 19), 0, "CAP_SYS_PTRACE kept");
}

pub fn no_ptrace_or_signal_outside(env: &Env) {
    let name = unique("trace");
    env.new_box(&name, &[]);
    let host_pid = std::process::id();
    // Host pids do not exist in the box's pid namespace: ESRCH (3) for both.
    let out = env
        .alice(
            Some(&name),
            &[&format!(
                "python3 -c \"{SYSCALL_ERRNO}\" 101 16 {host_pid} 0 0; python3 -c \"{SYSCALL_ERRNO}\" 62 {host_pid} 0"
            )],
        )
        .ok();
    assert_eq!(out.stdout, "3\n3\n", "ptrace/kill reached a host pid");
}

pub fn root_is_not_host_root(env: &Env) {
    let name = unique("uid");
    env.new_box(&name, &[]);
    let map = env.alice(Some(&name), &["cat /proc/self/uid_map"]).ok().stdout;
    let fields: Vec<u64> = map.split_whitespace().map(|f| f.parse().unwrap()).collect();
    assert_eq!(fields.len(), 3, "{map}");
    assert_eq!(fields[0], 0);
    assert!(fields[1] >= 65536, "box root maps to host uid {}", fields[1]);
    // Seen from the host, the box's processes run as that unprivileged uid.
    let id = box_id(env, &name);
    let procs = std::fs::read_to_string(format!("/sys/fs/cgroup/pids/moat/{id}/cgroup.procs"))
        .or_else(|_| std::fs::read_to_string(format!("/sys/fs/cgroup/moat/{id}/cgroup.procs")))
        .unwrap();
    let pid = procs.lines().next().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(uid_line.split_whitespace().skip(1).all(|u| u == fields[1].to_string()), "{uid_line}");
    // A second box gets a different range.
    let other = unique("uid");
    env.new_box(&other, &["--image", "busybox"]);
    let other_map = env.alice(Some(&other), &["cat /proc/self/uid_map"]).ok().stdout;
    assert_ne!(map, other_map);
}

pub fn boxes_cannot_reach_each_other(env: &Env) {
    let (a, b) = (unique("neta"), unique("netb"));
    env.new_box(&a, &[]);
    env.new_box(&b, &[]);
    env.alice(Some(&a), &["cd /tmp && nohup python3 -m http.server 9123 --bind 127.0.0.1 >/dev/null 2>&1 &"]).ok();
    let deadline = Instant::now() + Duration::from_secs(20);
    while env.alice(Some(&a), &["curl -s -m 2 -o /dev/null http://127.0.0.1:9123/"]).status != Some(0) {
        assert!(Instant::now() < deadline, "server in box a never came up");
        std::thread::sleep(Duration::from_millis(200));
    }
    // b has its own loopback; a's server is not there. curl: 7 = could not connect.
    let out = env.alice(Some(&b), &["curl -s -m 2 -o /dev/null http://127.0.0.1:9123/; echo rc=$?"]).ok();
    assert_eq!(out.stdout, "rc=7\n");
    // And no other interface than lo exists to reach anything else.
    let links = env.alice(Some(&b), &["ls /sys/class/net"]).ok().stdout;
    assert_eq!(links.trim(), "lo");
    // That /sys is one sysfs every box binds (a superblock of its own would
    // cost every memory cgroup on the host), not the host's.
    let sys_dev = |name: &str| env.alice(Some(name), &["stat -c %d /sys"]).ok().stdout;
    assert_eq!(sys_dev(&a), sys_dev(&b));
    let host_sys = std::os::unix::fs::MetadataExt::dev(&std::fs::metadata("/sys").unwrap());
    assert_ne!(sys_dev(&a).trim(), host_sys.to_string());
}

/// Polls a neighbour box while something hostile runs; it must keep answering.
fn neighbour_answers(env: &Env, neighbour: &str, while_running: &mut std::process::Child) -> usize {
    let mut answered = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while while_running.try_wait().unwrap().is_none() && Instant::now() < deadline {
        env.alice(Some(neighbour), &["true"]).ok();
        answered += 1;
    }
    answered
}

pub fn fork_bomb_contained(env: &Env) {
    let (bomb, neighbour) = (unique("bomb"), unique("calm"));
    env.new_box(&bomb, &["--pids", "64"]);
    env.new_box(&neighbour, &["--image", "busybox"]);
    let mut child = env
        .daemon
        .ssh(&env.alice, Some(&bomb), &["timeout -s KILL 8 python3 -c 'import os\nwhile True:\n try: os.fork()\n except OSError: pass'; echo survived"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pids_dir = pids_dir(env, &bomb);
    let max_hits = || -> u64 {
        let events = std::fs::read_to_string(pids_dir.join("pids.events")).unwrap();
        events.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    // Once the bomb is at its limit, the neighbour answers while it goes on
    // hitting it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while max_hits() == 0 {
        assert!(Instant::now() < deadline, "pids.max never reached");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (hits, answered) = (max_hits(), neighbour_answers(env, &neighbour, &mut child));
    assert!(answered >= 1 && max_hits() > hits, "the neighbour answered {answered} times, not during the bomb");
    // The box's shell outlived the bomb (killed by `timeout`).
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "survived\n");
    // And the box can still be removed, bomb and all.
    env.alice(None, &["rm", &bomb]).ok();
    assert!(!pids_dir.exists());

    // Every box together is held below the host's PID space (boxes' own
    // limits could add up past it: 32 boxes of 2,048), and one box to a
    // quarter of that.
    let read = |path: &std::path::Path| std::fs::read_to_string(path).unwrap().trim().parse::<u64>().unwrap();
    let space = read(std::path::Path::new("/proc/sys/kernel/pid_max"))
        .min(read(std::path::Path::new("/proc/sys/kernel/threads-max")));
    let all = read(&pids_dir.parent().unwrap().join("pids.max"));
    assert!(all < space && all >= space / 2, "every box together may hold {all} tasks of the host's {space}");
    let refused = env.alice(None, &["new", &unique("many"), "--pids", &(space + 1).to_string()]);
    assert_ne!(refused.status, Some(0));
    assert!(
        refused.stderr.contains(&format!("--pids may be at most {}", (all / 4).min(1 << 16))),
        "{}",
        refused.stderr
    );
}

pub fn memory_hog_contained(env: &Env) {
    let (hog, neighbour) = (unique("hog"), unique("calm"));
    env.new_box(&hog, &["--memory", "64M"]);
    env.new_box(&neighbour, &["--image", "busybox"]);
    let mut child = env
        .daemon
        .ssh(&env.alice, Some(&hog), &["python3 -c 'a = bytearray(1 << 30); print(len(a))'; echo rc=$?"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    neighbour_answers(env, &neighbour, &mut child);
    let out: crate::fixture::Ran = child.wait_with_output().unwrap().into();
    // Killed by the OOM killer (SIGKILL: 128 + 9) inside the box, or refused the memory.
    assert!(out.stdout.contains("rc=137") || out.stdout.contains("rc=1"), "{}", out.stdout);
    assert!(!out.stdout.contains("1073741824"), "the box got 1 GiB under a 64M limit");
    // Contained: the kill was the box's own cgroup's (not the host's OOM
    // killer), the hog's box goes on (its shell printed rc=), and so does
    // the neighbour.
    if out.stdout.contains("rc=137") {
        let id = box_id(env, &hog);
        let kills = ["/sys/fs/cgroup/memory/moat", "/sys/fs/cgroup/moat"]
            .iter()
            .map(|p| std::path::Path::new(p).join(&id))
            .find_map(|p| {
                let events = std::fs::read_to_string(p.join("memory.events"))
                    .or_else(|_| std::fs::read_to_string(p.join("memory.oom_control")))
                    .ok()?;
                events.lines().find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse::<u64>().ok())
            });
        assert!(kills.unwrap_or(0) > 0, "killed, but not by the box's own memory limit ({kills:?})");
    }
    env.alice(Some(&hog), &["true"]).ok();
    env.alice(Some(&neighbour), &["true"]).ok();
}

/// A 32-bit system call (`int 0x80`, getpid) kills the caller: run by the
/// kernel's filter, not an interpreter fixed to x86-64. The same code run
/// on the host (no filter) answers, which shows it makes the call.
pub fn i386_calls_kill_the_caller(env: &Env) {
    let script = "import ctypes, mmap
code = bytes([0xb8, 0x14, 0, 0, 0, 0xcd, 0x80, 0xc3])  # mov eax, 20; int 0x80; ret
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(code)
print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))())
";
    let mut host = std::process::Command::new("python3");
    host.args(["-c", script]);
    let on_host = run(&mut host);
    assert_eq!(on_host.status, Some(0), "the 32-bit call failed on the host: {}", on_host.stderr);
    assert!(on_host.stdout.trim().parse::<u32>().is_ok(), "{}", on_host.stdout);
    let name = unique("i386");
    env.new_box(&name, &[]);
    let mut cmd = env.daemon.ssh(&env.alice, Some(&name), &["python3 -; echo status=$?"]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), script.as_bytes()).unwrap();
    let out: crate::fixture::Ran = child.wait_with_output().unwrap().into();
    // Killed by SIGSYS: the shell's 128 + 31, and nothing printed.
    assert_eq!(out.ok().stdout, "status=159\n");
    env.alice(None, &["rm", &name]).ok();
}

/// Runs a python3 script (sent on stdin) in the box with `args`.
fn box_python(env: &Env, name: &str, script: &str, args: &[&str]) -> crate::fixture::Ran {
    use std::io::Write;
    let mut all = vec!["python3", "-"];
    all.extend_from_slice(args);
    let mut cmd = env.daemon.ssh(&env.alice, Some(name), &all);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    child.wait_with_output().unwrap().into()
}

/// No socket family beyond unix, inet, inet6 and netlink (vsock reaches the
/// hypervisor), no taking another process's fds, and a bounded share of the
/// host's pseudo-terminals.
pub fn no_vsock_fd_theft_or_pty_exhaustion(env: &Env) {
    let name = unique("fam");
    env.new_box(&name, &[]);
    let socket = "import socket, sys
try:
    socket.socket(int(sys.argv[1]), socket.SOCK_STREAM)
    print('allowed')
except OSError as e:
    print(e.errno)
";
    for (family, expect) in [("40", "97"), ("17", "97"), ("1", "allowed"), ("2", "allowed"), ("10", "allowed")] {
        let out = box_python(env, &name, socket, &[family]).ok();
        assert_eq!(out.stdout.trim(), expect, "socket family {family}");
    }
    // Netlink for routes and generic netlink, not the host's device events.
    let netlink = "import socket, sys
try:
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, int(sys.argv[1]))
    print('allowed')
except OSError as e:
    print(e.errno)
";
    for (protocol, expect) in [("0", "allowed"), ("16", "allowed"), ("15", "93"), ("11", "93")] {
        let out = box_python(env, &name, netlink, &[protocol]).ok();
        assert_eq!(out.stdout.trim(), expect, "netlink protocol {protocol}");
    }
    // pidfd_getfd(pidfd, fd, 0) is syscall 438.
    let out = box_python(env, &name, SYSCALL_ERRNO, &["438", "0", "3", "0"]).ok();
    assert_eq!(out.stdout.trim(), "1", "pidfd_getfd must be EPERM");
    // Nor through ptrace or /proc: PID 1 (the agent) is not dumpable. What the
    // box runs still is, so debuggers work on its own programs.
    let out = box_python(env, &name, SYSCALL_ERRNO, &["101", "16", "1", "0", "0"]).ok();
    assert_eq!(out.stdout.trim(), "1", "PTRACE_ATTACH to PID 1 must be EPERM");
    let probe = "cat /proc/1/mem; cat /proc/1/environ; readlink /proc/1/fd/3 || echo unreadable";
    let out = env.alice(Some(&name), &[probe]);
    assert_eq!(out.stdout, "unreadable\n", "{}", out.stderr);
    assert_eq!(out.stderr.matches("Permission denied").count(), 2, "{}", out.stderr);
    let own_child = "import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
child = os.fork()
if child == 0:
    time.sleep(5)
    os._exit(0)
print(libc.ptrace(16, child, 0, 0), ctypes.get_errno())
os.kill(child, 9)
";
    let out = box_python(env, &name, own_child, &[]).ok();
    assert_eq!(out.stdout.trim(), "0 0", "ptrace of the box's own program");
    let ptys = "import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
n = 0
try:
    while True:
        os.openpty()
        n += 1
except OSError:
    print(n)
";
    let out = box_python(env, &name, ptys, &[]).ok();
    // Exactly its own share: the box's devpts instance, not some other
    // failure, stopped it (and it could open them at all).
    let n: u32 = out.stdout.trim().parse().unwrap();
    assert_eq!(n, 256, "a box opened {n} pseudo-terminals");
    env.alice(None, &["rm", &name]).ok();
}

/// Every box's /dev and /run are directories of one tmpfs (a superblock
/// costs every memory cgroup on the host, so one for all rather than one
/// each), yet each box's own: it sees nothing of another's, what it left
/// there goes when it stops (a tree deeper than any stack among it), and
/// nothing of it is left on the host once it is removed.
pub fn dev_and_run_share_one_tmpfs_yet_are_each_boxs_own(env: &Env) {
    let (a, b) = (unique("tmpa"), unique("tmpb"));
    env.new_box(&a, &[]);
    env.new_box(&b, &[]);
    let fill = "echo a > /dev/shm/a-secret && echo 1 > /run/a.pid && python3 -c \"import os
os.chdir('/dev/shm')
for _ in range(30000):
    os.mkdir('d'); os.chdir('d')
print('deep')\"";
    assert_eq!(env.alice(Some(&a), &[fill]).ok().stdout, "deep\n");
    // Superblocks: /dev/shm's, /run's, then /proc's (each box's own).
    let probe = "stat -c %d /dev/shm /run /proc | tr '\\n' ' '; echo; ls -A /dev/shm /run | tr '\\n' ' '";
    let seen = |name: &str| env.alice(Some(name), &[probe]).ok().stdout;
    let (in_a, in_b) = (seen(&a), seen(&b));
    let devices = |out: &str| out.lines().next().unwrap().split_whitespace().map(str::to_string).collect::<Vec<_>>();
    let (dev_a, dev_b) = (devices(&in_a), devices(&in_b));
    assert_eq!(dev_a[0], dev_a[1], "/dev/shm and /run on one tmpfs: {in_a}");
    assert_eq!(dev_a[..2], dev_b[..2], "one tmpfs for both boxes: {in_a} / {in_b}");
    assert_ne!(dev_a[2], dev_b[2], "a /proc each: {in_a} / {in_b}");
    assert!(in_a.contains("a-secret") && in_a.contains("a.pid") && in_a.contains(" d "), "{in_a}");
    assert!(!in_b.contains("a-secret") && !in_b.contains("a.pid") && !in_b.contains(" d "), "{in_b}");
    // Nor what another keeps there: df counts the box's own shared memory.
    let used = |name: &str| -> u64 {
        let out = env.alice(Some(name), &["df -B1 --output=used /dev/shm | tail -1"]).ok().stdout;
        out.trim().parse().unwrap_or_else(|_| panic!("df: {out:?}"))
    };
    let (a_before, b_before) = (used(&a), used(&b));
    env.alice(Some(&a), &["head -c 32M /dev/zero > /dev/shm/blob"]).ok();
    let (a_after, b_after) = (used(&a), used(&b));
    assert!(a_after >= a_before + (30 << 20), "the box's own use: {a_before} then {a_after}");
    assert!(b_after < b_before + (8 << 20), "another box's use seen: {b_before} then {b_after}");

    let id = box_id(env, &a);
    let on_host = env.daemon.state_dir.join("boxtmp").join(&id);
    assert!(on_host.join(".dev/shm/a-secret").exists(), "{} holds the box's /dev", on_host.display());
    env.alice(None, &["stop", &a]).ok();
    assert!(!on_host.exists(), "{} left after stop", on_host.display());
    env.alice(None, &["start", &a]).ok();
    let after = seen(&a);
    let listed: Vec<&str> = after.lines().nth(1).unwrap_or_default().split_whitespace().collect();
    assert_eq!(listed, ["/dev/shm:", "/run:"], "{after}");
    env.alice(None, &["rm", &a]).ok();
    env.alice(None, &["rm", &b]).ok();
    assert!(!on_host.exists(), "{} left after rm", on_host.display());
}

/// A box sees nothing of the host's kernel command line, the pool's quota
/// groups or the loop devices' backing files; its PID 1 is the OOM killer's
/// last choice, while what the box runs is not.
pub fn host_details_masked_and_agent_outlives_oom(env: &Env) {
    let name = unique("mask");
    env.new_box(&name, &["--memory", "64M"]);
    let probe = "cat /proc/cmdline /proc/partitions /proc/zoneinfo /proc/buddyinfo | wc -c; find /sys/fs/btrfs /sys/block /sys/devices/virtual/block -mindepth 1 | wc -l; \
                 cat /sys/block/loop*/loop/backing_file 2>/dev/null | wc -l; \
                 cat /proc/1/oom_score_adj /proc/self/oom_score_adj; \
                 touch /sys/block/x 2>/dev/null && echo writable || echo read-only; \
                 stat -c '%a %u' /dev/shm /run /dev; touch /dev/shm/a /run/a && echo written; ls -A /dev | grep -c '^[.]'; \
                 awk '{for (i = 7; i <= NF; i++) if ($i == \"-\") print $(i + 1), $3}' /proc/self/mountinfo \
                   | sort -u | grep -cE '^(proc|sysfs|devpts|tmpfs) '; \
                 ls /proc/self/fd | tr '\\n' ' '";
    let out = env.alice(Some(&name), &[probe]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    // PID 1 is at -999 where the host has CAP_SYS_RESOURCE (this machine's root
    // lacks it), else 0; either way below what the box runs. /dev, /dev/shm
    // and /run are the box's, and with the masks they are one tmpfs: the box
    // sees four superblocks (proc, sysfs, devpts, tmpfs), of which sysfs and
    // the tmpfs are every box's (see `dev_and_run_share_one_tmpfs_...`).
    assert!(
        matches!(
            lines[..],
            [
                "0",
                "0",
                "0",
                "-999" | "0",
                "500",
                "read-only",
                "1777 0",
                "755 0",
                "755 0",
                "written",
                "0",
                "4",
                "0 1 2 3 "
            ]
        ),
        "bytes of cmdline, partitions and memory zones, sys entries, backing files, oom, masks, /dev/shm /run /dev, dot files in /dev, superblocks, \
         fds a command holds (none of the agent's, such as its statfs listener): {}",
        out.stdout
    );
    // A hog in a small box dies; the box (its PID 1) lives on.
    let started = "cut -d' ' -f22 /proc/1/stat";
    let pid1 = env.alice(Some(&name), &[started]).ok().stdout;
    let hog = env.alice(Some(&name), &["python3 -c 'a = bytearray(1 << 30)'; echo rc=$?"]);
    assert!(hog.stdout.contains("rc=137") || hog.stdout.contains("rc=1"), "{}", hog.stdout);
    assert_eq!(env.alice(Some(&name), &[started]).ok().stdout, pid1, "the box restarted");
    env.alice(None, &["rm", &name]).ok();
}

/// Two moat servers on one host hand out different host uid ranges, and keep
/// them across a restart.
pub fn two_servers_never_share_host_uids(env: &Env) {
    let mut other = crate::fixture::Daemon::start(env.dir.join("uids-state"), env.daemon.keys_file.clone(), &[]);
    let ours = unique("uids");
    env.new_box(&ours, &["--image", "busybox"]);
    run(&mut other.ssh(&env.alice, None, &["new", "theirs", "--image", "busybox"])).ok();
    let host_uid = |d: &crate::fixture::Daemon, name: &str| -> u64 {
        let map = run(&mut d.ssh(&env.alice, Some(name), &["cat /proc/self/uid_map"])).ok().stdout;
        map.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let (mine, theirs) = (host_uid(&env.daemon, &ours), host_uid(&other, "theirs"));
    let block = 1024 * 65536;
    assert_ne!(mine / block, theirs / block, "host uids {mine} and {theirs} come from one block");
    other.restart();
    run(&mut other.ssh(&env.alice, None, &["new", "again", "--image", "busybox"])).ok();
    assert_eq!(host_uid(&other, "again") / block, theirs / block, "a restart keeps the block");
    other.purge();
    env.alice(None, &["rm", &ours]).ok();
}

/// A process of box `id` (its network namespace is the box's).
pub(crate) fn first_pid(id: &str) -> u32 {
    let procs = box_procs(id);
    procs.lines().next().unwrap_or_else(|| panic!("box {id} has no process")).parse().unwrap()
}

/// The host pid of box `name`'s PID 1 (its agent).
fn agent_pid(env: &Env, name: &str) -> u32 {
    let procs = box_procs(&box_id(env, name));
    let agent = procs
        .lines()
        .find(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() == "moat-agent"));
    agent.unwrap_or_else(|| panic!("no agent among {procs}")).parse().unwrap()
}

/// The host pids of box `id`'s processes, a line each.
fn box_procs(id: &str) -> String {
    std::fs::read_to_string(box_cgroup(id, "pids").join("cgroup.procs")).unwrap()
}

/// Box `id`'s cgroup directory holding `controller` (v1), or its one
/// directory (v2).
fn box_cgroup(id: &str, controller: &str) -> std::path::PathBuf {
    let v1 = std::path::Path::new("/sys/fs/cgroup").join(controller).join("moat").join(id);
    if v1.exists() {
        v1
    } else {
        std::path::Path::new("/sys/fs/cgroup/moat").join(id)
    }
}

/// What the namespaces probe does: mount, rename and take `lo` down, in the
/// box's namespaces, then in namespaces of the box's own user namespace.
const NAMESPACE_PROBE: &str = "import ctypes, errno, fcntl, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
def said(r):
    return 'ok' if r == 0 else errno.errorcode[ctypes.get_errno()]
def lo_down():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(s, 0x8914, struct.pack('16sH14x', b'lo', 0))  # SIOCSIFFLAGS: no IFF_UP
        return 'ok'
    except OSError as e:
        return errno.errorcode[e.errno]
def changes():
    return 'mount %s, sethostname %s, lo down %s' % (
        said(libc.mount(b'none', b'/mnt', b'tmpfs', 0, None)), said(libc.sethostname(b'renamed', 7)), lo_down())
print('seccomp %d, no_new_privs %d' % (libc.prctl(21, 0, 0, 0, 0), libc.prctl(39, 0, 0, 0, 0)))
print(changes())
print('unshare', said(libc.unshare(0x00020000 | 0x04000000 | 0x40000000)))  # mount, uts, net
print(changes())
";

/// Root in a box can change none of its mount, net and uts namespaces even
/// without seccomp: they belong to the host's user namespace. The probe
/// runs in the box's namespaces from the host (nsenter applies no filter and
/// keeps every capability of the box's user namespace: the worst a missing
/// filter could give box root), and then shows the same calls work in
/// namespaces the box's user namespace owns, so the refusals are the
/// namespaces' and not a lack of privilege.
pub fn namespaces_refuse_changes_without_seccomp(env: &Env) {
    let name = unique("nsown");
    env.new_box(&name, &[]);
    let pid = agent_pid(env, &name).to_string();
    let mut probe = std::process::Command::new("nsenter");
    probe.args(["-t", &pid, "-U", "-m", "-u", "-i", "-n", "--", "python3", "-c", NAMESPACE_PROBE]);
    let out = run(&mut probe).ok();
    assert_eq!(
        out.stdout,
        "seccomp 0, no_new_privs 0\n\
         mount EPERM, sethostname EPERM, lo down EPERM\n\
         unshare ok\n\
         mount ok, sethostname ok, lo down ok\n",
        "{}",
        out.stderr
    );
    // The box itself is as it was: its own lo asked (SIOCGIFFLAGS), not /sys,
    // which is one sysfs shared by every box.
    let lo_flags = "python3 -c \"import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); \
                    print(hex(struct.unpack('16sH14x', fcntl.ioctl(s, 0x8913, struct.pack('16sH14x', b'lo', 0)))[1] & 0x9))\"";
    let out = env.alice(Some(&name), &[&format!("hostname; {lo_flags}")]).ok();
    assert_eq!(out.stdout, format!("{name}\n0x9\n"));
    env.alice(None, &["rm", &name]).ok();
}

/// Box `id`'s CPU time (user and system, in ns) as its cgroup counts it:
/// what LXCFS shows the box in /proc/stat.
pub(crate) fn cgroup_cpu_ns(id: &str) -> u64 {
    let dir = box_cgroup(id, "cpuacct");
    if let Ok(all) = std::fs::read_to_string(dir.join("cpuacct.usage_all")) {
        // "cpu user system", then one line per CPU.
        let per_cpu = all.lines().skip(1).flat_map(|l| l.split_whitespace().skip(1).map(|n| n.parse::<u64>().unwrap()));
        return per_cpu.sum();
    }
    let stat = std::fs::read_to_string(dir.join("cpu.stat")).unwrap();
    let usec = |key: &str| stat.lines().find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok()).unwrap();
    (usec("user_usec ") + usec("system_usec ")) * 1000
}

/// A box runs on at most its `--cpus`: two busy loops in a one-CPU box use
/// one CPU's worth of time.
pub fn cpu_limit_holds(env: &Env) {
    let name = unique("cpus");
    env.new_box(&name, &["--cpus", "1"]);
    let id = box_id(env, &name);
    let (before, started) = (cgroup_cpu_ns(&id), Instant::now());
    env.alice(Some(&name), &["timeout 4 sh -c 'while :; do :; done & while :; do :; done'; true"]).ok();
    let (used, took) = ((cgroup_cpu_ns(&id) - before) as f64 / 1e9, started.elapsed().as_secs_f64());
    // The bound is the point: one CPU, over the whole ssh (so a little more
    // than the 4 s); 10% over for the counters' rounding. Under load the
    // loops may get less, never more.
    assert!(used <= took * 1.1, "two loops in a one-CPU box used {used:.2} CPU-s in {took:.2} s");
    assert!(used >= 0.2, "the loops barely ran ({used:.2} CPU-s): nothing was measured");
    // A loaded machine may give the loops less than a CPU whatever the
    // limit, so what makes it is checked too: the box's processes may run
    // on one CPU, and its quota is one CPU's time per period.
    let allowed = env.alice(Some(&name), &["grep Cpus_allowed_list /proc/self/status"]).ok().stdout;
    let allowed = allowed.split_whitespace().nth(1).unwrap_or_default().to_string();
    assert!(allowed.parse::<usize>().is_ok(), "the box may run on CPUs {allowed}");
    let cpu = box_cgroup(&id, "cpu");
    let read = |file: &str| std::fs::read_to_string(cpu.join(file)).map(|s| s.trim().to_string());
    match (read("cpu.max"), read("cpu.cfs_quota_us"), read("cpu.cfs_period_us")) {
        (Ok(max), _, _) => assert_eq!(max, "100000 100000", "cpu.max"),
        (_, Ok(quota), Ok(period)) => assert_eq!((quota.as_str(), period.as_str()), ("100000", "100000")),
        other => panic!("no CPU quota to read: {other:?}"),
    }
    env.alice(None, &["rm", &name]).ok();
}

/// A box's memory limit has no swap beside it: memory plus swap is limited
/// to the memory limit (v1), or swap to 0 (v2). This host has no swap, so a
/// box could not swap here anyway: it is the setting that is checked.
pub fn memory_has_no_swap(env: &Env) {
    let name = unique("swap");
    env.new_box(&name, &["--memory", "256M"]);
    let memory = box_cgroup(&box_id(env, &name), "memory");
    let read = |file: &str| std::fs::read_to_string(memory.join(file)).map(|s| s.trim().to_string());
    match (read("memory.swap.max"), read("memory.memsw.limit_in_bytes"), read("memory.limit_in_bytes")) {
        (Ok(swap), _, _) => assert_eq!(swap, "0", "memory.swap.max"),
        (_, Ok(memsw), Ok(limit)) => assert_eq!((memsw.as_str(), limit.as_str()), ("268435456", "268435456")),
        other => panic!("no swap limit to read: {other:?}"),
    }
    env.alice(None, &["rm", &name]).ok();
}

/// A box whose own processes fill its pids limit leaves its agent no thread
/// for a new session: the session is told so in a line (not "Broken pipe"),
/// and the box is still removed.
pub fn a_full_box_says_why_a_session_cannot_start(env: &Env) {
    let name = unique("full");
    env.new_box(&name, &["--pids", "24"]);
    // Takes every pid freed, within 10 ms, for good.
    let filler = "nohup python3 -c 'import os, time\nwhile True:\n try:\n  if os.fork() == 0:\n   time.sleep(1000)\n   os._exit(0)\n except OSError:\n  time.sleep(0.01)' >/dev/null 2>&1 &";
    env.alice(Some(&name), &[filler]).ok();
    let pids_dir = pids_dir(env, &name);
    let read = |file: &str| std::fs::read_to_string(pids_dir.join(file)).unwrap().trim().to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    while read("pids.current") != read("pids.max") {
        assert!(Instant::now() < deadline, "the box never filled: {} of {}", read("pids.current"), read("pids.max"));
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..3 {
        let out = env.alice(Some(&name), &["echo", "hi"]);
        assert_ne!(out.status, Some(0), "a session ran in a full box");
        assert!(out.stderr.contains("no room for another process"), "{}", out.stderr);
        assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
    }
    env.alice(None, &["rm", &name]).ok();
    assert!(!pids_dir.exists());
}

/// What the kernel counts per user (inotify instances, POSIX message queues)
/// is counted against a box's own host uid, never host root's: a box holding
/// all it can get leaves root, and another box, theirs.
pub fn per_user_kernel_allowances_are_the_boxs_own(env: &Env) {
    use std::io::{BufRead, BufReader};
    let (name, other) = (unique("ucnt"), unique("ucnt2"));
    env.new_box(&name, &[]);
    env.new_box(&other, &[]);
    let hog = "import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
held = 0
while libc.inotify_init() >= 0:
    held += 1
queues = 0
while queues < 1000 and libc.mq_open(b\"/q%d\" % queues, os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:
    queues += 1
print(held, queues, flush=True)
sys.stdin.read()
for q in range(queues):
    libc.mq_unlink(b\"/q%d\" % q)
";
    let mut cmd = env.daemon.ssh(&env.alice, Some(&name), &["python3", "-c", &format!("'{hog}'")]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let counts: Vec<u64> = line.split_whitespace().filter_map(|n| n.parse().ok()).collect();
    assert!(counts.len() == 2 && counts[0] >= 100 && counts[1] >= 1, "the box held {line:?}");
    // Host root, while the box holds them.
    let host = "import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init()
q = libc.mq_open(b\"/moat-e2e-allowance\", os.O_CREAT | os.O_RDWR, 0o600, None)
libc.mq_unlink(b\"/moat-e2e-allowance\")
print(fd >= 0, q >= 0)";
    let out = run(std::process::Command::new("python3").args(["-c", host])).ok();
    assert_eq!(out.stdout, "True True\n", "host root's inotify instance, message queue");
    // And another box.
    let probe = "python3 -c 'import ctypes; print(ctypes.CDLL(None).inotify_init() >= 0)'";
    assert_eq!(env.alice(Some(&other), &[probe]).ok().stdout, "True\n");
    drop(child.stdin.take());
    let _ = child.wait();
    for n in [&name, &other] {
        env.alice(None, &["rm", n]).ok();
    }
}

/// LXCFS serves every box's /proc totals from one process outside every
/// box's memory limit, and each file held open costs it memory: a box
/// holding as many as it can gets "out of memory" from it past its bound
/// (the host's memory is not the bound), and it serves again once let go.
pub fn lxcfs_memory_is_bounded(env: &Env) {
    use std::io::{BufRead, BufReader};
    let (name, other) = (unique("lxh"), unique("lxo"));
    env.new_box(&name, &[]);
    env.new_box(&other, &[]);
    let hog = "import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 25000), min(hard, 25000)))
kids = []
for _ in range(12):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        n, err = 0, 0
        try:
            while n < 24000:
                os.open(\"/proc/meminfo\", os.O_RDONLY)
                n += 1
        except OSError as e:
            err = e.errno
        os.write(w, (\"%d %d\\n\" % (n, err)).encode())
        sys.stdin.read()
        os._exit(0)
    os.close(w)
    kids.append(r)
total, errs = 0, set()
for r in kids:
    n, err = os.read(r, 100).split()
    total += int(n)
    errs.add(int(err))
print(total, sorted(errs), flush=True)
sys.stdin.read()
";
    let mut cmd = env.daemon.ssh(&env.alice, Some(&name), &["python3", "-c", &format!("'{hog}'")]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let pidfile = env.daemon.state_dir.join("lxcfs.pid");
    let pid = std::fs::read_to_string(&pidfile).unwrap().trim().to_string();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    // Out of memory (12) stopped it, not the end of LXCFS (ENOTCONN).
    assert!(line.contains("12") && !line.contains("107"), "the box's opens: {line:?}");
    assert!(rss_kib < 300 << 10, "lxcfs holds {rss_kib} KiB with the box's files open ({line:?})");
    // Once the box lets go, LXCFS serves everyone again (while it held
    // them, others' opens got out of memory too: one LXCFS for all).
    drop(child.stdin.take());
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(20);
    let meminfo = loop {
        let read = env.alice(Some(&other), &["head -1 /proc/meminfo 2>&1"]).stdout;
        if read.starts_with("MemTotal:") || Instant::now() > deadline {
            break read;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(meminfo.starts_with("MemTotal:"), "{meminfo}");
    for n in [&name, &other] {
        env.alice(None, &["rm", n]).ok();
    }
}
