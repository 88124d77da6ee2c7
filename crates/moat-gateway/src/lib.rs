//! moat-gateway: everything a box's traffic meets on its way out. A box's
//! network namespace routes everything to its own `lo`, where the gateway's
//! listeners (made there by the privileged side and handed over) answer DNS
//! from the policy with fake addresses and take every TCP connection; the
//! gateway checks the name the box dialled against the policy and against
//! what the connection itself says (TLS SNI, HTTP Host), resolves the name
//! itself, and splices to the real host. It runs as an unprivileged uid with
//! no capabilities and never parses anything for the privileged side.

pub mod ask;
pub mod boxnet;
pub mod ca;
pub mod dns;
pub mod dnsd;
pub mod dropped;
pub mod fake;
pub mod gateway;
pub mod http;
pub mod inject;
pub mod intercept;
pub mod proxy;
pub mod scrub;
pub mod tls;
pub mod upstream;
pub mod zerocopy;

pub use gateway::{FromGateway, Gateway, GatewayHello, Role, ToGateway};
