//! Which block of host uid slots each moat state dir on this host uses (see
//! `moat_core::record::SLOTS_PER_BLOCK`), so that two servers never map two
//! boxes onto the same host uids.
//!
//! A host-wide registry holds one file per claimed block, naming the state dir
//! that claimed it; the state dir remembers its block too. A claim stands
//! while both agree, across restarts and while the server is down (its boxes
//! may still be running). A block whose state dir is gone, or names another
//! block, is free again. Claims are made under a lock on the registry.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use moat_core::record::SLOT_BLOCKS;
use nix::fcntl::{Flock, FlockArg};

/// The host-wide registry.
pub const REGISTRY: &str = "/var/lib/moat/uid-blocks";

/// The file in a state dir that remembers its block.
const MINE: &str = "uid-block";

/// The block `state_dir` uses: the one it has, else `preferred` (the block its
/// boxes' slots are in, for a state dir from before blocks), else the lowest
/// free one.
pub fn claim(state_dir: &Path, preferred: Option<u32>) -> Result<u32> {
    claim_in(Path::new(REGISTRY), state_dir, preferred)
}

/// Gives `state_dir`'s block back (at purge).
pub fn release(state_dir: &Path) {
    let registry = Path::new(REGISTRY);
    let (Ok(me), Some(block)) = (fs::canonicalize(state_dir), remembered(state_dir)) else { return };
    if holder(registry, block).as_deref() == Some(me.as_path()) {
        let _ = fs::remove_file(entry(registry, block));
    }
}

fn claim_in(registry: &Path, state_dir: &Path, preferred: Option<u32>) -> Result<u32> {
    fs::create_dir_all(registry).with_context(|| format!("create {}", registry.display()))?;
    let me = fs::canonicalize(state_dir).with_context(|| format!("resolve {}", state_dir.display()))?;
    let lock = fs::File::create(registry.join(".lock")).context("open the uid block registry's lock")?;
    let _lock =
        Flock::lock(lock, FlockArg::LockExclusive).map_err(|(_, e)| e).context("lock the uid block registry")?;
    let held_by_other = |block: u32| -> Option<PathBuf> {
        holder(registry, block).filter(|other| *other != me && remembered(other) == Some(block))
    };
    let block = match remembered(state_dir).or(preferred) {
        Some(block) if block >= SLOT_BLOCKS => bail!("{}: uid block {block} does not exist", me.display()),
        Some(block) => {
            if let Some(other) = held_by_other(block) {
                bail!(
                    "this state dir's boxes use host uid block {block}, which the moat state dir {} holds; two \
                     servers must not share host uids (stop one, or purge it)",
                    other.display()
                );
            }
            block
        }
        None => match (0..SLOT_BLOCKS).find(|b| held_by_other(*b).is_none()) {
            Some(block) => block,
            None => bail!("all {SLOT_BLOCKS} host uid blocks are held by other moat state dirs"),
        },
    };
    fs::write(entry(registry, block), me.as_os_str().as_encoded_bytes()).context("record the uid block")?;
    fs::write(state_dir.join(MINE), format!("{block}\n")).context("remember the uid block")?;
    Ok(block)
}

fn entry(registry: &Path, block: u32) -> PathBuf {
    registry.join(block.to_string())
}

/// The state dir the registry says holds `block`.
fn holder(registry: &Path, block: u32) -> Option<PathBuf> {
    match fs::read(entry(registry, block)) {
        Ok(bytes) => Some(PathBuf::from(std::ffi::OsString::from(String::from_utf8(bytes).ok()?))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(_) => None,
    }
}

/// The block `state_dir` says it holds.
fn remembered(state_dir: &Path) -> Option<u32> {
    fs::read_to_string(state_dir.join(MINE)).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_dirs_get_distinct_blocks_that_last() {
        let registry = tempfile::tempdir().unwrap();
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let claim = |dir: &Path, preferred| claim_in(registry.path(), dir, preferred);
        assert_eq!(claim(one.path(), None).unwrap(), 0);
        assert_eq!(claim(two.path(), None).unwrap(), 1);
        // Restarts keep their blocks.
        assert_eq!(claim(one.path(), None).unwrap(), 0);
        assert_eq!(claim(two.path(), None).unwrap(), 1);
        // A state dir from before blocks whose boxes sit in a held block is refused.
        let legacy = tempfile::tempdir().unwrap();
        let err = claim(legacy.path(), Some(0)).unwrap_err().to_string();
        assert!(err.contains("two servers must not share host uids"), "{err}");
        // A block whose state dir is gone is free again.
        let gone = one.path().to_path_buf();
        drop(one);
        assert!(!gone.exists());
        assert_eq!(claim(legacy.path(), Some(0)).unwrap(), 0);
    }
}
