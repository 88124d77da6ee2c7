//! What the box side and the gateway agree on: where in a box's network
//! namespace the gateway listens, the fake address range, and the audit log's
//! entries.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// The gateway's DNS listeners (UDP and TCP) in a box: `127.0.0.1` and `::1`.
/// Every packet to port 53 anywhere is redirected there.
pub const DNS_PORT: u16 = 53;

/// The gateway's TCP listener in a box (`127.0.0.1` and `::1`): every TCP
/// connection to an address outside loopback is redirected there.
pub const PROXY_PORT: u16 = 1;

/// Fake addresses handed to a box for the names it may reach: 198.18.0.0/15
/// (set aside for benchmarking, never routed on the internet).
pub const FAKE_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(198, 18, 0, 0), 15);

/// The box's own address in that range (on its `lo`): the source of its
/// connections out, which need one that is not loopback-only to get replies.
/// Never handed out for a name.
pub const BOX_SOURCE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);

/// The netlink log group (NFLOG) a box's namespace copies the heads of the
/// UDP and ICMP packets it drops to, for the gateway to log.
pub const DROPPED_GROUP: u16 = 1;

/// nfnetlink's subsystem of the packet log (its messages' type, high byte):
/// the privileged side binds the group with it, the gateway reads packets.
pub const NFNL_SUBSYS_ULOG: u16 = 4;

/// What a socket the privileged side makes in a box's namespace and hands
/// to the gateway is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// DNS over UDP (a bound UDP socket).
    DnsUdp,
    /// DNS over TCP (a listening socket).
    DnsTcp,
    /// Every other TCP connection (a listening socket).
    Proxy,
    /// Reports of the UDP and ICMP the box's namespace drops (a netlink log
    /// socket bound to its group).
    Dropped,
}

/// What an entry is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogKind {
    /// A DNS query.
    Dns,
    /// A TCP connection.
    Tcp,
    /// An HTTP request on a connection.
    Http,
    /// A UDP datagram (other than DNS): it goes nowhere.
    Udp,
    /// An ICMP message: it goes nowhere.
    Icmp,
    /// A request to the box through its web URL (the HTTP edge).
    Web,
}

/// What became of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogVerdict {
    /// Let through.
    Allow,
    /// Refused.
    Deny,
    /// Allowed, but failed upstream.
    Error,
}

/// One audit log entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// When, in milliseconds since the epoch.
    pub at_ms: u64,
    /// What.
    pub kind: LogKind,
    /// The name (or address) the box asked for.
    pub name: String,
    /// The port (0 for DNS).
    pub port: u16,
    /// The DNS record type, or the HTTP method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The method a method-override header asked the server to read the
    /// request as (`X-HTTP-Method-Override` and the like), where it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method_override: Option<String>,
    /// The HTTP request target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The verdict.
    pub verdict: LogVerdict,
    /// The rule that decided, if one did (none: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Why, in words, when the rule alone does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Bytes from the box to the host.
    #[serde(default)]
    pub sent: u64,
    /// Bytes from the host to the box.
    #[serde(default)]
    pub received: u64,
    /// The secret written into this request, if one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// LLM tokens the host reported using for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// The host's answer's status, where the gateway read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// A connection the gateway passed through without looking inside.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque: bool,
    /// The package file this request was for, where it was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package: Option<PackageFile>,
}

impl LogEntry {
    /// An entry at `at_ms` with the fields every kind has, the rest empty.
    pub fn new(at_ms: u64, kind: LogKind, name: impl Into<String>, port: u16, verdict: LogVerdict) -> Self {
        Self {
            at_ms,
            kind,
            name: name.into(),
            port,
            method: None,
            method_override: None,
            target: None,
            verdict,
            rule: None,
            reason: None,
            sent: 0,
            received: 0,
            secret: None,
            tokens: None,
            status: None,
            opaque: false,
            package: None,
        }
    }
}

/// A request's method in words: `GET`, or `GET as DELETE` where a
/// method-override header asked the server to read it as `DELETE`.
pub fn method_in_words(method: Option<&str>, method_override: Option<&str>) -> Option<String> {
    match (method, method_override) {
        (Some(method), Some(read_as)) => Some(format!("{method} as {read_as}")),
        (method, _) => method.map(str::to_string),
    }
}

/// A package file a box asked for, as the gateway read it off the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackageFile {
    /// The ecosystem.
    pub ecosystem: crate::policy::Ecosystem,
    /// The package's name, normalised.
    pub name: String,
    /// The version.
    pub version: String,
    /// The file.
    pub file: String,
    /// The hash the index promised (and the file had, where it came in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// Served from the host's cache rather than the registry.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cached: bool,
}

/// How long a box's connection or DNS query waits for its owner's answer in
/// ask mode before it is refused.
pub const ASK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A box in ask mode wants a name its policy does not allow; its owner is
/// asked (never the box itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Question {
    /// Its number, for the answer.
    pub id: u64,
    /// The box asking.
    pub box_name: String,
    /// The name it wants.
    pub name: String,
    /// The port it dialled (`None`: it looked the name up).
    pub port: Option<u16>,
    /// Command lines of what the box was running when it asked (newest last).
    pub running: Vec<String>,
    /// When, in milliseconds since the epoch.
    pub asked_ms: u64,
}

/// The owner's answer to a [`Question`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Answer {
    /// This once: the name for a minute, on the usual ports.
    Once,
    /// For good: an allow rule for the name is added to the box's policy.
    Always,
    /// Refused.
    Deny,
}

impl std::str::FromStr for Answer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "once" | "o" | "allow" => Ok(Self::Once),
            "always" | "a" => Ok(Self::Always),
            "deny" | "d" | "no" => Ok(Self::Deny),
            other => Err(format!("{other:?} is no answer (once, always or deny)")),
        }
    }
}
