//! Secrets at the gateway, the request side. A box granted a secret holds
//! only its placeholder; on a request to the secret's one host (always looked
//! inside), the gateway writes the real value into the secret's one header,
//! replacing whatever the box put there: its placeholder, or a key of its
//! own (so nothing the box sends there goes to another account). Another
//! box's placeholder is refused. Nothing else in the request is touched: a
//! placeholder in the body, the target or another header stays a
//! placeholder. The value is counted against the secret's limits first, and a
//! killed secret is refused outright.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use moat_core::secrets::{BoxSecret, Limit, LimitKind, PLACEHOLDER_PREFIX};
use tokio::sync::watch;

/// The counters of every secret in use, shared by the boxes it is granted to.
#[derive(Default)]
pub struct Meters(Mutex<HashMap<i64, Arc<Meter>>>);

impl Meters {
    /// Secret `id`'s meter.
    pub fn of(&self, id: i64) -> Arc<Meter> {
        let mut meters = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(meters.entry(id).or_default())
    }
}

/// One secret's use: per window, per box and in all, since the gateway
/// started (use before that comes with the secret, from the store), and the
/// switch that stops it.
pub struct Meter {
    counts: Mutex<HashMap<(Option<String>, LimitKind), Count>>,
    killed: watch::Sender<bool>,
}

impl Default for Meter {
    fn default() -> Self {
        Self { counts: Mutex::new(HashMap::new()), killed: watch::channel(false).0 }
    }
}

#[derive(Clone, Copy)]
struct Count {
    window_start: Instant,
    in_window: u64,
    since_start: u64,
}

impl Count {
    fn new(now: Instant) -> Self {
        Self { window_start: now, in_window: 0, since_start: 0 }
    }
}

impl Meter {
    /// Stops every use now; connections that used it end.
    pub fn kill(&self) {
        self.killed.send_replace(true);
    }

    /// Whether the secret was killed.
    pub fn is_killed(&self) -> bool {
        *self.killed.borrow()
    }

    /// Resolves when the secret is killed.
    pub fn on_kill(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.killed.subscribe();
        async move {
            let _ = rx.wait_for(|k| *k).await;
        }
    }

    /// Why box `box_id` may not use `secret` now, if it may not.
    pub fn refusal(&self, box_id: &str, secret: &BoxSecret) -> Option<String> {
        let now = Instant::now();
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let scopes = [
            (None, &secret.shared_limits, &secret.used_by_all),
            (Some(box_id), &secret.own_limits, &secret.used_by_box),
        ];
        for (scope, limits, before) in scopes {
            for limit in limits.iter() {
                let count = counts.entry((scope.map(str::to_string), limit.kind)).or_insert(Count::new(now));
                let used = match limit.per_secs {
                    Some(per) => {
                        if now.duration_since(count.window_start) >= Duration::from_secs(per) {
                            count.window_start = now;
                            count.in_window = 0;
                        }
                        count.in_window
                    }
                    None => before.of(limit.kind) + count.since_start,
                };
                if used >= limit.amount {
                    let whose = if scope.is_some() { "this box's" } else { "all boxes'" };
                    return Some(format!("secret {}: {whose} limit of {} reached", secret.name, describe(limit)));
                }
            }
        }
        None
    }

    /// Counts `n` of `kind` used by box `box_id`.
    pub fn count(&self, box_id: &str, kind: LimitKind, n: u64) {
        let now = Instant::now();
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        for scope in [None, Some(box_id.to_string())] {
            let count = counts.entry((scope, kind)).or_insert(Count::new(now));
            count.in_window += n;
            count.since_start += n;
        }
    }
}

fn describe(limit: &Limit) -> String {
    match limit.per_secs {
        Some(per) => format!("{} {} per {per} s", limit.amount, limit.kind.as_str()),
        None => format!("{} {}", limit.amount, limit.kind.as_str()),
    }
}

/// A secret as one box holds it at the gateway.
#[derive(Clone)]
pub struct Armed {
    /// The secret.
    pub secret: Arc<BoxSecret>,
    /// Its meter.
    pub meter: Arc<Meter>,
}

/// A request the gateway will not send, and what the box is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The HTTP status.
    pub status: u16,
    /// Why.
    pub why: String,
}

/// A request head with the secrets for its host written in.
#[derive(Debug)]
pub struct Rewritten {
    /// The head to send.
    pub head: Vec<u8>,
    /// The secrets written into it (indexes into the slice given).
    pub injected: Vec<usize>,
}

/// Writes `armed` (the box's secrets bound to the request's host) into a
/// request head, for box `box_id`. Also asks for an unencoded response, so
/// that the gateway can check it for the values.
pub fn rewrite(head: &[u8], armed: &[Armed], box_id: &str) -> Result<Rewritten, Refusal> {
    let refuse = |status, why: String| Err(Refusal { status, why });
    // The head was parsed already: text, lines ending in LF or CRLF.
    let text = std::str::from_utf8(head).map_err(|_| Refusal { status: 400, why: "a head that is not text".into() })?;
    let mut lines: Vec<String> = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l).to_string()).collect();
    while lines.last().is_some_and(String::is_empty) {
        lines.pop();
    }
    let name_of = |line: &str| line.split_once(':').map(|(n, _)| n.to_string());
    let mut injected = Vec::new();
    for (i, a) in armed.iter().enumerate() {
        let s = &a.secret;
        let at: Vec<usize> = (1..lines.len())
            .filter(|&j| name_of(&lines[j]).is_some_and(|n| n.eq_ignore_ascii_case(&s.header)))
            .collect();
        let j = match at[..] {
            [] => continue,
            [j] => j,
            _ => return refuse(400, format!("two {} headers", s.header)),
        };
        let value = lines[j].split_once(':').map_or("", |(_, v)| v);
        if !value.contains(&s.placeholder) && value.contains(PLACEHOLDER_PREFIX) {
            return refuse(403, format!("a placeholder that is not this box's in {}", s.header));
        }
        if s.killed {
            return refuse(403, format!("secret {} was killed", s.name));
        }
        if let Some(why) = a.meter.refusal(box_id, s) {
            return refuse(429, why);
        }
        lines[j] = format!("{}: {}", s.header, s.format.replacen("{}", s.value.expose(), 1));
        injected.push(i);
    }
    lines.retain(|l| !name_of(l).is_some_and(|n| n.eq_ignore_ascii_case("accept-encoding")));
    lines.push("Accept-Encoding: identity".into());
    let mut out = lines.join("\r\n").into_bytes();
    out.extend_from_slice(b"\r\n\r\n");
    Ok(Rewritten { head: out, injected })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use moat_core::policy::HostName;
    use moat_core::secrets::{SecretUse, SecretValue};

    const MINE: &str = "moat-placeholder-00000000000000000000000000000000000000aa";
    const THEIRS: &str = "moat-placeholder-00000000000000000000000000000000000000bb";

    fn armed(limits: Vec<Limit>, killed: bool) -> Armed {
        let secret = BoxSecret {
            id: 1,
            name: "llm".into(),
            host: HostName::parse("api.example").unwrap(),
            header: "Authorization".into(),
            format: "Bearer {}".into(),
            placeholder: MINE.into(),
            value: SecretValue::new("sk-REAL").unwrap(),
            killed,
            shared_limits: Vec::new(),
            own_limits: limits,
            used_by_all: SecretUse::default(),
            used_by_box: SecretUse::default(),
        };
        Armed { secret: Arc::new(secret), meter: Arc::new(Meter::default()) }
    }

    fn head(lines: &[&str]) -> Vec<u8> {
        let mut h = lines.join("\r\n");
        h.push_str("\r\n\r\n");
        h.into_bytes()
    }

    fn text(r: &Rewritten) -> String {
        String::from_utf8(r.head.clone()).unwrap()
    }

    #[test]
    fn the_value_goes_into_the_one_header_only() {
        let a = [armed(Vec::new(), false)];
        let req = head(&[
            "POST /v1?key=moat-placeholder-00000000000000000000000000000000000000aa HTTP/1.1",
            "Host: api.example",
            &format!("authorization: Bearer {MINE}"),
            &format!("X-Other: {MINE}"),
            "Accept-Encoding: gzip, br",
        ]);
        let r = rewrite(&req, &a, "b1").unwrap();
        let t = text(&r);
        assert_eq!(r.injected, [0]);
        assert!(t.contains("\r\nAuthorization: Bearer sk-REAL\r\n"), "{t}");
        assert_eq!(t.matches("sk-REAL").count(), 1, "{t}");
        assert!(t.contains(&format!("X-Other: {MINE}")) && t.starts_with("POST /v1?key=moat-placeholder-"));
        assert!(t.ends_with("Accept-Encoding: identity\r\n\r\n") && !t.contains("gzip"), "{t}");
    }

    #[test]
    fn own_keys_are_overwritten_and_absent_headers_stay_absent() {
        let a = [armed(Vec::new(), false)];
        let r = rewrite(&head(&["GET / HTTP/1.1", "Host: api.example", "Authorization: Bearer sk-ATTACKER"]), &a, "b1");
        let t = text(&r.unwrap());
        assert!(t.contains("Authorization: Bearer sk-REAL") && !t.contains("ATTACKER"), "{t}");
        let r = rewrite(&head(&["GET / HTTP/1.1", "Host: api.example"]), &a, "b1").unwrap();
        assert!(r.injected.is_empty() && !text(&r).contains("sk-REAL"));
    }

    #[test]
    fn smuggling_and_stolen_placeholders_are_refused() {
        let a = [armed(Vec::new(), false)];
        let twice =
            head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: {MINE}"), "authorization: x"]);
        assert_eq!(rewrite(&twice, &a, "b1").unwrap_err().status, 400);
        let stolen = head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: Bearer {THEIRS}")]);
        assert_eq!(rewrite(&stolen, &a, "b1").unwrap_err().status, 403);
        let killed = [armed(Vec::new(), true)];
        let mine = head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: Bearer {MINE}")]);
        assert!(rewrite(&mine, &killed, "b1").unwrap_err().why.contains("killed"));
    }

    #[test]
    fn limits_refuse_with_429_and_windows_reset() {
        let a = [armed(vec![Limit::new(LimitKind::Requests, 2, Some(3600)).unwrap()], false)];
        let mine = head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: Bearer {MINE}")]);
        for _ in 0..2 {
            rewrite(&mine, &a, "b1").unwrap();
            a[0].meter.count("b1", LimitKind::Requests, 1);
        }
        let refused = rewrite(&mine, &a, "b1").unwrap_err();
        assert_eq!(refused.status, 429);
        assert!(refused.why.contains("2 requests per 3600 s"), "{}", refused.why);
        // Another box's own limit is its own.
        assert!(rewrite(&mine, &a, "b2").is_ok());
    }
}
