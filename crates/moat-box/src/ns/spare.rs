//! Warm spares for `create` and `start`, prepared in the background so that the
//! slow kernel work is off the path a user waits on.
//!
//! - A helper parked in a spare cgroup. Moving a process into a cgroup takes the
//!   cgroup threadgroup lock for writing, which waits for an RCU grace period:
//!   4-20 ms on a cgroup v1 host, once half the cost of creating a box. `start`
//!   renames the spare cgroup to the box's (cheap), writes the box's limits and
//!   hands the helper its plan.
//! - A snapshot of each image in use. A btrfs snapshot commits a transaction
//!   (~2 ms); `create` renames the spare snapshot to the box's root instead.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

use moat_core::{BackendError, BoxId, Limits, Name};

use super::plan::SpawnPlan;
use crate::host::cgroup::CgroupLayout;
use crate::pool::Pool;

/// Names of spare cgroups start with this (box ids are hex, so never do).
pub const PREFIX: &str = "spare-";

/// What a helper prints once it has joined its cgroups.
pub const READY: &str = "ready";

/// A helper waiting, inside its own cgroup, for a plan.
pub struct Spare {
    name: String,
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Spare {
    /// Starts a helper in a new spare cgroup and waits until it has joined it.
    pub fn prepare(cgroups: &CgroupLayout, helper: &Path) -> Result<Self, BackendError> {
        let name = spare_name();
        cgroups.create(&name, &Limits::default()).map_err(|e| BackendError::new("create spare cgroup", e))?;
        let spawned = Command::new(helper)
            .arg("box-spawn")
            .arg("--join")
            .args(cgroups.procs_files(&name))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let _ = cgroups.destroy(&name);
                return Err(BackendError::new(format!("run {}", helper.display()), e));
            }
        };
        let Some(stdout) = child.stdout.take() else {
            return Err(discard(cgroups, &name, child, "no stdout"));
        };
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        if stdout.read_line(&mut line).is_err() || line.trim() != READY {
            return Err(discard(cgroups, &name, child, "helper did not join its cgroup"));
        }
        Ok(Self { name, child, stdout })
    }

    /// Makes the spare's cgroup box `id`'s, with its limits, and starts the box
    /// from `plan`. Returns the host pid of the box's PID 1.
    pub fn launch(
        self,
        cgroups: &CgroupLayout,
        id: &BoxId,
        limits: &Limits,
        plan: &SpawnPlan,
    ) -> Result<u32, BackendError> {
        let Self { name, mut child, mut stdout } = self;
        let handed_over = cgroups
            .rename(&name, id)
            .and_then(|()| cgroups.set_limits(id, limits))
            .and_then(|()| cgroups.set_cpus(id, &plan.cpus))
            .map_err(|e| BackendError::new("take over spare cgroup", e));
        if let Err(e) = handed_over {
            let _ = child.kill();
            let _ = child.wait();
            let _ = cgroups.destroy(&name);
            return Err(e);
        }
        let json = serde_json::to_vec(plan).map_err(|e| BackendError::new("encode spawn plan", e))?;
        if let Some(mut stdin) = child.stdin.take() {
            if let Err(e) = stdin.write_all(&json) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(BackendError::new("send spawn plan", e));
            }
        }
        let mut out = String::new();
        let _ = stdout.read_to_string(&mut out);
        let mut err = String::new();
        if let Some(mut stderr) = child.stderr.take() {
            let _ = stderr.read_to_string(&mut err);
        }
        let status = child.wait().map_err(|e| BackendError::new("wait for box-spawn", e))?;
        match out.trim().parse::<u32>() {
            Ok(pid) if status.success() => Ok(pid),
            _ => Err(BackendError::msg(format!("box did not start: {}", err.trim()))),
        }
    }

    /// Ends the helper and removes its cgroup.
    pub fn discard(self, cgroups: &CgroupLayout) {
        let _ = discard(cgroups, &self.name, self.child, "discarded");
    }
}

fn discard(cgroups: &CgroupLayout, name: &str, mut child: Child, why: &str) -> BackendError {
    let _ = child.kill();
    let _ = child.wait();
    let _ = cgroups.destroy(name);
    BackendError::msg(format!("spare helper: {why}"))
}

/// Removes spare cgroups and spare roots left by a daemon that exited (their
/// helpers end when the daemon does). Another daemon's spares are left
/// alone: destroying one as its owner hands it to a box would freeze that
/// box mid-start, its cgroup renamed under the freezer's feet.
pub fn remove_stale(cgroups: &CgroupLayout, pool: &Pool) {
    for name in cgroups.named_with_prefix(PREFIX) {
        if !owner_alive(&name) {
            let _ = cgroups.destroy(name.as_str());
        }
    }
    for name in pool.boxes_named_with_prefix(PREFIX) {
        let _ = pool.delete_spare_root(&name);
    }
}

/// A fresh snapshot of an image, waiting to become a box's root.
pub struct SpareRoot {
    /// Its subvolume's name under `boxes/`.
    pub name: String,
    /// Which build of the image it was taken from (the image's device number).
    pub image_dev: u64,
}

impl SpareRoot {
    /// Snapshots `image` under a spare name.
    pub fn prepare(pool: &Pool, image: &Name) -> Result<Self, BackendError> {
        let name = spare_name();
        let image_dev = pool
            .snapshot_spare_root(image, &name)
            .map_err(|e| BackendError::new(format!("snapshot image {image}"), e))?;
        Ok(Self { name, image_dev })
    }
}

/// `spare-PID-RANDOM`: the cgroups of every daemon on the host share one
/// parent, so a spare says which daemon owns it.
fn spare_name() -> String {
    let mut id = [0u8; 6];
    let _ = getrandom::fill(&mut id);
    format!("{PREFIX}{}-{}", std::process::id(), hex::encode(id))
}

/// Whether spare `name` belongs to a daemon that still runs (not this one:
/// it has none when it looks).
fn owner_alive(name: &str) -> bool {
    let owner = name.strip_prefix(PREFIX).and_then(|rest| rest.split_once('-')).map(|(pid, _)| pid);
    match owner.and_then(|pid| pid.parse::<u32>().ok()) {
        Some(pid) => pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists(),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_spares_of_daemons_gone_are_stale() {
        assert!(spare_name().starts_with(&format!("{PREFIX}{}-", std::process::id())));
        assert!(!owner_alive(&spare_name()), "this daemon's own spares are its own to clear");
        assert!(owner_alive(&format!("{PREFIX}1-00aa")), "PID 1 runs: its spares are not stale");
        // A pid past the kernel's largest never runs; names of older daemons have none.
        assert!(!owner_alive(&format!("{PREFIX}4194305-00aa")));
        assert!(!owner_alive(&format!("{PREFIX}00aa11bb22cc")));
        assert!(!owner_alive("spare-"));
    }
}
