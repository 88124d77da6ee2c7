//! Tooling for the network namespaces boxes live in: the host's `ip` and
//! `nft`, fed a script on stdin, run in the caller's namespace.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Applies `routes` (an `ip -batch` script) and then `rules` (an `nft`
/// ruleset) to the caller's network namespace.
pub fn configure(routes: &str, rules: &str) -> io::Result<()> {
    run(&tool("ip")?, &["-batch", "-"], routes)?;
    run(&tool("nft")?, &["-f", "-"], rules)
}

/// Where a system tool is.
pub fn tool(name: &str) -> io::Result<PathBuf> {
    crate::image::which(name)
        .ok_or_else(|| io::Error::other(format!("{name} not found: install iproute2 and nftables")))
}

/// Runs `tool` with `args` and `input` on its stdin, in the caller's
/// network namespace; its stderr is the error.
pub fn run(tool: &Path, args: &[&str], input: &str) -> io::Result<()> {
    let mut child = Command::new(tool)
        .args(args)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| io::Error::other(format!("run {}: {e}", tool.display())))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(io::Error::other(format!("{}: {}", tool.display(), err.trim())));
    }
    Ok(())
}
