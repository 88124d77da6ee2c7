//! The microVM backend's first parts: the initramfs moat generates for a
//! guest, and a probe that boots one on QEMU's `microvm` machine, to learn
//! whether KVM can run a guest here or only TCG can (a host may open
//! `/dev/kvm` and still hang every guest: this one does). The backend itself
//! (a box as a guest, its disk, its agent over virtio-serial) is issue 12.

pub mod cpio;
pub mod disk;
pub mod modules;
pub mod probe;
