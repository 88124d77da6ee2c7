//! A guest's root disk: an image's tree as an ext4 file system in a raw file,
//! made by `mkfs.ext4 -d` without mounting anything. The host never mounts a
//! guest's disk: a file system a guest wrote is hostile input to the host's
//! kernel. (Made from moat's own image trees, which only moat wrote.)

use std::io;
use std::path::Path;
use std::process::Command;

/// Room left free beyond the tree's own bytes.
const SLACK: u64 = 64 << 20;

/// Writes `tree` as an ext4 file system into the raw file `out`.
pub fn ext4_image(tree: &Path, out: &Path) -> io::Result<()> {
    let size = tree_bytes(tree)? + SLACK;
    let mib = size.div_ceil(1 << 20);
    let _ = std::fs::remove_file(out);
    let made = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "moat-root", "-d"])
        .arg(tree)
        .arg(out)
        .arg(format!("{mib}M"))
        .output()?;
    if made.status.success() {
        Ok(())
    } else {
        let _ = std::fs::remove_file(out);
        Err(io::Error::other(format!("mkfs.ext4: {}", String::from_utf8_lossy(&made.stderr).trim())))
    }
}

/// The bytes the regular files under `tree` hold (links not followed).
fn tree_bytes(tree: &Path) -> io::Result<u64> {
    let mut total = 0u64;
    let mut dirs = vec![tree.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                dirs.push(entry.path());
            } else {
                total = total.saturating_add(meta.len());
            }
        }
    }
    Ok(total)
}
