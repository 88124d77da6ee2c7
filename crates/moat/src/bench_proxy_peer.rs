//! The gateway against proxies users trust doing the same job: nginx's
//! `stream` module and HAProxy, each run in the bench's test internet, where
//! the client's connections to a fake address are redirected to it by NAT
//! (as a box's are to its gateway) and it connects on to the same server.
//! Three jobs, each a download: plain HTTP relayed (the gateway reads the
//! request and splices the body; the peers relay bytes), TLS passed through,
//! and TLS ended and made again with a certificate of the proxy's own CA
//! (the gateway's looked-inside path; the peers do it without reading HTTP).
//! A peer not installed is left out, and the table says so.
//!
//! Host CPU is all of `/proc/stat`'s busy time over the downloads: client,
//! proxy and kernel together, on a machine doing nothing else.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moat_core::{AccountId, BoxManager};

use crate::bench_egress::{BenchNet, Side, NAME, SERVER};

/// The fake addresses the client dials for a peer: relayed (HTTP and TLS
/// passed through), and TLS ended.
const RELAYED: Ipv4Addr = Ipv4Addr::new(198, 18, 255, 1);
const ENDED: Ipv4Addr = Ipv4Addr::new(198, 18, 255, 2);
/// Where a peer listens for each (NAT sends the fake addresses' ports there).
const PLAIN_PORT: u16 = 9080;
const PASS_PORT: u16 = 9443;
const ENDED_PORT: u16 = 9444;

/// The jobs, in the table's order.
const JOBS: [&str; 3] = ["plain HTTP relayed", "TLS passed through", "TLS ended and made again"];

/// One way of carrying the downloads, and what each job cost (or why it
/// was not measured).
pub struct Carried {
    /// Who carried them ("moat gateway", "nginx stream", ...).
    pub by: String,
    /// One per [`JOBS`].
    pub jobs: [Result<Cost, String>; 3],
}

/// A job's throughput and the host CPU it took.
#[derive(Clone, Copy)]
pub struct Cost {
    /// MiB/s over all runs.
    pub mib_s: f64,
    /// Host CPU seconds per GiB carried.
    pub cpu_s_per_gib: f64,
}

/// Measures the downloads through the gateway (a box passing the test
/// host's TLS through, one looking inside it), directly, and through each
/// peer; prints the table.
pub async fn measure(manager: &Arc<BoxManager>, net: &BenchNet, state_dir: &Path, runs: usize, mib: u64) -> Result<()> {
    let account = AccountId("bench".into());
    let (mut sides, mut sessions) = (Vec::new(), Vec::new());
    for (name, look) in [("pass", false), ("look", true)] {
        crate::bench_egress::make_box(manager, &account, name, crate::bench_egress::policy(look)?).await?;
        // Held until the end: a box without a session is suspended.
        let (side, session) = crate::bench_egress::box_side(manager, &account, name, state_dir, net).await?;
        sides.push(side);
        sessions.push(session);
    }
    let bytes = mib << 20;
    let peers_dir = state_dir.join("proxy-peers");
    let internet = Side::direct(net);
    // Off the async thread, which polls the gateway's supervisor meanwhile.
    let rows = tokio::task::spawn_blocking(move || -> Result<Vec<Carried>> {
        eprintln!("bench: proxies: {mib} MiB downloads, {runs} times each: direct, the gateway, nginx stream, HAProxy");
        let (pass, look) = (&sides[0], &sides[1]);
        let direct = Carried {
            by: "direct (no proxy)".into(),
            jobs: [Ok(plain(&internet, runs, bytes)?), Ok(https(&internet, runs, bytes)?), Err("-".into())],
        };
        let gateway = Carried {
            by: "moat gateway".into(),
            jobs: [Ok(plain(pass, runs, bytes)?), Ok(https(pass, runs, bytes)?), Ok(https(look, runs, bytes)?)],
        };
        let mut rows = vec![direct, gateway];
        rows.extend(peers(&internet, &peers_dir, runs, bytes)?);
        Ok(rows)
    })
    .await??;
    drop(sessions);
    print(&rows, mib, runs);
    Ok(())
}

fn print(rows: &[Carried], mib: u64, runs: usize) {
    let head: Vec<String> = JOBS.iter().map(|j| format!("{j} | host CPU per GiB")).collect();
    println!("\n| download, {mib} MiB x {runs} | {} |", head.join(" | "));
    println!("|---{}|", "|---|---".repeat(JOBS.len()));
    let cell = |c: &Result<Cost, String>| match c {
        Ok(c) => format!("{:.0} MiB/s | {:.2} s", c.mib_s, c.cpu_s_per_gib),
        Err(why) => format!("{why} | -"),
    };
    for row in rows {
        let cells: Vec<String> = row.jobs.iter().map(cell).collect();
        println!("| {} | {} |", row.by, cells.join(" | "));
    }
    let find = |by: &str| rows.iter().find(|r| r.by == by);
    let (Some(gateway), Some(nginx)) = (find("moat gateway"), find("nginx stream")) else { return };
    println!();
    let met = |ok: bool| if ok { "met" } else { "**not met**" };
    for (i, job) in JOBS.iter().enumerate() {
        let (Ok(g), Ok(n)) = (&gateway.jobs[i], &nginx.jobs[i]) else { continue };
        let (speed, cpu) = (g.mib_s / n.mib_s, g.cpu_s_per_gib / n.cpu_s_per_gib);
        // The targets: relayed at least 1.0x and CPU at most 1.0x;
        // ended at least 0.8x.
        let floor = if i == 2 { 0.8 } else { 1.0 };
        println!(
            "{job}, gateway against nginx stream: {speed:.2}x its throughput (target at least {floor:.1}x: {}), \
             {cpu:.2}x its CPU per GiB{}",
            met(speed >= floor),
            if i == 2 { String::new() } else { format!(" (target at most 1.0x: {})", met(cpu <= 1.0)) }
        );
    }
}

/// Times `runs` plain HTTP downloads of `bytes` from `side`.
fn plain(side: &Side, runs: usize, bytes: u64) -> Result<Cost> {
    cost(runs, bytes, || side.download(runs, bytes))
}

/// Times `runs` HTTPS downloads of `bytes` from `side`.
fn https(side: &Side, runs: usize, bytes: u64) -> Result<Cost> {
    cost(runs, bytes, || side.https_download(runs, bytes))
}

/// What `download` (`runs` downloads of `bytes`) cost: throughput and host CPU.
fn cost(runs: usize, bytes: u64, download: impl FnOnce() -> Result<Vec<Duration>>) -> Result<Cost> {
    let busy = busy_cpu_s()?;
    let started = Instant::now();
    download()?;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = busy_cpu_s()? - busy;
    let total = (runs as u64 * bytes) as f64;
    Ok(Cost { mib_s: total / f64::from(1 << 20) / elapsed, cpu_s_per_gib: cpu / (total / f64::from(1 << 30)) })
}

/// The peers' rows: each installed proxy started in the test internet
/// (where `internet`'s client runs) in turn, the client (trusting the test
/// internet's CA and the peer's) dialing it by NAT.
fn peers(internet: &Side, dir: &Path, runs: usize, bytes: u64) -> Result<Vec<Carried>> {
    redirect_to_peers(&internet.netns)?;
    std::fs::create_dir_all(dir)?;
    let (ca, ca_key) = moat_core::box_ca::mint()?;
    let (leaf, leaf_key) = moat_core::box_ca::leaf_pem(&ca_key, NAME)?;
    std::fs::write(dir.join("leaf.pem"), &leaf)?;
    std::fs::write(dir.join("leaf.key"), &leaf_key)?;
    std::fs::write(dir.join("leaf-and-key.pem"), format!("{leaf}{leaf_key}"))?;
    std::fs::write(dir.join("upstream-ca.pem"), &internet.roots)?;
    let side = |to| Side { to: Some(to), roots: format!("{}\n{ca}", internet.roots), ..internet.clone() };
    let mut rows = Vec::new();
    for peer in [Peer::Nginx, Peer::Haproxy] {
        let jobs = match peer.start(&internet.netns, dir) {
            Ok(_running) => {
                let shown = |c: Result<Cost>| c.map_err(|e| format!("{e:#}"));
                [
                    shown(plain(&side(RELAYED), runs, bytes)),
                    shown(https(&side(RELAYED), runs, bytes)),
                    shown(https(&side(ENDED), runs, bytes)),
                ]
            }
            Err(e) => [0, 1, 2].map(|_| Err(format!("{e:#}"))),
        };
        rows.push(Carried { by: peer.name().to_string(), jobs });
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(rows)
}

/// The test internet's own connections to the fake addresses go to the
/// peer's ports on loopback (its namespace, made and removed by the bench).
fn redirect_to_peers(netns: &Path) -> Result<()> {
    let routes = "route add 198.18.255.0/24 dev lo\n";
    let rules = format!(
        "table ip moat_bench_peer {{
            chain output {{
                type nat hook output priority -100; policy accept;
                ip daddr {RELAYED} tcp dport 80 redirect to :{PLAIN_PORT}
                ip daddr {RELAYED} tcp dport 443 redirect to :{PASS_PORT}
                ip daddr {ENDED} tcp dport 443 redirect to :{ENDED_PORT}
            }}
        }}\n"
    );
    moat_box::host::egress::in_netns(netns, || moat_box::host::netns::configure(routes, &rules))
        .context("redirect the fake addresses to the peers")
}

/// Host CPU time spent busy so far, in seconds (every CPU; `/proc/stat`).
fn busy_cpu_s() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy: u64 = ticks.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100);
    Ok(busy as f64 / hz as f64)
}

enum Peer {
    Nginx,
    Haproxy,
}

/// A peer proxy running; stopped when dropped: asked first (SIGTERM), so
/// that nginx's master ends its workers (killed, it would leave them).
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Peer {
    fn name(&self) -> &'static str {
        match self {
            Self::Nginx => "nginx stream",
            Self::Haproxy => "HAProxy",
        }
    }

    /// Starts the peer in the namespace at `netns`, with its files in `dir`, and
    /// waits until its ports listen.
    fn start(&self, netns: &Path, dir: &Path) -> Result<Running> {
        let d = dir.display();
        let (program, config, args): (&str, String, Vec<String>) = match self {
            Self::Nginx => {
                let module = Path::new("/usr/lib/nginx/modules/ngx_stream_module.so");
                if !module.exists() {
                    bail!("not installed (apt-get install nginx libnginx-mod-stream)");
                }
                let config = format!(
                    "load_module {module};
                    daemon off;
                    user root;
                    worker_processes 2;
                    pid {d}/nginx.pid;
                    error_log {d}/error.log warn;
                    events {{ worker_connections 1024; }}
                    stream {{
                        server {{ listen 127.0.0.1:{PLAIN_PORT}; proxy_pass {SERVER}:80; }}
                        server {{ listen 127.0.0.1:{PASS_PORT}; proxy_pass {SERVER}:443; }}
                        server {{
                            listen 127.0.0.1:{ENDED_PORT} ssl;
                            ssl_certificate {d}/leaf.pem;
                            ssl_certificate_key {d}/leaf.key;
                            proxy_pass {SERVER}:443;
                            proxy_ssl on;
                            proxy_ssl_server_name on;
                            proxy_ssl_name {NAME};
                            proxy_ssl_verify on;
                            proxy_ssl_trusted_certificate {d}/upstream-ca.pem;
                        }}
                    }}\n",
                    module = module.display()
                );
                let args = ["-e", "stderr", "-p", "DIR", "-c", "DIR/peer.conf"];
                ("nginx", config, args.iter().map(|a| a.replace("DIR", &d.to_string())).collect())
            }
            Self::Haproxy => {
                let config = format!(
                    "global
                        nbthread 2
                    defaults
                        mode tcp
                        timeout connect 5s
                        timeout client 60s
                        timeout server 60s
                    listen plain
                        bind 127.0.0.1:{PLAIN_PORT}
                        server upstream {SERVER}:80
                    listen passed
                        bind 127.0.0.1:{PASS_PORT}
                        server upstream {SERVER}:443
                    listen ended
                        bind 127.0.0.1:{ENDED_PORT} ssl crt {d}/leaf-and-key.pem
                        server upstream {SERVER}:443 ssl verify required ca-file {d}/upstream-ca.pem sni str({NAME}) verifyhost {NAME}\n"
                );
                ("haproxy", config, vec!["-db".into(), "-f".into(), format!("{d}/peer.conf")])
            }
        };
        let path = moat_box::image::which(program).with_context(|| {
            format!("not installed (apt-get install {})", program.replace("nginx", "nginx libnginx-mod-stream"))
        })?;
        std::fs::write(dir.join("peer.conf"), config)?;
        let child = Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .arg(&path)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr"))?)
            .spawn()
            .with_context(|| format!("start {}", path.display()))?;
        let mut running = Running(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = running.0.try_wait()? {
                let said = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
                bail!("{} exited ({status}): {}", self.name(), said.trim());
            }
            let listening = moat_box::host::egress::in_netns(netns, || -> std::io::Result<bool> {
                let up = |port| std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok();
                Ok(up(PLAIN_PORT) && up(PASS_PORT) && up(ENDED_PORT))
            })?;
            if listening {
                return Ok(running);
            }
            if Instant::now() > deadline {
                bail!("{} did not listen within 10 s", self.name());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
