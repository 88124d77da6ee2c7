//! The `btrfs send` and `btrfs receive` processes (btrfs-progs: the stream
//! format is theirs, so are its reader and writer), and a subvolume's
//! generation, which tells whether a box changed since its last snapshot.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::{io_err, DurableError};

/// Starts `btrfs send` of read-only `snapshot` (an incremental against
/// `parent` if given), its stream on stdout.
pub fn send(snapshot: &Path, parent: Option<&Path>) -> Result<Child, DurableError> {
    let mut cmd = Command::new("btrfs");
    cmd.args(["send", "-q"]);
    if let Some(parent) = parent {
        cmd.arg("-p").arg(parent);
    }
    cmd.arg(snapshot).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.spawn().map_err(io_err("start btrfs send"))
}

/// Starts `btrfs receive` into `dir`, the stream on its stdin; it stops at
/// the stream's end marker.
pub fn receive(dir: &Path) -> Result<Child, DurableError> {
    Command::new("btrfs")
        .args(["receive", "-q", "-e"])
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err("start btrfs receive"))
}

/// Waits for `child`; an error carrying its stderr if it failed.
pub fn finish(mut child: Child, what: &str) -> Result<(), DurableError> {
    let mut err = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = stderr.read_to_string(&mut err);
    }
    let status = child.wait().map_err(io_err(format!("wait for {what}")))?;
    if status.success() {
        return Ok(());
    }
    Err(DurableError::Io {
        what: format!("{what} failed ({status}): {}", err.trim()),
        source: std::io::Error::other("btrfs"),
    })
}

/// A subvolume's generation (the newest transaction that changed it) and
/// its generation at creation, once writes so far are committed (a write
/// counts only from its transaction's commit, up to 30 s later).
pub fn generations(path: &Path) -> Result<(u64, u64), DurableError> {
    let _ = Command::new("btrfs").args(["filesystem", "sync"]).arg(path).stdout(Stdio::null()).status();
    let out = Command::new("btrfs")
        .args(["subvolume", "show"])
        .arg(path)
        .stderr(Stdio::null())
        .output()
        .map_err(io_err("run btrfs subvolume show"))?;
    parse_generations(&String::from_utf8_lossy(&out.stdout)).ok_or_else(|| DurableError::Io {
        what: format!("read the generation of {}", path.display()),
        source: std::io::Error::other(String::from_utf8_lossy(&out.stdout).into_owned()),
    })
}

fn parse_generations(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        text.lines().find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().parse::<u64>())).and_then(Result::ok)
    };
    Some((field("Generation:")?, field("Gen at creation:")?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn generations_parse_from_subvolume_show() {
        let text = "r\n\tName: \t\t\tr\n\tGeneration: \t\t10\n\tGen at creation: \t7\n\tParent ID: \t\t5\n";
        assert_eq!(super::parse_generations(text), Some((10, 7)));
        assert_eq!(super::parse_generations("Generation: x\n"), None);
    }
}
