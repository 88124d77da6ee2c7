//! `moat bench --density N` (issue 29, part 3): N busybox boxes made over
//! ssh on one `moat serve`, left to suspend, then what they cost and how the
//! host answers with all of them there:
//!
//! - host memory per suspended box (MemTotal - MemAvailable, before and
//!   after, split into the kernel's own counters), next to as many idle
//!   bubblewrap sandboxes (`bwrap --unshare-all ... sleep`), the peer;
//! - the file systems each box mounted of its own (each costs every memory
//!   cgroup on the host a slot, so they set how the cost grows with N);
//! - the daemon's RSS, and its helpers' (front door, gateway);
//! - `ls` and `ls --json` over one connection, next to `whoami` (the floor:
//!   a control command that reads no box);
//! - `moat serve` killed and started again, to the first `ssh BOX true`;
//! - resumes of random boxes while all are suspended: `ssh BOX true` to a
//!   suspended box and to the same box running, and the daemon's own
//!   account of each resume (its `box resumed` log line);
//! - the first limit hit, if creating stopped before N (the error `new` gave).
//!
//! Boxes are made over one SSH connection (OpenSSH's ControlMaster), four
//! `new`s in flight. Timings are reported, never asserted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::bench::{ms, Samples};
use crate::bench_egress::{BenchNet, SERVER};
use crate::bench_fleet_rig::{moat, path, serve, Server};

/// `new`s in flight at once.
const CREATORS: usize = 4;
/// Random boxes resumed.
const RESUMES: usize = 200;
/// Idle bubblewrap sandboxes at most (each is two processes).
const MAX_PEERS: usize = 2000;

/// Runs the density benchmark with `boxes` boxes under `state_dir`.
pub fn run(state_dir: &Path, boxes: usize) -> Result<()> {
    crate::bench_fleet_rig::fresh_state_dir(state_dir)?;
    let result = measure(state_dir, boxes.max(1));
    let single = state_dir.join("single");
    if single.exists() {
        eprintln!("bench: removing the boxes");
        if let Err(e) = crate::purge::run(&single) {
            eprintln!("bench: cannot purge {}: {e:#}", single.display());
        }
    }
    let _ = std::fs::remove_dir_all(state_dir);
    result
}

/// What the kernel says memory is doing, in KiB.
#[derive(Clone, Copy, Default)]
struct Meminfo {
    used: i64,
    slab_unreclaimable: i64,
    slab_reclaimable: i64,
    page_tables: i64,
    kernel_stack: i64,
    percpu: i64,
    shmem: i64,
}

impl Meminfo {
    fn read() -> Result<Self> {
        let text = std::fs::read_to_string("/proc/meminfo")?;
        let field = |name: &str| -> i64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        Ok(Self {
            used: field("MemTotal") - field("MemAvailable"),
            slab_unreclaimable: field("SUnreclaim"),
            slab_reclaimable: field("SReclaimable"),
            page_tables: field("PageTables"),
            kernel_stack: field("KernelStack"),
            percpu: field("Percpu"),
            shmem: field("Shmem"),
        })
    }

    /// Settled: the page cache and slabs the last work left dropped first
    /// (what is reclaimable is not a box's cost).
    fn settled() -> Result<Self> {
        // Failing, it leaves the cache as it is (the figures then count it).
        let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
        std::thread::sleep(Duration::from_millis(500));
        Self::read()
    }

    /// Each counter's change from `before`, per `n`, in MiB.
    fn per(&self, before: &Self, n: usize) -> Vec<(&'static str, f64)> {
        let per = |a: i64, b: i64| (a - b) as f64 / 1024.0 / n.max(1) as f64;
        vec![
            ("used (MemTotal - MemAvailable)", per(self.used, before.used)),
            ("  slab, unreclaimable", per(self.slab_unreclaimable, before.slab_unreclaimable)),
            ("  slab, reclaimable", per(self.slab_reclaimable, before.slab_reclaimable)),
            ("  page tables", per(self.page_tables, before.page_tables)),
            ("  kernel stacks", per(self.kernel_stack, before.kernel_stack)),
            ("  per-CPU", per(self.percpu, before.percpu)),
            ("  shmem and tmpfs", per(self.shmem, before.shmem)),
        ]
    }
}

fn measure(state_dir: &Path, boxes: usize) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    // Boxes reach nothing; the gateway still asks a resolver of the bench's own.
    let net = BenchNet::start()?;
    let single = state_dir.join("single");
    eprintln!("bench: moat's busybox image");
    moat(&["image", "build", "busybox", "--state-dir", &path(&single)])?;
    let key = state_dir.join("client_key");
    crate::bench::keygen(&key)?;
    let most = (boxes + 16).to_string();
    let flags: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--authorized-keys",
        &path(&key.with_extension("pub")),
        "--max-boxes",
        &most,
        "--max-memory-per-account",
        "1024T",
        "--idle-grace",
        "1",
        "--upstream-netns",
        &path(&net.path()),
        "--upstream-dns",
        &format!("{SERVER}:53"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut server = serve(single.clone(), &flags)?;
    let result = density(state_dir, &key, &mut server, &flags, boxes);
    server.kill();
    if result.is_err() {
        // What the daemon said last is the lead.
        let log = std::fs::read_to_string(single.with_extension("log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        eprintln!("bench: the daemon's last words:\n{}", lines[lines.len().saturating_sub(30)..].join("\n"));
    }
    result
}

/// An OpenSSH client on `key` for `user` at `server`; `master`: over the
/// ControlMaster socket at that path.
fn ssh(key: &Path, server: &Server, user: &str, master: Option<&Path>) -> Command {
    let mut cmd = crate::bench::ssh_command(key, server.addr.port(), user, &[]);
    if let Some(socket) = master {
        cmd.args(["-o", "ControlMaster=no", "-o"]).arg(format!("ControlPath={}", socket.display()));
    }
    cmd
}

/// Runs `command` over `master`; its stdout, or its stderr as the error.
fn control(key: &Path, server: &Server, master: &Path, command: &str) -> Result<String> {
    let out =
        ssh(key, server, moat_core::ids::CONTROL_USER, Some(master)).arg(command).stdin(Stdio::null()).output()?;
    if !out.status.success() {
        bail!("{command}: {} ({})", String::from_utf8_lossy(&out.stderr).trim(), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The control connection every other control command rides; ended when dropped.
struct Master(Child, PathBuf);

impl Master {
    fn open(key: &Path, server: &Server, socket: PathBuf) -> Result<Self> {
        let child = crate::bench::ssh_command(key, server.addr.port(), moat_core::ids::CONTROL_USER, &[])
            .args(["-N", "-o", "ControlMaster=yes", "-o"])
            .arg(format!("ControlPath={}", socket.display()))
            // What it says (debug1, to a file) is the lead if a command on it fails.
            .arg("-v")
            .arg("-E")
            .arg(socket.with_extension("log"))
            .stdin(Stdio::null())
            .spawn()
            .context("ssh (apt-get install openssh-client)")?;
        let master = Self(child, socket);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !master.1.exists() {
            if Instant::now() > deadline {
                bail!("ssh's control connection did not come up");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(master)
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(&self.1);
    }
}

fn box_name(i: usize) -> String {
    format!("d{i}")
}

fn density(state_dir: &Path, key: &Path, server: &mut Server, flags: &[&str], wanted: usize) -> Result<()> {
    let socket = state_dir.join("control.sock");
    let master = Master::open(key, server, socket.clone())?;
    std::thread::sleep(Duration::from_secs(2));
    let before = Meminfo::settled()?;
    let slabs_before = slabs();
    let threads_before = host_threads();

    eprintln!("bench: creating {wanted} busybox boxes, {CREATORS} at once over one connection");
    let started = Instant::now();
    let (next, made, stop) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicBool::new(false));
    let first_failure: Mutex<Option<(usize, String)>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..CREATORS {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= wanted {
                        return;
                    }
                    match control(key, server, &socket, &format!("new {} --image busybox", box_name(i))) {
                        Ok(_) => {
                            let done = made.fetch_add(1, Ordering::Relaxed) + 1;
                            if done % 500 == 0 {
                                eprintln!("bench: {done} boxes in {:.1} s", started.elapsed().as_secs_f64());
                            }
                        }
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            let mut first = first_failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                            first.get_or_insert_with(|| {
                                // What the control connection said just then is the lead.
                                let said = std::fs::read_to_string(socket.with_extension("log")).unwrap_or_default();
                                let lines: Vec<&str> = said.lines().collect();
                                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                                (i, format!("{e:#}\nthe control connection's last words:\n{tail}"))
                            });
                        }
                    }
                }
            });
        }
    });
    let created_in = started.elapsed();
    let first_failure = first_failure.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    // Names were taken in order; a failure stops the rest, so the boxes are
    // those `ls` shows.
    let names = box_names(&control(key, server, &socket, "ls --json")?)?;
    let made = names.len();
    if made == 0 {
        bail!("no box was made: {}", first_failure.map(|f| f.1).unwrap_or_default());
    }
    eprintln!("bench: {made} boxes in {:.1} s; waiting for all to suspend", created_in.as_secs_f64());
    wait_all_suspended(key, server, &socket, made)?;
    let after = Meminfo::settled()?;
    let slabs_grown = slab_growth(&slabs_before, &slabs(), made);
    let (file_systems, fs_types) = own_file_systems();
    let threads = (host_threads() - threads_before) as f64 / made as f64;
    let daemon = rss_kib(server.pid())?;
    let helpers = helpers_rss_kib(server.pid())?;

    eprintln!("bench: ls, ls --json and whoami, 20 times each");
    let timed = |command: &str| -> Result<Samples> {
        Samples::collect(20, || {
            let t = Instant::now();
            control(key, server, &socket, command)?;
            Ok(t.elapsed())
        })
    };
    let (ls, ls_json, floor) = (timed("ls")?, timed("ls --json")?, timed("whoami")?);

    eprintln!("bench: {RESUMES} resumes of random boxes while all are suspended");
    let resumes = resume_random(key, server, &names)?;
    let daemon_side = resumed_on_host(&server.dir.with_extension("log"))?;

    eprintln!("bench: moat serve killed and started again, to the first ssh BOX true");
    wait_all_suspended(key, server, &socket, made)?;
    drop(master);
    server.kill();
    let restarted = Instant::now();
    *server = serve(server.dir.clone(), flags)?;
    let listening = restarted.elapsed();
    let probe = names.get(made / 2).cloned().unwrap_or_else(|| box_name(0));
    loop {
        let ok = ssh(key, server, &probe, None).arg("true").stdin(Stdio::null()).output()?.status.success();
        if ok {
            break;
        }
        if restarted.elapsed() > Duration::from_secs(300) {
            bail!("no answer from {probe} 300 s after the restart");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let restart = restarted.elapsed();

    let peers = made.min(MAX_PEERS);
    eprintln!("bench: {peers} idle bubblewrap sandboxes (the peer)");
    let peer_mib = idle_bwraps(peers)?;

    let ours = after.per(&before, made);
    let per_box = ours.first().map(|r| r.1).unwrap_or_default();
    println!();
    println!("| density: {made} suspended busybox boxes | moat | peer | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| host memory per box (MiB) | {per_box:.3} | {peer_mib:.3} ({peers} idle bwrap sandboxes) | {:.2}x |",
        per_box / peer_mib.max(1e-6)
    );
    for (what, mib) in ours.iter().skip(1) {
        println!("| {what} | {mib:.3} | | |");
    }
    let slab_top: Vec<String> = slabs_grown.iter().map(|(name, kib)| format!("{name} {kib:.1}")).collect();
    println!("| slab caches grown most (KiB per box) | {} | | |", slab_top.join(", "));
    println!("| file systems of its own per box ({}) | {file_systems:.2} | | |", fs_types.join(", "));
    println!("| host threads (pids) per box | {threads:.2} | | |");
    println!("| daemon RSS | {:.1} MiB | | |", daemon as f64 / 1024.0);
    for (what, kib) in &helpers {
        println!("| {what} RSS | {:.1} MiB | | |", *kib as f64 / 1024.0);
    }
    println!(
        "| made over one connection | {:.1} s ({:.1} ms each) | | |",
        created_in.as_secs_f64(),
        created_in.as_secs_f64() * 1e3 / made as f64
    );
    let row = |what: &str, ours: &Samples, floor: &Samples| {
        let r = ours.pct(50).as_secs_f64() / floor.pct(50).as_secs_f64().max(1e-9);
        println!("| {what}, p50 | {} | {} (whoami) | {r:.2}x |", ms(ours.pct(50)), ms(floor.pct(50)));
    };
    row("ls", &ls, &floor);
    row("ls --json", &ls_json, &floor);
    println!(
        "| restart to the first ssh BOX true | {:.2} s (listening after {:.2} s) | | |",
        restart.as_secs_f64(),
        listening.as_secs_f64()
    );
    let (suspended, running) = (Samples::sorted(resumes.0.clone()), Samples::sorted(resumes.1.clone()));
    let extra = Samples::sorted(resumes.0.iter().zip(&resumes.1).map(|(s, r)| s.saturating_sub(*r)).collect());
    println!(
        "| ssh BOX true, suspended box, p50 / p99 | {} / {} | {} / {} (same box running) | {:.2}x |",
        ms(suspended.pct(50)),
        ms(suspended.pct(99)),
        ms(running.pct(50)),
        ms(running.pct(99)),
        suspended.pct(50).as_secs_f64() / running.pct(50).as_secs_f64().max(1e-9)
    );
    println!(
        "| resume as the client sees it (difference), p50 / p99 | {} / {} | | |",
        ms(extra.pct(50)),
        ms(extra.pct(99))
    );
    let mut host_resume = None;
    if !daemon_side.is_empty() {
        let parts = |what: &str, part: &dyn Fn(&[Duration; 4]) -> Duration| {
            let s = Samples::sorted(daemon_side.iter().map(part).collect());
            println!("| {what}, p50 / p99 / max | {} / {} / {} | | |", ms(s.pct(50)), ms(s.pct(99)), ms(s.pct(100)));
            s
        };
        host_resume = Some(parts("resume on the host (daemon's log)", &|p| p.iter().sum()));
        parts("  of which the gateway's sockets made", &|p| p[0]);
        parts("  of which the thaw (the counters read first)", &|p| p[1]);
        parts("  of which the meter's sample", &|p| p[2]);
        parts("  of which the store's one write (sample and state)", &|p| p[3]);
    }
    match first_failure {
        Some((i, e)) => {
            println!("\nfirst limit hit: `new {}` (box {} of {wanted}) failed: {e}", box_name(i), i + 1);
            // The client may say little (ssh's 255); the daemon says more.
            let log = crate::bench::without_colours(
                &std::fs::read_to_string(server.dir.with_extension("log")).unwrap_or_default(),
            );
            let said: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).collect();
            println!("the daemon's last warnings:\n{}", said[said.len().saturating_sub(10)..].join("\n"));
        }
        None => println!("\nno limit hit: all {wanted} boxes made"),
    }
    let verdict = |ok: bool| if ok { "met" } else { "**not met**" };
    let ls_ms = ls.pct(50).as_secs_f64() * 1e3;
    println!(
        "targets at 10,000: under 1 MiB per box ({}), ls under 100 ms ({}), restart under 10 s ({}), resume p99 under 5 ms on the host ({})",
        verdict(per_box < 1.0),
        verdict(ls_ms < 100.0),
        verdict(restart < Duration::from_secs(10)),
        host_resume.map_or("not seen in the log", |s| verdict(s.pct(99) < Duration::from_millis(5)))
    );
    Ok(())
}

/// The names in `ls --json`'s answer.
fn box_names(json: &str) -> Result<Vec<String>> {
    let boxes: Vec<serde_json::Value> = serde_json::from_str(json).context("ls --json")?;
    Ok(boxes.iter().filter_map(|b| Some(b.get("name")?.as_str()?.to_string())).collect())
}

/// Waits (up to a second a box, at least two minutes) until `made` boxes are suspended.
fn wait_all_suspended(key: &Path, server: &Server, socket: &Path, made: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120).max(Duration::from_millis(made as u64 * 1000));
    loop {
        let boxes: Vec<serde_json::Value> = serde_json::from_str(&control(key, server, socket, "ls --json")?)?;
        let suspended = boxes.iter().filter(|b| b.get("state").and_then(|s| s.as_str()) == Some("suspended")).count();
        if suspended >= made {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{suspended} of {made} boxes suspended after waiting");
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// `ssh BOX true` to [`RESUMES`] random boxes while suspended, then again
/// while running; each box at most once.
fn resume_random(key: &Path, server: &Server, names: &[String]) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let mut seed = std::process::id() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    let mut order: Vec<usize> = (0..names.len()).collect();
    // Fisher-Yates with a xorshift: random enough to miss any cache of recent boxes.
    for i in (1..order.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        order.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    let (mut suspended, mut running) = (Vec::new(), Vec::new());
    for &i in order.iter().take(RESUMES) {
        let name = &names[i];
        for out in [&mut suspended, &mut running] {
            let t = Instant::now();
            let status = ssh(key, server, name, None).arg("true").stdin(Stdio::null()).status()?;
            if !status.success() {
                bail!("ssh {name} true failed: {status}");
            }
            out.push(t.elapsed());
        }
    }
    Ok((suspended, running))
}

/// The daemon's `box resumed` lines in its log: listen, thaw, meter and
/// store, each.
fn resumed_on_host(log: &Path) -> Result<Vec<[Duration; 4]>> {
    let text = std::fs::read_to_string(log).with_context(|| format!("read {}", log.display()))?;
    Ok(crate::bench::without_colours(&text)
        .lines()
        .filter(|l| l.contains("box resumed"))
        .filter_map(|l| {
            let fields: HashMap<&str, &str> = l.split_whitespace().filter_map(|w| w.split_once('=')).collect();
            let part = |k: &str| debug_duration(fields.get(k)?);
            Some([part("listen")?, part("thaw")?, part("meter")?, part("store")?])
        })
        .collect())
}

/// A `Duration` as `{:?}` prints it (`812.5µs`, `1.2ms`, `3s`).
fn debug_duration(text: &str) -> Option<Duration> {
    let text = text.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '.' && c != 'µ');
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.')?;
    let (value, unit) = text.split_at(split);
    let value: f64 = value.parse().ok()?;
    let secs = match unit {
        "ns" => value / 1e9,
        "µs" | "us" => value / 1e6,
        "ms" => value / 1e3,
        "s" => value,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

/// Each slab cache's bytes (`/proc/slabinfo`: objects times their size).
fn slabs() -> HashMap<String, i64> {
    let text = std::fs::read_to_string("/proc/slabinfo").unwrap_or_default();
    text.lines()
        .skip(2)
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.next()?.to_string();
            let (_active, objects, size) = (words.next()?, words.next()?, words.next()?);
            Some((name, objects.parse::<i64>().ok()? * size.parse::<i64>().ok()?))
        })
        .collect()
}

/// The slab caches that grew most between `before` and `after`, KiB per `n`.
fn slab_growth(before: &HashMap<String, i64>, after: &HashMap<String, i64>, n: usize) -> Vec<(String, f64)> {
    let mut grown: Vec<(String, f64)> = after
        .iter()
        .map(|(name, bytes)| {
            let grew = bytes - before.get(name).copied().unwrap_or(0);
            (name.clone(), grew as f64 / 1024.0 / n.max(1) as f64)
        })
        .collect();
    grown.sort_by(|a, b| b.1.total_cmp(&a.1));
    grown.truncate(8);
    grown
}

/// The file systems the boxes mounted of their own (superblocks: in no
/// mount of this process's namespace, as the shared /sys and LXCFS are),
/// per box, with their types. Each is a slot in every memory cgroup's
/// shrinker map (1 KiB per 64 slots from Linux 6.7 on), so on a host of N
/// boxes each box's cgroup costs N times this many slots.
fn own_file_systems() -> (f64, Vec<String>) {
    // (device, file system type) of each mount in `pid`'s namespace.
    let mounts = |pid: &str| -> HashMap<String, String> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let dev = l.split_whitespace().nth(2)?;
                let fs_type = l.split_once(" - ")?.1.split_whitespace().next()?;
                Some((dev.to_string(), fs_type.to_string()))
            })
            .collect()
    };
    let host = mounts("self");
    let agents: Vec<String> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "moat-agent"))
        .collect();
    let mut own: HashMap<String, String> = HashMap::new();
    for pid in &agents {
        own.extend(mounts(pid).into_iter().filter(|(dev, _)| !host.contains_key(dev)));
    }
    let mut types: Vec<String> = own.values().cloned().collect();
    types.sort();
    types.dedup();
    (own.len() as f64 / agents.len().max(1) as f64, types)
}

/// Threads on the host, each a pid (`/proc/loadavg`'s fourth field, after the slash).
fn host_threads() -> i64 {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().nth(3).and_then(|f| f.split_once('/')?.1.parse().ok()).unwrap_or(0)
}

/// A process's resident memory, in KiB.
fn rss_kib(pid: u32) -> Result<i64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0))
}

/// The daemon's children that are this binary (front door, gateway, ...),
/// by their command's first words, with their RSS.
fn helpers_rss_kib(daemon: u32) -> Result<Vec<(String, i64)>> {
    let exe = std::fs::read_link(format!("/proc/{daemon}/exe"))?;
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let Some(pid) = entry?.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if parent != Some(daemon) || std::fs::read_link(format!("/proc/{pid}/exe")).ok().as_ref() != Some(&exe) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let verb = cmdline.split(|b| *b == 0).nth(1).map(|w| String::from_utf8_lossy(w).into_owned());
        out.push((format!("moat {}", verb.unwrap_or_default()), rss_kib(pid).unwrap_or(0)));
    }
    out.sort();
    Ok(out)
}

/// Host memory each of `n` idle bubblewrap sandboxes costs, in MiB: the
/// same namespaces as a box, one `sleep` inside, all alive at once.
fn idle_bwraps(n: usize) -> Result<f64> {
    let before = Meminfo::settled()?;
    let mut sandboxes = Vec::with_capacity(n);
    let result = (|| -> Result<f64> {
        for _ in 0..n {
            let child = Command::new("bwrap")
                .args(["--die-with-parent", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"])
                .args(["--tmpfs", "/tmp", "sleep", "infinity"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("bwrap (apt-get install bubblewrap)")?;
            sandboxes.push(child);
        }
        // Each has set itself up once its sleep runs.
        std::thread::sleep(Duration::from_secs(2));
        let after = Meminfo::settled()?;
        Ok((after.used - before.used) as f64 / 1024.0 / n.max(1) as f64)
    })();
    for mut child in sandboxes {
        // Its PID 1 first (killing that ends everything in the sandbox's
        // namespace); killing bwrap alone leaves it running.
        let pid = child.id();
        let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        for inner in children.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(inner), nix::sys::signal::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_as_debug_prints_them() {
        for d in
            [Duration::from_nanos(950), Duration::from_micros(812), Duration::from_millis(3), Duration::from_secs(2)]
        {
            let back = debug_duration(&format!("{d:?}")).unwrap();
            assert!((back.as_secs_f64() - d.as_secs_f64()).abs() < 1e-6 * d.as_secs_f64().max(1e-6), "{d:?}");
        }
        assert_eq!(debug_duration("soon"), None);
        let line = "\x1b[2m2026\x1b[0m box resumed \x1b[3mthaw\x1b[0m\x1b[2m=\x1b[0m1.5ms";
        assert_eq!(crate::bench::without_colours(line), "2026 box resumed thaw=1.5ms");
    }
}
