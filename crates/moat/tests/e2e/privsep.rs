//! The process that speaks SSH holds nothing worth stealing, and dying costs
//! nothing but its connections.

use std::time::{Duration, Instant};

use crate::fixture::{run, Daemon};
use crate::Env;

/// Socket inodes listening on TCP `port` (IPv4), from /proc/net/tcp.
fn listening_inodes(port: u16) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
            (local_port == port && f.get(3) == Some(&"0A")).then(|| f.get(9).map(|s| s.to_string()))?
        })
        .collect()
}

/// Every process holding a descriptor on one of `inodes`.
fn holders(inodes: &[String]) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .map(|target| inodes.iter().any(|i| target.to_string_lossy() == format!("socket:[{i}]")))
                .unwrap_or(false)
        });
        if holds {
            pids.push(pid);
        }
    }
    pids
}

/// The one process listening on the daemon's port. (While it starts, the
/// socket is in flight to it, held by no process: wait for it to land.)
pub(crate) fn front_door(port: u16) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let inodes = listening_inodes(port);
        assert!(!inodes.is_empty(), "nothing listens on {port}");
        let pids = holders(&inodes);
        assert!(pids.len() <= 1, "exactly one process should hold the SSH socket: {pids:?}");
        if let Some(pid) = pids.first() {
            return *pid;
        }
        assert!(Instant::now() < deadline, "no process holds the SSH socket");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Seconds since boot, as /proc's process start times count them (in
/// hundredths: USER_HZ is 100 on Linux).
fn since_boot() -> f64 {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
    uptime.split_whitespace().next().unwrap().parse().unwrap()
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

pub(crate) fn assert_confined(pid: u32) -> u32 {
    let uids: Vec<u32> = status_field(pid, "Uid").split_whitespace().map(|u| u.parse().unwrap()).collect();
    assert!(uids.iter().all(|u| *u != 0), "front door runs as {uids:?}");
    let gids = status_field(pid, "Gid");
    assert!(gids.split_whitespace().all(|g| g != "0"), "front door gids {gids}");
    assert_eq!(status_field(pid, "Groups"), "");
    for caps in ["CapEff", "CapPrm", "CapInh", "CapAmb", "CapBnd"] {
        assert_eq!(status_field(pid, caps), "0000000000000000", "{caps}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "Seccomp"), "2");
    uids[0]
}

pub fn front_door_is_unprivileged_and_restarts(env: &Env) {
    // A daemon of its own: killing the shared one's front door would cut the
    // connections of tests running beside this one.
    let mut daemon = Daemon::start(env.dir.join("privsep-state"), env.daemon.keys_file.clone(), &[]);
    let ssh = |user: Option<&str>, args: &[&str]| run(&mut daemon.ssh(&env.alice, user, args));
    let port = daemon.port;
    // Once it answers, the listening socket has reached the front door (the
    // privileged side binds it and holds it only until it is handed over).
    ssh(None, &["ls"]).ok();
    let pid = front_door(port);
    let uid = assert_confined(pid);

    // Its uid can read nothing of the state: not the database, not the host key.
    for file in ["moat.db", "ssh_host_ed25519_key"] {
        let path = daemon.state_dir.join(file);
        assert!(path.exists(), "{}", path.display());
        let out = run(std::process::Command::new("setpriv")
            .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string(), "--clear-groups", "cat"])
            .arg(&path));
        assert_ne!(out.status, Some(0), "uid {uid} could read {}", path.display());
    }

    // A box with a process of its own, then the front door dies.
    let name = "keeper";
    ssh(None, &["new", name, "--image", "busybox"]).ok();
    ssh(Some(name), &["echo kept > /root/data"]).ok();
    let sleeper = ssh(Some(name), &["setsid sleep 1000 >/dev/null 2>&1 < /dev/null & echo $!"]).ok().stdout;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let killed = Instant::now();
    let killed_since_boot = since_boot();
    let back = loop {
        let ran = ssh(None, &["ls"]);
        if ran.status == Some(0) {
            break killed.elapsed();
        }
        assert!(killed.elapsed() < Duration::from_secs(10), "no new front door: {}", ran.stderr);
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("    new ssh works {:.0} ms after the front door was killed", back.as_secs_f64() * 1000.0);

    // The box and its process never noticed.
    let out = ssh(Some(name), &[&format!("cat /root/data; kill -0 {} && echo alive", sleeper.trim())]).ok();
    assert_eq!(out.stdout, "kept\nalive\n");
    let new_pid = front_door(port);
    assert_ne!(new_pid, pid);
    assert_confined(new_pid);
    // Restarted at once: the supervisor waits 50 ms (1 s at most, for one
    // that keeps dying). Timed by when the new process started, not by how
    // long an ssh took on a loaded machine; 3 s is generous.
    let stat = std::fs::read_to_string(format!("/proc/{new_pid}/stat")).unwrap();
    let ticks: f64 = stat.rsplit(") ").next().unwrap().split_whitespace().nth(19).unwrap().parse().unwrap();
    let delay = ticks / 100.0 - killed_since_boot;
    assert!(delay < 3.0, "the front door was started again {delay:.2} s after it died");
    daemon.purge();
}
