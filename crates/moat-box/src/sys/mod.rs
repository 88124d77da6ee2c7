//! The raw kernel calls moat needs that no safe wrapper offers: btrfs subvolume
//! ioctls, the new mount API (`open_tree`, `mount_setattr`, `move_mount`),
//! seccomp, interface flags, netlink and extended attributes. Each is a thin, typed wrapper; callers never see
//! a raw pointer.
//!
//! One file per kind of call: [`btrfs`], [`mount`], [`seccomp`], [`net`],
//! [`process`], [`landlock`], [`netlink`], [`xattr`]; callers use the flat names
//! re-exported here (netlink by its module's name).

mod btrfs;
mod landlock;
mod mount;
mod net;
pub mod netlink;
mod process;
mod seccomp;
mod xattr;

use std::io;

use nix::errno::Errno;

pub use btrfs::*;
pub use landlock::{landlock, landlock_abi, landlock_only_beneath};
pub use mount::*;
pub use net::*;
pub use process::*;
pub use seccomp::*;
pub use xattr::*;

/// Turns an errno-style result into `io::Result`.
pub fn check(r: nix::Result<()>) -> io::Result<()> {
    r.map_err(|e: Errno| io::Error::from_raw_os_error(e as i32))
}
