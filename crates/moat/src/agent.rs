//! The in-box agent: embedded in this binary at build time (see build.rs),
//! written out once per content under the state directory, and checked to be
//! static before any box gets it.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest as _, Sha256};

/// The static agent built with this binary.
pub static EMBEDDED: &[u8] = include_bytes!(env!("MOAT_EMBEDDED_AGENT"));

/// The agent to use: `explicit` (a flag) or `$MOAT_AGENT` if given, else the
/// embedded one written under `state_dir`. Refuses one that is not static.
pub fn resolve(explicit: Option<&Path>, state_dir: &Path) -> Result<PathBuf> {
    let path = match explicit.map(Path::to_path_buf).or_else(|| std::env::var_os("MOAT_AGENT").map(PathBuf::from)) {
        Some(path) => path,
        None => install_embedded(state_dir)?,
    };
    let bytes = std::fs::read(&path).with_context(|| format!("read the agent {}", path.display()))?;
    check_static(&bytes).with_context(|| format!("{} cannot be a box's agent", path.display()))?;
    Ok(path)
}

/// Writes the embedded agent to `STATE/agent/HASH/moat-agent` unless it is
/// there. (The file keeps its name: a box's `ps` shows PID 1 by it.)
fn install_embedded(state_dir: &Path) -> Result<PathBuf> {
    let hash = hex::encode(Sha256::digest(EMBEDDED));
    let top = state_dir.join("agent");
    let dir = top.join(hash.get(..16).unwrap_or(&hash));
    let path = dir.join("moat-agent");
    if std::fs::read(&path).is_ok_and(|b| b == EMBEDDED) {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o700))?;
    // Written beside and renamed: a box starting meanwhile never sees half a file.
    let tmp = dir.join(format!(".moat-agent-{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o755).open(&tmp)?;
    file.write_all(EMBEDDED)?;
    file.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("install {}", path.display()))?;
    Ok(path)
}

/// Fails unless `elf` is a static x86-64 ELF executable: one with a program
/// interpreter (a dynamic loader) cannot run in an image without libc.
pub fn check_static(elf: &[u8]) -> Result<()> {
    let field = |at: usize, len: usize| -> Option<u64> {
        let bytes = elf.get(at..at + len)?;
        Some(bytes.iter().rev().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    };
    if elf.get(..4) != Some(b"\x7fELF") || elf.get(4) != Some(&2) {
        bail!("not a 64-bit ELF executable");
    }
    let (phoff, phentsize, phnum) = match (field(0x20, 8), field(0x36, 2), field(0x38, 2)) {
        (Some(off), Some(size), Some(num)) => (off, size, num),
        _ => bail!("truncated ELF header"),
    };
    for i in 0..phnum {
        let at = usize::try_from(phoff + i * phentsize).context("bad program header offset")?;
        const PT_INTERP: u64 = 3;
        match field(at, 4) {
            Some(PT_INTERP) => bail!(
                "it is dynamically linked; build moat with `cargo build` (which embeds a static agent) or \
                 scripts/build.sh, or pass a static agent with --agent"
            ),
            Some(_) => {}
            None => bail!("truncated program headers"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_agent_is_static_and_this_binary_is_not() {
        assert!(check_static(EMBEDDED).is_ok());
        let me = std::fs::read("/proc/self/exe").unwrap_or_default();
        assert!(check_static(&me).is_err(), "the test binary is dynamic");
        assert!(check_static(b"#!/bin/sh\n").is_err());
        assert!(check_static(&EMBEDDED[..40]).is_err());
    }
}
