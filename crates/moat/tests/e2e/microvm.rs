//! VM boxes (`new --backend vm`): a kernel of their own, on TCG here, with
//! the same SSH experience as namespace boxes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::egress::sh;
use crate::fixture::{run, unique};
use crate::Env;

fn state(env: &Env, name: &str) -> String {
    let info = env.alice(None, &["info", name, "--json"]).ok().stdout;
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    info["state"].as_str().unwrap_or_default().to_string()
}

/// The QEMU of box `id`: the one in its cgroup.
fn qemu_of(id: &str) -> u32 {
    let qemus = run(Command::new("pgrep").args(["-f", "qemu-system-x86_64 -M microvm,"])).stdout;
    let in_box = |pid: &&str| {
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        cgroups.lines().any(|l| l.ends_with(&format!("/moat/{id}")) || l.contains(&format!("/moat/{id}/")))
    };
    let found: Vec<&str> = qemus.lines().map(str::trim).filter(in_box).collect();
    assert_eq!(found.len(), 1, "QEMUs in the box's cgroup: {found:?} (of {qemus:?})");
    found[0].parse().unwrap()
}

fn host_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap().trim().to_string()
}

/// The release of the kernel moat boots guests with (the newest cloud kernel in /boot).
fn guest_release() -> String {
    let mut kernels: Vec<String> = std::fs::read_dir("/boot")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("vmlinuz-").map(str::to_string))
        .filter(|r| r.ends_with("-cloud-amd64"))
        .collect();
    kernels.sort();
    kernels.pop().expect("a cloud kernel in /boot")
}

pub fn box_runs_its_own_kernel_over_ssh(env: &Env) {
    let name = unique("vm");
    env.new_box(&name, &["--backend", "vm"]);
    let info = env.alice(None, &["info", &name]).ok().stdout;
    assert!(info.contains("backend:  vm"), "{info}");
    let listed: serde_json::Value = serde_json::from_str(&env.alice(None, &["ls", "--json"]).ok().stdout).unwrap();
    let me = listed.as_array().unwrap().iter().find(|b| b["name"] == name.as_str()).cloned().unwrap();
    assert_eq!(me["backend"], "vm", "{me}");

    // The kernel-level probe: the guest's kernel, not the host's.
    let guest = env.alice(Some(&name), &["uname -r"]).ok().stdout.trim().to_string();
    assert_eq!(guest, guest_release());
    assert_ne!(guest, host_release());
    // Its own machine: its host name, its own pid 1 (the agent), a disk as big as its limit.
    let out = env.alice(Some(&name), &["hostname; cat /proc/1/comm"]).ok().stdout;
    assert_eq!(out, format!("{name}\ninit\n"));
    // The guest grows its file system to its disk limit once it is up.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = env.alice(Some(&name), &["stat -f -c '%b %S' /"]).ok().stdout;
        let size = out.trim().split(' ').map(|n| n.parse::<u64>().unwrap()).product::<u64>() >> 30;
        if (14..=16).contains(&size) {
            break;
        }
        assert!(Instant::now() < deadline, "a 16G disk limit, a root of {size}G");
        std::thread::sleep(Duration::from_millis(500));
    }

    // Its QEMU: not root but the box's own uid, no privilege to gain, under
    // seccomp, in the box's cgroup and a network namespace not the host's,
    // holding no descriptor but its own and the ones handed to it.
    let id = {
        let info: serde_json::Value =
            serde_json::from_str(&env.alice(None, &["info", &name, "--json"]).ok().stdout).unwrap();
        info["id"].as_str().unwrap().to_string()
    };
    let qemu = qemu_of(&id);
    let status = std::fs::read_to_string(format!("/proc/{qemu}/status")).unwrap();
    let field = |name: &str| {
        let value = status.lines().find_map(|l| l.strip_prefix(name)).unwrap_or_default();
        value.split_whitespace().next().unwrap_or_default().to_string()
    };
    assert_ne!(field("Uid:"), "0", "QEMU runs as root:\n{status}");
    assert_eq!((field("NoNewPrivs:").as_str(), field("Seccomp:").as_str()), ("1", "2"), "{status}");
    let cgroups = std::fs::read_to_string(format!("/proc/{qemu}/cgroup")).unwrap();
    let box_cgroup = format!("/moat/{id}");
    for controller in ["pids", "memory", "cpu"] {
        let line = cgroups.lines().find(|l| l.split(':').nth(1).is_some_and(|c| c.split(',').any(|c| c == controller)));
        // On a cgroup v2 host, one line (`0::PATH`) says it for all.
        let line = line.or_else(|| cgroups.lines().find(|l| l.starts_with("0::")));
        assert!(
            line.is_some_and(|l| l.contains(&box_cgroup)),
            "QEMU is not in the box's {controller} cgroup:\n{cgroups}"
        );
    }
    let netns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(netns(&qemu.to_string()), netns("self"), "QEMU is in the host's network namespace");
    let mut handed_files = 0;
    for fd in std::fs::read_dir(format!("/proc/{qemu}/fd")).unwrap() {
        let fd = fd.unwrap().path();
        let target = std::fs::read_link(&fd).unwrap().display().to_string();
        let own = ["/dev/null", "/dev/net/tun", "/dev/kvm", "/dev/urandom", "anon_inode:", "pipe:", "socket:"];
        if own.iter().any(|o| target.starts_with(o)) {
            continue;
        }
        // Files: this box's own (its disk, its initramfs and its memory,
        // owned by the uid QEMU runs as) and the guest kernel; nothing else of moat's.
        let memory = target.ends_with(&format!("/pool/vm-states/{id}.mem"));
        let ours = target.contains(&format!("/{id}/")) || target.contains("/pool/vm-kernels/") || memory;
        assert!(ours && !std::fs::metadata(&fd).unwrap().is_dir(), "QEMU holds {target} (fd {})", fd.display());
        if target.ends_with("initramfs.cpio") || memory {
            use std::os::unix::fs::MetadataExt;
            assert_eq!(std::fs::metadata(&fd).unwrap().uid().to_string(), field("Uid:"), "QEMU's uid is not the box's");
        }
        handed_files += 1;
    }
    assert!(handed_files >= 4, "QEMU holds no kernel, initramfs, disk or memory");
    // Its memory file is outside the box's disk quota: QEMU makes no file
    // longer than the box's disk or memory.
    let limits = std::fs::read_to_string(format!("/proc/{qemu}/limits")).unwrap();
    let fsize = limits.lines().find(|l| l.starts_with("Max file size")).unwrap_or_default();
    assert!(!fsize.contains("unlimited"), "QEMU may make a file of any size: {fsize}");
    // Its supervisor, which reads the guest's link and QEMU's answers, holds
    // no more than QEMU does: the box's uid, no capability, no privilege to
    // gain, its own seccomp filter.
    let parent = field("PPid:");
    let supervisor = std::fs::read_to_string(format!("/proc/{parent}/status")).unwrap_or_default();
    let of = |name: &str| {
        let value = supervisor.lines().find_map(|l| l.strip_prefix(name)).unwrap_or_default();
        value.split_whitespace().next().unwrap_or_default().to_string()
    };
    assert!(std::fs::read_to_string(format!("/proc/{parent}/cmdline")).unwrap_or_default().contains("box-vm"));
    assert_eq!(of("Uid:"), field("Uid:"), "the supervisor is not QEMU's uid:\n{supervisor}");
    for caps in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
        assert_eq!(of(caps), "0000000000000000", "{caps}\n{supervisor}");
    }
    assert_eq!((of("NoNewPrivs:").as_str(), of("Seccomp:").as_str()), ("1", "2"), "{supervisor}");

    // Status, stdout and stderr apart, stdin streamed.
    let ran = env.alice(Some(&name), &["echo out; echo err >&2; exit 7"]);
    assert_eq!((ran.status, ran.stdout.as_str(), ran.stderr.as_str()), (Some(7), "out\n", "err\n"));
    let data: Vec<u8> = (0..(4u64 << 20)).map(|i| (i * 7919 % 251) as u8).collect();
    let mut cmd = env.daemon.ssh(&env.alice, Some(&name), &["wc -c"]);
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &data));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), (4u32 << 20).to_string());

    // A terminal.
    let out = run(&mut env.daemon.ssh_with(&env.alice, Some(&name), &["-tt"], &["tty"])).ok().stdout;
    assert!(out.starts_with("/dev/pts/"), "{out:?}");

    // Files both ways with scp (sftp underneath) and rsync.
    let src = env.dir.join(format!("{name}.bin"));
    std::fs::write(&src, (0..(1 << 20)).map(|i: u32| (i % 253) as u8).collect::<Vec<u8>>()).unwrap();
    let back = env.dir.join(format!("{name}.back"));
    let mut scp = Command::new("timeout");
    scp.arg("300").arg("scp").args(env.daemon.ssh_opts(&env.alice)).arg("-P").arg(env.daemon.port.to_string());
    run(Command::new(scp.get_program()).args(scp.get_args()).arg(&src).arg(format!("{name}@127.0.0.1:/root/in.bin")))
        .ok();
    run(scp.arg(format!("{name}@127.0.0.1:/root/in.bin")).arg(&back)).ok();
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());

    // rsync both ways, and other clients than OpenSSH on one connection.
    let ssh = format!("ssh {} -p {}", env.daemon.ssh_opts(&env.alice).join(" "), env.daemon.port);
    let rsync = |from: String, to: String| {
        run(Command::new("timeout").args(["300", "rsync", "-a", "-e", &ssh, &from, &to])).ok();
    };
    rsync(src.display().to_string(), format!("{name}@127.0.0.1:/srv/in.bin"));
    let synced = env.dir.join(format!("{name}.synced"));
    rsync(format!("{name}@127.0.0.1:/srv/in.bin"), synced.display().to_string());
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&synced).unwrap());
    let out = crate::clients::python_client(env, "paramiko_session.py", &name).ok();
    assert!(out.stdout.contains("paramiko: 100 commands"), "{}", out.stdout);

    // A forward to a server in the guest.
    env.alice(
        Some(&name),
        &["mkdir -p /srv/www && echo hello-from-vm > /srv/www/index.html && cd /srv/www && setsid python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 < /dev/null &"],
    )
    .ok();
    let port = crate::forward::free_port();
    let _t = crate::forward::tunnel(env, &name, &format!("{port}:localhost:8000"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while crate::forward::curl(port).stdout != "hello-from-vm\n" {
        assert!(Instant::now() < deadline, "no answer through the tunnel from the guest");
        std::thread::sleep(Duration::from_millis(300));
    }

    // The egress gateway is the guest's only way out: an unlisted name does
    // not resolve, a listed one is reached by name, nothing else leaves.
    let (status, _) = sh(env, &name, "curl -sS -m 10 http://web.test/");
    assert_eq!(status, Some(6), "an unlisted name does not resolve");
    env.alice(None, &["policy", &name, "allow", "web.test"]).ok();
    let (status, out) = sh(env, &name, "curl -sS -m 20 http://web.test/a");
    assert_eq!((status, out.as_str()), (Some(0), "GET /a host=web.test body=0\n"));
    let (status, _) = sh(env, &name, &format!("curl -sS -m 5 http://{}/", crate::testnet::WEB));
    assert_ne!(status, Some(0), "an address, not a listed name, is reached");
    let log = crate::egress::log(env, &name);
    assert!(log.contains("allow http web.test:80 GET /a"), "{log}");
}

/// How many QEMUs run on the host.
fn qemus() -> u32 {
    let out = run(Command::new("pgrep").args(["-c", "-f", "qemu-system-x86_64"])).stdout;
    out.trim().parse().unwrap_or(0)
}

pub fn suspend_resume_dup_checkpoint_and_rm(env: &Env) {
    let name = unique("vmlife");
    env.new_box(&name, &["--backend", "vm", "--idle", "2"]);
    env.alice(Some(&name), &["echo kept > /root/kept"]).ok();
    let machine_id = env.alice(Some(&name), &["cat /etc/machine-id"]).ok().stdout;

    // No session: suspended (vCPUs paused, QEMU frozen); the next session resumes
    // it, its processes and clock where they should be.
    env.alice(Some(&name), &["setsid sleep 1000 >/dev/null 2>&1 < /dev/null &"]).ok();
    let deadline = Instant::now() + Duration::from_secs(30);
    while state(env, &name) != "suspended" {
        assert!(Instant::now() < deadline, "never suspended");
        std::thread::sleep(Duration::from_millis(300));
    }
    // Paused a while (the time it stays paused, not a wait for anything):
    // its clock must have moved on with the host's.
    std::thread::sleep(Duration::from_secs(3));
    let host_now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let asked = host_now();
    let out = env.alice(Some(&name), &["date +%s; pgrep -c -x sleep"]).ok().stdout;
    let answered = host_now();
    let mut lines = out.lines();
    let guest_now: i64 = lines.next().unwrap().trim().parse().unwrap();
    // Between when the host asked and when it heard back (however slow the
    // resume), give or take the second both clocks round to.
    assert!(
        (asked - 1..=answered + 1).contains(&guest_now),
        "the resumed guest's clock says {guest_now}, asked at {asked}, answered at {answered}"
    );
    assert_eq!(lines.next().map(str::trim), Some("1"), "the guest's processes survived the pause");

    // A copy: the files as they were, a new machine, the same kind of box,
    // its processes with it. It is left suspended, as saved (no QEMU runs
    // for it), until its first session resumes it.
    let copy = format!("{name}-copy");
    let qemus_before = qemus();
    env.alice(None, &["dup", &name, &copy]).ok();
    assert_eq!(state(env, &copy), "suspended");
    assert_eq!(qemus(), qemus_before, "a QEMU runs for a copy nobody uses");
    // A copy of that copy, before it ever ran, gets the machine too.
    let second = format!("{name}-copy2");
    env.alice(None, &["dup", &copy, &second]).ok();
    assert_eq!(state(env, &second), "suspended");
    // Each lists its own files, so diff wakes both.
    let out = env.alice(None, &["diff", &copy, &second]).ok().stdout;
    assert!(!out.contains("root/kept"), "{out}");
    assert_eq!((state(env, &copy), state(env, &second)), ("running".into(), "running".into()));
    let out = env.alice(Some(&second), &["hostname; pgrep -c -x sleep"]).ok().stdout;
    assert_eq!(out, format!("{second}\n1\n"), "the copy of a copy lost its processes");
    env.alice(None, &["rm", &second]).ok();
    let out = env
        .alice(Some(&copy), &["cat /root/kept; hostname; cat /etc/machine-id; uname -r; pgrep -c -x sleep"])
        .ok()
        .stdout;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["kept", copy.as_str()], "{out}");
    assert_ne!(format!("{}\n", lines[2]), machine_id, "the copy kept its parent's machine-id");
    assert_eq!(lines[3], guest_release());
    assert_eq!(lines[4], "1", "the copy's processes came with it: {out}");
    assert_eq!(state(env, &copy), "running");

    // What the copy changed, as each guest lists its own files.
    env.alice(Some(&copy), &["echo n > /root/new-in-copy; rm /root/kept"]).ok();
    let diff = env.alice(None, &["diff", &name, &copy]).ok().stdout;
    for want in ["A /root/new-in-copy", "D /root/kept", "M /etc/hostname"] {
        assert!(diff.lines().any(|l| l == want), "no {want:?} in:\n{diff}");
    }
    assert!(!diff.contains("/proc/"), "other mounts are not listed:\n{diff}");

    // A checkpoint, damage, and the files put back.
    env.alice(None, &["checkpoint", &name, "good"]).ok();
    env.alice(Some(&name), &["rm /root/kept"]).ok();
    env.alice(None, &["restore", &name, "good"]).ok();
    let out = env.alice(Some(&name), &["cat /root/kept"]).ok().stdout;
    assert_eq!(out, "kept\n");

    // Removing a box ends its QEMU.
    let before = qemus();
    env.alice(None, &["rm", &copy]).ok();
    env.alice(None, &["rm", &name]).ok();
    assert_eq!(qemus() + 2, before, "a removed box's QEMU still runs");
}

/// A daemon of its own: VM boxes outlive its restart, and a parked VM box
/// (suspended long enough to be saved to a file and its QEMU ended) resumes
/// with its processes.
pub fn restart_and_park_keep_the_guest_running(env: &Env) {
    let flags = ["--idle-grace", "1", "--meter-interval", "1", "--park-after", "3"];
    let mut daemon =
        crate::fixture::Daemon::start(env.dir.join("vm-restart-state"), env.daemon.keys_file.clone(), &flags);
    let ssh = |d: &crate::fixture::Daemon, user: Option<&str>, args: &[&str]| run(&mut d.ssh(&env.alice, user, args));
    let state = |d: &crate::fixture::Daemon| -> String {
        let info: serde_json::Value =
            serde_json::from_str(&ssh(d, None, &["info", "keeper", "--json"]).ok().stdout).unwrap();
        info["state"].as_str().unwrap_or_default().to_string()
    };
    ssh(&daemon, None, &["new", "keeper", "--image", "busybox", "--backend", "vm", "--idle", "600"]).ok();
    ssh(&daemon, Some("keeper"), &["echo precious > /root/data; setsid sleep 1000 >/dev/null 2>&1 < /dev/null &"]).ok();
    // A suspended one too: its QEMU, frozen, answers nothing, and the
    // restarted daemon freezes it again without asking it (it waited the
    // QMP timeout, 10 s, for each such box before it listened).
    ssh(&daemon, None, &["new", "sleeper", "--image", "busybox", "--backend", "vm"]).ok();
    ssh(&daemon, None, &["suspend", "sleeper"]).ok();
    daemon.restart();
    let log = std::fs::read_to_string(daemon.state_dir.with_extension("log")).unwrap();
    assert!(!log.contains("could not pause a guest's vCPUs"), "{log}");
    assert_eq!(ssh(&daemon, Some("sleeper"), &["echo awake"]).ok().stdout, "awake\n");
    ssh(&daemon, None, &["rm", "sleeper"]).ok();
    let out =
        ssh(&daemon, Some("keeper"), &["cat /root/data; ps | grep -q '[s]leep 1000' && echo still-running; uname -r"])
            .ok()
            .stdout;
    assert_eq!(out, format!("precious\nstill-running\n{}\n", guest_release()));

    // Parked: the machine saved to a file, QEMU gone; the next session resumes it.
    ssh(&daemon, None, &["set", "keeper", "idle", "1"]).ok();
    let deadline = Instant::now() + Duration::from_secs(60);
    while state(&daemon) != "stopped" {
        assert!(Instant::now() < deadline, "never parked: {}", state(&daemon));
        std::thread::sleep(Duration::from_millis(500));
    }
    let saved = daemon.state_dir.join("pool/vm-states");
    let files = |extension: &str| -> Vec<std::path::PathBuf> {
        let entries = std::fs::read_dir(&saved).into_iter().flatten().filter_map(Result::ok);
        entries.map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == extension)).collect()
    };
    let (states, memories) = (files("state"), files("mem"));
    assert_eq!((states.len(), memories.len()), (1, 1), "no saved machine in {saved:?}");
    // The save is the devices' state alone: the guest's memory is its file.
    use std::os::unix::fs::MetadataExt;
    let state_bytes = std::fs::metadata(&states[0]).unwrap().len();
    let memory_bytes = std::fs::metadata(&memories[0]).unwrap().blocks() * 512;
    assert!(state_bytes < 4 << 20, "the saved state holds {state_bytes} bytes: the memory went into it");
    assert!(memory_bytes > 8 << 20, "the guest's memory file holds only {memory_bytes} bytes");
    let out = ssh(&daemon, Some("keeper"), &["ps | grep -q '[s]leep 1000' && echo still-running; cat /root/data"]).ok();
    assert_eq!(out.stdout, "still-running\nprecious\n");
    assert_eq!(files("state").len(), 0, "the saved machine was kept");
    assert_eq!(files("mem"), memories, "the resumed guest's memory is not the file it was saved with");
    daemon.purge();
}

/// A secret granted to a running VM box: the guest holds a placeholder (handed
/// to it live), trusts its CA (handed at boot), and the gateway writes the
/// value in for its host and scrubs it from the answer; a copy of the box
/// holds a placeholder of its own.
pub fn secrets_reach_their_host_from_a_guest(env: &Env) {
    let value = format!("sk-REAL-0123456789-{}", unique("v"));
    let secret = unique("vmllm");
    crate::secrets::add_secret(env, &secret, &value);
    let name = unique("vmsec");
    env.new_box(&name, &["--backend", "vm"]);
    env.alice(None, &["secret", "grant", &secret, &name]).ok();
    let (_, held) = sh(env, &name, "echo $LLM_KEY");
    let placeholder = held.trim().to_string();
    assert!(placeholder.starts_with("moat-placeholder-"), "{held}");

    let m = unique("m");
    let (status, out) =
        sh(env, &name, &format!("curl -sS -m 30 -i -H \"Authorization: Bearer $LLM_KEY\" https://llm.test/echo?{m}"));
    assert_eq!(status, Some(0), "{out}");
    let got = crate::secrets::arrived(env, &m).concat();
    assert!(got.contains(&format!("Authorization: Bearer {value}")), "{got}");
    assert!(!out.contains(&value) && out.contains("[secret removed by moat]"), "the value came back: {out}");
    let (_, anywhere) = sh(env, &name, &format!("grep -rl {value} /etc /root /tmp 2>/dev/null | head -1"));
    assert_eq!(anywhere.trim(), "", "the value is in the guest");

    let copy = format!("{name}-copy");
    env.alice(None, &["dup", &name, &copy]).ok();
    let (_, theirs) = sh(env, &copy, "echo $LLM_KEY");
    assert!(theirs.trim().starts_with("moat-placeholder-") && theirs.trim() != placeholder, "{theirs}");
    env.alice(None, &["rm", &copy]).ok();
    env.alice(None, &["rm", &name]).ok();
}

/// A VM box's port answers its web URL: the edge asks the box's agent, in
/// the guest, to connect to the guest's own loopback.
pub fn a_guest_port_answers_its_web_url(env: &Env) {
    let edge = env.daemon.edge.clone().expect("the shared daemon runs an HTTP edge");
    let name = unique("vmweb");
    env.new_box(&name, &["--backend", "vm", "--image", "busybox"]);
    let page = unique("guest-page");
    let setup =
        format!("mkdir -p /www && echo {page} > /www/index.html && (busybox httpd -p 127.0.0.1:8000 -h /www &)");
    env.alice(Some(&name), &[&setup]).ok();
    env.alice(None, &["expose", &name, "8000", "--public"]).ok();
    let host = crate::web::host_of(&crate::web::url_of(env, &name, 8000));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = crate::web_hostile::get(&edge, &host, "/");
        if answer.contains(&page) {
            break;
        }
        assert!(Instant::now() < deadline, "the guest's server never answered through the edge:\n{answer}");
        std::thread::sleep(Duration::from_millis(300));
    }
    // A port nothing listens on in the guest: the page says so.
    env.alice(None, &["expose", &name, "8001", "--public"]).ok();
    let other = crate::web::host_of(&crate::web::url_of(env, &name, 8001));
    let answer = crate::web_hostile::get(&edge, &other, "/");
    assert!(answer.starts_with("HTTP/1.1 502") && answer.contains("Start a server on port 8001"), "{answer}");
    env.alice(None, &["rm", &name]).ok();
}

/// Copies of a VM box taken while a session streams into it: every copy's
/// link to its agent works (a frame half-way to the guest at the instant of
/// the save would leave the copy's link out of step).
pub fn dup_while_a_session_streams_in(env: &Env) {
    let name = unique("vmbusy");
    env.new_box(&name, &["--backend", "vm", "--image", "busybox"]);
    let mut cmd = env.daemon.ssh(&env.alice, Some(&name), &["cat > /dev/null"]);
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = std::sync::Arc::clone(&stop);
    let (fed, streaming) = std::sync::mpsc::channel();
    let feeding = std::thread::spawn(move || {
        let chunk = vec![b'x'; 64 << 10];
        while !stopped.load(std::sync::atomic::Ordering::Relaxed)
            && std::io::Write::write_all(&mut stdin, &chunk).is_ok()
        {
            let _ = fed.send(());
        }
    });
    // The session streams in (a megabyte through) before the first dup.
    for _ in 0..16 {
        streaming.recv_timeout(Duration::from_secs(60)).expect("the session never streamed in");
    }
    for i in 0..3 {
        let copy = format!("{name}-c{i}");
        env.alice(None, &["dup", &name, &copy]).ok();
        let out = run(&mut env.daemon.ssh_with(&env.alice, Some(&copy), &["-o", "ConnectTimeout=20"], &["echo alive"]));
        assert_eq!((out.status, out.stdout.as_str()), (Some(0), "alive\n"), "copy {i}: {}", out.stderr);
        env.alice(None, &["rm", &copy]).ok();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = feeding.join();
    let _ = child.kill();
    let _ = child.wait();
    env.alice(None, &["rm", &name]).ok();
}

/// Runs `moat box-vm` (a supervisor) on a plan whose "QEMU" is `qemu`, a
/// script (the plan's kernel, so that QEMU's Landlock lets it run), in a
/// directory of its own; the helper, still waiting for the guest, and that
/// directory.
fn fake_supervisor(qemu: &str, timeout_ms: u64) -> (std::process::Child, std::path::PathBuf) {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("moat-e2e-{}-{}", std::process::id(), unique("fakeqemu")));
    let run_dir = dir.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(dir.join("kernel"), format!("#!/bin/sh\n{qemu}\n")).unwrap();
    std::fs::set_permissions(dir.join("kernel"), std::fs::Permissions::from_mode(0o755)).unwrap();
    for file in ["initramfs", "disk"] {
        std::fs::write(dir.join(file), b"x").unwrap();
    }
    let plan = serde_json::json!({
        "qemu": dir.join("kernel"),
        "kernel": dir.join("kernel"),
        "initramfs": dir.join("initramfs"),
        "disk": dir.join("disk"),
        "run_dir": run_dir,
        "machine": { "accel": "tcg", "memory_mib": 128, "cpus": 1, "cmdline": "", "mac": "52:54:00:00:00:01", "incoming": false },
        "uid": 3_999_999_000u32,
        "cgroup_procs": [],
        "incoming": null,
        "boot_timeout_ms": timeout_ms,
    });
    let mut child = Command::new(crate::fixture::moat_bin())
        .arg("box-vm")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(plan.to_string().as_bytes()).unwrap();
    (child, dir)
}

/// A QEMU that ends before its guest is up is reported by the supervisor,
/// already confined by then (it kills what is left of its QEMU and says why,
/// rather than dying of its seccomp filter with nothing said).
pub fn supervisor_explains_a_qemu_that_ended(_env: &Env) {
    let (child, dir) = fake_supervisor("exit 0", 20_000);
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("qemu ended before the guest was up"), "{stderr:?}");
}

/// The supervisor holds no descriptor its starter left open by mistake
/// (without close-on-exec): what it holds, a guest that took it over holds.
pub fn supervisor_holds_nothing_left_open(_env: &Env) {
    use std::os::fd::AsRawFd;
    // Inherited by `moat box-vm`, as a daemon's stray descriptor would be.
    let (stray, _write) = nix::unistd::pipe().unwrap();
    let stray_link = std::fs::read_link(format!("/proc/self/fd/{}", stray.as_raw_fd())).unwrap();
    let (mut child, dir) = fake_supervisor("exec sleep 30", 30_000);
    // The supervisor: the helper's child, once it runs as the box's uid.
    let deadline = Instant::now() + Duration::from_secs(20);
    let supervisor = loop {
        let found = std::fs::read_dir("/proc").unwrap().filter_map(Result::ok).find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let ppid = status.lines().find_map(|l| l.strip_prefix("PPid:"))?.trim().parse::<u32>().ok()?;
            let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.to_string();
            (ppid == child.id() && uid == "3999999000").then_some(pid)
        });
        if let Some(pid) = found {
            break pid;
        }
        assert!(Instant::now() < deadline, "no confined supervisor");
        std::thread::sleep(Duration::from_millis(20));
    };
    let held: Vec<_> = std::fs::read_dir(format!("/proc/{supervisor}/fd"))
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(supervisor as i32), nix::sys::signal::Signal::SIGKILL);
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!held.is_empty());
    assert!(!held.contains(&stray_link), "{stray_link:?} in {held:?}");
}

/// A process run in a box's network namespace from the host, killed when
/// the test is done with it, failed or not.
struct InNetns(std::process::Child);

impl Drop for InNetns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a guest sends around the gateway goes nowhere, checked as packets:
/// raw frames from the guest (root there may send anything) with a forged
/// source address, aimed at loopback, or IPv6 (to every node on the link
/// and to the host end's own address) reach neither the gateway nor a
/// listener the test opens in the box's namespace. The guest's last frame,
/// an honest DNS query, is logged: the frames before it were handled (one
/// link, in order), and the frames are well-formed.
pub fn guest_packets_around_the_gateway_go_nowhere(env: &Env) {
    use std::io::{BufRead, BufReader, Write};
    let name = unique("vmpkt");
    env.new_box(&name, &["--backend", "vm"]);
    let info: serde_json::Value =
        serde_json::from_str(&env.alice(None, &["info", &name, "--json"]).ok().stdout).unwrap();
    let netns = format!("--net=/proc/{}/ns/net", qemu_of(info["id"].as_str().unwrap()));
    let port = "47123";
    let mut listener = Command::new("nsenter");
    listener.args([&netns, "python3", "-c", include_str!("packets/listen.py"), port]).stdout(Stdio::piped());
    let mut listener = InNetns(listener.spawn().unwrap());
    let mut heard = BufReader::new(listener.0.stdout.take().unwrap()).lines();
    assert_eq!(heard.next().unwrap().unwrap(), "ready");

    let [forged, looped, honest] = ["forged", "loop", "honest"].map(|what| format!("{}.test", unique(what)));
    // A lookup first, so that the guest knows the host end's link address.
    let script = format!("getent hosts warm.test >/dev/null; python3 - {forged} {looped} {honest} {port}");
    let mut guest = env.daemon.ssh(&env.alice, Some(&name), &[&script]);
    guest.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut guest = guest.spawn().unwrap();
    guest.stdin.take().unwrap().write_all(include_bytes!("packets/forge.py")).unwrap();
    let sent: crate::fixture::Ran = guest.wait_with_output().unwrap().into();
    assert_eq!(sent.ok().stdout, "sent\n");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !crate::egress::log(env, &name).contains(&honest) {
        assert!(Instant::now() < deadline, "the honest query was never logged:\n{}", crate::egress::log(env, &name));
        std::thread::sleep(Duration::from_millis(200));
    }
    let end = "import socket, sys; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'end', ('127.0.0.1', int(sys.argv[1])))";
    run(Command::new("nsenter").args([&netns, "python3", "-c", end, port])).ok();
    let got: Vec<String> = heard.map_while(Result::ok).collect();
    assert!(got.is_empty(), "frames from the guest reached the box's namespace: {got:?}");
    let log = crate::egress::log(env, &name);
    assert!(!log.contains(&forged), "a query from a forged source reached the gateway:\n{log}");
    assert!(!log.contains(&looped), "a query aimed at loopback reached the gateway:\n{log}");
    drop(listener);
    env.alice(None, &["rm", &name]).ok();
}
