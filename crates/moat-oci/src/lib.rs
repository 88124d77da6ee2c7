//! OCI images for moat.
//!
//! - [`reference`]: what a user names (`python:3.12-slim`, `ghcr.io/o/i@sha256:…`).
//! - [`digest`]: content addresses, and the chain ids layers are kept under.
//! - [`manifest`]: indexes, manifests (OCI and Docker) and image configs, with
//!   the size bounds every document read from a registry is held to.
//! - [`client`]: the distribution API (v2): auth, redirects, limits,
//!   deadlines, digests checked as bytes arrive. It runs in the unprivileged
//!   fetch helper, never in the daemon.
//! - [`pack`]: a tree's changes as one layer (a template pushed), read
//!   from the tree without ever leaving it.
//! - [`unpack`]: one layer (a tar, plain, gzip or zstd) applied onto a tree
//!   that is a snapshot of its parent, never leaving it. It runs in the
//!   confined unpack helper, never as root in the daemon.
//!
//! Every byte here comes from a registry, and registries are hostile: the
//! parsing modules cannot panic (the deny-lints below).

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

pub mod client;
pub mod digest;
pub mod manifest;
pub mod pack;
pub mod reference;
pub mod unpack;

pub use digest::Digest;
pub use reference::Reference;
