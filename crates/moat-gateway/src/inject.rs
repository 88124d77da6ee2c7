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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use moat_core::egress::LogEntry;
use moat_core::secrets::{same_header, BoxSecret, Limit, LimitKind, PLACEHOLDER_PREFIX};

use crate::boxnet::Logger;
use crate::http;

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
#[derive(Default)]
pub struct Meter {
    counts: Mutex<Counts>,
    killed: std::sync::atomic::AtomicBool,
}

/// Counts per (box or all, kind), and each box's requests still being
/// answered.
#[derive(Default)]
struct Counts {
    used: HashMap<(Option<String>, LimitKind), Count>,
    in_flight: HashMap<String, usize>,
}

/// Requests one box may have in flight with a secret whose tokens or bytes
/// are limited: those are counted as answers finish, so without a cap a box
/// could send many at once past a nearly spent limit.
pub const MAX_METERED_IN_FLIGHT: usize = 4;

#[derive(Clone, Copy)]
struct Count {
    window_start: Instant,
    /// The window of the limit on this count (`None`: no window).
    per: Option<Duration>,
    in_window: u64,
    since_start: u64,
}

impl Count {
    fn new(now: Instant) -> Self {
        Self { window_start: now, per: None, in_window: 0, since_start: 0 }
    }

    /// Starts a new window if the current one is over.
    fn roll(&mut self, now: Instant) {
        if self.per.is_some_and(|per| now.duration_since(self.window_start) >= per) {
            self.window_start = now;
            self.in_window = 0;
        }
    }

    fn add(&mut self, n: u64) {
        self.in_window = self.in_window.saturating_add(n);
        self.since_start = self.since_start.saturating_add(n);
    }
}

impl Meter {
    /// Stops every use now; connections that used it end.
    pub fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
    }

    /// Whether the secret was killed.
    pub fn is_killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }

    /// Lets box `box_id` use `secret` for one more request, counted and in
    /// flight until [`release`](Self::release)d, or says why not. Checked and
    /// counted under one lock, so that requests racing on several
    /// connections cannot all pass the last free place.
    pub fn admit(&self, box_id: &str, secret: &BoxSecret) -> Result<(), String> {
        if self.is_killed() {
            return Err(format!("secret {} was killed", secret.name));
        }
        let now = Instant::now();
        let mut guard = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let Counts { used: counts, in_flight } = &mut *guard;
        let flowing = in_flight.entry(box_id.to_string()).or_default();
        let after_the_fact = |l: &Limit| l.kind != LimitKind::Requests;
        if *flowing >= MAX_METERED_IN_FLIGHT
            && secret.shared_limits.iter().chain(&secret.own_limits).any(after_the_fact)
        {
            return Err(format!(
                "secret {}: {MAX_METERED_IN_FLIGHT} requests with it are still being answered (its tokens or bytes \
                 are limited, and counted as answers finish)",
                secret.name
            ));
        }
        let scopes = [
            (None, &secret.shared_limits, &secret.used_by_all),
            (Some(box_id), &secret.own_limits, &secret.used_by_box),
        ];
        for (scope, limits, before) in scopes {
            for limit in limits.iter() {
                let count = counts.entry((scope.map(str::to_string), limit.kind)).or_insert(Count::new(now));
                count.per = limit.per_secs.map(Duration::from_secs);
                count.roll(now);
                let used = match count.per {
                    Some(_) => count.in_window,
                    None => before.of(limit.kind).saturating_add(count.since_start),
                };
                if used >= limit.amount {
                    let whose = if scope.is_some() { "this box's" } else { "all boxes'" };
                    return Err(format!("secret {}: {whose} limit of {} reached", secret.name, describe(limit)));
                }
            }
        }
        add(counts, box_id, LimitKind::Requests, 1, now);
        *in_flight.entry(box_id.to_string()).or_default() += 1;
        Ok(())
    }

    /// A request [`admit`](Self::admit)ted for box `box_id` is answered (or
    /// was never sent).
    pub fn release(&self, box_id: &str) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = counts.in_flight.get_mut(box_id) {
            *n = n.saturating_sub(1);
        }
    }

    /// Counts `n` of `kind` used by box `box_id`.
    pub fn count(&self, box_id: &str, kind: LimitKind, n: u64) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        add(&mut counts.used, box_id, kind, n, Instant::now());
    }
}

/// Adds `n` of `kind` to box `box_id`'s count and to the count of all boxes.
fn add(counts: &mut HashMap<(Option<String>, LimitKind), Count>, box_id: &str, kind: LimitKind, n: u64, now: Instant) {
    for scope in [None, Some(box_id.to_string())] {
        let count = counts.entry((scope, kind)).or_insert(Count::new(now));
        count.roll(now);
        count.add(n);
    }
}

fn describe(limit: &Limit) -> String {
    match limit.per_secs {
        Some(per) => format!("{} {} per {per} s", limit.amount, limit.kind.as_str()),
        None => format!("{} {}", limit.amount, limit.kind.as_str()),
    }
}

/// Request headers dropped on the way to a host a secret is bound to.
const UNCHECKABLE: [&str; 4] = ["accept-encoding", "te", "range", "if-range"];

/// A secret as one box holds it at the gateway.
#[derive(Clone)]
pub struct Armed {
    /// The secret.
    pub secret: Arc<BoxSecret>,
    /// Its meter.
    pub meter: Arc<Meter>,
}

/// A request a secret was written into, until its response is through: its
/// log entry and the secrets to meter. Dropped unfinished (the connection
/// ended first), it is still metered and logged.
pub struct Metered {
    entry: Option<LogEntry>,
    armed: Vec<Armed>,
    logger: Logger,
    /// Bytes of the request sent so far (its body may still be going).
    request_bytes: Arc<AtomicU64>,
}

impl Metered {
    /// `entry` of a request `armed` went into, to be logged by `logger`;
    /// `request_bytes` counts the request as it goes.
    pub fn new(mut entry: LogEntry, armed: Vec<Armed>, logger: Logger, request_bytes: &Arc<AtomicU64>) -> Self {
        let names: Vec<&str> = armed.iter().map(|a| a.secret.name.as_str()).collect();
        entry.secret = Some(names.join(","));
        Self { entry: Some(entry), armed, logger, request_bytes: Arc::clone(request_bytes) }
    }

    /// The response is through (`received` bytes of it, `tokens` reported),
    /// or cut (`failed`): meters the secrets and logs the request. Where a
    /// secret's tokens are limited and the host reported none, a token is
    /// counted per [`BYTES_PER_TOKEN`] bytes both ways.
    pub fn finish(&mut self, received: u64, tokens: u64, failed: Option<&str>) {
        let Some(mut entry) = self.entry.take() else { return };
        entry.sent = self.request_bytes.load(Ordering::Relaxed);
        entry.received = received;
        let bytes = received.saturating_add(entry.sent);
        let tokens_limited = self.armed.iter().any(|a| {
            let s = &a.secret;
            s.shared_limits.iter().chain(&s.own_limits).any(|l| l.kind == LimitKind::Tokens)
        });
        let tokens = if tokens == 0 && tokens_limited { bytes / BYTES_PER_TOKEN } else { tokens };
        entry.tokens = (tokens > 0).then_some(tokens);
        if let Some(why) = failed {
            entry.reason.get_or_insert_with(|| why.to_string());
        }
        for a in &self.armed {
            a.meter.count(&self.logger.box_id, LimitKind::Tokens, tokens);
            a.meter.count(&self.logger.box_id, LimitKind::Bytes, bytes);
            a.meter.release(&self.logger.box_id);
        }
        // What the secret's use is billed from: never lost to a full backlog.
        self.logger.log_surely(entry);
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        self.finish(0, 0, Some("the connection ended before the response"));
    }
}

/// Bytes counted as one token where a host reports no usage (about what
/// LLM tokenizers average on English text and code).
pub const BYTES_PER_TOKEN: u64 = 4;

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
    let mut lines =
        http::head_lines(head).ok_or_else(|| Refusal { status: 400, why: "a head that is not text".into() })?;
    let name_of = |line: &str| line.split_once(':').map(|(n, _)| n.to_string());
    // Where each secret goes, every refusal decided before any is counted.
    let mut found = Vec::new();
    for (i, a) in armed.iter().enumerate() {
        let s = &a.secret;
        let at: Vec<usize> =
            (1..lines.len()).filter(|&j| name_of(&lines[j]).is_some_and(|n| same_header(&n, &s.header))).collect();
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
        found.push((i, j));
    }
    let mut injected: Vec<usize> = Vec::new();
    for (i, j) in found {
        let (a, s) = (&armed[i], &armed[i].secret);
        if let Err(why) = a.meter.admit(box_id, s) {
            for &k in &injected {
                armed[k].meter.release(box_id);
            }
            return refuse(429, why);
        }
        lines[j] = format!("{}: {}", s.header, s.format.replacen("{}", s.value.expose(), 1));
        injected.push(i);
    }
    // Whatever would make the response harder to check for the values
    // goes: a compressed or transfer-coded body, and a byte range (a value
    // echoed back in slices would pass the scrubber piece by piece).
    lines.retain(|l| !name_of(l).is_some_and(|n| UNCHECKABLE.iter().any(|u| n.eq_ignore_ascii_case(u))));
    lines.push("Accept-Encoding: identity".into());
    Ok(Rewritten { head: http::join_head(&lines), injected })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use moat_core::egress::{LogKind, LogVerdict};
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
            value: SecretValue::new("sk-REAL-0123456789").unwrap(),
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
        assert!(t.contains("\r\nAuthorization: Bearer sk-REAL-0123456789\r\n"), "{t}");
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
        let spelled =
            head(&["GET / HTTP/1.1", "Host: api.example", &format!("Authorization: {MINE}"), "AUTHORIZATION: x"]);
        assert_eq!(rewrite(&spelled, &a, "b1").unwrap_err().status, 400);
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
        }
        let refused = rewrite(&mine, &a, "b1").unwrap_err();
        assert_eq!(refused.status, 429);
        assert!(refused.why.contains("2 requests per 3600 s"), "{}", refused.why);
        // Another box's own limit is its own.
        assert!(rewrite(&mine, &a, "b2").is_ok());
    }

    #[test]
    fn racing_requests_never_pass_the_last_free_place_together() {
        let a = armed(vec![Limit::new(LimitKind::Requests, 50, None).unwrap()], false);
        let admitted = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..20 {
                        if a.meter.admit("b1", &a.secret).is_ok() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 50);
    }

    #[test]
    fn header_names_match_as_servers_read_them() {
        assert!(same_header("X_Api_Key", "x-api-key") && same_header("AUTHORIZATION", "Authorization"));
        assert!(!same_header("X-Api-Keys", "x-api-key") && !same_header("X.Api.Key", "x-api-key"));
    }

    #[test]
    fn answers_owed_under_a_tokens_limit_are_capped() {
        let a = armed(vec![Limit::new(LimitKind::Tokens, 1000, None).unwrap()], false);
        for _ in 0..MAX_METERED_IN_FLIGHT {
            a.meter.admit("b1", &a.secret).unwrap();
        }
        assert!(a.meter.admit("b1", &a.secret).unwrap_err().contains("still being answered"));
        assert!(a.meter.admit("b2", &a.secret).is_ok(), "another box has its own");
        a.meter.release("b1");
        assert!(a.meter.admit("b1", &a.secret).is_ok());
        // Without such a limit there is no cap.
        let free = armed(Vec::new(), false);
        for _ in 0..2 * MAX_METERED_IN_FLIGHT {
            free.meter.admit("b1", &free.secret).unwrap();
        }
        // A host that reports no usage is charged by the bytes.
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let entry = crate::boxnet::entry(LogKind::Http, "api.example", 443, LogVerdict::Allow);
        let mut metered = Metered::new(entry, vec![a.clone()], Logger::new("b1".into(), tx), &Arc::new(400.into()));
        metered.finish(3600, 0, None);
        assert_eq!(rx.try_recv().unwrap().1.tokens, Some(1000));
        assert!(a.meter.admit("b1", &a.secret).unwrap_err().contains("1000 tokens"));
    }

    #[test]
    fn counts_start_a_new_window_when_the_old_one_is_over() {
        let now = Instant::now();
        let mut count = Count::new(now);
        count.per = Some(Duration::from_secs(60));
        count.add(u64::MAX);
        count.add(5);
        assert_eq!(count.in_window, u64::MAX, "saturates");
        count.roll(now + Duration::from_secs(59));
        assert_eq!(count.in_window, u64::MAX);
        count.roll(now + Duration::from_secs(60));
        assert_eq!((count.in_window, count.since_start), (0, u64::MAX));
    }

    #[test]
    fn a_request_cut_before_its_answer_is_still_metered_and_logged() {
        let a = armed(vec![Limit::new(LimitKind::Bytes, 100, None).unwrap()], false);
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let entry = crate::boxnet::entry(LogKind::Http, "api.example", 443, LogVerdict::Allow);
        let metered = Metered::new(entry, vec![a.clone()], Logger::new("b1".into(), tx), &Arc::new(150.into()));
        drop(metered);
        let (_, logged) = rx.try_recv().unwrap();
        assert_eq!((logged.sent, logged.secret.as_deref()), (150, Some("llm")));
        assert!(logged.reason.unwrap().contains("before the response"));
        assert!(a.meter.admit("b1", &a.secret).unwrap_err().contains("100 bytes"));
    }
}
