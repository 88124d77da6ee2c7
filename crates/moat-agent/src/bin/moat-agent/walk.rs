//! `Walk`: the guest's root file system listed for the host, which never
//! reads a guest's disk itself (for `diff` of VM boxes). Every entry under
//! `/` in tree order (a directory before what it holds, names byte-wise
//! sorted within one), without following links or entering other mounts,
//! as records in `Stdout` frames (see [`moat_agent::walk`]), then
//! `Exit(0)`.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

use moat_agent::protocol::{AgentMsg, ExitStatus};
use moat_agent::walk;

use crate::frames;

/// Frames of about this many bytes of records.
const FRAME: usize = 64 << 10;
/// Deepest nesting listed.
const MAX_DEPTH: usize = 256;

/// Lists `/` to `stream`.
pub fn run(stream: &UnixStream) -> io::Result<()> {
    let dev = std::fs::symlink_metadata("/")?.dev();
    let mut out = Vec::with_capacity(FRAME);
    let walked = dir(Path::new("/"), dev, 0, &mut out, stream);
    if !out.is_empty() {
        frames::send(stream, &AgentMsg::Stdout(std::mem::take(&mut out)))?;
    }
    match walked {
        Ok(()) => frames::send(stream, &AgentMsg::Exit(ExitStatus::Code(0))),
        Err(e) => frames::send(stream, &AgentMsg::Error(format!("list the root: {e}"))),
    }
}

fn dir(path: &Path, dev: u64, depth: usize, out: &mut Vec<u8>, stream: &UnixStream) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::other(format!("{}: nested deeper than {MAX_DEPTH}", path.display())));
    }
    let mut names: Vec<std::ffi::OsString> = match std::fs::read_dir(path) {
        Ok(entries) => entries.filter_map(Result::ok).map(|e| e.file_name()).collect(),
        // Gone, or not readable: listed as it stands, nothing below it.
        Err(_) => return Ok(()),
    };
    names.sort();
    for name in names {
        let child = path.join(&name);
        let Ok(meta) = std::fs::symlink_metadata(&child) else { continue };
        let target = if meta.file_type().is_symlink() { std::fs::read_link(&child).ok() } else { None };
        let entry = walk::Entry {
            kind: meta.mode() & libc::S_IFMT,
            mode: meta.mode() & 0o7777,
            uid: meta.uid(),
            gid: meta.gid(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: Some((meta.ctime(), meta.ctime_nsec())),
            rdev: meta.rdev(),
        };
        walk::encode(child.as_os_str(), &entry, target.as_ref().map(|t| t.as_os_str()), out);
        if out.len() >= FRAME {
            frames::send(stream, &AgentMsg::Stdout(std::mem::take(out)))?;
        }
        if meta.is_dir() && meta.dev() == dev {
            dir(&child, dev, depth + 1, out, stream)?;
        }
    }
    Ok(())
}
