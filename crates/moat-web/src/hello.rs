//! What the privileged side tells the edge when it starts it: the domain, the
//! certificate to present, and the limits to hold hostile clients to.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The edge's configuration (its listening socket comes with it).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebHello {
    /// Box URLs are names right under it.
    pub domain: String,
    /// The certificate chain to present (PEM), leaf first.
    pub cert_pem: String,
    /// Its key (PEM).
    pub key_pem: String,
    /// The limits.
    pub limits: EdgeLimits,
    /// Event loops (a thread each) to serve in; 0: one per CPU but one.
    pub loops: usize,
}

impl std::fmt::Debug for WebHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebHello")
            .field("domain", &self.domain)
            .field("limits", &self.limits)
            .field("loops", &self.loops)
            .finish_non_exhaustive()
    }
}

/// How much the edge gives one client, one box, and a slow peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EdgeLimits {
    /// Connections open at once from one address.
    pub per_source: usize,
    /// Connections open at once in all.
    pub connections: usize,
    /// Requests in flight at once to one box port.
    pub per_box: usize,
    /// Seconds a TLS handshake, or a request's head, may take.
    pub head_secs: u64,
    /// Seconds a request body may go without a byte.
    pub body_secs: u64,
    /// Seconds the box has to begin its answer.
    pub answer_secs: u64,
    /// Seconds a connection may go with nothing read or written.
    pub idle_secs: u64,
    /// Most bytes of a request's head (HTTP/1.1), or of its header list (HTTP/2).
    pub head_bytes: usize,
    /// Most header fields in a request (HTTP/1.1).
    pub headers: usize,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        Self {
            per_source: 256,
            connections: 16 << 10,
            per_box: 256,
            head_secs: 10,
            body_secs: 30,
            answer_secs: 60,
            idle_secs: 300,
            head_bytes: 64 << 10,
            headers: 100,
        }
    }
}

impl EdgeLimits {
    /// As a duration.
    pub fn head(&self) -> Duration {
        Duration::from_secs(self.head_secs)
    }

    /// As a duration.
    pub fn body(&self) -> Duration {
        Duration::from_secs(self.body_secs)
    }

    /// As a duration.
    pub fn answer(&self) -> Duration {
        Duration::from_secs(self.answer_secs)
    }

    /// As a duration.
    pub fn idle(&self) -> Duration {
        Duration::from_secs(self.idle_secs)
    }
}
