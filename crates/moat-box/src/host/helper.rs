//! The helper a box is started through: this executable run again with a
//! verb (`box-spawn` for a namespace box, `box-vm` for a VM box's
//! supervisor), its plan as JSON on stdin, the host pid of what it started on
//! stdout.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use moat_core::BackendError;

/// Runs `helper verb` with `plan` on its stdin; the pid it prints.
pub fn run(helper: &Path, verb: &str, plan: &[u8]) -> Result<u32, BackendError> {
    let mut child = Command::new(helper)
        .arg(verb)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| BackendError::new(format!("run {}", helper.display()), e))?;
    if let Some(mut stdin) = child.stdin.take() {
        if let Err(e) = stdin.write_all(plan) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(BackendError::new(format!("send the plan to {verb}"), e));
        }
    }
    let out = child.wait_with_output().map_err(|e| BackendError::new(format!("wait for {verb}"), e))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.trim().parse::<u32>() {
        Ok(pid) if out.status.success() => Ok(pid),
        _ => Err(BackendError::msg(format!("box did not start: {}", String::from_utf8_lossy(&out.stderr).trim()))),
    }
}
