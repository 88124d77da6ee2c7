//! A guest's root disk: an image's tree as an ext4 file system in a raw file,
//! made by `mkfs.ext4 -d` without mounting anything. The host never mounts a
//! guest's disk: a file system a guest wrote is hostile input to the host's
//! kernel. The tree may be a template a box wrote: it is walked without
//! following links and sized by the blocks its files hold (a sparse file's
//! holes stay holes: `mkfs.ext4 -d` copies data only).

use std::io;
use std::path::Path;
use std::process::Command;

/// Room left free beyond the tree's own bytes.
const SLACK: u64 = 64 << 20;

/// Bytes of disk per inode, as mke2fs's defaults for a disk of some size.
const BYTES_PER_INODE: u64 = 16 << 10;

/// The file system's block: every file and directory takes whole ones.
const BLOCK: u64 = 4096;

/// The size of an inode (`-I`): the inode tables take this per inode.
const INODE: u64 = 256;

/// The journal mke2fs makes for a file system below 16 GiB, at most.
const JOURNAL: u64 = 64 << 20;

/// Writes `tree` as an ext4 file system into the raw file `out`, unless
/// it would be larger than `at_most` (then nothing is written).
///
/// The file system is laid out as for a large disk (4 KiB blocks, 256-byte
/// inodes), not as mke2fs would for a small one (1 KiB blocks): a box's disk
/// grows it to many GiB, and growing one of 1 KiB blocks to 16 GiB took
/// a TCG guest ~1.5 s. It has inodes for the tree twice over at least
/// (growing adds more in proportion).
pub fn ext4_image(tree: &Path, out: &Path, at_most: u64) -> io::Result<()> {
    let (bytes, entries) = tree_size(tree)?;
    let inodes = (bytes.saturating_add(SLACK) / BYTES_PER_INODE).max(entries.saturating_mul(2).saturating_add(4096));
    // The tree in whole blocks, the inode tables, the journal, and the
    // groups' bitmaps and descriptors (well under 1/32 of the rest).
    let size = bytes.saturating_add(inodes.saturating_mul(INODE)).saturating_add(JOURNAL + SLACK);
    let size = size.saturating_add(size / 32);
    if size > at_most {
        return Err(io::Error::other(format!(
            "the image takes {} as a disk, more than the box's disk limit of {}",
            moat_core::limits::format_size(size),
            moat_core::limits::format_size(at_most)
        )));
    }
    let _ = std::fs::remove_file(out);
    let made = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-T", "default", "-b", "4096", "-I", "256", "-L", "moat-root"])
        .arg("-N")
        .arg(inodes.to_string())
        .arg("-d")
        .arg(tree)
        .arg(out)
        .arg(format!("{}M", size.div_ceil(1 << 20)))
        .output();
    finished("mkfs.ext4", made).inspect_err(|_| {
        let _ = std::fs::remove_file(out);
    })
}

/// Grows the file system in the raw file `disk` to fill it. Only for a disk
/// no guest has written yet (a new box's copy of its image's): `resize2fs`
/// reads the file system in userspace, but moat runs it on its own output only.
pub fn grow(disk: &Path) -> io::Result<()> {
    finished("resize2fs", Command::new("resize2fs").arg(disk).output())
}

fn finished(program: &str, output: io::Result<std::process::Output>) -> io::Result<()> {
    let output = output.map_err(|e| io::Error::new(e.kind(), format!("{program}: {e}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!("{program}: {}", String::from_utf8_lossy(&output.stderr).trim())))
    }
}

/// The bytes the entries under `tree` take on the guest's disk, each in
/// whole blocks (links not followed, a file's holes not counted), and how
/// many entries it has.
fn tree_size(tree: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut entries) = (0u64, 0u64);
    let mut dirs = vec![tree.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            entries = entries.saturating_add(1);
            if meta.is_dir() {
                dirs.push(entry.path());
            }
            // A directory's entries, a symlink's target (inline if short) and
            // a file's data, rounded up: a tree of many small files takes
            // many times its bytes. A sparse file takes what it holds (its
            // 512-byte blocks), not its length.
            let held = meta.len().min(meta.blocks().saturating_mul(512));
            bytes = bytes.saturating_add(held.div_ceil(BLOCK).max(1).saturating_mul(BLOCK));
        }
    }
    Ok((bytes, entries))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_of_many_small_files_fits() {
        // 30000 one-byte files hold 30 KB and take 117 MiB of 4 KiB blocks,
        // beyond what their bytes and the slack would make room for.
        let tree = tempfile::tempdir().unwrap();
        for d in 0..30 {
            let dir = tree.path().join(format!("d{d}"));
            std::fs::create_dir(&dir).unwrap();
            for f in 0..1000 {
                std::fs::write(dir.join(format!("f{f}")), b"x").unwrap();
            }
        }
        let out = tempfile::tempdir().unwrap();
        let disk = out.path().join("disk.raw");
        ext4_image(tree.path(), &disk, u64::MAX).unwrap();
        assert!(disk.metadata().unwrap().len() > 117 << 20);
    }

    #[test]
    fn sparse_files_take_what_they_hold_and_a_limit_is_kept() {
        // Two files of the largest length a file can have: neither an
        // overflow nor a disk of their length.
        let tree = tempfile::tempdir().unwrap();
        for name in ["a", "b"] {
            let f = std::fs::File::create(tree.path().join(name)).unwrap();
            f.set_len(i64::MAX as u64).or_else(|_| f.set_len(1 << 40)).unwrap();
        }
        let out = tempfile::tempdir().unwrap();
        let disk = out.path().join("disk.raw");
        ext4_image(tree.path(), &disk, 1 << 30).unwrap();
        assert!(disk.metadata().unwrap().len() < 1 << 30);
        // A tree larger than the limit: refused before anything is written.
        std::fs::write(tree.path().join("data"), vec![1u8; 4 << 20]).unwrap();
        let small = out.path().join("small.raw");
        let refused = ext4_image(tree.path(), &small, 100 << 20).unwrap_err();
        assert!(refused.to_string().contains("more than the box's disk limit of"), "{refused}");
        assert!(!small.exists());
    }
}
