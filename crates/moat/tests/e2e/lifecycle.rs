//! Billing stops when the last session ends: suspend after a grace period,
//! resume on the next session, keep-running, stop/start, parking, and the
//! usage ledger. One daemon with short timers serves these tests.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::fixture::{run, Daemon, Ran};
use crate::Env;

struct Lifecycle<'a> {
    env: &'a Env,
    daemon: Daemon,
}

impl Lifecycle<'_> {
    fn ssh(&self, user: Option<&str>, args: &[&str]) -> Ran {
        run(&mut self.daemon.ssh(&self.env.alice, user, args))
    }

    fn info(&self, name: &str) -> serde_json::Value {
        serde_json::from_str(&self.ssh(None, &["info", name, "--json"]).ok().stdout).unwrap()
    }

    /// Waits (bounded) until the box reaches `state`, reading `info` (which
    /// opens no session on the box).
    fn wait_state(&self, name: &str, state: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.info(name)["state"] != state {
            assert!(Instant::now() < deadline, "{name} never became {state}: {}", self.info(name));
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn cgroup(&self, name: &str, controller: &str) -> PathBuf {
        let id = self.info(name)["id"].as_str().unwrap().to_string();
        let v1 = PathBuf::from(format!("/sys/fs/cgroup/{controller}/moat/{id}"));
        if v1.exists() {
            v1
        } else {
            PathBuf::from(format!("/sys/fs/cgroup/moat/{id}"))
        }
    }

    fn cpu_ns(&self, name: &str) -> u64 {
        let dir = self.cgroup(name, "cpuacct");
        match std::fs::read_to_string(dir.join("cpuacct.usage")) {
            Ok(v) => v.trim().parse().unwrap(),
            Err(_) => {
                let stat = std::fs::read_to_string(dir.join("cpu.stat")).unwrap();
                let usec: u64 = stat.lines().find_map(|l| l.strip_prefix("usage_usec ")?.parse().ok()).unwrap();
                usec * 1000
            }
        }
    }

    fn frozen(&self, name: &str) -> bool {
        let dir = self.cgroup(name, "freezer");
        match std::fs::read_to_string(dir.join("freezer.state")) {
            Ok(state) => state.trim() == "FROZEN",
            Err(_) => std::fs::read_to_string(dir.join("cgroup.events")).unwrap().contains("frozen 1"),
        }
    }

    /// A file in the box, read from the host (so no session resumes it).
    fn host_read(&self, name: &str, path: &str) -> String {
        let id = self.info(name)["id"].as_str().unwrap().to_string();
        std::fs::read_to_string(self.daemon.state_dir.join("pool/boxes").join(id).join(path)).unwrap()
    }

    fn usage(&self, name: &str) -> serde_json::Value {
        let report: serde_json::Value =
            serde_json::from_str(&self.ssh(None, &["usage", name, "--json"]).ok().stdout).unwrap();
        report["boxes"][0].clone()
    }
}

/// All lifecycle checks on one daemon (idle grace 1 s, meter every second,
/// parking after 4 s suspended), run in sequence.
pub fn suspend_resume_stop_park_and_ledger(env: &Env) {
    let daemon = Daemon::start(
        env.dir.join("lifecycle-state"),
        env.daemon.keys_file.clone(),
        &["--idle-grace", "1", "--meter-interval", "1", "--park-after", "4"],
    );
    let mut t = Lifecycle { env, daemon };
    suspends_when_idle_and_resumes_where_it_was(&t);
    keep_running_is_never_suspended(&t);
    stop_and_start(&t);
    long_suspended_boxes_are_parked(&t);
    ledger_cpu_matches_a_busy_loop_and_survives_restart(&mut t);
    let mut daemon = t.daemon;
    daemon.purge();
}

fn suspends_when_idle_and_resumes_where_it_was(t: &Lifecycle) {
    t.ssh(None, &["new", "idle", "--image", "busybox", "--idle", "2"]).ok();
    // A loop that counts as fast as it can: it burns CPU and shows progress.
    // It appends (one write per line), so a freeze never leaves the file half-written.
    t.ssh(Some("idle"), &["(i=0; while :; do i=$((i+1)); echo $i >> /root/count; done) >/dev/null 2>&1 &"]).ok();
    assert!(t.info("idle")["state"] == "running");
    t.wait_state("idle", "suspended");
    assert!(t.frozen("idle"), "state says suspended but the processes are not frozen");
    // Frozen: the counter and the CPU counter stand still.
    let (count, cpu) = (t.host_read("idle", "root/count"), t.cpu_ns("idle"));
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(t.host_read("idle", "root/count"), count);
    assert_eq!(t.cpu_ns("idle"), cpu, "a suspended box used CPU");
    let frozen_at: u64 = count.lines().last().unwrap().parse().unwrap();
    // The next session resumes it transparently; the loop goes on from there
    // (waited for: up to 10 s for the counter to move on a loaded machine).
    // The running loop may be mid-append when read (a line straddling a page shows
    // its first part alone), so the last complete line is the one before the last.
    let resumed = "last() { tail -n 2 /root/count | head -n 1; }; a=$(last); i=0; \
                   while [ \"$(last)\" = \"$a\" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; \
                   echo $a $(last)";
    let out = t.ssh(Some("idle"), &[resumed]).ok();
    let v: Vec<u64> = out.stdout.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert!(v[0] + 1 >= frozen_at && v[1] > v[0], "counter did not continue: frozen at {frozen_at}, then {v:?}");
    assert!(!t.frozen("idle"));
    // Once more without sessions, it is suspended again.
    t.wait_state("idle", "suspended");
    // Copying a suspended box leaves it suspended (dup thaws only what it froze).
    t.ssh(None, &["dup", "idle", "idle-copy"]).ok();
    assert_eq!(t.info("idle")["state"], "suspended");
    assert!(t.frozen("idle"), "dup thawed a suspended box");
    assert_eq!(t.ssh(Some("idle-copy"), &["test -s /root/count && echo copied"]).ok().stdout, "copied\n");
    t.ssh(None, &["rm", "idle-copy"]).ok();
}

fn keep_running_is_never_suspended(t: &Lifecycle) {
    t.ssh(None, &["new", "server", "--image", "busybox"]).ok();
    t.ssh(None, &["set", "server", "keep-running", "on"]).ok();
    // Not suspended while a box made after it, idle as long, is.
    t.ssh(None, &["new", "idler", "--image", "busybox"]).ok();
    t.wait_state("idler", "suspended");
    t.ssh(None, &["rm", "idler"]).ok();
    assert_eq!(t.info("server")["state"], "running");
    assert!(!t.frozen("server"));
    assert!(t.ssh(None, &["info", "server"]).ok().stdout.contains("keep-running (billed while idle)"));
    // Turned off, the idle rule applies again.
    t.ssh(None, &["set", "server", "keep-running", "off"]).ok();
    t.wait_state("server", "suspended");
    // And a suspended box set to keep-running is resumed at once.
    t.ssh(None, &["set", "server", "keep-running", "on"]).ok();
    assert_eq!(t.info("server")["state"], "running");
    assert!(!t.frozen("server"));
    t.ssh(None, &["rm", "server"]).ok();
}

fn stop_and_start(t: &Lifecycle) {
    t.ssh(None, &["new", "stopper", "--image", "busybox"]).ok();
    t.ssh(Some("stopper"), &["echo kept > /root/f; sleep 1000 >/dev/null 2>&1 &"]).ok();
    let cgroup = t.cgroup("stopper", "pids");
    t.ssh(None, &["stop", "stopper"]).ok();
    assert_eq!(t.info("stopper")["state"], "stopped");
    assert!(!cgroup.exists(), "stopped box still has a cgroup (processes)");
    t.ssh(None, &["start", "stopper"]).ok();
    assert_eq!(t.info("stopper")["state"], "running");
    let out = t.ssh(Some("stopper"), &["cat /root/f; ps | grep -c '[s]leep 1000'"]);
    assert_eq!(out.stdout, "kept\n0\n", "files kept, processes gone");
    // A session on a stopped box boots it.
    t.ssh(None, &["stop", "stopper"]).ok();
    assert_eq!(t.ssh(Some("stopper"), &["cat /root/f"]).ok().stdout, "kept\n");
    t.ssh(None, &["rm", "stopper"]).ok();
}

fn long_suspended_boxes_are_parked(t: &Lifecycle) {
    t.ssh(None, &["new", "parked", "--image", "busybox"]).ok();
    t.ssh(Some("parked"), &["echo kept > /root/f"]).ok();
    t.wait_state("parked", "suspended");
    t.wait_state("parked", "stopped");
    assert_eq!(t.ssh(Some("parked"), &["cat /root/f"]).ok().stdout, "kept\n");
    t.ssh(None, &["rm", "parked"]).ok();
}

fn ledger_cpu_matches_a_busy_loop_and_survives_restart(t: &mut Lifecycle) {
    t.ssh(None, &["new", "busy", "--image", "busybox"]).ok();
    // busybox `time` prints user and sys seconds of the loop to stderr.
    let out = t.ssh(Some("busy"), &["time timeout 3 sh -c 'while :; do :; done'; true"]).ok();
    let secs = |key: &str| -> f64 {
        let line = out.stderr.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("{}", out.stderr));
        let v = line.split_whitespace().last().unwrap().trim_end_matches('s');
        let (m, s) = v.split_once('m').map_or((0.0, v), |(m, s)| (m.parse().unwrap(), s));
        m * 60.0 + s.parse::<f64>().unwrap()
    };
    let loop_cpu = secs("user") + secs("sys");
    assert!(loop_cpu > 0.5, "the loop barely ran: {}", out.stderr);
    let ledger = t.usage("busy")["cpu_seconds"].as_f64().unwrap();
    let error = (ledger - loop_cpu).abs() / loop_cpu;
    assert!(error <= 0.10, "ledger says {ledger:.3} CPU-s, the loop used {loop_cpu:.3} ({:.1}% off)", error * 100.0);

    // Counters survive a restart and never run backwards, nor count twice.
    let before = t.usage("busy");
    t.daemon.restart();
    let after = t.usage("busy");
    for key in ["cpu_seconds", "memory_gib_seconds", "running_seconds", "suspended_seconds"] {
        let (b, a) = (before[key].as_f64().unwrap(), after[key].as_f64().unwrap());
        assert!(a >= b, "{key} ran backwards across a restart: {b} -> {a}");
    }
    let (b, a) = (before["cpu_seconds"].as_f64().unwrap(), after["cpu_seconds"].as_f64().unwrap());
    assert!(a - b < 0.25, "restart double-counted CPU: {b} -> {a}");
    assert!(after["disk_bytes"].as_u64().is_some(), "{after}");
}
