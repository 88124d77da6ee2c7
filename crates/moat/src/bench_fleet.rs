//! `moat bench --fleet`: what a fleet adds over one host, each next to a peer
//! measured in the same run on this machine (see [`crate::bench_fleet_rig`]
//! for what runs):
//!
//! - `ssh box true` through the front door to a box on node n2, against the
//!   same box through n2's own SSH listener (the single-host path) and
//!   against OpenSSH's ProxyJump through sshd as a bastion to that listener
//!   (how people usually reach a host behind one);
//! - `new` through the front door, and through n2's own listener, against
//!   `new` on a single host (SQLite);
//! - placement: the store's insert of a new box on PostgreSQL (the node's room
//!   checked under a lock, in the transaction that adds the row), called
//!   directly, against the same insert on a single host's SQLite.
//!
//! Runs are interleaved (one of each way in turn), so that a shared
//! machine's load falls on every way alike. Timings are reported against
//! the targets, never asserted: this is not a test.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moat_core::store::nodes::NodeOffer;
use moat_core::{AccountId, BackendKind, Limits, Name, Store};

use crate::bench::{ms, time_command, Samples, BENCH_USER};
use crate::bench_fleet_rig::Rig;

/// Between two `new`s: the time a user takes, in which a node refills its
/// warm box (100 ms after a `new`, then a create).
const PAUSE: Duration = Duration::from_millis(300);

/// Runs the fleet benchmark with `runs` runs of each measurement; prints
/// the table. Everything it started is gone when it returns.
pub fn run(state_dir: &Path, runs: usize) -> Result<()> {
    let pg_dir = PathBuf::from(format!("{}-pg", state_dir.display()));
    for dir in [state_dir, &pg_dir] {
        if dir.exists() {
            bail!(
                "{} is left from an earlier bench that was killed: stop what it started (its `moat serve`s, \
                 `moat front` and PostgreSQL), `moat purge --state-dir` each state dir in it, and remove it",
                dir.display()
            );
        }
    }
    let stop = watch_signals()?;
    let rig = Rig::start(state_dir, &pg_dir, stop)?;
    let measured = measure(&rig, runs.max(1));
    drop(rig);
    let m = measured?;
    let rows = [
        Row::new("`ssh box true` through the front door (box on n2)", &m.fleet_ssh, NODE_SSH, &m.node_ssh),
        Row::new("`ssh -J bastion box@n2 true` (OpenSSH ProxyJump, sshd)", &m.jump_ssh, NODE_SSH, &m.node_ssh),
        Row::new("`new` through the front door (placed by the router)", &m.fleet_new, SINGLE_NEW, &m.single_new),
        Row::new("`new` through n2's own listener (PostgreSQL, no hop)", &m.node_new, SINGLE_NEW, &m.single_new),
        Row::new(
            "placement: a new box's insert transaction on PostgreSQL (node's room checked)",
            &m.placement,
            "the same insert on a single host's SQLite",
            &m.placement_sqlite,
        ),
    ];
    print!("{}", render(runs, &rows));
    let p50s = P50s {
        fleet_ssh: m.fleet_ssh.pct(50),
        node_ssh: m.node_ssh.pct(50),
        jump_ssh: m.jump_ssh.pct(50),
        placement: m.placement.pct(50),
        fleet_new: m.fleet_new.pct(50),
        single_new: m.single_new.pct(50),
    };
    print!("\n{}", render_verdicts(&verdicts(&p50s)));
    Ok(())
}

const NODE_SSH: &str = "the same box through n2's own listener (one host's path)";
const SINGLE_NEW: &str = "`new` on a single host (SQLite)";

/// Every measurement, sorted.
struct Measured {
    fleet_ssh: Samples,
    node_ssh: Samples,
    jump_ssh: Samples,
    fleet_new: Samples,
    node_new: Samples,
    single_new: Samples,
    placement: Samples,
    placement_sqlite: Samples,
}

fn measure(rig: &Rig, n: usize) -> Result<Measured> {
    let front = rig.front.as_ref().context("no front door")?.addr;
    let node = rig.nodes.get(1).context("no node n2")?.addr;
    let single = rig.single.as_ref().context("no single host")?.addr;
    let (_, bastion) = rig.bastion.as_ref().context("no bastion")?;
    let made = output(ssh_to(rig, front, None, &["new", "fbox", "--node", "n2", "--image", "busybox"]))?;
    if made.trim() != "fbox" {
        bail!("new fbox --node n2 printed {made:?}");
    }

    eprintln!("bench: `ssh box true`, {n} times each way: the front door, n2's own listener, ProxyJump");
    let jump = format!("{BENCH_USER}@127.0.0.1:{bastion}");
    let ways = |way: usize| match way {
        0 => ssh_to(rig, front, Some("fbox"), &["true"]),
        1 => ssh_to(rig, node, Some("fbox"), &["true"]),
        _ => {
            let mut cmd = rig.ssh();
            cmd.args(["-J", &jump, "-p", &node.port().to_string(), &format!("fbox@{}", node.ip()), "true"]);
            cmd
        }
    };
    let [fleet_ssh, node_ssh, jump_ssh] = interleaved(rig, n, 1, |way, _| timed(|| ways(way)))?;

    eprintln!("bench: `new` (then `rm`), {n} times each way: the front door, n2's own listener, a single host");
    let hosts = [front, node, single];
    let [fleet_new, node_new, single_new] = interleaved(rig, n, 2, |way, i| {
        std::thread::sleep(PAUSE);
        let name = format!("{}{i}", ["f", "n", "s"][way]);
        let took = timed(|| ssh_to(rig, hosts[way], None, &["new", &name, "--image", "busybox"]))?;
        output(ssh_to(rig, hosts[way], None, &["rm", &name]))?;
        Ok(took)
    })?;

    eprintln!("bench: placement, {n} inserts on PostgreSQL and on SQLite");
    let (placement, placement_sqlite) = placement(rig, n)?;
    Ok(Measured { fleet_ssh, node_ssh, jump_ssh, fleet_new, node_new, single_new, placement, placement_sqlite })
}

/// `warmup` untimed rounds, then `n` timed ones, each round one run of every
/// way in turn (`run(way, round)`).
fn interleaved<const W: usize>(
    rig: &Rig,
    n: usize,
    warmup: usize,
    mut run: impl FnMut(usize, usize) -> Result<Duration>,
) -> Result<[Samples; W]> {
    let mut taken: [Vec<Duration>; W] = std::array::from_fn(|_| Vec::with_capacity(n));
    for round in 0..warmup + n {
        for (way, out) in taken.iter_mut().enumerate() {
            rig.check_stop()?;
            let took = run(way, round)?;
            if round >= warmup {
                out.push(took);
            }
        }
    }
    Ok(taken.map(Samples::sorted))
}

/// The store's insert of a new box, called directly as a node's manager
/// calls it: on PostgreSQL as a live node (lock, the node's room, a slot, the
/// row and its policy, in one transaction; a database of its own on the
/// fleet's cluster, so that no router places a real box on that node), and
/// on a single host's SQLite. The boxes stay, so each insert finds the ones
/// before it.
fn placement(rig: &Rig, n: usize) -> Result<(Samples, Samples)> {
    let pg = rig.pg.as_ref().context("no PostgreSQL")?;
    let offer = NodeOffer {
        name: "p1".into(),
        address: "127.0.0.1:9".into(),
        cpus: 1 << 16,
        memory: 1 << 50,
        disk: 1 << 50,
        max_boxes: n as u32 + 1,
    };
    let on_pg = Store::connect(&pg.create_db("placement")?)?.for_node(&offer.name);
    let on_sqlite = Store::open(&rig.dir.join("placement.db"))?;
    let account = AccountId("bench".into());
    let image = Name::new("busybox")?;
    let made = (&image, Limits::default(), BackendKind::Ns);
    let policy = moat_core::policy::Policy::default();
    let stores = [&on_pg, &on_sqlite];
    let [pg, sqlite] = interleaved(rig, n, 1, |way, i| {
        if way == 0 {
            // Kept live (not timed): a lapsed node takes no boxes.
            on_pg.renew_lease(&offer)?;
        }
        let name = Name::new(&format!("p{i}"))?;
        let t = Instant::now();
        stores[way].insert_new(&account, &name, made, moat_core::clock::now_ms(), &policy)?;
        Ok(t.elapsed())
    })?;
    Ok((pg, sqlite))
}

/// `ssh -F CONFIG -p PORT [user@]IP ARGS` as the bench's client.
pub(crate) fn ssh_to(rig: &Rig, addr: SocketAddr, user: Option<&str>, args: &[&str]) -> Command {
    let mut cmd = rig.ssh();
    cmd.args(["-p", &addr.port().to_string()]);
    cmd.arg(match user {
        Some(user) => format!("{user}@{}", addr.ip()),
        None => addr.ip().to_string(),
    });
    cmd.args(args);
    cmd
}

/// How long the command `make` makes takes, run as `moat bench` runs its
/// clients; if it fails, run again to say why.
fn timed(mut make: impl FnMut() -> Command) -> Result<Duration> {
    time_command(&mut make()).map_err(|e| match output(make()) {
        Ok(_) => e,
        Err(why) => why.context(e),
    })
}

/// Runs `cmd`; its stdout, or why it failed.
pub(crate) fn output(mut cmd: Command) -> Result<String> {
    let out = cmd.stdin(std::process::Stdio::null()).output()?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A flag set by SIGINT, SIGTERM or SIGHUP, which no longer kill the bench
/// (it stops between two runs and tears down; the rig's servers are in
/// process groups of their own, so a Ctrl-C at the terminal reaches only the
/// bench and the client it is timing).
pub(crate) fn watch_signals() -> Result<Arc<AtomicBool>> {
    use tokio::signal::unix::{signal, SignalKind};
    let stop = Arc::new(AtomicBool::new(false));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (mut int, mut term, mut hup) = {
        let _in = runtime.enter();
        (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?, signal(SignalKind::hangup())?)
    };
    let flag = Arc::clone(&stop);
    std::thread::spawn(move || {
        runtime.block_on(async move {
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                    _ = hup.recv() => {}
                }
                if !flag.swap(true, Ordering::Relaxed) {
                    eprintln!("bench: interrupted: stopping after this run, then tearing down");
                }
            }
        })
    });
    Ok(stop)
}

/// One line of the table: a measurement and its peer.
struct Row {
    what: String,
    ours: Samples,
    peer: String,
    theirs: Samples,
}

impl Row {
    fn new(what: &str, ours: &Samples, peer: &str, theirs: &Samples) -> Row {
        Row { what: what.into(), ours: ours.clone(), peer: peer.into(), theirs: theirs.clone() }
    }
}

/// `a - b` in milliseconds (negative when `a` is faster).
fn added_ms(a: Duration, b: Duration) -> f64 {
    (a.as_secs_f64() - b.as_secs_f64()) * 1e3
}

/// The table, in Markdown, as `moat bench` prints its own.
fn render(runs: usize, rows: &[Row]) -> String {
    let mut out = format!(
        "| measurement ({runs} runs) | p50 | p95 | peer | peer p50 | peer p95 | added (p50) | ratio (p50) |\n\
         |---|---|---|---|---|---|---|---|\n"
    );
    for Row { what, ours, peer, theirs } in rows {
        let (a, b) = (ours.pct(50), theirs.pct(50));
        out += &format!(
            "| {what} | {} | {} | {peer} | {} | {} | {:+.2} ms | {:.2}x |\n",
            ms(a),
            ms(ours.pct(95)),
            ms(b),
            ms(theirs.pct(95)),
            added_ms(a, b),
            a.as_secs_f64() / b.as_secs_f64()
        );
    }
    out
}

/// The p50s the issue sets targets on.
struct P50s {
    fleet_ssh: Duration,
    node_ssh: Duration,
    jump_ssh: Duration,
    placement: Duration,
    fleet_new: Duration,
    single_new: Duration,
}

/// A target, what was measured against it, and whether it was met.
#[derive(Debug, PartialEq)]
struct Verdict {
    target: &'static str,
    measured: String,
    met: bool,
}

/// The targets for a fleet.
fn verdicts(p: &P50s) -> Vec<Verdict> {
    let added = added_ms(p.fleet_ssh, p.node_ssh);
    let jump_hop = added_ms(p.jump_ssh, p.node_ssh);
    let new_ratio = p.fleet_new.as_secs_f64() / p.single_new.as_secs_f64();
    vec![
        Verdict {
            target: "the front door adds under 2 ms to `ssh box true` (p50)",
            measured: format!("{added:+.2} ms"),
            met: added < 2.0,
        },
        Verdict {
            target: "the front door's hop under 0.5x the ProxyJump hop (p50)",
            measured: format!("{added:+.2} ms against {jump_hop:+.2} ms: {:.3}x", added / jump_hop),
            met: jump_hop > 0.0 && added < 0.5 * jump_hop,
        },
        Verdict {
            target: "placement transaction p50 under 5 ms",
            measured: ms(p.placement),
            met: p.placement < Duration::from_millis(5),
        },
        Verdict {
            target: "`new` through the fleet within 1.2x of a single host (p50)",
            measured: format!("{} against {}: {new_ratio:.2}x", ms(p.fleet_new), ms(p.single_new)),
            met: new_ratio <= 1.2,
        },
    ]
}

fn render_verdicts(verdicts: &[Verdict]) -> String {
    let mut out = String::from("Targets (reported, not enforced):\n");
    for v in verdicts {
        out += &format!("- {}: {}: {}\n", v.target, v.measured, if v.met { "met" } else { "NOT met" });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn millis(v: &[f64]) -> Samples {
        Samples::sorted(v.iter().map(|m| Duration::from_secs_f64(m / 1e3)).collect())
    }

    #[test]
    fn percentiles_pick_the_sample_at_len_times_p() {
        let s = millis(&(1..=40).rev().map(f64::from).collect::<Vec<_>>());
        assert_eq!(s.pct(50), Duration::from_millis(21));
        assert_eq!(s.pct(95), Duration::from_millis(39));
        assert_eq!(s.pct(100), Duration::from_millis(40));
        assert_eq!(millis(&[]).pct(50), Duration::ZERO);
    }

    #[test]
    fn a_row_shows_both_sides_what_was_added_and_the_ratio() {
        let row = Row::new("fleet", &millis(&[12.0, 10.0, 30.0]), "one host", &millis(&[8.0, 9.0, 20.0]));
        let table = render(3, &[row]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(lines[0].starts_with("| measurement (3 runs) | p50 |"));
        assert_eq!(lines[2], "| fleet | 12.00 ms | 30.00 ms | one host | 9.00 ms | 20.00 ms | +3.00 ms | 1.33x |");
    }

    fn p50s(fleet_ssh: f64, node_ssh: f64, jump_ssh: f64, placement: f64, fleet_new: f64, single_new: f64) -> P50s {
        let d = |m: f64| Duration::from_secs_f64(m / 1e3);
        P50s {
            fleet_ssh: d(fleet_ssh),
            node_ssh: d(node_ssh),
            jump_ssh: d(jump_ssh),
            placement: d(placement),
            fleet_new: d(fleet_new),
            single_new: d(single_new),
        }
    }

    fn met(p: &P50s) -> Vec<bool> {
        verdicts(p).iter().map(|v| v.met).collect()
    }

    #[test]
    fn targets_are_met_below_their_bounds() {
        assert_eq!(met(&p50s(16.5, 15.0, 150.0, 2.0, 30.0, 26.0)), [true, true, true, true]);
        let text = render_verdicts(&verdicts(&p50s(16.5, 15.0, 150.0, 2.0, 30.0, 26.0)));
        assert!(text.contains("adds under 2 ms to `ssh box true` (p50): +1.50 ms: met\n"), "{text}");
        assert!(text.contains("+1.50 ms against +135.00 ms: 0.011x: met\n"), "{text}");
    }

    #[test]
    fn targets_are_missed_past_their_bounds() {
        // 2.5 ms added; against a 4 ms ProxyJump hop that is over half.
        assert_eq!(met(&p50s(17.5, 15.0, 19.0, 5.5, 32.0, 26.0)), [false, false, false, false]);
        // A ProxyJump no slower than the direct path: no hop to be under half of.
        assert!(!met(&p50s(15.0, 15.0, 15.0, 1.0, 1.0, 1.0))[1]);
        let text = render_verdicts(&verdicts(&p50s(17.5, 15.0, 19.0, 5.5, 32.0, 26.0)));
        assert!(text.contains("placement transaction p50 under 5 ms: 5.50 ms: NOT met\n"), "{text}");
        assert!(text.contains("32.00 ms against 26.00 ms: 1.23x: NOT met\n"), "{text}");
    }
}
