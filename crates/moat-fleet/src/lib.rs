//! moat-fleet: many hosts behind one SSH address.
//!
//! A *node* is today's privileged core on one host; a *front door* is the
//! confined SSH parser with, beside it, an unprivileged *router* that answers
//! its requests by forwarding each to the node that holds the box. Between
//! them the core API travels over TCP with mutual TLS: every member proves
//! itself with a certificate from the fleet's CA, registered in the store
//! with its role.
//!
//! - [`frame`]: moat-api's messages framed on a byte stream;
//! - [`listen`]: the node's listener, bridging into moat-api's own answering;
//! - [`dial`]: the router's dialing and forwarding, sessions included;
//! - [`relay`]: a session's bytes between a local stream and a fleet connection;
//! - [`router`]: which node answers a front door's request ([`store`]: what it asks the store);
//! - [`pki`], [`tls`], [`serial`], [`peer`]: who is a member, and proving it;
//! - [`join`]: `moat fleet init|token|join`, and a member's state dir.

mod ask;
pub mod dial;
pub mod frame;
pub mod join;
pub mod listen;
pub mod peer;
pub mod pki;
pub mod relay;
pub mod router;
pub mod serial;
pub mod store;
pub mod tls;
