//! The seam between a host's storage and what runs a box on it. A
//! [`Machine`] is one way of running boxes: `ns` runs a box's processes on
//! the host's kernel, `vm` in a guest with a kernel of its own. Both keep a
//! box in a subvolume of the one pool and its processes in a cgroup of the
//! host's; what they share (images, checkpoints, quotas, identity,
//! removal) is done once, over the pool, by [`crate::backend::HostBackend`],
//! which asks the machine only what differs.
//!
//! Every call blocks, and either finishes its work or undoes what it did.

use std::path::PathBuf;

use moat_core::{BackendError, BoxRecord, ChangeSink, Copied};

use crate::pool::PoolError;

/// Work done on a box's subvolume while the machine holds it still.
pub type StillWork<'a> = dyn FnMut() -> Result<(), PoolError> + 'a;

/// One way of running boxes.
pub trait Machine: Send + Sync {
    /// Makes a new box's subvolume from its image, laid out as this machine
    /// runs it (a tree to be the root, or a disk and a mini-root of files).
    /// On error nothing of it is left.
    fn lay_out(&self, rec: &BoxRecord) -> Result<(), BackendError>;

    /// Where moat writes the box's own files (its identity, host name,
    /// `/etc/environment`): the box's root, or a VM box's mini-root.
    fn files(&self, rec: &BoxRecord) -> PathBuf;

    /// Bytes the box's subvolume may hold beyond its disk limit (a VM disk
    /// file's own metadata and the mini-root).
    fn disk_slack(&self) -> u64 {
        0
    }

    /// Boots the box, or resumes its saved machine where there is one; the
    /// host pid of its first process (its PID 1, or its supervisor).
    fn start(&self, rec: &BoxRecord) -> Result<u32, BackendError>;

    /// Where the booted box's agent listens on the host.
    fn agent_socket(&self, rec: &BoxRecord) -> PathBuf;

    /// Whether the box's loopback is the host kernel's (its own network
    /// namespace, as its first process sees it), so moat may connect to its
    /// ports itself.
    fn loopback_on_host(&self) -> bool {
        false
    }

    /// Ends every process of the box; its files stay.
    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError>;

    /// Releases a suspended box's memory: by default its processes end (as
    /// [`Machine::stop`]); a machine that can save them does, and its next
    /// start resumes them.
    fn park(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.stop(rec)
    }

    /// Freezes every process of the box where it stands.
    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError>;

    /// Lets the box's processes run again; a no-op if they are not frozen.
    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError>;

    /// Makes `dst`'s subvolume a snapshot of `src`'s as of one instant (a
    /// running `src` held still for it), and says what else the copy holds.
    /// `dst` gets its identity from the caller afterwards.
    fn copy(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError>;

    /// Runs `work` on the box's subvolume with the box held still and its
    /// files as the box would leave them now (a checkpoint is one instant).
    fn quiesce(&self, rec: &BoxRecord, work: &mut StillWork<'_>) -> Result<(), BackendError>;

    /// What differs in `b`'s files relative to `a`'s (both boxes of this
    /// machine), handed to `out` in batches in tree order; bounded in work
    /// and memory whatever the boxes hold.
    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError>;

    /// Moat changed `paths` (relative to [`Machine::files`]) of a box that
    /// may be running: a machine whose boxes do not see those files directly
    /// hands them over now.
    fn files_changed(&self, _rec: &BoxRecord, _paths: &[&str]) -> Result<(), BackendError> {
        Ok(())
    }

    /// The running box was given to an owner under a new name (a warm box
    /// adopted): it takes that name now, not at its next boot.
    fn adopted(&self, rec: &BoxRecord) -> Result<(), BackendError>;

    /// Tells the running box its disk limit and use (what `df /` shows in
    /// it), where the machine can; best effort, never waiting.
    fn tell_disk(&self, _rec: &BoxRecord) {}
}
