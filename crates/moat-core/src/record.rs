//! What the store keeps about a box.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{AccountId, BoxId, Name};
use crate::limits::Limits;

/// Which isolation technology runs a box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Linux namespaces, seccomp and cgroups on the host's kernel.
    #[default]
    Ns,
    /// A microVM with a kernel of its own (QEMU's `microvm` machine).
    Vm,
}

impl BackendKind {
    /// The name as stored, shown and typed.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ns => "ns",
            Self::Vm => "vm",
        }
    }

    /// Parses a name as typed (`ns` or `vm`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ns" => Some(Self::Ns),
            "vm" => Some(Self::Vm),
            _ => None,
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// Where a box is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoxState {
    /// Being made; a box found in this state after a crash is rolled back.
    Creating,
    /// Its PID 1 is up.
    Running,
    /// Its processes are frozen (no session for a while); the next session resumes it.
    Suspended,
    /// Its filesystem exists but no process runs; the next session boots it.
    Stopped,
}

impl BoxState {
    /// The state as stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "creating",
            Self::Running => "running",
            Self::Suspended => "suspended",
            Self::Stopped => "stopped",
        }
    }

    /// Parses a stored state.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "creating" => Some(Self::Creating),
            "running" => Some(Self::Running),
            "suspended" => Some(Self::Suspended),
            "stopped" => Some(Self::Stopped),
            _ => None,
        }
    }
}

impl fmt::Display for BoxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// A box as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BoxRecord {
    /// Host-side id (paths, cgroups).
    pub id: BoxId,
    /// The owning account.
    #[serde(skip)]
    pub account: AccountId,
    /// The name the owner uses.
    pub name: Name,
    /// The image its filesystem was made from.
    pub image: Name,
    /// Its cgroup limits.
    pub limits: Limits,
    /// What isolates it.
    pub backend: BackendKind,
    /// Index of its host uid range; unique among live boxes.
    #[serde(skip)]
    pub slot: u32,
    /// Lifecycle state.
    pub state: BoxState,
    /// Host pid of its PID 1 while running.
    #[serde(skip)]
    pub pid: Option<u32>,
    /// Creation time, seconds since the Unix epoch.
    pub created_at: u64,
    /// The box this one was duplicated from, if any.
    #[serde(skip)]
    pub parent: Option<BoxId>,
    /// That box's name, if it still exists (for display).
    #[serde(rename = "parent")]
    pub parent_name: Option<Name>,
    /// Seconds without a session before the box is suspended (`None`: the
    /// daemon's default).
    pub idle: Option<u32>,
    /// Never suspended for want of sessions (and billed meanwhile).
    pub keep_running: bool,
    /// When the box entered its current state, seconds since the Unix epoch.
    pub state_since: u64,
    /// The fleet node that holds it (`""` on a single host).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// Changes whenever the box's owner node does: a node acts on a box only
    /// while the epoch it holds is the box's.
    #[serde(skip)]
    pub epoch: u64,
}

impl BoxRecord {
    /// First host uid of the box's range: box uid N is host uid `uid_base() + N`.
    pub fn uid_base(&self) -> u32 {
        UID_BASE + self.slot * UIDS_PER_BOX
    }
}

/// Host uids below this are never given to a box.
pub const UID_BASE: u32 = 1 << 20;
/// The front door's uid and gid unless the operator picks another: owned by
/// no file and no box (below every box's range, above every distribution's
/// user ranges), so it can signal or read nothing of anyone's.
pub const FRONT_DOOR_ID: u32 = UID_BASE - 1;
/// The egress gateway's uid and gid unless the operator picks another (as
/// the front door's, and not the same: neither can signal the other).
pub const GATEWAY_ID: u32 = UID_BASE - 2;
/// The HTTP edge's uid and gid unless the operator picks another (its own:
/// `UID_BASE - 3` is a fleet front door's router).
pub const WEB_EDGE_ID: u32 = UID_BASE - 4;
/// Each box maps this many uids (0..65535 inside).
pub const UIDS_PER_BOX: u32 = 1 << 16;
/// Slots that fit below `u32::MAX` (uid -1 is reserved by the kernel).
pub const MAX_SLOTS: u32 = (u32::MAX - UID_BASE) / UIDS_PER_BOX - 1;
/// Slots are handed to servers in blocks of this many, each block one state
/// dir's on a host (a state dir takes another when its boxes fill those it
/// holds), so two moat servers never give two boxes the same host uids.
pub const SLOTS_PER_BLOCK: u32 = 1024;
/// How many blocks there are (between them, the servers of one host hold at
/// most this many).
pub const SLOT_BLOCKS: u32 = MAX_SLOTS / SLOTS_PER_BLOCK;
