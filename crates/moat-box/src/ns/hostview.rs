//! What a box sees of the machine's totals: its own, not the host's.
//!
//! A box's `/proc/meminfo` would say 24 GB under a 2 GiB limit and
//! `/proc/cpuinfo` would count every core, and agents size their work by them
//! (`make -j$(nproc)`). LXCFS (Debian's package) serves those files computed
//! from the reading process's cgroup; each box gets them bind-mounted over its
//! `/proc` entries. `nproc` asks the scheduler instead, so a box limited to
//! fewer CPUs than the host has is also given an affinity of that many CPUs
//! (see [`cpu_affinity`]); the cgroup's CPU quota stays the real limit.
//!
//! One LXCFS process per state dir, in the foreground of its own session, so it
//! outlives a daemon restart (boxes keep their mounts) and `moat purge` ends it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The files LXCFS serves that a box gets, relative to both the LXCFS mount
/// and the box's root. Not `/proc/uptime`: LXCFS counts it from the box's
/// start while every process's start time is still counted from the host's
/// boot, so `ps -o etime` went negative (and printed years); a box sees the
/// host's uptime, as a Docker container does.
const FILES: &[&str] =
    &["proc/meminfo", "proc/cpuinfo", "proc/stat", "proc/diskstats", "proc/swaps", "sys/devices/system/cpu/online"];

/// Most private memory LXCFS may map (`RLIMIT_DATA`; thread stacks count).
/// It is one process for every box, outside every box's memory limit, and
/// each file a box holds open costs it ~1.6 KB: a box holding a million of
/// them made it take 1.9 GB of the host's memory and keep it. Past this an
/// open fails (ENOMEM) instead; ~10 threads' stacks and buffers are ~100 MiB
/// of it.
const LXCFS_DATA: u64 = 256 << 20;

/// A running LXCFS mount.
#[derive(Debug, Clone)]
pub struct HostView {
    dir: PathBuf,
    /// (host file, path in the box) for each file LXCFS serves here; read
    /// once, not at every box start.
    binds: Vec<(PathBuf, PathBuf)>,
}

impl HostView {
    /// The LXCFS mount at `dir`, started if it is not serving already. `None`
    /// (and a warning) where LXCFS is missing or cannot mount: boxes then see
    /// the host's totals, as containers without LXCFS do.
    pub fn ensure(dir: &Path) -> Option<Self> {
        let view = Self { dir: dir.to_path_buf(), binds: Vec::new() };
        if view.serving() {
            return Some(view.with_binds());
        }
        // A mount whose process died answers ENOTCONN: clear it first.
        let _ = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH);
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "no per-box /proc totals");
            return None;
        }
        let log = std::fs::File::create(dir.with_extension("log")).ok();
        let mut cmd = Command::new("lxcfs");
        cmd.args(["--foreground", "--enable-cfs", "--pidfile"])
            .arg(dir.with_extension("pid"))
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.map_or(Stdio::null(), Stdio::from))
            .process_group(0);
        crate::sys::limit_data(&mut cmd, LXCFS_DATA);
        if let Err(e) = cmd.spawn() {
            tracing::warn!(error = %e, "lxcfs did not start (apt-get install lxcfs): boxes see the host's totals");
            return None;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if view.serving() {
                return Some(view.with_binds());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::warn!(dir = %dir.display(), "lxcfs did not mount in 5 s: boxes see the host's totals");
        None
    }

    fn serving(&self) -> bool {
        std::fs::read(self.dir.join("proc/meminfo")).is_ok_and(|m| !m.is_empty())
    }

    fn with_binds(mut self) -> Self {
        self.binds =
            FILES.iter().map(|f| (self.dir.join(f), PathBuf::from(f))).filter(|(src, _)| src.exists()).collect();
        self
    }

    /// (host file, path in the box) for each file the box gets.
    pub fn binds(&self) -> &[(PathBuf, PathBuf)] {
        &self.binds
    }

    /// Unmounts the LXCFS at `dir` and ends its process (for `moat purge`).
    pub fn stop(dir: &Path) {
        let pidfile = dir.with_extension("pid");
        let _ = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH);
        if let Some(pid) = std::fs::read_to_string(&pidfile).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
            // Only an lxcfs: a stale pid file must not kill whatever reused the pid.
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "lxcfs" {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
            }
        }
        let _ = std::fs::remove_file(pidfile);
        let _ = std::fs::remove_file(dir.with_extension("log"));
        let _ = std::fs::remove_dir(dir);
    }
}

/// Runs `bind` (a bind mount of one of LXCFS's files into a box) again while
/// it fails with ENOENT, five times at most over ~60 ms. LXCFS now and then
/// answers the lookup of a file it serves with "no such file" while boxes
/// start side by side: one `new` in ~25 of `moat bench --density 8` failed
/// so, and the file was there when looked at right after the failure.
pub fn retry_lost_lookups<T>(mut bind: impl FnMut() -> nix::Result<T>) -> nix::Result<T> {
    let mut pause = Duration::from_millis(2);
    for _ in 0..5 {
        match bind() {
            Err(nix::errno::Errno::ENOENT) => {
                std::thread::sleep(pause);
                pause *= 2;
            }
            done => return done,
        }
    }
    bind()
}

/// The CPUs a box with `cpus` CPUs of bandwidth runs on, so that `nproc` and
/// the like count its share: none (no pinning) when it may use the whole host,
/// else `cpus` consecutive CPUs, starting where its slot falls so that boxes
/// spread over the host.
pub fn cpu_affinity(cpus: u32, slot: u32, host_cpus: usize) -> Vec<usize> {
    let want = cpus as usize;
    if host_cpus == 0 || want >= host_cpus {
        return Vec::new();
    }
    let start = (slot as usize).wrapping_mul(want) % host_cpus;
    (0..want).map(|i| (start + i) % host_cpus).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_lookup_is_tried_again_and_other_failures_are_not() {
        use nix::errno::Errno;
        let mut calls = 0;
        let found = retry_lost_lookups(|| {
            calls += 1;
            if calls < 3 {
                Err(Errno::ENOENT)
            } else {
                Ok(calls)
            }
        });
        assert_eq!(found, Ok(3));
        let mut calls = 0;
        let lost = retry_lost_lookups(|| -> nix::Result<()> {
            calls += 1;
            Err(Errno::ENOENT)
        });
        assert_eq!((lost, calls), (Err(Errno::ENOENT), 6), "gives up after five retries");
        let mut calls = 0;
        let refused = retry_lost_lookups(|| -> nix::Result<()> {
            calls += 1;
            Err(Errno::EPERM)
        });
        assert_eq!((refused, calls), (Err(Errno::EPERM), 1));
    }

    #[test]
    fn affinity_counts_the_share_and_spreads_boxes() {
        assert_eq!(cpu_affinity(2, 0, 2), Vec::<usize>::new(), "the whole host: no pinning");
        assert_eq!(cpu_affinity(8, 3, 2), Vec::<usize>::new());
        assert_eq!(cpu_affinity(1, 0, 2), vec![0]);
        assert_eq!(cpu_affinity(1, 1, 2), vec![1]);
        assert_eq!(cpu_affinity(3, 1, 8), vec![3, 4, 5]);
        assert_eq!(cpu_affinity(3, 2, 8), vec![6, 7, 0]);
        assert_eq!(cpu_affinity(1, u32::MAX, 3).len(), 1);
    }
}
