//! Cold create under load (`moat bench`, issue 29 part 4): a burst of `new`s
//! at once (20 by default), each timed from its request to `true` having run
//! in the box, next to the same number of bubblewrap sandboxes started at
//! once. A burst drains the warm pool after its first box, so most of these
//! are made on demand while the others are being made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use moat_core::{AccountId, BoxManager, BoxSpec, Name};

use crate::bench::{bwrap_true, run_true, time_command, Samples};

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
