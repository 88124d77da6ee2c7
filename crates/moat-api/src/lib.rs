//! moat-api: the narrow typed API between moat's two halves.
//!
//! The privileged side (box manager, backends, store) serves it; the front
//! door (SSH, control commands), an unprivileged process, is its only client.
//! It inherits one packet socket, the *dialer*: each request asks it for a
//! fresh connection, so a request's life is its connection's life: a box
//! session lasts until the front door closes it, and every session of a front
//! door that dies ends with it. A session's answer carries a stream already
//! connected to the box's agent, so box traffic never takes an extra hop.
//! Whatever answers the dials implements [`server::Answer`]: the privileged
//! side on one host, or a fleet's router (moat-fleet), which forwards each
//! connection to the node holding the box.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

pub mod client;
pub mod proto;
pub mod route;
pub mod server;
pub mod wire;

pub use client::{ApiClient, Lease, WebLease, WebReach};
pub use proto::{
    AccountLimits, ApiError, BoxInfo, DurableInfo, Event, Hello, ImageInfo, Op, Password, Reply, Request, Route, WebOp,
    WebSessionMsg, Whoami,
};
pub use wire::Packets;
