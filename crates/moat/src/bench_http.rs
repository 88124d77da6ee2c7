//! `moat bench --http`: a box's web URL through the HTTP edge, next to
//! Debian's nginx reverse-proxying the same box port (the peer an operator
//! would set up by hand: nginx in the box's network namespace, TLS with the
//! same certificate, upstream keep-alive), both driven by wrk over loopback:
//!
//! - request latency p50 and p99, one connection, one request at a time;
//! - throughput, 16 connections;
//! - the first byte from a suspended box against a running one (each a new
//!   connection with curl, after the edge let its idle box connection go).
//!
//! Reported against the issue's targets, never asserted: this is not a test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::bench::{ms, Samples};
use crate::bench_fleet_rig::{moat, path, serve, Server};

const DOMAIN: &str = "bench.test";
/// Where nginx listens, in the box's network namespace.
const NGINX_PORT: u16 = 8443;
/// Seconds of each wrk run.
const WRK_SECS: u64 = 5;
/// wrk runs of each side, taking turns; each side's median run is reported
/// (one run of each moved nginx's own figure by 20% from bench to bench).
const WRK_ROUNDS: usize = 3;

/// What runs for the bench; torn down when dropped.
struct HttpRig {
    dir: PathBuf,
    server: Option<Server>,
    nginx: Option<Child>,
}

impl Drop for HttpRig {
    fn drop(&mut self) {
        eprintln!("bench: tearing down");
        if let Some(mut nginx) = self.nginx.take() {
            // SIGTERM: the master ends its workers.
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(nginx.id() as i32), nix::sys::signal::SIGTERM);
            let _ = nginx.wait();
        }
        if let Some(mut server) = self.server.take() {
            server.kill();
            if let Err(e) = crate::purge::run(&server.dir) {
                eprintln!("bench: cannot purge {}: {e:#}", server.dir.display());
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One wrk run's figures.
struct Wrk {
    p50: Duration,
    p99: Duration,
    rps: f64,
}

/// Runs the HTTP benchmark with `runs` runs of the wake measurement.
pub fn run(state_dir: &Path, runs: usize) -> Result<()> {
    for tool in ["nginx", "wrk", "curl", "nsenter"] {
        if Command::new("sh").arg("-c").arg(format!("command -v {tool}")).stdout(Stdio::null()).status()?.code()
            != Some(0)
        {
            bail!("{tool} is not installed (scripts/deps.sh installs nginx-light, wrk and curl)");
        }
    }
    crate::bench_fleet_rig::fresh_state_dir(state_dir)?;
    let mut rig = HttpRig { dir: state_dir.to_path_buf(), server: None, nginx: None };
    let key = state_dir.join("client_key");
    crate::bench::keygen(&key)?;
    let single = state_dir.join("single");
    eprintln!("bench: the busybox image and a server with an HTTP edge");
    moat(&["image", "build", "busybox", "--state-dir", &path(&single)])?;
    let flags = [
        "--listen",
        "127.0.0.1:0",
        "--authorized-keys",
        &path(&key.with_extension("pub")),
        "--http-listen",
        "127.0.0.1:0",
        "--http-domain",
        DOMAIN,
        "--idle-grace",
        "60",
        "--warm-boxes",
        "0",
    ];
    let server = rig.server.insert(serve(single.clone(), &flags)?);
    let edge_port: u16 = server
        .printed
        .iter()
        .find_map(|l| l.strip_prefix("http listening on ")?.rsplit(':').next()?.parse().ok())
        .context("the server printed no HTTP address")?;
    let ssh_port = server.addr.port();
    let ssh = |user: &str, command: &str| -> Result<String> {
        let out = Command::new("ssh")
            .args(["-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no"])
            .args(["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-i"])
            .arg(&key)
            .args(["-p", &ssh_port.to_string(), &format!("{user}@127.0.0.1"), command])
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            bail!("ssh {user} {command}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    ssh("moat", "new web --image busybox")?;
    ssh("web", "mkdir -p /www && head -c 1024 /dev/zero | tr '\\0' x > /www/index.html && (busybox httpd -p 127.0.0.1:8000 -h /www &)")?;
    let exposed = ssh("moat", "expose web 8000 --public")?;
    let url = exposed.split_whitespace().next().context("no URL")?.to_string();
    let host = url.trim_start_matches("https://").trim_end_matches('/').to_string();
    let name = host.split(':').next().unwrap_or_default().to_string();

    // nginx in the box's namespace, with a leaf of the same CA.
    let store = moat_core::Store::open(&single.join("moat.db"))?;
    let pid = store.list(None)?.into_iter().find_map(|b| b.pid).context("the box has no pid")?;
    drop(store);
    let ca = std::fs::read_to_string(single.join("web/ca.pem"))?;
    let ca_key = std::fs::read_to_string(single.join("web/ca.key"))?;
    let (chain, leaf_key) = moat_web::site::issue(DOMAIN, &ca, &ca_key)?;
    let nginx_dir = state_dir.join("nginx");
    std::fs::create_dir(&nginx_dir)?;
    std::fs::write(nginx_dir.join("cert.pem"), chain)?;
    std::fs::write(nginx_dir.join("key.pem"), leaf_key)?;
    let d = path(&nginx_dir);
    std::fs::write(
        nginx_dir.join("nginx.conf"),
        format!(
            "worker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\nevents {{ worker_connections 1024; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             upstream box {{ server 127.0.0.1:8000; keepalive 16; }}\n\
             server {{\n    listen 127.0.0.1:{NGINX_PORT} ssl http2;\n    ssl_certificate {d}/cert.pem;\n    ssl_certificate_key {d}/key.pem;\n\
             location / {{ proxy_pass http://box; proxy_http_version 1.1; proxy_set_header Connection \"\";\n\
             proxy_set_header Host localhost:8000; proxy_set_header X-Forwarded-For $remote_addr;\n\
             proxy_set_header X-Forwarded-Proto https; proxy_set_header X-Forwarded-Host $host; }}\n  }}\n}}\n"
        ),
    )?;
    let netns = format!("--net=/proc/{pid}/ns/net");
    rig.nginx = Some(
        Command::new("nsenter")
            .args([&netns, "nginx", "-c", &format!("{d}/nginx.conf"), "-g", "daemon off;"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start nginx")?,
    );
    std::thread::sleep(Duration::from_millis(500));

    let edge_url = format!("https://127.0.0.1:{edge_port}/");
    let nginx_url = format!("https://127.0.0.1:{NGINX_PORT}/");
    let wrk = |inside: bool, url: &str, connections: usize| -> Result<Wrk> {
        let mut cmd = Command::new(if inside { "nsenter" } else { "wrk" });
        if inside {
            cmd.args([netns.as_str(), "wrk"]);
        }
        cmd.args(["-t", if connections > 1 { "2" } else { "1" }, "-c", &connections.to_string()]).args([
            "-d",
            &format!("{WRK_SECS}s"),
            "--latency",
            "-H",
            &format!("Host: {host}"),
            url,
        ]);
        let out = cmd.stdin(Stdio::null()).output().context("wrk")?;
        parse_wrk(&String::from_utf8_lossy(&out.stdout))
    };
    eprintln!("bench: latency and throughput, {WRK_ROUNDS} runs of {WRK_SECS} s each way, taking turns");
    // Each side's median run (by requests per second) of WRK_ROUNDS, the
    // two sides taking turns so that the machine's drift falls on both.
    let turns = |connections: usize| -> Result<(Wrk, Wrk)> {
        let (mut edge, mut nginx) = (Vec::new(), Vec::new());
        for _ in 0..WRK_ROUNDS {
            edge.push(wrk(false, &edge_url, connections)?);
            nginx.push(wrk(true, &nginx_url, connections)?);
        }
        Ok((median(edge), median(nginx)))
    };
    let (edge_one, nginx_one) = turns(1)?;
    let (edge_many, nginx_many) = turns(16)?;

    eprintln!("bench: first byte from a running and from a suspended box, {runs} times each");
    let first_byte = || -> Result<Duration> {
        // The edge lets its idle connection to the box go after a second.
        std::thread::sleep(Duration::from_millis(1300));
        let out = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{time_starttransfer} %{time_appconnect}", "--cacert"])
            .arg(single.join("web/ca.pem"))
            .args(["--resolve", &format!("{name}:{edge_port}:127.0.0.1"), &format!("https://{host}/")])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut times = text.split_whitespace().filter_map(|t| t.parse::<f64>().ok());
        let (Some(first), Some(tls)) = (times.next(), times.next()) else { bail!("curl: {text}") };
        // From the request sent (TLS done) to its first byte.
        Ok(Duration::from_secs_f64((first - tls).max(0.0)))
    };
    let (mut running, mut suspended) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        running.push(first_byte()?);
        ssh("moat", "suspend web")?;
        suspended.push(first_byte()?);
    }
    let (running, suspended) = (Samples::sorted(running), Samples::sorted(suspended));

    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    println!("\n| measurement | moat edge | nginx | ratio | target |");
    println!("|---|---|---|---|---|");
    let p50 = ratio(edge_one.p50, nginx_one.p50);
    println!(
        "| latency p50, 1 connection | {} | {} | {p50:.2}x | within 1.2x: {} |",
        ms(edge_one.p50),
        ms(nginx_one.p50),
        if p50 <= 1.2 { "met" } else { "not met" }
    );
    println!(
        "| latency p99, 1 connection | {} | {} | {:.2}x | - |",
        ms(edge_one.p99),
        ms(nginx_one.p99),
        ratio(edge_one.p99, nginx_one.p99)
    );
    let tput = edge_many.rps / nginx_many.rps.max(1e-9);
    println!(
        "| throughput, 16 connections | {:.0} req/s | {:.0} req/s | {tput:.2}x | at least 0.9x: {} |",
        edge_many.rps,
        nginx_many.rps,
        if tput >= 0.9 { "met" } else { "not met" }
    );
    let extra = suspended.pct(50).saturating_sub(running.pct(50));
    println!(
        "| first byte, suspended box (p50) | {} | running: {} | +{} | under 20 ms more: {} |",
        ms(suspended.pct(50)),
        ms(running.pct(50)),
        ms(extra),
        if extra < Duration::from_millis(20) { "met" } else { "not met" }
    );
    drop(rig);
    Ok(())
}

/// The run with the median requests per second.
fn median(mut runs: Vec<Wrk>) -> Wrk {
    runs.sort_by(|a, b| a.rps.total_cmp(&b.rps));
    let middle = runs.len() / 2;
    runs.swap_remove(middle)
}

/// p50, p99 and requests per second from wrk's `--latency` report.
fn parse_wrk(out: &str) -> Result<Wrk> {
    let field = |prefix: &str| out.lines().find_map(|l| l.trim().strip_prefix(prefix).map(|r| r.trim().to_string()));
    let duration = |text: String| -> Option<Duration> {
        let (n, unit) = text.split_at(text.find(|c: char| c.is_ascii_alphabetic())?);
        let n: f64 = n.parse().ok()?;
        let scale = match unit {
            "us" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            _ => return None,
        };
        Some(Duration::from_secs_f64(n * scale))
    };
    let (Some(p50), Some(p99), Some(rps)) = (
        field("50%").and_then(duration),
        field("99%").and_then(duration),
        field("Requests/sec:").and_then(|r| r.parse().ok()),
    ) else {
        bail!("wrk said: {out}");
    };
    Ok(Wrk { p50, p99, rps })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrk() {
        let out = "  Latency Distribution\n     50%  412.00us\n     75%  1.02ms\n     90%  2.00ms\n     99%    3.50ms\n  Requests/sec:   2345.67\n";
        let w = parse_wrk(out).unwrap();
        assert_eq!((w.p50, w.p99), (Duration::from_micros(412), Duration::from_micros(3500)));
        assert!((w.rps - 2345.67).abs() < 1e-6);
        assert!(parse_wrk("nothing").is_err());
    }
}
