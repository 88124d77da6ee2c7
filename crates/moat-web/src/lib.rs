//! moat-web: the HTTP edge. A box's port is reached at
//! `https://PORT-NAME-OWNER.DOMAIN`; this crate is the unprivileged, confined
//! process that terminates TLS and HTTP (hyper: HTTP/1.1 and HTTP/2 by ALPN),
//! asks the privileged side whether each request may reach the box (private
//! unless exposed `--public`: a one-time sign-in link becomes a host-only
//! cookie), and carries it over a session on the box's agent to the port, as
//! `ssh -L` does. It holds no privilege and reaches boxes only through
//! moat-api, as the SSH front door does.
//!
//! Everything here parses hostile bytes (a browser's, or anyone's): the
//! lints below forbid panicking on them.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

pub mod body;
pub mod cookie;
pub mod edge;
pub mod hello;
pub mod host;
pub mod limits;
pub mod origin;
pub mod pages;
pub mod proxy;
pub mod site;
pub mod upstream;
pub mod yielding;

pub use edge::serve;
pub use hello::{EdgeLimits, WebHello};
