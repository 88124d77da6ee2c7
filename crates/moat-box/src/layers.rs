//! Layers of pulled images in the pool: each a read-only subvolume under
//! `layers/`, named by its chain id (the hex of it), made as a writable
//! snapshot of its parent that the unpacker applies the layer onto, and
//! sealed read-only only once that worked. An image is a read-only snapshot
//! of its top layer under `images/` (O(1)); a box of it, a snapshot of that.
//! A layer being made is `layers/.partial-HEX` until sealed: a pull cut short
//! leaves only those, which the next pull (or a restart) removes.

use std::fs;
use std::path::PathBuf;

use moat_core::Name;

use crate::pool::{io_err, Pool, PoolError};
use crate::sys;

const PARTIAL: &str = ".partial-";

fn checked(hex: &str) -> Result<&str, PoolError> {
    let ok = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    ok.then_some(hex).ok_or(PoolError::Unsupported("a layer's name must be 64 hex digits"))
}

/// Where layers are kept.
pub fn dir(pool: &Pool) -> PathBuf {
    pool.root().join("layers")
}

/// Where blobs are written while they are fetched and checked (never kept).
pub fn blobs_dir(pool: &Pool) -> PathBuf {
    pool.root().join("blobs")
}

/// Whether layer `chain` is made and sealed.
pub fn has(pool: &Pool, chain: &str) -> bool {
    checked(chain).is_ok_and(|c| dir(pool).join(c).is_dir())
}

/// Starts layer `chain` as a writable snapshot of layer `parent` (or empty,
/// for a base layer); returns the tree to unpack into.
pub fn begin(pool: &Pool, parent: Option<&str>, chain: &str) -> Result<PathBuf, PoolError> {
    let layers = dir(pool);
    fs::create_dir_all(&layers).map_err(io_err("create", &layers))?;
    let name = format!("{PARTIAL}{}", checked(chain)?);
    let path = layers.join(&name);
    if path.exists() {
        sys::subvolume_delete(&layers, &name).map_err(io_err("delete subvolume", &path))?;
    }
    match parent {
        Some(parent) => {
            let src = layers.join(checked(parent)?);
            sys::subvolume_snapshot(&src, &layers, &name, false).map_err(io_err("snapshot", &src))?;
        }
        None => sys::subvolume_create(&layers, &name).map_err(io_err("create subvolume", &path))?,
    }
    Ok(path)
}

/// Seals layer `chain` read-only under its name.
pub fn seal(pool: &Pool, chain: &str) -> Result<(), PoolError> {
    let layers = dir(pool);
    let name = format!("{PARTIAL}{}", checked(chain)?);
    let path = layers.join(&name);
    let result = sys::subvolume_snapshot(&path, &layers, chain, true).map_err(io_err("snapshot", &path));
    abort(pool, chain);
    result
}

/// Throws away layer `chain` being made, if it is.
pub fn abort(pool: &Pool, chain: &str) {
    let layers = dir(pool);
    let name = format!("{PARTIAL}{chain}");
    if checked(chain).is_ok() && layers.join(&name).exists() {
        if let Err(e) = sys::subvolume_delete(&layers, &name) {
            tracing::warn!(chain, error = %e, "cannot remove a layer cut short");
        }
    }
}

/// Directories a box's start mounts over or writes into: an image that
/// lacks one gets it, empty (one that has it as anything else is refused
/// when a box of it starts).
const MOUNT_POINTS: &[&str] = &["proc", "sys", "dev", "run", "tmp", "etc", "root"];

/// Makes image `key`: a snapshot of layer `top` (an empty tree for an image
/// of no layers) with the directories a box needs, sealed read-only. An
/// image already there is kept.
pub fn make_image(pool: &Pool, key: &Name, top: Option<&str>) -> Result<(), PoolError> {
    let images = pool.images_dir();
    if pool.has_image(key) {
        return Ok(());
    }
    let scratch = format!(".pulled-{key}");
    let path = images.join(&scratch);
    if path.exists() {
        sys::subvolume_delete(&images, &scratch).map_err(io_err("delete subvolume", &path))?;
    }
    match top {
        Some(top) => {
            let src = dir(pool).join(checked(top)?);
            sys::subvolume_snapshot(&src, &images, &scratch, false).map_err(io_err("snapshot", &src))?;
        }
        None => sys::subvolume_create(&images, &scratch).map_err(io_err("create subvolume", &path))?,
    }
    let result = add_mount_points(&path)
        .map_err(io_err("make mount points in", &path))
        .and_then(|()| sys::subvolume_snapshot(&path, &images, key.as_str(), true).map_err(io_err("snapshot", &path)));
    let _ = sys::subvolume_delete(&images, &scratch);
    result
}

fn add_mount_points(tree: &std::path::Path) -> std::io::Result<()> {
    use nix::sys::stat::Mode;
    let root = nix::fcntl::open(tree, nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC, Mode::empty())?;
    for dir in MOUNT_POINTS {
        // One name in the tree's own directory: nothing is resolved, nothing followed.
        match nix::sys::stat::fstatat(&root, *dir, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(nix::errno::Errno::ENOENT) => {
                let mode = if *dir == "tmp" { 0o1777 } else { 0o755 };
                nix::sys::stat::mkdirat(&root, *dir, Mode::from_bits_truncate(mode))?;
                if *dir == "tmp" {
                    nix::sys::stat::fchmodat(
                        &root,
                        *dir,
                        Mode::from_bits_truncate(0o1777),
                        nix::sys::stat::FchmodatFlags::FollowSymlink,
                    )?;
                }
            }
            Err(e) => return Err(e.into()),
            Ok(_) => {}
        }
    }
    Ok(())
}

/// Removes layer `chain`; images and boxes made from it keep their snapshots.
pub fn remove(pool: &Pool, chain: &str) -> Result<(), PoolError> {
    let layers = dir(pool);
    let path = layers.join(checked(chain)?);
    if !path.exists() {
        return Ok(());
    }
    sys::subvolume_delete(&layers, chain).map_err(io_err("delete subvolume", &path))
}

/// The sealed layers.
pub fn list(pool: &Pool) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir(pool)) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| checked(n).is_ok())
        .collect()
}

/// Removes what pulls cut short left: layers being made, blobs being fetched.
pub fn clean_partials(pool: &Pool) {
    let layers = dir(pool);
    if let Ok(entries) = fs::read_dir(&layers) {
        for name in entries.filter_map(Result::ok).filter_map(|e| e.file_name().into_string().ok()) {
            if let Some(chain) = name.strip_prefix(PARTIAL) {
                abort(pool, chain);
            }
        }
    }
    let _ = fs::remove_dir_all(blobs_dir(pool));
}

/// Whether image `key`'s /etc/passwd has a line for user `name` (read
/// inside the image's tree, at most 4 MiB: the image is hostile).
pub fn has_user(pool: &Pool, key: &Name, name: &str) -> bool {
    let Ok(root) = fs::File::open(pool.image_path(key)) else { return false };
    let root: std::os::fd::OwnedFd = root.into();
    let Ok(Some(passwd)) = crate::in_root::read_in_root(&root, "etc/passwd", 4 << 20) else { return false };
    String::from_utf8_lossy(&passwd).lines().any(|line| line.split(':').next() == Some(name))
}
