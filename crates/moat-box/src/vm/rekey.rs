//! A VM copy's own identity in its guest. `dup` mints a copy's identity into
//! the host's mini-root of its files ([`super::files`]), but the guest may
//! have made identity files of its own on its disk (a random seed, host keys
//! from `ssh-keygen -A`), which the host never reads: the copy would keep
//! its parent's. So a copy is marked, and its first run, before its first
//! session (booted afresh, or resumed from its parent's saved machine), asks
//! its guest which of [`identity::BOX_MADE`] it holds, mints new ones for
//! those the mini-root lacks, hands them over, and only then drops the mark.
//! A crash or a failure on the way leaves the mark, so the next run does it
//! again.
//!
//! A resumed copy is the parent's very machine: besides this, its first run
//! sets its clock, reseeds its kernel's random number generator and writes
//! every file of its mini-root (machine-id, host name, the CA) before any
//! session ([`super::machine`]). Processes that came with the machine keep
//! what they read before (a running `sshd` serves the parent's host keys
//! until restarted; a random generator seeded in user space before the copy
//! is its parent's until it reseeds from the kernel).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use moat_core::Name;

use crate::identity;
use crate::vm::files;

/// The mark, in a box's directory (beside its disk, outside its mini-root).
fn mark(box_dir: &Path) -> PathBuf {
    box_dir.join("rekey")
}

/// Marks the copy in `box_dir` as one whose guest is yet to be re-keyed.
pub fn mark_copy(box_dir: &Path) -> io::Result<()> {
    std::fs::write(mark(box_dir), b"")
}

/// Whether the box in `box_dir` is a copy whose guest is yet to be re-keyed.
pub fn pending(box_dir: &Path) -> bool {
    mark(box_dir).exists()
}

/// Re-keys the running guest of the copy in `box_dir` (whose agent is at
/// `socket`, its mini-root `files`), named `name`, and drops the mark.
pub fn finish(box_dir: &Path, socket: &Path, files: &Path, name: &Name, timeout: Duration) -> io::Result<()> {
    let present = files::present(socket, identity::BOX_MADE, timeout)?;
    let held: Vec<&str> =
        identity::BOX_MADE.iter().zip(present).filter(|(_, held)| *held).map(|(rel, _)| *rel).collect();
    let written = identity::mint_held(files, name, &held)?;
    if !written.is_empty() {
        let paths: Vec<&str> = written.iter().map(String::as_str).collect();
        files::push(socket, files, &paths, timeout)?;
    }
    std::fs::remove_file(mark(box_dir))
}
