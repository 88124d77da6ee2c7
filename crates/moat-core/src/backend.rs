//! The trait every isolation backend implements. The namespace backend and the
//! microVM backend differ in how they isolate; above this line nothing cares.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::ids::{AccountId, BoxId, Name};
use crate::record::BoxRecord;

pub use crate::record::BackendKind;

/// Where a box's agent listens for the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentAddr {
    /// A unix socket on the host (namespace backend).
    Unix(PathBuf),
}

/// Where a booted box's network attaches on the host: the egress gateway puts
/// its listeners there, and a VM's tap device lives there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetAttach {
    /// A network namespace, by a path that opens it.
    Netns(PathBuf),
}

/// A booted box as its backend reaches it. Only the privileged side holds
/// one; it turns `agent` into a connected stream for the front door.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoxHandle {
    /// Host pid of its PID 1 (for the VM backend, the VMM's).
    pub pid: u32,
    /// Where its agent listens.
    pub agent: AgentAddr,
    /// Where its network attaches.
    pub network: NetAttach,
    /// The private key (PEM file) of the TLS CA the box trusts, with which the
    /// gateway signs what it shows the box where it looks inside HTTPS.
    /// `None` for a box made before boxes had one.
    pub ca_key: Option<std::path::PathBuf>,
}

/// How a path differs between two boxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeKind {
    /// Only in the second box.
    Added,
    /// In both, with different type, content size, mode, owner, times or target.
    Modified,
    /// Only in the first box.
    Deleted,
}

/// Where `diff` hands its batches of changes; false means stop.
pub type ChangeSink<'a> = dyn FnMut(Vec<Change>) -> bool + Send + 'a;

/// One difference between two box filesystems.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Change {
    /// The path inside the box, starting with `/`.
    pub path: String,
    /// What happened to it.
    pub change: ChangeKind,
}

/// A saved state of a box's filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Its label.
    pub label: String,
    /// When it was made (ms since the epoch).
    pub created_ms: u64,
    /// Bytes only it holds (shared with no other checkpoint, root or image),
    /// where the backend can tell.
    pub held_bytes: Option<u64>,
}

/// What a box was received as (see [`Backend::received`]).
#[derive(Debug, Clone, Default)]
pub struct Received {
    /// The subvolumes received (its root is a snapshot of the newest).
    pub subvolumes: Vec<u64>,
    /// Its checkpoints, oldest first: each label, the received subvolume it
    /// is to be a snapshot of, and when it was saved (ms).
    pub checkpoints: Vec<(String, std::path::PathBuf, u64)>,
}

/// A box's cumulative counters, as the host sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MeterReading {
    /// CPU time used since the box booted.
    pub cpu_ns: u64,
    /// Resident memory now.
    pub memory_bytes: u64,
}

/// A backend failure, with the backend's own error as its source.
#[derive(Debug, thiserror::Error)]
#[error("{what}")]
pub struct BackendError {
    what: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl BackendError {
    /// An error with a message and an underlying cause.
    pub fn new(what: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self { what: what.into(), source: Some(Box::new(source)) }
    }

    /// An error with only a message.
    pub fn msg(what: impl Into<String>) -> Self {
        Self { what: what.into(), source: None }
    }
}

/// Reports progress of long work (an image build) to whoever waits for it.
pub type Progress<'a> = &'a mut (dyn FnMut(&str) + Send);

/// What a copy made by [`Backend::dup`] holds besides its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copied {
    /// Nothing: it boots afresh, as a new box does.
    Files,
    /// Its source's whole machine as of the copy, saved: it is left
    /// suspended (as a box with no session is), and its first session
    /// resumes it, its processes where they were.
    Machine,
}

/// One isolation technology. Calls block; the manager runs them off the async
/// threads. Each call must either finish its work or undo what it did.
pub trait Backend: Send + Sync + 'static {
    /// Whether `image` is ready to make boxes from.
    fn has_image(&self, image: &Name) -> bool;
    /// `image` is gone from the pool: what the backend made of it ahead of
    /// boxes (spare snapshots, VM disks) goes too. Boxes made of it keep
    /// their files.
    fn image_removed(&self, _image: &Name) {}
    /// Builds `image` (a name this backend knows how to build).
    fn build_image(&self, image: &Name, progress: Progress<'_>) -> Result<(), BackendError>;
    /// Whether `image`'s /etc/passwd has a line for user `name` (an image's
    /// `User`, checked at `new`). A backend that cannot tell says yes.
    fn image_has_user(&self, _image: &Name, _name: &str) -> bool {
        true
    }
    /// Makes the box's files as of now the read-only image `key` (a template).
    fn save_image(&self, _rec: &BoxRecord, _key: &Name) -> Result<(), BackendError> {
        Err(BackendError::msg("this backend cannot save a box as an image"))
    }
    /// Makes the box's filesystem from its image.
    fn create(&self, rec: &BoxRecord) -> Result<(), BackendError>;
    /// Boots the box; returns how to reach it.
    fn start(&self, rec: &BoxRecord) -> Result<BoxHandle, BackendError>;
    /// Tells the running box's agent to keep `argv` running as its service
    /// (empty: none); see [`crate::manager`]'s services.
    fn set_service(&self, _rec: &BoxRecord, _argv: &[String]) -> Result<(), BackendError> {
        Err(BackendError::msg("this backend runs no services"))
    }
    /// The running box's service's recent output, as its agent keeps it.
    fn service_log(&self, _rec: &BoxRecord) -> Result<Vec<u8>, BackendError> {
        Err(BackendError::msg("this backend runs no services"))
    }
    /// Whether the box's PID 1 is alive, judged from the host (never by asking
    /// the box, which could lie or stall).
    fn is_running(&self, rec: &BoxRecord) -> bool;
    /// Ends every process of the box; its filesystem stays.
    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError>;
    /// Releases a suspended box's memory: by default its processes end (as
    /// `stop`); a backend that can save them does, and its next `start`
    /// resumes them.
    fn park(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.stop(rec)
    }
    /// Removes the box's filesystem and every host resource it held.
    fn destroy(&self, rec: &BoxRecord) -> Result<(), BackendError>;
    /// How to reach the box if it is running (judged from the host, as
    /// `is_running`): for a box booted before the daemon restarted.
    fn handle(&self, rec: &BoxRecord) -> Option<BoxHandle>;
    /// `count` TCP sockets (non-blocking, unconnected, IPv6 taking IPv4
    /// too) made in the running box's own network on the host's kernel: the
    /// HTTP edge connects them to a port on the box's loopback itself. `None`
    /// where the box's loopback is not the host kernel's (a microVM guest's:
    /// its agent connects there).
    fn box_sockets(&self, _rec: &BoxRecord, _count: usize) -> Result<Option<Vec<OwnedFd>>, BackendError> {
        Ok(None)
    }
    /// Sets (`Some`) or removes (`None`) variables in the box's
    /// `/etc/environment`, which every session reads.
    fn set_environment(&self, rec: &BoxRecord, vars: &[(String, Option<String>)]) -> Result<(), BackendError>;
    /// Makes `dst`'s filesystem a copy of `src`'s as of this instant (a running
    /// `src` is frozen for that instant), with a fresh identity for `dst`;
    /// says what else the copy holds.
    fn dup(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError>;
    /// What differs in `b`'s filesystem relative to `a`'s, handed to `out` in
    /// batches as it is found (in tree order); `out` returns false to stop.
    /// The work and memory are bounded whatever the boxes hold.
    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError>;
    /// Saves the box's filesystem as of this instant (a running box is frozen
    /// for that instant) as read-only checkpoint `label`.
    fn checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError>;
    /// The box's checkpoints, oldest first; with `held`, the bytes only each
    /// holds too (a walk of each checkpoint's tree: slow on a large one).
    fn checkpoints(&self, rec: &BoxRecord, held: bool) -> Vec<Checkpoint>;
    /// With the box stopped: makes its filesystem a writable copy of its
    /// checkpoint `label`, keeping the filesystem it had as checkpoint
    /// `before`. Whole or not at all, a crash included.
    fn restore(&self, rec: &BoxRecord, label: &Name, before: &Name) -> Result<(), BackendError>;
    /// Deletes the box's checkpoint `label`.
    fn delete_checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError>;
    /// Gives a box booted ahead of demand under account `from` its owner
    /// (`rec.account`: its disk use is charged there from now) and name (in
    /// its files and its running host name).
    fn adopt(&self, rec: &BoxRecord, from: &AccountId) -> Result<(), BackendError>;
    /// Writes a new host name into the box's files (running processes see it
    /// after the box restarts).
    fn rename(&self, rec: &BoxRecord, name: &Name) -> Result<(), BackendError>;
    /// Lets the box's processes run again (after `suspend`, or an operation
    /// interrupted by a crash); a no-op if they are not frozen.
    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError>;
    /// Freezes every process of the box where it stands.
    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError>;
    /// The box's counters, if it has processes.
    fn meter(&self, rec: &BoxRecord) -> Option<MeterReading>;
    /// Bytes the box has written beyond what it shares with its image or parent.
    fn disk_usage(&self, rec: &BoxRecord) -> Option<u64>;
    /// Bytes the account's boxes hold together, including data removed boxes
    /// left shared with their copies, where the backend can tell.
    fn account_disk_usage(&self, account: &AccountId) -> Option<u64>;
    /// Makes the box root just received from the object store for `rec` (a
    /// writable snapshot of the read-only subvolumes `received.subvolumes`,
    /// about to be deleted) a box of this host: its disk limit, its charges
    /// as if it had written its data here, its checkpoints (read-only
    /// snapshots of those received for them), and a new TLS CA (the old key
    /// stayed on the node it came from). On failure the box's files are
    /// deleted.
    fn received(&self, rec: &BoxRecord, received: &Received) -> Result<(), BackendError> {
        let _ = received;
        Err(BackendError::msg(format!("this host cannot take box {} from elsewhere", rec.name)))
    }
    /// Makes the box ready to leave this host: its processes end, and a
    /// backend that can save them puts the saved machine where the box's
    /// files travel (and its TLS CA's key with it). Whether its processes
    /// travel.
    fn pack_for_move(&self, rec: &BoxRecord) -> Result<bool, BackendError> {
        self.stop(rec).map(|()| false)
    }
    /// The boxes this host holds files or processes of.
    fn local_boxes(&self) -> Vec<BoxId> {
        Vec::new()
    }
    /// Removes every trace of box `id` from this host (its record names
    /// another node now): its processes, files and host resources.
    fn discard(&self, id: &BoxId) -> Result<(), BackendError> {
        Err(BackendError::msg(format!("this host cannot discard box {id}")))
    }
}
