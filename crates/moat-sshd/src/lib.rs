//! moat-sshd: the front door.
//!
//! Terminates SSH with russh, maps keys to accounts, and routes every channel:
//! to the control plane (`new`, `ls`, `rm`, ...) or to a box, where each
//! channel becomes one connection on the box agent's protocol. Nothing here
//! knows which backend runs a box.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

pub mod accounts;
pub mod admission;
pub mod auth;
pub mod boxchan;
pub mod control;
pub mod forward;
pub mod handler;
pub mod penalty;
pub mod quickack;
pub mod ratelimit;
pub mod remote_forward;
pub mod server;
pub mod setup;
pub mod source_slots;
pub mod task;
pub mod words;

pub use server::{serve, ServerConfig};

/// The version line the front door sends (see `server`).
pub const BANNER: &str = "SSH-2.0-OpenSSH_moat";
