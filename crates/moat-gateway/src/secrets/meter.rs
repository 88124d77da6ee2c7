//! What a secret's use costs, counted at the gateway: each secret's meter
//! (requests, bytes and tokens, per window, per box and for all boxes, and the
//! switch that kills it), the entry of each request a secret went into
//! (finished, metered and logged when its answer is through), and the LLM
//! tokens hosts report in their answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use moat_core::egress::LogEntry;
use moat_core::secrets::{BoxSecret, Limit, LimitKind};
use moat_core::BoxId;

use crate::log::Logger;
use crate::refusal::Refusal;
use crate::secrets::scrub::find;

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
    used: HashMap<(Option<BoxId>, LimitKind), Count>,
    in_flight: HashMap<BoxId, usize>,
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
    pub fn admit(&self, box_id: &BoxId, secret: &BoxSecret) -> Result<(), Refusal> {
        if self.is_killed() {
            return Err(Refusal::SecretKilled(secret.name.clone()));
        }
        let now = Instant::now();
        let mut guard = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let Counts { used: counts, in_flight } = &mut *guard;
        let flowing = in_flight.entry(box_id.clone()).or_default();
        let after_the_fact = |l: &Limit| l.kind != LimitKind::Requests;
        if *flowing >= MAX_METERED_IN_FLIGHT
            && secret.shared_limits.iter().chain(&secret.own_limits).any(after_the_fact)
        {
            return Err(Refusal::SecretBusy { secret: secret.name.clone(), max: MAX_METERED_IN_FLIGHT });
        }
        let scopes = [
            (None, &secret.shared_limits, &secret.used_by_all),
            (Some(box_id), &secret.own_limits, &secret.used_by_box),
        ];
        for (scope, limits, before) in scopes {
            for limit in limits.iter() {
                let count = counts.entry((scope.cloned(), limit.kind)).or_insert(Count::new(now));
                count.per = limit.per_secs.map(Duration::from_secs);
                count.roll(now);
                let used = match count.per {
                    Some(_) => count.in_window,
                    None => before.of(limit.kind).saturating_add(count.since_start),
                };
                if used >= limit.amount {
                    let whose = if scope.is_some() { "this box's" } else { "all boxes'" };
                    let (secret, limit) = (secret.name.clone(), describe(limit));
                    return Err(Refusal::SecretLimit { secret, whose, limit });
                }
            }
        }
        add(counts, box_id, LimitKind::Requests, 1, now);
        *in_flight.entry(box_id.clone()).or_default() += 1;
        Ok(())
    }

    /// A request [`admit`](Self::admit)ted for box `box_id` is answered (or
    /// was never sent).
    pub fn release(&self, box_id: &BoxId) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = counts.in_flight.get_mut(box_id) {
            *n = n.saturating_sub(1);
        }
    }

    /// Counts `n` of `kind` used by box `box_id`.
    pub fn count(&self, box_id: &BoxId, kind: LimitKind, n: u64) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        add(&mut counts.used, box_id, kind, n, Instant::now());
    }
}

/// Adds `n` of `kind` to box `box_id`'s count and to the count of all boxes.
fn add(counts: &mut HashMap<(Option<BoxId>, LimitKind), Count>, box_id: &BoxId, kind: LimitKind, n: u64, now: Instant) {
    for scope in [None, Some(box_id.clone())] {
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

    /// Notes the status the host answered with.
    pub fn status(&mut self, status: u16) {
        if let Some(entry) = self.entry.as_mut() {
            entry.status = Some(status);
        }
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

/// Largest token count one field of a response may report; more is read as
/// this much (a body the box had echoed could say anything).
const MAX_REPORTED: u64 = 100_000_000;

/// Reads the token counts LLM APIs report in their responses (whole JSON
/// bodies, and streamed events): `input_tokens`/`output_tokens`
/// (Anthropic, OpenAI Responses), `prompt_tokens`/`completion_tokens`
/// (OpenAI chat), `promptTokenCount`/`candidatesTokenCount` (Gemini), and
/// the totals. Streams report running totals, so the largest of each is
/// taken; each is capped at `MAX_REPORTED`. A total is never taken for
/// less than its parts (a body can hold any JSON the box asked for).
#[derive(Default)]
pub struct TokenCount {
    tail: Vec<u8>,
    max: [u64; TOKEN_KEYS.len()],
    /// Bytes read since a count was last found.
    unreported: u64,
    /// Bytes of generated text (string values of [`TEXT_KEYS`]) read since
    /// a count was last found, and whether the read is inside one.
    unreported_text: u64,
    in_text: bool,
    escaped: bool,
}

/// The keys whose string values are what a model generates, as the APIs
/// stream them: Anthropic's `text`, `thinking` and `partial_json`, OpenAI's
/// `content`, `arguments` and `delta`, Gemini's `text`.
const TEXT_KEYS: [&[u8]; 6] = [b"text", b"thinking", b"partial_json", b"content", b"arguments", b"delta"];

const TOKEN_KEYS: [&[u8]; 9] = [
    b"\"input_tokens\"",
    b"\"prompt_tokens\"",
    b"\"promptTokenCount\"",
    b"\"output_tokens\"",
    b"\"completion_tokens\"",
    b"\"candidatesTokenCount\"",
    b"\"total_tokens\"",
    b"\"totalTokenCount\"",
    b"\"thoughtsTokenCount\"",
];

impl TokenCount {
    /// Reads more of the body.
    pub fn feed(&mut self, data: &[u8]) {
        self.unreported = self.unreported.saturating_add(data.len() as u64);
        let mut window = std::mem::take(&mut self.tail);
        let fresh = window.len();
        window.extend_from_slice(data);
        self.count_text(&window, fresh);
        for (max, key) in self.max.iter_mut().zip(TOKEN_KEYS) {
            let mut at = 0;
            while let Some(i) = window.get(at..).and_then(|w| find(w, key)) {
                let mut j = at + i + key.len();
                while window.get(j).is_some_and(|b| *b == b' ' || *b == b':') {
                    j += 1;
                }
                let number = window.get(j..).unwrap_or_default();
                let digits = number.iter().take_while(|b| b.is_ascii_digit()).count();
                // A number cut by the end of this read is read whole next time.
                if digits > 0 && j + digits < window.len() {
                    let text = std::str::from_utf8(number.get(..digits).unwrap_or_default()).unwrap_or("0");
                    let n = text.parse().unwrap_or(u64::MAX).min(MAX_REPORTED);
                    *max = (*max).max(n);
                    // A report read last time already (in the tail kept)
                    // does not count again what came after it.
                    if j + digits >= fresh {
                        self.unreported = 0;
                        self.unreported_text = 0;
                    }
                }
                at = j;
            }
        }
        let keep = window.len().saturating_sub(48);
        self.tail = window.split_off(keep);
    }

    /// The tokens reported.
    pub fn total(&self) -> u64 {
        let [input, prompt, gemini_in, output, completion, gemini_out, total, gemini_total, thoughts] = self.max;
        let parts = input.max(prompt).max(gemini_in).saturating_add(output.max(completion).max(gemini_out));
        parts.saturating_add(thoughts).max(total).max(gemini_total)
    }

    /// The tokens of a body cut before its end (the box went away, or the
    /// host did): those reported, and a token for every [`BYTES_PER_TOKEN`]
    /// bytes of generated text read since the last report (of any bytes,
    /// in a body with no text this knows). Streams report output tokens at
    /// their end: a box must not take a stream's output unbilled by hanging
    /// up before its last event, nor an agent's interrupt be billed for the
    /// events' framing.
    pub fn total_cut(&self) -> u64 {
        let unreported = if self.unreported_text > 0 { self.unreported_text } else { self.unreported };
        self.total().saturating_add(unreported.div_ceil(BYTES_PER_TOKEN))
    }

    /// Counts the bytes of generated text in `window` from `fresh` on (what
    /// is before is the last read's tail, looked back at for keys).
    fn count_text(&mut self, window: &[u8], fresh: usize) {
        for (i, &b) in window.iter().enumerate().skip(fresh) {
            if self.in_text {
                match (self.escaped, b) {
                    (true, _) => (self.escaped, self.unreported_text) = (false, self.unreported_text + 1),
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_text = false,
                    (false, _) => self.unreported_text += 1,
                }
            } else if b == b'"' && text_key_before(window.get(..i).unwrap_or_default()) {
                self.in_text = true;
            }
        }
    }
}

/// Whether `before` ends in `"KEY":` (spaces allowed) for a key of
/// [`TEXT_KEYS`]: the string that starts next is generated text.
fn text_key_before(before: &[u8]) -> bool {
    let trimmed = |s: &[u8]| -> usize { s.len() - s.iter().rev().take_while(|b| b.is_ascii_whitespace()).count() };
    let end = trimmed(before);
    let Some(rest) = before.get(..end).and_then(|s| s.strip_suffix(b":")) else { return false };
    let end = trimmed(rest);
    let Some(rest) = rest.get(..end).and_then(|s| s.strip_suffix(b"\"")) else { return false };
    TEXT_KEYS.iter().any(|key| rest.strip_suffix(*key).is_some_and(|s| s.ends_with(b"\"")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
pub(crate) mod tests {
    use super::*;
    use moat_core::egress::{LogKind, LogVerdict};
    use moat_core::policy::HostName;
    use moat_core::secrets::{SecretUse, SecretValue};

    /// Box `s`'s id.
    pub fn id(s: &str) -> BoxId {
        BoxId::parse(s).unwrap()
    }

    /// The placeholder of the secret [`armed`] makes.
    pub const MINE: &str = "moat-placeholder-00000000000000000000000000000000000000aa";

    /// The box's secret `llm` for `api.example`, with these limits of its own.
    pub fn armed(limits: Vec<Limit>, killed: bool) -> Armed {
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

    #[test]
    fn racing_requests_never_pass_the_last_free_place_together() {
        let a = armed(vec![Limit::new(LimitKind::Requests, 50, None).unwrap()], false);
        let admitted = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..20 {
                        if a.meter.admit(&id("b1"), &a.secret).is_ok() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 50);
    }

    #[test]
    fn answers_owed_under_a_tokens_limit_are_capped() {
        let a = armed(vec![Limit::new(LimitKind::Tokens, 1000, None).unwrap()], false);
        for _ in 0..MAX_METERED_IN_FLIGHT {
            a.meter.admit(&id("b1"), &a.secret).unwrap();
        }
        assert!(a.meter.admit(&id("b1"), &a.secret).unwrap_err().to_string().contains("still being answered"));
        assert!(a.meter.admit(&id("b2"), &a.secret).is_ok(), "another box has its own");
        a.meter.release(&id("b1"));
        assert!(a.meter.admit(&id("b1"), &a.secret).is_ok());
        // Without such a limit there is no cap.
        let free = armed(Vec::new(), false);
        for _ in 0..2 * MAX_METERED_IN_FLIGHT {
            free.meter.admit(&id("b1"), &free.secret).unwrap();
        }
        // A host that reports no usage is charged by the bytes.
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let entry = crate::log::entry(LogKind::Http, "api.example", 443, LogVerdict::Allow);
        let mut metered = Metered::new(entry, vec![a.clone()], Logger::new(id("b1"), tx), &Arc::new(400.into()));
        metered.finish(3600, 0, None);
        assert_eq!(rx.try_recv().unwrap().1.tokens, Some(1000));
        assert!(a.meter.admit(&id("b1"), &a.secret).unwrap_err().to_string().contains("1000 tokens"));
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
        let entry = crate::log::entry(LogKind::Http, "api.example", 443, LogVerdict::Allow);
        let metered = Metered::new(entry, vec![a.clone()], Logger::new(id("b1"), tx), &Arc::new(150.into()));
        drop(metered);
        let (_, logged) = rx.try_recv().unwrap();
        assert_eq!((logged.sent, logged.secret.as_deref()), (150, Some("llm")));
        assert!(logged.reason.unwrap().contains("before the response"));
        assert!(a.meter.admit(&id("b1"), &a.secret).unwrap_err().to_string().contains("100 bytes"));
    }

    #[test]
    fn tokens_from_whole_and_streamed_bodies() {
        let mut t = TokenCount::default();
        let body = br#"{"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
        for piece in body.chunks(5) {
            t.feed(piece);
        }
        assert_eq!(t.total(), 42);
        let mut t = TokenCount::default();
        t.feed(b"event: message_start\ndata: {\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}\n\n");
        t.feed(b"event: message_delta\ndata: {\"usage\":{\"output_tokens\": 15}}\n\n");
        assert_eq!(t.total(), 40);
        let mut t = TokenCount::default();
        t.feed(b"{\"cache_read_input_tokens\":999,\"input_tokens\":3,\"output_tokens\":4}");
        assert_eq!(t.total(), 7);
    }

    /// A stream cut after its deltas but before the event that counts them
    /// is billed for what came (it was billed its input token count alone).
    #[test]
    fn a_stream_cut_before_its_count_is_billed_for_what_came() {
        let mut t = TokenCount::default();
        t.feed(b"event: message_start\ndata: {\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}\n\n");
        assert_eq!(t.total_cut(), 11, "nothing unreported yet");
        let delta = format!("event: content_block_delta\ndata: {{\"delta\":{{\"text\":\"{}\"}}}}\n\n", "x".repeat(950));
        for _ in 0..20 {
            t.feed(delta.as_bytes());
        }
        assert_eq!(t.total(), 11);
        assert!(t.total_cut() >= 11 + 20 * 950 / 4, "{}", t.total_cut());
        t.feed(b"event: message_delta\ndata: {\"usage\":{\"output_tokens\":5000}}\n\n");
        assert_eq!(t.total(), 5010);
        assert!(t.total_cut() < 5010 + 16, "what the report counted is not counted twice: {}", t.total_cut());
        // An interrupt after small deltas is billed their text, not their framing.
        let mut t = TokenCount::default();
        t.feed(b"data: {\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}\n\n");
        let delta = b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi \\\"x\\\" \"}}\n\n";
        for piece in delta.repeat(10).chunks(7) {
            t.feed(piece);
        }
        assert_eq!(t.total_cut(), 11 + (10 * 7_u64).div_ceil(4), "7 bytes of text a delta, however split");
    }

    #[test]
    fn token_counts_are_capped_and_totals_are_never_less_than_their_parts() {
        let mut t = TokenCount::default();
        t.feed(b"{\"input_tokens\":99999999999999999999999999,\"output_tokens\":18446744073709551615}");
        assert_eq!(t.total(), 2 * MAX_REPORTED);
        // A total less than its parts (a tool's JSON input, say) is not taken.
        let mut t = TokenCount::default();
        t.feed(b"{\"input\":{\"total_tokens\":1},\"usage\":{\"input_tokens\":30,\"output_tokens\":12}}");
        assert_eq!(t.total(), 42);
        let mut t = TokenCount::default();
        t.feed(b"{\"usageMetadata\":{\"promptTokenCount\":7,\"candidatesTokenCount\":5,\"totalTokenCount\":12}}");
        assert_eq!(t.total(), 12);
    }
}
