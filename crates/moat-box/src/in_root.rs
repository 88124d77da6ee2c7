//! Reading and writing a box's files from the host without ever leaving the
//! box's tree: every path is resolved inside the root (`RESOLVE_IN_ROOT`), a
//! final symlink is replaced or not followed, and reads are bounded and never
//! block on a FIFO. A box's root is hostile: it may be full of links aimed at
//! the host.

// Reads what a box or its QEMU sends, as root: it cannot panic.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]

use std::io::{self, Write};
use std::os::fd::OwnedFd;

use nix::errno::Errno;
use nix::fcntl::{openat, openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use nix::unistd::{unlinkat, UnlinkatFlags};

/// The directory `rel` is in, resolved inside `root`, and `rel`'s last part.
fn parent_in_root<'a>(root: &OwnedFd, rel: &'a str) -> io::Result<(OwnedFd, &'a str)> {
    let (parent, name) = rel.rsplit_once('/').unwrap_or((".", rel));
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    Ok((openat2(root, parent, how).map_err(context(rel))?, name))
}

/// An error about `rel`, keeping the kernel's kind.
fn context(rel: &str) -> impl Fn(nix::Error) -> io::Error + '_ {
    move |e| io::Error::new(io::Error::from(e).kind(), format!("{rel}: {e}"))
}

/// Whether `rel` names something (not following a final symlink) inside `root`.
pub(crate) fn exists_in_root(root: &OwnedFd, rel: &str) -> bool {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    openat2(root, rel, how).is_ok()
}

/// Replaces `rel` (relative to `root`) with a new file holding `data`, never
/// leaving `root`: the parent is resolved inside the root, and whatever stood at
/// `rel` (a symlink included) is unlinked, not followed.
pub(crate) fn write_in_root(root: &OwnedFd, rel: &str, data: &[u8], mode: u32) -> io::Result<()> {
    let context = context(rel);
    let (dir, file) = parent_in_root(root, rel)?;
    match unlinkat(&dir, file, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(context(e)),
    }
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = openat(&dir, file, flags, Mode::from_bits_truncate(mode)).map_err(context)?;
    std::fs::File::from(fd).write_all(data)
}

/// Makes the directory `rel` inside `root` if it is not there.
pub(crate) fn dir_in_root(root: &OwnedFd, rel: &str) -> io::Result<()> {
    let context = context(rel);
    let (dir, name) = parent_in_root(root, rel)?;
    match nix::sys::stat::mkdirat(&dir, name, Mode::from_bits_truncate(0o755)) {
        Ok(()) | Err(Errno::EEXIST) => Ok(()),
        Err(e) => Err(context(e)),
    }
}

/// Makes every directory above `rel` inside `root` that is not there.
pub(crate) fn parents_in_root(root: &OwnedFd, rel: &str) -> io::Result<()> {
    let mut at = 0;
    while let Some(slash) = rel.get(at..).and_then(|rest| rest.find('/')) {
        at += slash;
        dir_in_root(root, rel.get(..at).unwrap_or_default())?;
        at += 1;
    }
    Ok(())
}

/// What `rel` (resolved inside `root`, symlinks included) holds, if it is a
/// regular file; larger than `max` bytes is an error.
pub(crate) fn read_in_root(root: &OwnedFd, rel: &str, max: u64) -> io::Result<Option<Vec<u8>>> {
    // Non-blocking, so that a FIFO planted there cannot stall the host.
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = match openat2(root, rel, how) {
        Ok(fd) => fd,
        Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => return Ok(None),
        Err(e) => return Err(context(rel)(e)),
    };
    let file = std::fs::File::from(fd);
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Ok(None);
    }
    if meta.len() > max {
        return Err(io::Error::other(format!("{rel}: larger than {max} bytes")));
    }
    let mut data = Vec::with_capacity(meta.len() as usize);
    io::Read::read_to_end(&mut io::Read::take(file, max + 1), &mut data)?;
    if data.len() as u64 > max {
        return Err(io::Error::other(format!("{rel}: larger than {max} bytes")));
    }
    Ok(Some(data))
}
