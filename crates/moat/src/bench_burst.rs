//! Cold create under load (`moat bench`, issue 29 part 4): a burst of `new`s
//! at once (20 by default), each timed from its request to `true` having run
//! in the box, next to the same number of bubblewrap sandboxes started at
//! once. A burst drains the warm pool after its first box, so most of these
//! are made on demand while the others are being made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use moat_core::{AccountId, BoxManager, BoxSpec, Name};

use crate::bench::{busybox, bwrap_true, ms, run_true, time_command, wait_warm, Samples};

/// `moat bench --bursts`: `rounds` bursts of `size` busybox creates, each
/// after a quiet second (a warm box ready, the spares below it made again),
/// and as many bursts of bwraps; one table of every create's time, the p95s
/// side by side.
pub async fn rounds(manager: &Arc<BoxManager>, rounds: usize, size: usize) -> Result<()> {
    let account = AccountId("bench".into());
    let image = Name::new("busybox")?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        eprintln!("bench: burst {}/{rounds}: {size} creates at once, then {size} bwraps at once", round + 1);
        wait_warm(manager, &image).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        ours.push(moat(manager, &account, size, |i| busybox(&format!("burst{round}-{i}"))).await?);
        theirs.push(tokio::task::spawn_blocking(move || bwrap(size)).await??);
    }
    println!("| burst of {size} ({rounds} rounds) | p50 | p95 | max | bwrap p50 | p95 | max | ratio (p95) |");
    println!("|---|---|---|---|---|---|---|---|");
    let line = |what: &str, a: &Samples, b: &Samples| {
        let ratio = a.pct(95).as_secs_f64() / b.pct(95).as_secs_f64();
        println!(
            "| {what} | {} | {} | {} | {} | {} | {} | {ratio:.2}x |",
            ms(a.pct(50)),
            ms(a.pct(95)),
            ms(a.pct(100)),
            ms(b.pct(50)),
            ms(b.pct(95)),
            ms(b.pct(100))
        );
    };
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        line(&format!("round {}", i + 1), a, b);
    }
    let all = |rounds: &[Samples]| Samples::sorted(rounds.iter().flat_map(|s| s.iter()).collect());
    let (a, b) = (all(&ours), all(&theirs));
    line("all rounds", &a, &b);
    let ratio = a.pct(95).as_secs_f64() / b.pct(95).as_secs_f64();
    let met = if ratio <= 3.0 { "met" } else { "**not met**" };
    println!("\nbursts of {size}: p95 {ratio:.2}x bubblewrap's burst p95 (target: at most 3x: {met})");
    Ok(())
}

/// A burst of `size` creates at once, with boxes made by `spec(i)`; each
/// one's time to `true`. The boxes are removed afterwards.
pub async fn moat(
    manager: &Arc<BoxManager>,
    account: &AccountId,
    size: usize,
    spec: impl Fn(usize) -> Result<BoxSpec>,
) -> Result<Samples> {
    let specs = (0..size).map(&spec).collect::<Result<Vec<_>>>()?;
    let names: Vec<Name> = specs.iter().map(|s| s.name.clone()).collect();
    // Spawned first, awaited after: they run at once.
    let runs: Vec<_> = specs
        .into_iter()
        .map(|spec| {
            let (manager, account) = (Arc::clone(manager), account.clone());
            tokio::spawn(async move {
                let name = spec.name.clone();
                let t = Instant::now();
                manager.create(&account, spec, Box::new(|_: &str| {})).await?;
                let (handle, _session) = manager.open_session(&account, &name).await?;
                run_true(&handle.agent).await?;
                anyhow::Ok(t.elapsed())
            })
        })
        .collect();
    let mut joined = Vec::with_capacity(runs.len());
    for run in runs {
        joined.push(run.await);
    }
    for name in &names {
        let _ = manager.remove(account, name).await;
    }
    let times = joined.into_iter().map(|r| r.context("a create of the burst panicked")?).collect::<Result<_>>()?;
    Ok(Samples::sorted(times))
}

/// The same burst of bubblewrap sandboxes running `true`, each timed from
/// its spawn to its exit.
pub fn bwrap(size: usize) -> Result<Samples> {
    let runs: Vec<std::thread::JoinHandle<Result<Duration>>> =
        (0..size).map(|_| std::thread::spawn(|| time_command(&mut bwrap_true()))).collect();
    let times = runs
        .into_iter()
        .map(|r| r.join().map_err(|_| anyhow::anyhow!("a bwrap thread panicked"))?)
        .collect::<Result<_>>()?;
    Ok(Samples::sorted(times))
}
