//! Which block of host uid slots each moat state dir on this host uses (see
//! `moat_core::record::SLOTS_PER_BLOCK`), so that two servers never map two
//! boxes onto the same host uids.
//!
//! A host-wide registry holds one file per claimed block, naming the state dir
//! that claimed it; the state dir remembers its block too. A server holds a
//! lock on its block's file for as long as it runs. A block is another's while
//! that server runs or any process runs under the block's uids (its boxes
//! outlive their server); otherwise it is stale and may be taken. A state dir
//! whose block was taken meanwhile moves to a free one: its boxes are not
//! running (or the block would not have been taken), and a box's files do not
//! depend on its uids. Claims are made under a lock on the registry.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use moat_core::record::{SLOTS_PER_BLOCK, SLOT_BLOCKS, UIDS_PER_BOX, UID_BASE};
use nix::fcntl::{Flock, FlockArg};

/// The host-wide registry.
pub const REGISTRY: &str = "/var/lib/moat/uid-blocks";

/// The file in a state dir that remembers its block.
const MINE: &str = "uid-block";

/// A block held for as long as this value lives.
pub struct Claim {
    /// The block.
    pub block: u32,
    _lock: Flock<fs::File>,
}

/// Claims a block for `state_dir`: the one it has, else `preferred` (the block
/// its boxes' slots are in, for a state dir from before blocks), else the
/// lowest free one.
pub fn claim(state_dir: &Path, preferred: Option<u32>) -> Result<Claim> {
    claim_in(Path::new(REGISTRY), state_dir, preferred, &uids_in_use)
}

/// Gives `state_dir`'s block back (at purge).
pub fn release(state_dir: &Path) {
    let registry = Path::new(REGISTRY);
    let (Ok(me), Some(block)) = (fs::canonicalize(state_dir), remembered(state_dir)) else { return };
    if holder(registry, block).as_deref() == Some(me.as_path()) {
        let _ = fs::remove_file(entry(registry, block));
    }
}

fn claim_in(registry: &Path, state_dir: &Path, preferred: Option<u32>, in_use: &dyn Fn(u32) -> bool) -> Result<Claim> {
    fs::create_dir_all(registry).with_context(|| format!("create {}", registry.display()))?;
    let me = fs::canonicalize(state_dir).with_context(|| format!("resolve {}", state_dir.display()))?;
    let lock = fs::File::create(registry.join(".lock")).context("open the uid block registry's lock")?;
    let _registry = Flock::lock(lock, FlockArg::LockExclusive).map_err(|(_, e)| e).context("lock the uid registry")?;
    let free = |block: u32| match holder(registry, block) {
        None => true,
        Some(other) if other == me => true,
        Some(other) => !(remembered(&other) == Some(block) && (locked(registry, block) || in_use(block))),
    };
    let wanted = remembered(state_dir).or(preferred).filter(|b| *b < SLOT_BLOCKS);
    // Blocks nobody ever claimed before stale ones, so a stopped server's block
    // is taken over only when there is no other.
    let block = wanted
        .filter(|b| free(*b))
        .or_else(|| (0..SLOT_BLOCKS).find(|b| holder(registry, *b).is_none()))
        .or_else(|| (0..SLOT_BLOCKS).find(|b| free(*b)));
    let Some(block) = block else {
        bail!("all {SLOT_BLOCKS} host uid blocks are held by running moat servers or their boxes")
    };
    let path = entry(registry, block);
    fs::write(&path, me.as_os_str().as_encoded_bytes()).context("record the uid block")?;
    fs::write(state_dir.join(MINE), format!("{block}\n")).context("remember the uid block")?;
    let file = fs::File::open(&path).context("open the uid block's entry")?;
    let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| e)
        .context("another moat server is running on this state dir")?;
    Ok(Claim { block, _lock: lock })
}

fn entry(registry: &Path, block: u32) -> PathBuf {
    registry.join(block.to_string())
}

/// The state dir the registry says holds `block`.
fn holder(registry: &Path, block: u32) -> Option<PathBuf> {
    let bytes = fs::read(entry(registry, block)).ok()?;
    Some(PathBuf::from(String::from_utf8(bytes).ok()?))
}

/// Whether a running server holds `block`'s entry.
fn locked(registry: &Path, block: u32) -> bool {
    let Ok(file) = fs::File::open(entry(registry, block)) else { return false };
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Ok(probe) => {
            drop(probe);
            false
        }
        Err(_) => true,
    }
}

/// The block `state_dir` says it holds.
fn remembered(state_dir: &Path) -> Option<u32> {
    fs::read_to_string(state_dir.join(MINE)).ok()?.trim().parse().ok()
}

/// Whether any process on the host runs under one of `block`'s uids.
fn uids_in_use(block: u32) -> bool {
    let per_block = u64::from(SLOTS_PER_BLOCK) * u64::from(UIDS_PER_BOX);
    let first = u64::from(UID_BASE) + u64::from(block) * per_block;
    let Ok(procs) = fs::read_dir("/proc") else { return true };
    procs.filter_map(Result::ok).any(|p| {
        let status = fs::read_to_string(p.path().join("status")).unwrap_or_default();
        let uids = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap_or_default();
        uids.split_whitespace().filter_map(|u| u.parse::<u64>().ok()).any(|u| (first..first + per_block).contains(&u))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_dirs_get_distinct_blocks_that_last_and_stale_ones_are_taken_over() {
        let registry = tempfile::tempdir().unwrap();
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let nothing_runs = |_: u32| false;
        let claim = |dir: &Path, preferred| claim_in(registry.path(), dir, preferred, &nothing_runs);
        let first = claim(one.path(), None).unwrap();
        assert_eq!(first.block, 0);
        // A second server on the same state dir is refused while the first runs.
        assert!(claim(one.path(), None).is_err());
        let second = claim(two.path(), None).unwrap();
        assert_eq!(second.block, 1);
        drop((first, second));
        // Restarts keep their blocks.
        assert_eq!(claim(one.path(), None).unwrap().block, 0);
        // A state dir from before blocks whose boxes sit in a running server's
        // block moves to a free one.
        let held = claim(two.path(), None).unwrap();
        let legacy = tempfile::tempdir().unwrap();
        assert_eq!(claim(legacy.path(), Some(1)).unwrap().block, 2);
        drop(held);
        // A block whose server is down and whose uids run nothing is taken over
        // once no block was never claimed; while its boxes run, it is not.
        let others = tempfile::tempdir().unwrap();
        let all: Vec<Claim> = (3..SLOT_BLOCKS)
            .map(|i| {
                let dir = others.path().join(i.to_string());
                fs::create_dir(&dir).unwrap();
                claim(&dir, None).unwrap()
            })
            .collect();
        let late = tempfile::tempdir().unwrap();
        let busy = |b: u32| b == 0;
        assert_eq!(claim_in(registry.path(), late.path(), None, &busy).unwrap().block, 1);
        drop(all);
    }
}
