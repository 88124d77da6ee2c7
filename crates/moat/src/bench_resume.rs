//! The resume tail (`moat bench`, issue 29): enough suspend/resume cycles of
//! one box (500 by default) to tell whether a tail exists, each split where
//! its time goes, next to the same session on a box that stayed running:
//!
//! - host: `open_session`, all on the host (the gateway's sockets, the
//!   counters read and the cgroup thawed, the meter's sample and the state
//!   written in one commit);
//! - box: from there to the first byte of `echo x` (the agent's exec).
//!
//! The slowest cycles are printed with their split, so a tail names its side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use moat_core::{AccountId, BoxManager, BoxSpec, Name};

use crate::bench::{first_byte, ms, Samples};

/// One session's time, split where it went.
#[derive(Clone, Copy)]
struct Cycle {
    host: Duration,
    agent: Duration,
}

impl Cycle {
    fn total(&self) -> Duration {
        self.host + self.agent
    }
}

/// What `runs` cycles of each kind measured.
pub struct ResumeSamples {
    resumed: Vec<Cycle>,
    running: Vec<Cycle>,
}

impl ResumeSamples {
    /// A suspended box's session to its first byte (the bench's main row).
    pub fn resumed(&self) -> Samples {
        Samples::sorted(self.resumed.iter().map(Cycle::total).collect())
    }

    /// The same on a running box.
    pub fn running(&self) -> Samples {
        Samples::sorted(self.running.iter().map(Cycle::total).collect())
    }
}

/// Runs `runs` cycles on a box made from `spec`: a session on it while it
/// runs, then one right after `suspend`, alternately.
pub async fn samples(
    manager: &Arc<BoxManager>,
    account: &AccountId,
    spec: BoxSpec,
    runs: usize,
) -> Result<ResumeSamples> {
    let name: Name = spec.name.clone();
    manager.create(account, spec, Box::new(|_: &str| {})).await?;
    let mut out = ResumeSamples { resumed: Vec::with_capacity(runs), running: Vec::with_capacity(runs) };
    for _ in 0..runs {
        for suspend_first in [false, true] {
            if suspend_first {
                manager.suspend(account, &name).await?;
            }
            let t = Instant::now();
            let (box_handle, _session) = manager.open_session(account, &name).await?;
            let host = t.elapsed();
            first_byte(&box_handle.agent, "echo x").await?;
            let cycle = Cycle { host, agent: t.elapsed() - host };
            if suspend_first { &mut out.resumed } else { &mut out.running }.push(cycle);
        }
    }
    manager.remove(account, &name).await?;
    Ok(out)
}

/// Prints the tail table and the slowest resumes, split.
pub fn print(s: &ResumeSamples) {
    let runs = s.resumed.len();
    println!();
    println!("| resume tail ({runs} runs each) | p50 | p95 | p99 | max |");
    println!("|---|---|---|---|---|");
    let row = |what: &str, cycles: &[Cycle], part: fn(&Cycle) -> Duration| {
        let all = Samples::sorted(cycles.iter().map(part).collect());
        let max = all.pct(100);
        println!("| {what} | {} | {} | {} | {} |", ms(all.pct(50)), ms(all.pct(95)), ms(all.pct(99)), ms(max));
    };
    row("suspended box: session + first byte", &s.resumed, Cycle::total);
    row("  of which host (sockets, thaw, meter, store)", &s.resumed, |c| c.host);
    row("  of which box (exec to first byte)", &s.resumed, |c| c.agent);
    row("running box: session + first byte (peer)", &s.running, Cycle::total);
    row("  of which host", &s.running, |c| c.host);
    row("  of which box", &s.running, |c| c.agent);
    let p99 = s.resumed().pct(99).as_secs_f64() * 1e3;
    println!("\nresume p99 {p99:.2} ms (target: under 10 ms: {})", if p99 < 10.0 { "met" } else { "**not met**" });
    let mut slowest = s.resumed.clone();
    slowest.sort_by_key(|c| std::cmp::Reverse(c.total()));
    let split: Vec<String> = slowest
        .iter()
        .take(5)
        .map(|c| format!("{} (host {}, box {})", ms(c.total()), ms(c.host), ms(c.agent)))
        .collect();
    println!("slowest resumes: {}", split.join("; "));
}
