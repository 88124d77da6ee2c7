//! The messages between the privileged side and the gateway, over the
//! socket the gateway is started with: the first tells it how to reach the
//! internet; then boxes are attached (with their listeners), changed, cut and
//! detached, and the gateway sends back log entries and questions for boxes'
//! owners. Both sides read them as JSON of at most [`MAX_MESSAGE`] bytes; a
//! box id in them is a [`BoxId`], checked as it is read.

use moat_core::box_ca::CaKey;
use moat_core::egress::{Answer, LogEntry};
use moat_core::policy::{HostName, Policy};
use moat_core::secrets::BoxSecret;
use moat_core::{AccountId, BoxId};
use serde::{Deserialize, Serialize};

/// Largest message either side reads.
pub const MAX_MESSAGE: usize = 1 << 20;

/// The first message to the gateway: how it reaches the internet (read by
/// [`GatewayHello::upstream`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GatewayHello {
    /// The resolver it asks.
    pub upstream_dns: std::net::SocketAddr,
    /// Ranges it may dial although they are not public (`ADDR/PREFIX`).
    pub upstream_allow: Vec<String>,
    /// The roots (PEM) it verifies hosts with where it looks inside HTTPS.
    pub upstream_roots: String,
}

/// What a listener handed over with [`ToGateway::Attach`] or
/// [`ToGateway::Listen`] is for (both sides of the trust line agree on it:
/// see `moat_core::egress`).
pub use moat_core::egress::Role;

/// From the privileged side.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ToGateway {
    /// Serve a box on the attached sockets, one per role listed, in order.
    Attach {
        /// The box's host-side id.
        box_id: BoxId,
        /// Its owner (whose boxes' connections count together).
        account: AccountId,
        /// Its policy.
        policy: Policy,
        /// The private key of the TLS CA the box trusts, if it has one.
        ca_key: Option<CaKey>,
        /// What each attached socket is.
        roles: Vec<Role>,
    },
    /// A box's new policy; connections open keep the one they started with.
    Policy {
        /// The box.
        box_id: BoxId,
        /// The policy.
        policy: Policy,
    },
    /// A box's secrets (all it has now), opened.
    Secrets {
        /// The box.
        box_id: BoxId,
        /// The secrets.
        secrets: Vec<BoxSecret>,
    },
    /// A box was suspended: end its open connections and close its sockets
    /// (it sends nothing until it resumes, and gets new ones then).
    Suspend {
        /// The box.
        box_id: BoxId,
    },
    /// Serve an attached box (just resumed) on the attached sockets, one per
    /// role listed, in order.
    Listen {
        /// The box.
        box_id: BoxId,
        /// What each attached socket is.
        roles: Vec<Role>,
    },
    /// Stop serving a box and close its sockets.
    Detach {
        /// The box.
        box_id: BoxId,
    },
    /// The owner's answer to question `id` (see [`FromGateway::Ask`]).
    Answer {
        /// The question.
        id: u64,
        /// The answer.
        answer: Answer,
    },
}

/// To the privileged side.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FromGateway {
    /// Audit log entries: (box id, entry).
    Log {
        /// The entries, oldest first.
        entries: Vec<(BoxId, LogEntry)>,
    },
    /// A box in ask mode wants a name its policy does not allow: ask its
    /// owner, and send the answer back with this `id`.
    Ask {
        /// The box.
        box_id: BoxId,
        /// The question's number.
        id: u64,
        /// The name (checked as it is read: the owner is shown it).
        name: HostName,
        /// The port dialled (`None`: a DNS query).
        port: Option<u16>,
    },
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use moat_core::egress::{LogKind, LogVerdict};

    #[test]
    fn box_ids_and_names_are_checked_as_a_message_is_read() {
        let ask = FromGateway::Ask {
            box_id: BoxId::parse("0123abcd").unwrap(),
            id: 7,
            name: HostName::parse("pypi.org").unwrap(),
            port: Some(443),
        };
        let json = serde_json::to_string(&ask).unwrap();
        assert_eq!(json, r#"{"ask":{"box_id":"0123abcd","id":7,"name":"pypi.org","port":443}}"#);
        assert!(matches!(serde_json::from_str(&json).unwrap(), FromGateway::Ask { id: 7, .. }));
        let entry = crate::log::entry(LogKind::Tcp, "pypi.org", 443, LogVerdict::Allow);
        let log = FromGateway::Log { entries: vec![(BoxId::parse("0123abcd").unwrap(), entry)] };
        let log = serde_json::to_string(&log).unwrap();
        assert!(serde_json::from_str::<FromGateway>(&log).is_ok());
        for bad in [
            json.replace("0123abcd", "../etc"),
            json.replace("pypi.org", "\\u001b]0;owned\\u0007"),
            log.replace("0123abcd", "b1 ; rm"),
        ] {
            assert!(serde_json::from_str::<FromGateway>(&bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<ToGateway>(r#"{"suspend":{"box_id":"0123abcd"}}"#).is_ok());
        assert!(serde_json::from_str::<ToGateway>(r#"{"suspend":{"box_id":"not hex"}}"#).is_err());
    }
}
