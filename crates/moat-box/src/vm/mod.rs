//! The microVM backend: each box a guest with a kernel of its own on QEMU's
//! `microvm` machine.
//!
//! - [`machine`]: the [`crate::machine::Machine`] that runs VM boxes;
//! - [`supervise`]: the host process that owns a box's QEMU and is the host
//!   end of its agent's port;
//! - [`qemu`]: QEMU's command line and QMP;
//! - [`net`]: the box's network namespace, where the guest's link ends;
//! - [`files`]: what moat writes into a guest, kept on the host;
//! - [`listing`]: a guest's files as its agent lists them, for `diff`;
//! - [`rekey`]: a copy's own identity in its guest, on its first run;
//! - [`disk`]: the guest's root disk;
//! - [`initramfs`], [`cpio`], [`modules`]: what the guest's kernel unpacks first;
//! - [`vmlinux`]: the guest kernel unpacked, booted through its PVH entry;
//! - [`probe`]: boots a guest to learn whether KVM can run one here or only
//!   TCG can (a host may open `/dev/kvm` and still hang every guest: this
//!   one does).

pub mod cpio;
pub mod disk;
pub mod files;
pub mod initramfs;
pub mod listing;
pub mod machine;
pub mod modules;
pub mod net;
pub mod probe;
pub mod qemu;
pub mod rekey;
pub mod supervise;
pub mod vmlinux;

pub use machine::{VmConfig, VmMachine};
pub use qemu::Accel;
