//! moat-box: where boxes are actually made, on one host.
//!
//! ```text
//! backend   HostBackend: moat_core::Backend for every box of this host; storage
//!    │      (images, checkpoints, quotas, identity, removal) once, over the pool
//!    ├── machine   the Machine trait: only what differs in running a box
//!    │     ├── ns/     namespaces, seccomp and cgroups on the host's kernel
//!    │     └── vm/     a QEMU microVM with a kernel of its own
//!    ├── host/     what both machines use: cgroups, the start helper, a new
//!    │             box's ownership, network namespace tooling
//!    └── pool, checkpoint, lineage, image, identity, trust, environment, diff
//! sys/      the raw kernel calls (btrfs, mount, seccomp, Landlock, tap, process
//!           setup): with ns/enforce.rs, the crate's only `unsafe`
//! ```
//!
//! - [`backend`]: the host's one [`moat_core::Backend`];
//! - [`machine`]: the seam a new way of running boxes implements;
//! - [`host`]: the host machinery both machines share;
//! - [`pool`]: the copy-on-write storage pool (btrfs, loop-backed where needed);
//! - [`checkpoint`]: a box's root saved by label, and restored in place;
//! - [`lineage`]: a copy charged for what it keeps alive of removed parents;
//! - [`image`]: building the read-only images boxes start from;
//! - [`layers`]: pulled images' layers, a snapshot chain keyed by chain id;
//! - [`identity`], [`trust`], [`environment`]: what moat writes into a box
//!   (through `in_root`, which never leaves the box's tree);
//! - [`diff`]: what changed between two boxes' filesystems;
//! - [`confine`]: the confinement of moat's own unprivileged processes;
//! - [`unpacker`]: the confinement of the helper that applies a registry's layers;
//! - [`bpf`]: a small assembler for seccomp filters.

mod agent_call;
pub mod backend;
pub mod bpf;
pub mod checkpoint;
pub mod confine;
pub mod diff;
pub mod environment;
pub mod host;
pub mod identity;
pub mod image;
mod in_root;
pub mod layers;
pub mod lineage;
pub mod machine;
pub mod ns;
pub mod pool;
#[allow(unsafe_code)]
pub mod sys;
pub mod travel;
pub mod trust;
pub mod unpacker;
pub mod vm;

pub use backend::HostBackend;
pub use host::{Host, HostConfig};
