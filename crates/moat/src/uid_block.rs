//! Which blocks of host uid slots each moat state dir on this host uses (see
//! `moat_core::record::SLOTS_PER_BLOCK`), so that two servers never map two
//! boxes onto the same host uids.
//!
//! A host-wide registry holds one file per claimed block, naming the state dir
//! that claimed it; the state dir remembers its blocks too. A server holds a
//! lock on each of its blocks' files for as long as it runs, and claims one
//! more when its boxes fill the ones it has. A block is another's while that
//! server runs or any process runs under the block's uids (its boxes outlive
//! their server); otherwise it is stale and may be taken. Boxes in a block
//! that was taken meanwhile move to a free one: they are not running (or the
//! block would not have been taken), and a box's files do not depend on its
//! uids. Claims are made under a lock on the registry.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use moat_core::record::{SLOTS_PER_BLOCK, SLOT_BLOCKS, UIDS_PER_BOX, UID_BASE};
use nix::fcntl::{Flock, FlockArg};

/// The host-wide registry.
pub const REGISTRY: &str = "/var/lib/moat/uid-blocks";

/// The file in a state dir that remembers its blocks.
const MINE: &str = "uid-block";

/// Blocks held for as long as this value lives.
pub struct Claim {
    registry: PathBuf,
    /// The state dir, resolved.
    me: PathBuf,
    /// Where the state dir remembers its blocks.
    mine: PathBuf,
    in_use: fn(u32) -> bool,
    /// The blocks held, in the order the store hands them out.
    blocks: Vec<u32>,
    /// Boxes to move: from a block lost meanwhile to the one that replaces it.
    moves: Vec<(u32, u32)>,
    _locks: Vec<Flock<fs::File>>,
}

/// Claims blocks for `state_dir`: each of `in_use` (the blocks its boxes'
/// slots are in) it can keep, a free one for each it cannot, or (no boxes)
/// the first block it remembers, else the lowest free one.
pub fn claim(state_dir: &Path, in_use: &[u32]) -> Result<Claim> {
    claim_in(Path::new(REGISTRY), state_dir, in_use, uids_in_use)
}

/// Gives `state_dir`'s blocks back (at purge).
pub fn release(state_dir: &Path) {
    let registry = Path::new(REGISTRY);
    let Ok(me) = fs::canonicalize(state_dir) else { return };
    give_back(registry, &me, remembered(state_dir));
}

/// Removes the registry's entries of `blocks` that name `me`.
fn give_back(registry: &Path, me: &Path, blocks: impl IntoIterator<Item = u32>) {
    for block in blocks {
        if holder(registry, block).as_deref() == Some(me) {
            let _ = fs::remove_file(entry(registry, block));
        }
    }
}

impl Claim {
    /// The blocks held, in the order the store hands them out.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Boxes to move before any runs: `(from, to)`, a block lost meanwhile
    /// and the one that replaces it.
    pub fn moves(&self) -> &[(u32, u32)] {
        &self.moves
    }

    /// Claims one more block (the state dir's boxes fill the ones it holds).
    pub fn grow(&mut self) -> Result<u32> {
        let _registry = lock_registry(&self.registry)?;
        let Some(block) = self.pick(&self.blocks) else { bail!("{}", all_held()) };
        self.take(block)?;
        Ok(block)
    }

    /// A block free for this state dir outside `not`: one nobody ever
    /// claimed first, so a stopped server's block is taken over only when
    /// there is no other. The caller holds the registry's lock.
    fn pick(&self, not: &[u32]) -> Option<u32> {
        let candidates = || (0..SLOT_BLOCKS).filter(|b| !not.contains(b));
        candidates().find(|b| holder(&self.registry, *b).is_none()).or_else(|| candidates().find(|b| self.free(*b)))
    }

    /// Whether `block` is this state dir's to take. The caller holds the
    /// registry's lock.
    fn free(&self, block: u32) -> bool {
        match holder(&self.registry, block) {
            None => true,
            Some(other) if other == self.me => true,
            Some(other) => {
                !(remembered(&other).contains(&block) && (locked(&self.registry, block) || (self.in_use)(block)))
            }
        }
    }

    /// Records and locks `block` as this state dir's. The caller holds the
    /// registry's lock.
    fn take(&mut self, block: u32) -> Result<()> {
        let path = entry(&self.registry, block);
        fs::write(&path, self.me.as_os_str().as_encoded_bytes()).context("record the uid block")?;
        let file = fs::File::open(&path).context("open the uid block's entry")?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| e)
            .context("another moat server is running on this state dir")?;
        self._locks.push(lock);
        self.blocks.push(block);
        let list: String = self.blocks.iter().map(|b| format!("{b}\n")).collect();
        fs::write(&self.mine, list).context("remember the uid blocks")
    }
}

fn claim_in(registry: &Path, state_dir: &Path, in_use: &[u32], in_use_by: fn(u32) -> bool) -> Result<Claim> {
    fs::create_dir_all(registry).with_context(|| format!("create {}", registry.display()))?;
    let me = fs::canonicalize(state_dir).with_context(|| format!("resolve {}", state_dir.display()))?;
    let _registry = lock_registry(registry)?;
    let before = remembered(state_dir);
    let mut claim = Claim {
        registry: registry.to_path_buf(),
        mine: me.join(MINE),
        me,
        in_use: in_use_by,
        blocks: Vec::new(),
        moves: Vec::new(),
        _locks: Vec::new(),
    };
    let mut wanted: Vec<u32> = in_use.iter().copied().filter(|b| *b < SLOT_BLOCKS).collect();
    if wanted.is_empty() {
        wanted.extend(before.first().copied().filter(|b| *b < SLOT_BLOCKS));
    }
    // Blocks the boxes are in stay theirs where they can; a replacement is
    // never one of them, so no box moves onto another's slot.
    let (kept, lost): (Vec<u32>, Vec<u32>) = wanted.iter().partition(|b| claim.free(**b));
    for block in kept {
        claim.take(block)?;
    }
    for from in lost {
        let not: Vec<u32> = wanted.iter().chain(&claim.blocks).copied().collect();
        let Some(to) = claim.pick(&not) else { bail!("{}", all_held()) };
        claim.take(to)?;
        claim.moves.push((from, to));
    }
    if claim.blocks.is_empty() {
        let Some(block) = claim.pick(&[]) else { bail!("{}", all_held()) };
        claim.take(block)?;
    }
    // Blocks remembered but no longer needed go back to the registry.
    give_back(registry, &claim.me, before.into_iter().filter(|b| !claim.blocks.contains(b)));
    Ok(claim)
}

fn lock_registry(registry: &Path) -> Result<Flock<fs::File>> {
    let lock = fs::File::create(registry.join(".lock")).context("open the uid block registry's lock")?;
    Flock::lock(lock, FlockArg::LockExclusive).map_err(|(_, e)| e).context("lock the uid registry")
}

fn all_held() -> String {
    format!("all {SLOT_BLOCKS} host uid blocks are held by running moat servers or their boxes")
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

/// The blocks `state_dir` says it holds (one per line; one alone before
/// a state dir could hold several).
fn remembered(state_dir: &Path) -> Vec<u32> {
    let text = fs::read_to_string(state_dir.join(MINE)).unwrap_or_default();
    text.split_whitespace().filter_map(|b| b.parse().ok()).collect()
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
        let claim = |dir: &Path, in_use: &[u32]| claim_in(registry.path(), dir, in_use, |_| false);
        let first = claim(one.path(), &[]).unwrap();
        assert_eq!((first.blocks(), first.moves()), (&[0][..], &[][..]));
        // A second server on the same state dir is refused while the first runs.
        assert!(claim(one.path(), &[]).is_err());
        let second = claim(two.path(), &[]).unwrap();
        assert_eq!(second.blocks(), [1]);
        drop((first, second));
        // Restarts keep their blocks.
        assert_eq!(claim(one.path(), &[]).unwrap().blocks(), [0]);
        // Boxes in a running server's block move to a free one.
        let held = claim(two.path(), &[]).unwrap();
        let legacy = tempfile::tempdir().unwrap();
        let moved = claim(legacy.path(), &[1]).unwrap();
        assert_eq!((moved.blocks(), moved.moves()), (&[2][..], &[(1, 2)][..]));
        drop((held, moved));
        // A block whose server is down and whose uids run nothing is taken over
        // once no block was never claimed; while its boxes run, it is not.
        let others = tempfile::tempdir().unwrap();
        let all: Vec<Claim> = (3..SLOT_BLOCKS)
            .map(|i| {
                let dir = others.path().join(i.to_string());
                fs::create_dir(&dir).unwrap();
                claim(&dir, &[]).unwrap()
            })
            .collect();
        let late = tempfile::tempdir().unwrap();
        assert_eq!(claim_in(registry.path(), late.path(), &[], |b| b == 0).unwrap().blocks(), [1]);
        drop(all);
    }

    #[test]
    fn a_state_dir_grows_into_more_blocks_and_keeps_them() {
        let registry = tempfile::tempdir().unwrap();
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let claim = |dir: &Path, in_use: &[u32]| claim_in(registry.path(), dir, in_use, |_| false);
        let mut first = claim(one.path(), &[]).unwrap();
        let second = claim(two.path(), &[]).unwrap();
        assert_eq!((first.blocks(), second.blocks()), (&[0][..], &[1][..]));
        // Full: the next block is one nobody holds, and it is remembered.
        assert_eq!(first.grow().unwrap(), 2);
        assert_eq!(first.blocks(), [0, 2]);
        assert_eq!(remembered(one.path()), [0, 2]);
        drop(first);
        // A restart keeps both while boxes are in both.
        let again = claim(one.path(), &[0, 2]).unwrap();
        assert_eq!((again.blocks(), again.moves()), (&[0, 2][..], &[][..]));
        drop(again);
        // Once the second is empty, a restart gives it back to the registry.
        let again = claim(one.path(), &[0]).unwrap();
        assert_eq!(again.blocks(), [0]);
        assert_eq!(holder(registry.path(), 2), None);
        // Blocks of a running server are never grown into.
        let mut again = again;
        assert_eq!(again.grow().unwrap(), 2);
        assert_eq!(again.grow().unwrap(), 3);
        drop(second);
        release(one.path());
    }
}
