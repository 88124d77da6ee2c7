//! `moat bench --node-loss`: a node is lost (`kill -9`) while it holds a
//! suspended box of 1 GiB, and the bench times how long until `ssh box true`
//! through the front door answers again, now from the other node. The
//! fleet is [`crate::bench_fleet_rig`]'s, its nodes keeping boxes durable in
//! a real SeaweedFS on loopback, with `--node-grace` [`GRACE_SECS`].
//!
//! The peer is the floor the design sets: nothing may take a lost node's
//! boxes before its lease lapses (at least `LEASE - LEASE_RENEW` after the
//! kill: it was renewed at most that long before) and the grace passes (a
//! node that is only slow must not find its boxes taken). The rest is moat's: noticing,
//! fetching the box from the object store, receiving it, the first session.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::bench_durable::Weed;
use crate::bench_fleet::{output, ssh_to, watch_signals};
use crate::bench_fleet_rig::{path, Rig};

/// The grace the nodes are started with.
const GRACE_SECS: u64 = 20;
/// The box's size.
const BOX_MIB: u64 = 1024;

/// Runs it with its scratch dirs beside `state_dir`.
pub fn run(state_dir: &Path) -> Result<()> {
    let pg_dir = PathBuf::from(format!("{}-pg", state_dir.display()));
    let weed_dir = PathBuf::from(format!("{}-s3", state_dir.display()));
    for dir in [state_dir, &pg_dir, &weed_dir] {
        if dir.exists() {
            bail!("{} is left from an earlier bench that was killed: remove it (see `moat bench --fleet`)", path(dir));
        }
    }
    let stop = watch_signals()?;
    let result = (|| {
        let s3 = Weed::start(&weed_dir)?;
        s3.create_bucket("loss")?;
        let creds = PathBuf::from(format!("{}-s3.env", state_dir.display()));
        std::fs::write(&creds, "AWS_ACCESS_KEY_ID=any\nAWS_SECRET_ACCESS_KEY=any\n")?;
        let grace = GRACE_SECS.to_string();
        let endpoint = s3.endpoint();
        let flags = [
            "--object-store",
            "s3://loss/bench",
            "--s3-endpoint",
            &endpoint,
            "--s3-credentials",
            &path(&creds),
            "--node-grace",
            &grace,
            "--upload-interval",
            "3600",
        ];
        let rig = Rig::start_with(state_dir, &pg_dir, stop, &flags)?;
        let measured = measure(&rig);
        drop(rig);
        let _ = std::fs::remove_file(&creds);
        measured
    })();
    let _ = std::fs::remove_dir_all(&weed_dir);
    let m = result?;
    // The lease was renewed at most LEASE_RENEW before the kill.
    let floor = moat_core::manager::LEASE - moat_core::manager::LEASE_RENEW + Duration::from_secs(GRACE_SECS);
    println!(
        "\n{:<58} {:>10}  {:<48} {:>10} {:>7}  target",
        "node loss (a suspended box of 1 GiB)", "moat", "peer", "peer", "ratio"
    );
    println!(
        "{:<58} {:>9.1}s  {:<48} {:>9.1}s {:>6.2}x  under 60 s, grace included",
        "kill -9 of its node to `ssh box true` answering elsewhere",
        m.answered.as_secs_f64(),
        format!("the floor: lease left + --node-grace {GRACE_SECS}"),
        floor.as_secs_f64(),
        m.answered.as_secs_f64() / floor.as_secs_f64(),
    );
    println!(
        "\nof which: the receive on the other node {:.1} s ({} MiB fetched); the rest is noticing (the mover's \
         rounds) and the first session",
        m.received.as_secs_f64(),
        m.fetched_bytes >> 20
    );
    Ok(())
}

struct Measured {
    answered: Duration,
    received: Duration,
    fetched_bytes: u64,
}

fn measure(rig: &Rig) -> Result<Measured> {
    let front = rig.front.as_ref().context("no front door")?.addr;
    output(ssh_to(rig, front, None, &["new", "big", "--node", "n1", "--image", "busybox"]))?;
    eprintln!("bench: writing {BOX_MIB} MiB of random data into box big on n1");
    let fill = format!("dd if=/dev/urandom of=/root/data bs=1M count={BOX_MIB} 2>/dev/null; sync");
    output(ssh_to(rig, front, Some("big"), &[&fill]))?;
    let written = moat_core::clock::now_ms();
    output(ssh_to(rig, front, None, &["suspend", "big"]))?;
    eprintln!("bench: waiting for its upload");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        rig.check_stop()?;
        let info = info(rig, front)?;
        let durable = &info["durable"];
        if durable["as_of_ms"].as_u64().is_some_and(|t| t > written) && durable["pending"] == false {
            break;
        }
        if Instant::now() > deadline {
            bail!("box big was not made durable within 10 minutes: {durable}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }

    eprintln!("bench: kill -9 of node n1; timing until `ssh big true` answers from n2");
    let n1 = rig.nodes.first().context("no node n1")?;
    let lost = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(n1.pid() as i32), nix::sys::signal::Signal::SIGKILL)?;
    let answered = loop {
        rig.check_stop()?;
        let mut ssh = ssh_to(rig, front, Some("big"), &["true"]);
        if ssh.stdin(std::process::Stdio::null()).output()?.status.success() {
            break lost.elapsed();
        }
        if lost.elapsed() > Duration::from_secs(600) {
            bail!("box big did not answer within 10 minutes of its node's loss");
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let info = info(rig, front)?;
    if info["node"] != "n2" {
        bail!("box big answered, but from node {} (not n2)", info["node"]);
    }
    let (received, fetched_bytes) = received_in_log(&rig.nodes[1].dir.with_extension("log"))?;
    Ok(Measured { answered, received, fetched_bytes })
}

/// `info big --json` through the front door at `front`.
fn info(rig: &Rig, front: std::net::SocketAddr) -> Result<serde_json::Value> {
    Ok(serde_json::from_str(&output(ssh_to(rig, front, None, &["info", "big", "--json"]))?)?)
}

/// How long node n2 took to receive the box, and how much it fetched, from
/// its log's `box received` line.
fn received_in_log(log: &Path) -> Result<(Duration, u64)> {
    let text = std::fs::read_to_string(log)?;
    let line = text
        .lines()
        .map(crate::bench::without_colours)
        .find(|l| l.contains("box received"))
        .with_context(|| format!("no `box received` in {}", path(log)))?;
    let field = |name: &str| -> Option<u64> {
        let at = line.find(&format!(" {name}="))? + name.len() + 2;
        line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    Ok((Duration::from_millis(field("took_ms").unwrap_or_default()), field("fetched_bytes").unwrap_or_default()))
}
