//! The effects ledger: what a box did outside that no checkpoint can take
//! back. A restore puts files back; it cannot unsend a POST. Every request
//! the gateway let go that is not GET, HEAD or OPTIONS (a push among them),
//! and every connection it passed through without looking inside
//! ("opaque": whatever was sent is unknown), is an effect, derived here from
//! the gateway's log entries on the host side (the box can neither write nor
//! erase one) and kept in the store beside the log.

use serde::{Deserialize, Serialize};

use crate::egress::{LogEntry, LogKind, LogVerdict};

/// Methods that change nothing (by HTTP's contract): not effects.
const SAFE_METHODS: [&str; 3] = ["GET", "HEAD", "OPTIONS"];

/// Whether `method` changes nothing by HTTP's contract (GET, HEAD, OPTIONS).
pub fn is_safe_method(method: &str) -> bool {
    SAFE_METHODS.contains(&method)
}

/// From when effects are asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Since {
    /// Since the box was made.
    Start,
    /// Since a time (ms since the epoch).
    Time(u64),
    /// Since the box's checkpoint with this label was made.
    Checkpoint(crate::ids::Name),
}

/// What kind of effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EffectKind {
    /// An HTTP request that may change something.
    Request,
    /// A git push (a `git-receive-pack` request).
    Push,
    /// A connection the gateway did not look inside.
    Opaque,
}

/// One effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Effect {
    /// When, in milliseconds since the epoch.
    pub at_ms: u64,
    /// What kind.
    pub kind: EffectKind,
    /// The host.
    pub host: String,
    /// The port.
    pub port: u16,
    /// The method (requests and pushes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The method a method-override header asked the server to read the
    /// request as, where it differs (see [`crate::egress::LogEntry`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method_override: Option<String>,
    /// The request target (requests and pushes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The host's answer's status, where the gateway read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Bytes sent to the host.
    pub sent: u64,
    /// Bytes the host sent back.
    pub received: u64,
}

impl Effect {
    /// The effect a log entry records, if it records one: only what went
    /// out (allowed, or allowed and failed on the way: it may have arrived).
    pub fn of(entry: &LogEntry) -> Option<Self> {
        if entry.verdict == LogVerdict::Deny {
            return None;
        }
        let kind = match entry.kind {
            LogKind::Http => {
                let method = entry.method.as_deref()?;
                // Read as the server may read it: a GET that asks to be a
                // DELETE is one.
                let read_as = entry.method_override.as_deref();
                if std::iter::once(method).chain(read_as).all(is_safe_method) {
                    return None;
                }
                let push = entry
                    .target
                    .as_deref()
                    .is_some_and(|t| t.split('?').next().is_some_and(|p| p.ends_with("/git-receive-pack")));
                if push {
                    EffectKind::Push
                } else {
                    EffectKind::Request
                }
            }
            LogKind::Tcp if entry.opaque => EffectKind::Opaque,
            _ => return None,
        };
        let request = kind != EffectKind::Opaque;
        Some(Self {
            at_ms: entry.at_ms,
            kind,
            host: entry.name.clone(),
            port: entry.port,
            method: entry.method.clone().filter(|_| request),
            method_override: entry.method_override.clone().filter(|_| request),
            path: entry.target.clone().filter(|_| request),
            status: entry.status,
            sent: entry.sent,
            received: entry.received,
        })
    }
}

/// Effects in words, a line per host and kind, newest last: "3 requests to
/// api.github.com: POST /repos/o/r/pulls 201, ...", "2 opaque connections
/// to x.org:22 (4.1 KiB sent)". At most `per_line` requests are named on a line.
pub fn summary(effects: &[Effect], per_line: usize) -> Vec<String> {
    let mut groups: Vec<(EffectKind, String, Vec<&Effect>)> = Vec::new();
    for e in effects {
        let place = match e.kind {
            EffectKind::Opaque => format!("{}:{}", e.host, e.port),
            _ => e.host.clone(),
        };
        match groups.iter_mut().find(|(k, p, _)| *k == e.kind && *p == place) {
            Some((_, _, list)) => list.push(e),
            None => groups.push((e.kind, place, vec![e])),
        }
    }
    groups
        .into_iter()
        .map(|(kind, place, list)| {
            let n = list.len();
            let plural = |one: &str, many: &str| if n == 1 { one.to_string() } else { format!("{n} {many}") };
            match kind {
                EffectKind::Opaque => {
                    let sent: u64 = list.iter().map(|e| e.sent).sum();
                    let what = plural("1 opaque connection", "opaque connections");
                    format!("{what} to {place} ({} sent, contents unknown)", bytes(sent))
                }
                EffectKind::Request | EffectKind::Push => {
                    let what = if kind == EffectKind::Push {
                        plural("1 push", "pushes")
                    } else {
                        plural("1 request", "requests")
                    };
                    let mut named: Vec<String> = list
                        .iter()
                        .take(per_line)
                        .map(|e| {
                            let status = e.status.map_or_else(|| "-".to_string(), |s| s.to_string());
                            let method =
                                crate::egress::method_in_words(e.method.as_deref(), e.method_override.as_deref());
                            format!(
                                "{} {} {status}",
                                method.as_deref().unwrap_or("?"),
                                e.path.as_deref().unwrap_or("?")
                            )
                        })
                        .collect();
                    if n > per_line {
                        named.push(format!("and {} more", n - per_line));
                    }
                    format!("{what} to {place}: {}", named.join(", "))
                }
            }
        })
        .collect()
}

/// A byte count for people.
fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(kind: LogKind, method: Option<&str>, target: Option<&str>, verdict: LogVerdict, opaque: bool) -> LogEntry {
        LogEntry {
            method: method.map(str::to_string),
            target: target.map(str::to_string),
            sent: 100,
            received: 50,
            status: Some(201),
            opaque,
            ..LogEntry::new(5, kind, "api.example", 443, verdict)
        }
    }

    #[test]
    fn only_what_went_out_and_may_change_something() {
        use LogKind::*;
        use LogVerdict::*;
        let post = Effect::of(&entry(Http, Some("POST"), Some("/repos/o/r/pulls"), Allow, false)).unwrap();
        assert_eq!(
            (post.kind, post.status, post.path.as_deref()),
            (EffectKind::Request, Some(201), Some("/repos/o/r/pulls"))
        );
        let push = Effect::of(&entry(Http, Some("POST"), Some("/o/r.git/git-receive-pack"), Allow, false)).unwrap();
        assert_eq!(push.kind, EffectKind::Push);
        assert!(Effect::of(&entry(Http, Some("DELETE"), Some("/x"), Error, false)).is_some());
        for quiet in [
            entry(Http, Some("GET"), Some("/x"), Allow, false),
            entry(Http, Some("HEAD"), Some("/x"), Allow, false),
            entry(Http, Some("POST"), Some("/x"), Deny, false),
            entry(Tcp, None, None, Allow, false),
            entry(Tcp, None, None, Deny, true),
            entry(Dns, Some("A"), None, Allow, false),
        ] {
            assert_eq!(Effect::of(&quiet), None, "{quiet:?}");
        }
        // A GET a method-override header asks the server to read as a DELETE.
        let mut hidden = entry(Http, Some("GET"), Some("/x"), Allow, false);
        hidden.method_override = Some("DELETE".into());
        let hidden = Effect::of(&hidden).unwrap();
        assert_eq!(summary(&[hidden], 1), ["1 request to api.example: GET as DELETE /x 201"]);
        let opaque = Effect::of(&entry(Tcp, None, None, Allow, true)).unwrap();
        assert_eq!((opaque.kind, opaque.method.as_deref()), (EffectKind::Opaque, None));
        let lines = summary(&[post.clone(), post.clone(), post, opaque.clone(), opaque, push], 2);
        assert_eq!(
            lines,
            [
                "3 requests to api.example: POST /repos/o/r/pulls 201, POST /repos/o/r/pulls 201, and 1 more",
                "2 opaque connections to api.example:443 (200 B sent, contents unknown)",
                "1 push to api.example: POST /o/r.git/git-receive-pack 201",
            ]
        );
    }
}
