//! moat-gateway: everything a box's traffic meets on its way out. A box's
//! network namespace routes everything to its own `lo`, where the gateway's
//! listeners (made there by the privileged side and handed over) answer DNS
//! from the policy with fake addresses and take every TCP connection; the
//! gateway checks the name the box dialled against the policy and against
//! what the connection itself says (TLS SNI, HTTP Host), resolves the name
//! itself, and splices to the real host. It runs as an unprivileged uid with
//! no capabilities and never parses anything for the privileged side.
//!
//! Layout, by concern:
//! - [`messages`]: what the privileged side and the gateway say to each
//!   other; [`gateway`]: the attached boxes and what each message does.
//! - [`boxnet`]: one attached box (policy, fake addresses, secrets, the cut
//!   switch); [`log`]: its audit entries; [`ask`]: ask mode's questions;
//!   [`admission`]: how many connections a box, an account and all carry.
//! - [`dns`]: the DNS wire format and the server a box looks names up in;
//!   [`fake`]: the fake addresses names are given.
//! - [`proxy`]: every TCP connection, from the dialled address to the
//!   request loop; [`proxy::judge`] decides each HTTP request, purely;
//!   [`refusal`]: every reason the gateway refuses or ends something;
//!   [`proxy::push`] holds a push until its rules are checked, with
//!   [`git`]: smart HTTP's command list and pack, read for push rules;
//!   [`packages`]: PyPI, npm and crates.io read as their own protocols.
//! - [`http`]: request and response heads and chunked framing; [`tls`]: the
//!   ClientHello, the box's leaves and TLS the gateway looks inside.
//! - [`secrets`]: injection into requests, meters and token counts, scrubbing
//!   of answers.
//! - [`upstream`]: resolving and dialling real hosts; [`zerocopy`]: splicing
//!   bytes the gateway never reads; [`dropped`]: the UDP and ICMP a box's
//!   namespace drops, as log entries.
//!
//! Everything here reads bytes a box (or a host) chose, so the crate denies
//! `unwrap`, `expect`, indexing and `panic!` outside tests.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

pub mod admission;
pub mod ask;
pub mod boxnet;
pub mod dns;
pub mod dropped;
pub mod fake;
pub mod gateway;
pub mod git;
pub mod http;
pub mod log;
pub mod messages;
pub mod packages;
pub mod proxy;
pub mod refusal;
pub mod scratch;
pub mod secrets;
pub mod tls;
pub mod upstream;
pub mod zerocopy;

pub use gateway::Gateway;
pub use messages::{FromGateway, GatewayHello, Role, ToGateway, MAX_MESSAGE};
