//! Restarting the daemon loses nothing.

use crate::fixture::{run, Daemon};
use crate::Env;

pub fn loses_nothing(env: &Env) {
    let mut daemon = Daemon::start(env.dir.join("restart-state"), env.daemon.keys_file.clone(), &[]);
    let ssh = |d: &Daemon, user: Option<&str>, args: &[&str]| run(&mut d.ssh(&env.alice, user, args));
    ssh(&daemon, None, &["new", "keeper", "--image", "busybox"]).ok();
    ssh(&daemon, Some("keeper"), &["echo precious > /root/data; sleep 1000 >/dev/null 2>&1 &"]).ok();
    // /dev and /run (directories of the state dir's shared tmpfs) as well.
    ssh(&daemon, Some("keeper"), &["echo shm > /dev/shm/kept && echo run > /run/kept"]).ok();
    let tmp_and_null = "cat /dev/shm/kept /run/kept 2>&1; echo x > /dev/null && echo null-ok";
    ssh(&daemon, None, &["checkpoint", "keeper", "saved"]).ok();
    let before = ssh(&daemon, None, &["ls", "--json"]).ok().stdout;
    let checkpoints = ssh(&daemon, None, &["checkpoints", "keeper", "--json"]).ok().stdout;

    daemon.restart();
    assert_eq!(ssh(&daemon, None, &["ls", "--json"]).ok().stdout, before);
    assert_eq!(ssh(&daemon, None, &["checkpoints", "keeper", "--json"]).ok().stdout, checkpoints);
    let out = ssh(&daemon, Some("keeper"), &["cat /root/data; ps | grep -q '[s]leep 1000' && echo still-running"]).ok();
    assert_eq!(out.stdout, "precious\nstill-running\n");
    assert_eq!(ssh(&daemon, Some("keeper"), &[tmp_and_null]).ok().stdout, "shm\nrun\nnull-ok\n");

    // A suspended box is still suspended (and frozen) after a restart, and the next
    // session resumes it with its processes.
    ssh(&daemon, None, &["suspend", "keeper"]).ok();
    let state = |d: &Daemon| -> serde_json::Value {
        serde_json::from_str(&ssh(d, None, &["info", "keeper", "--json"]).ok().stdout).unwrap()
    };
    assert_eq!(state(&daemon)["state"], "suspended");
    daemon.restart();
    assert_eq!(state(&daemon)["state"], "suspended");
    let out = ssh(&daemon, Some("keeper"), &["ps | grep -q '[s]leep 1000' && echo still-running"]).ok();
    assert_eq!(out.stdout, "still-running\n");
    assert_eq!(state(&daemon)["state"], "running");

    // A box whose processes died while the daemon was down boots on the next session.
    let info: serde_json::Value =
        serde_json::from_str(&ssh(&daemon, None, &["info", "keeper", "--json"]).ok().stdout).unwrap();
    daemon.kill();
    kill_box_processes(info["id"].as_str().unwrap());
    daemon.restart();
    let out = ssh(&daemon, Some("keeper"), &["cat /root/data"]).ok();
    assert_eq!(out.stdout, "precious\n");
    // Booted afresh: what its /dev and /run held went with its processes.
    let out = ssh(&daemon, Some("keeper"), &[tmp_and_null]).ok().stdout;
    assert!(out.contains("No such file") && out.ends_with("null-ok\n") && !out.contains("shm\n"), "{out}");
    daemon.purge();
    assert!(!env.dir.join("restart-state").exists(), "purge left the state dir (its shared tmpfs?)");
}

/// Kills every process of box `id` from the host, as a crash or the OOM killer
/// might, leaving the daemon's records as they are.
pub fn kill_box_processes(id: &str) {
    let procs = ["/sys/fs/cgroup/pids/moat", "/sys/fs/cgroup/moat"]
        .iter()
        .find_map(|p| std::fs::read_to_string(format!("{p}/{id}/cgroup.procs")).ok())
        .unwrap();
    for pid in procs.lines() {
        let _ =
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid.parse().unwrap()), nix::sys::signal::Signal::SIGKILL);
    }
}

/// `new` takes a box booted ahead of demand and gives it its name; warm boxes
/// are nobody's, and a restart leaves none behind.
pub fn warm_boxes_are_named_when_taken_and_never_outlive_a_restart(env: &Env) {
    let mut daemon = Daemon::start(env.dir.join("warm-state"), env.daemon.keys_file.clone(), &[]);
    let ssh = |d: &Daemon, user: Option<&str>, args: &[&str]| run(&mut d.ssh(&env.alice, user, args));
    let roots = |d: &Daemon| -> Vec<String> {
        std::fs::read_dir(d.state_dir.join("pool/boxes"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.bytes().all(|b| b.is_ascii_hexdigit()))
            .collect()
    };
    let id_of = |d: &Daemon, name: &str| -> String {
        let info: serde_json::Value =
            serde_json::from_str(&ssh(d, None, &["info", name, "--json"]).ok().stdout).unwrap();
        info["id"].as_str().unwrap().to_string()
    };
    ssh(&daemon, None, &["new", "first", "--image", "busybox"]).ok();
    let first = id_of(&daemon, "first");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let warm = loop {
        if let Some(w) = roots(&daemon).into_iter().find(|r| *r != first) {
            break w;
        }
        assert!(std::time::Instant::now() < deadline, "no box was booted ahead of demand");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let listed = ssh(&daemon, None, &["ls", "--json"]).ok().stdout;
    assert!(!listed.contains("warm-"), "a warm box is listed: {listed}");
    ssh(&daemon, None, &["new", "second", "--image", "busybox"]).ok();
    assert_eq!(id_of(&daemon, "second"), warm, "new did not take the warm box");
    let script =
        "hostname; cat /etc/hostname; echo ~second; grep -c second /etc/hosts; grep -c ^warm- /etc/passwd || true";
    let out = ssh(&daemon, Some("second"), &[script]).ok();
    assert_eq!(out.stdout, "second\nsecond\n/root\n1\n0\n", "not named, or the name it booted with is left");
    // A restart rolls back the warm box made meanwhile.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while roots(&daemon).len() < 3 {
        assert!(std::time::Instant::now() < deadline, "no second warm box");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    daemon.restart();
    let mut left = roots(&daemon);
    left.sort();
    let mut boxes = vec![first, warm];
    boxes.sort();
    assert_eq!(left, boxes, "a warm box outlived the restart");
    daemon.purge();
}

/// A pool the kernel made read-only (as it does after an I/O error: seen
/// here when the host's disk filled) cannot be opened, and `moat purge`
/// still ends every box and leaves nothing: no process, cgroup, mount or
/// state directory.
pub fn purge_copes_with_a_read_only_pool(env: &Env) {
    let state = env.dir.join("ro-pool-state");
    let mut daemon = Daemon::start(state.clone(), env.daemon.keys_file.clone(), &[]);
    let ssh = |d: &Daemon, user: Option<&str>, args: &[&str]| run(&mut d.ssh(&env.alice, user, args));
    ssh(&daemon, None, &["new", "doomed", "--image", "busybox"]).ok();
    ssh(&daemon, Some("doomed"), &["setsid sleep 1000 >/dev/null 2>&1 < /dev/null &"]).ok();
    let info: serde_json::Value =
        serde_json::from_str(&ssh(&daemon, None, &["info", "doomed", "--json"]).ok().stdout).unwrap();
    let id = info["id"].as_str().unwrap().to_string();
    let cgroup = ["/sys/fs/cgroup/pids/moat", "/sys/fs/cgroup/moat"]
        .iter()
        .map(|p| std::path::Path::new(p).join(&id))
        .find(|p| p.exists())
        .unwrap();
    let pids: Vec<String> =
        std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap().lines().map(String::from).collect();
    assert!(pids.len() >= 2, "the box's agent and its sleep: {pids:?}");
    daemon.kill();
    run(std::process::Command::new("mount").args(["-o", "remount,ro"]).arg(state.join("pool"))).ok();
    daemon.purge();
    assert!(!state.exists(), "the state directory is left");
    assert!(!cgroup.exists(), "the box's cgroup is left");
    for pid in &pids {
        // Gone, or dead and waiting for a parent to reap it.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit(") ").next().and_then(|rest| rest.split_whitespace().next());
        assert!(matches!(state, None | Some("Z")), "the box's process {pid} is left: {stat}");
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&state.display().to_string()), "a mount under the state directory is left");
}
