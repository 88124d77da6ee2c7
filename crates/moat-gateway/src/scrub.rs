//! Secrets at the gateway, the response side. On a connection to a host
//! that one of the box's secrets is bound to, every response is read before
//! the box sees it: the box's secret values are cut out of its headers and
//! body (which is decoded first when the host compressed it anyway, though
//! asked not to; an encoding the gateway cannot read is refused), and the
//! LLM tokens it reports are counted. The body reaches the box re-framed
//! (chunked, or until close for HTTP/1.0), never compressed.

use std::io::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Mutex};

use crate::inject::Metered;

/// Largest response head read.
const MAX_HEAD: usize = 64 << 10;
const MAX_HEADERS: usize = 128;
/// Compressed bytes decoded at once (at most about a megabyte out).
const DECODE_STEP: usize = 1024;
/// What a value is replaced with.
const REMOVED: &[u8] = b"[secret removed by moat]";

/// Largest token count one field of a response may report; more is read as
/// this much (a body the box had echoed could say anything).
const MAX_REPORTED: u64 = 100_000_000;

/// What the gateway knows of a request whose response comes next.
pub struct Expect {
    /// It was a HEAD request (its response has no body).
    pub head: bool,
    /// It was HTTP/1.0 (no chunked responses).
    pub http10: bool,
    /// It asked for the connection to end after its response.
    pub close: bool,
    /// The box's secret values as the request went out (cut from its
    /// response: a secret granted since the connection opened included).
    pub values: Arc<[String]>,
    /// For a request a secret was written into: its entry, to finish and log.
    pub metered: Option<Metered>,
    /// A request the gateway refused: this answer, in its turn, then the end.
    pub refusal: Option<(u16, String)>,
    /// Counts the response as still to come while it lives.
    pub in_flight: Option<InFlight>,
}

impl Expect {
    /// The response to a request the host was sent.
    pub fn response(head: bool, http10: bool, close: bool, values: Arc<[String]>) -> Self {
        Self { head, http10, close, values, metered: None, refusal: None, in_flight: None }
    }

    /// The gateway's own answer to a refused request.
    pub fn refused(status: u16, why: String) -> Self {
        Self { refusal: Some((status, why)), ..Self::response(false, false, true, Arc::from([])) }
    }
}

/// One response still to come on a connection, counted while it lives (so
/// that a connection waiting on a slow answer is not taken for idle).
pub struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    /// Counts one more in `count`.
    pub fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(count))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Cuts secret values out of a stream of bytes. What it holds back for the
/// next bytes is decided without looking at the values (the trailing run of
/// printable bytes, as long as the longest form less one): were it the tail
/// that starts a value, the sizes of the pieces the box gets would tell it,
/// byte by byte, what the value starts with. A streamed response (server-sent
/// events, whose events end in a newline) still reaches the box event by event.
pub struct Scrubber {
    forms: Vec<Vec<u8>>,
    longest: usize,
    pending: Vec<u8>,
}

impl Scrubber {
    /// Cuts out each of `values` as it is, and as JSON strings and URLs
    /// write it.
    pub fn new(values: &[String]) -> Self {
        let mut forms: Vec<Vec<u8>> = Vec::new();
        for v in values.iter().filter(|v| !v.is_empty()) {
            for form in encodings(v) {
                if !forms.contains(&form) {
                    forms.push(form);
                }
            }
        }
        let longest = forms.iter().map(Vec::len).max().unwrap_or(0);
        Self { forms, longest, pending: Vec::new() }
    }

    /// What of `data` (and what came before) is safe to pass on now.
    pub fn push(&mut self, data: &[u8]) -> Vec<u8> {
        self.pending.extend_from_slice(data);
        self.cut();
        let ready = self.pending.len() - self.held();
        self.pending.drain(..ready).collect()
    }

    /// How much of the end of what is pending could be the start of a value
    /// (values are printable ASCII): the same whatever the values are.
    fn held(&self) -> usize {
        let printable = self.pending.iter().rev().take_while(|b| (0x20..0x7f).contains(*b)).count();
        printable.min(self.longest.saturating_sub(1))
    }

    /// The rest, at the end of the stream.
    pub fn finish(&mut self) -> Vec<u8> {
        self.cut();
        std::mem::take(&mut self.pending)
    }

    fn cut(&mut self) {
        for value in &self.forms {
            let mut at = 0;
            while let Some(i) = find(&self.pending[at..], value) {
                let start = at + i;
                self.pending.splice(start..start + value.len(), REMOVED.iter().copied());
                at = start + REMOVED.len();
            }
        }
    }
}

/// The ways a response may spell `value`: as it is; in a JSON string
/// (quotes and backslashes escaped, with or without `/` escaped, or every
/// character that is not a letter or digit as `\u00XX`); percent-encoded,
/// in either case of hex.
fn encodings(value: &str) -> Vec<Vec<u8>> {
    let json = value.replace('\\', "\\\\").replace('"', "\\\"");
    let mut forms = vec![value.to_string(), json.clone(), json.replace('/', "\\/")];
    let escaped = |f: &dyn Fn(u8) -> String| -> String {
        value.bytes().map(|b| if b.is_ascii_alphanumeric() { char::from(b).to_string() } else { f(b) }).collect()
    };
    forms.push(escaped(&|b| format!("\\u{b:04x}")));
    forms.push(escaped(&|b| format!("\\u{b:04X}")));
    let unreserved = |b: u8| b.is_ascii_alphanumeric() || b"-._~".contains(&b);
    let percent = |upper: bool| -> String {
        value
            .bytes()
            .map(|b| match (unreserved(b), upper) {
                (true, _) => char::from(b).to_string(),
                (false, true) => format!("%{b:02X}"),
                (false, false) => format!("%{b:02x}"),
            })
            .collect()
    };
    forms.push(percent(true));
    forms.push(percent(false));
    forms.into_iter().map(String::into_bytes).collect()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Reads the token counts LLM APIs report in their responses (whole JSON
/// bodies, and streamed events): `input_tokens`/`output_tokens`
/// (Anthropic, OpenAI Responses), `prompt_tokens`/`completion_tokens`
/// (OpenAI chat), `promptTokenCount`/`candidatesTokenCount` (Gemini), and
/// the totals. Streams report running totals, so the largest of each is
/// taken; each is capped at [`MAX_REPORTED`]. A total is never taken for
/// less than its parts (a body can hold any JSON the box asked for).
#[derive(Default)]
pub struct TokenCount {
    tail: Vec<u8>,
    max: [u64; TOKEN_KEYS.len()],
}

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
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(data);
        for (k, key) in TOKEN_KEYS.iter().enumerate() {
            let mut at = 0;
            while let Some(i) = find(&window[at..], key) {
                let mut j = at + i + key.len();
                while window.get(j).is_some_and(|b| *b == b' ' || *b == b':') {
                    j += 1;
                }
                let digits = window[j..].iter().take_while(|b| b.is_ascii_digit()).count();
                // A number cut by the end of this read is read whole next time.
                if digits > 0 && j + digits < window.len() {
                    let text = std::str::from_utf8(&window[j..j + digits]).unwrap_or("0");
                    let n = text.parse().unwrap_or(u64::MAX).min(MAX_REPORTED);
                    self.max[k] = self.max[k].max(n);
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
}

/// Decodes a chunked body.
#[derive(Default)]
struct Dechunk {
    state: Chunk,
    line: Vec<u8>,
}

#[derive(Default, PartialEq)]
enum Chunk {
    #[default]
    Size,
    Data(u64),
    DataEnd,
    Trailer,
    Done,
}

impl Dechunk {
    /// Feeds `input`; decoded bytes go to `out`. Returns bytes consumed
    /// (less than all only once the body is done).
    fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, &'static str> {
        let mut i = 0;
        while i < input.len() && self.state != Chunk::Done {
            match self.state {
                Chunk::Data(left) => {
                    let n = (left.min((input.len() - i) as u64)) as usize;
                    out.extend_from_slice(&input[i..i + n]);
                    i += n;
                    self.state = if left == n as u64 { Chunk::DataEnd } else { Chunk::Data(left - n as u64) };
                }
                _ => {
                    let b = input[i];
                    i += 1;
                    if b != b'\n' {
                        if self.line.len() > 4096 {
                            return Err("a chunk line too long");
                        }
                        self.line.push(b);
                        continue;
                    }
                    let line = std::mem::take(&mut self.line);
                    let line = line.strip_suffix(b"\r").unwrap_or(&line);
                    self.state = match self.state {
                        Chunk::Size => {
                            let hex = line.split(|c| *c == b';').next().unwrap_or_default();
                            let hex = std::str::from_utf8(hex).map_err(|_| "a bad chunk size")?.trim();
                            match u64::from_str_radix(hex, 16).map_err(|_| "a bad chunk size")? {
                                0 => Chunk::Trailer,
                                n => Chunk::Data(n),
                            }
                        }
                        Chunk::DataEnd if line.is_empty() => Chunk::Size,
                        Chunk::DataEnd => return Err("a chunk longer than its size"),
                        _ if line.is_empty() => Chunk::Done,
                        _ => Chunk::Trailer,
                    };
                }
            }
        }
        Ok(i)
    }
}

enum Framing {
    None,
    Length(u64),
    Chunked,
    UntilClose,
}

enum Decoder {
    Identity,
    Gzip(Box<flate2::write::GzDecoder<Vec<u8>>>),
    Zlib(Box<flate2::write::ZlibDecoder<Vec<u8>>>),
}

impl Decoder {
    fn decode(&mut self, data: &[u8]) -> Result<Vec<u8>, &'static str> {
        match self {
            Self::Identity => Ok(data.to_vec()),
            Self::Gzip(d) => {
                d.write_all(data).map_err(|_| "a bad gzip body")?;
                Ok(std::mem::take(d.get_mut()))
            }
            Self::Zlib(d) => {
                d.write_all(data).map_err(|_| "a bad deflate body")?;
                Ok(std::mem::take(d.get_mut()))
            }
        }
    }

    fn finish(self) -> Result<Vec<u8>, &'static str> {
        match self {
            Self::Identity => Ok(Vec::new()),
            Self::Gzip(d) => d.finish().map_err(|_| "a cut gzip body"),
            Self::Zlib(d) => d.finish().map_err(|_| "a cut deflate body"),
        }
    }
}

/// Relays responses from `up` to the box, one per [`Expect`], scrubbed of
/// the secret values each names, until either side ends.
pub async fn relay<R, W>(mut up: R, to_box: Arc<Mutex<W>>, mut expect: mpsc::Receiver<Expect>, received: Arc<AtomicU64>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
    // One response per request, in order; when the requests end, so do we.
    'responses: while let Some(mut req) = expect.recv().await {
        if let Some((status, why)) = &req.refusal {
            refuse(&mut *to_box.lock().await, *status, why).await;
            break;
        }
        let mut scrub = Scrubber::new(&req.values);
        // Counted from here: the head is part of what the request cost.
        let start = received.load(Ordering::Relaxed);
        let head = loop {
            let head = match read_head(&mut up, &mut buf, &received).await {
                Ok(Some(head)) => head,
                Ok(None) => break 'responses,
                Err(why) => {
                    tracing::debug!(why, "response refused");
                    break 'responses;
                }
            };
            if !(100..200).contains(&head.status) || head.status == 101 {
                break head;
            }
            let mut out = status_line(&head, &mut scrub);
            out.extend(scrub_headers(&head.headers, &mut scrub, &[]));
            out.extend_from_slice(b"\r\n");
            if to_box.lock().await.write_all(&out).await.is_err() {
                break 'responses;
            }
        };
        // A protocol switch (never asked for on such a connection) ends it.
        if head.status == 101 {
            break;
        }
        let checkable = framing(&head, req.head).and_then(|f| Ok((f, decoder(&head)?)));
        let (framing, decoder) = match checkable {
            Ok(both) => both,
            Err(why) => {
                refuse(
                    &mut *to_box.lock().await,
                    502,
                    &format!("the host's answer cannot be checked for secrets: {why}"),
                )
                .await;
                break;
            }
        };
        let until_close = matches!(framing, Framing::UntilClose);
        let has_body = !matches!(framing, Framing::None);
        let mut out = status_line(&head, &mut scrub);
        let dropped: &[&str] =
            if has_body { &["content-length", "transfer-encoding", "content-encoding"] } else { &[] };
        out.extend(scrub_headers(&head.headers, &mut scrub, dropped));
        if has_body {
            out.extend_from_slice(if req.http10 {
                b"Connection: close\r\n"
            } else {
                b"Transfer-Encoding: chunked\r\n"
            });
        }
        out.extend_from_slice(b"\r\n");
        let mut tokens = reports_usage(&head).then(TokenCount::default);
        let sent = {
            let mut w = to_box.lock().await;
            match w.write_all(&out).await {
                Ok(()) => {
                    body(&mut up, &mut *w, &mut buf, framing, decoder, &mut scrub, &mut tokens, req.http10, &received)
                        .await
                }
                Err(_) => Err("the box went away"),
            }
        };
        if let Some(metered) = req.metered.as_mut() {
            let bytes = received.load(Ordering::Relaxed).saturating_sub(start);
            metered.finish(bytes, tokens.as_ref().map_or(0, TokenCount::total), sent.err());
        }
        // Either side asking for the end, or a body that ran to the close.
        let closing = header(&head, "connection").any(|v| v.split(',').any(|t| t.trim() == "close"));
        if sent.is_err() || req.http10 || req.close || closing || until_close {
            break;
        }
    }
    let _ = to_box.lock().await.shutdown().await;
}

/// Whether a response's body is where an LLM API reports tokens used (JSON,
/// or a stream of events): only those are read for counts.
fn reports_usage(head: &ResponseHead) -> bool {
    header(head, "content-type").next().is_some_and(|t| {
        let t = t.split(';').next().unwrap_or_default().trim();
        t == "application/json" || t.ends_with("+json") || t == "text/event-stream" || t == "application/x-ndjson"
    })
}

/// A response's status line as the box gets it: HTTP/1.1, its reason
/// scrubbed (a host can put anything there).
fn status_line(head: &ResponseHead, scrub: &mut Scrubber) -> Vec<u8> {
    let mut line = format!("HTTP/1.1 {} ", head.status).into_bytes();
    line.extend(scrub.push(head.reason.as_bytes()));
    line.extend(scrub.finish());
    line.extend_from_slice(b"\r\n");
    line
}

/// The gateway's own answer to a request it will not send (the connection
/// ends after it).
pub async fn refuse<W: AsyncWrite + Unpin>(w: &mut W, status: u16, why: &str) {
    let reason = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        429 => "Too Many Requests",
        _ => "Bad Gateway",
    };
    let body = format!("moat egress gateway: {why}\n");
    let reply = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = w.write_all(reply.as_bytes()).await;
}

struct ResponseHead {
    status: u16,
    /// The reason phrase, control characters removed.
    reason: String,
    headers: Vec<(String, Vec<u8>)>,
}

async fn read_head<R: AsyncRead + Unpin>(
    up: &mut R,
    buf: &mut Vec<u8>,
    received: &AtomicU64,
) -> Result<Option<ResponseHead>, &'static str> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(buf) {
            Ok(httparse::Status::Complete(n)) => {
                let status = resp.code.ok_or("no status")?;
                let reason: String = resp.reason.unwrap_or("").chars().filter(|c| !c.is_control()).collect();
                let headers = resp.headers.iter().map(|h| (h.name.to_string(), h.value.to_vec())).collect();
                buf.drain(..n);
                return Ok(Some(ResponseHead { status, reason, headers }));
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            Ok(httparse::Status::Partial) => return Err("response head too large"),
            Err(_) => return Err("malformed response"),
        }
        let mut chunk = [0u8; 16 << 10];
        match up.read(&mut chunk).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) | Err(_) => return Err("closed inside a response head"),
            Ok(n) => {
                received.fetch_add(n as u64, Ordering::Relaxed);
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

fn header<'a>(head: &'a ResponseHead, name: &str) -> impl Iterator<Item = String> + 'a {
    let name = name.to_string();
    head.headers
        .iter()
        .filter(move |(n, _)| n.eq_ignore_ascii_case(&name))
        .map(|(_, v)| String::from_utf8_lossy(v).trim().to_ascii_lowercase())
}

/// How a response's body is framed. Only plain chunked is read as a
/// transfer coding: any other would hide the body's bytes from the scrubber.
fn framing(head: &ResponseHead, to_head: bool) -> Result<Framing, &'static str> {
    if to_head || head.status == 204 || head.status == 304 {
        return Ok(Framing::None);
    }
    let codings: Vec<String> = header(head, "transfer-encoding").collect();
    match codings.as_slice() {
        [] => {}
        [c] if c == "chunked" => return Ok(Framing::Chunked),
        _ => return Err("a transfer coding other than chunked"),
    }
    let lengths: Vec<String> = header(head, "content-length").collect();
    match lengths.as_slice() {
        [] => Ok(Framing::UntilClose),
        [first, rest @ ..] if rest.iter().all(|l| l == first) => {
            first.parse().map(Framing::Length).map_err(|_| "a bad Content-Length")
        }
        _ => Err("two Content-Lengths"),
    }
}

fn decoder(head: &ResponseHead) -> Result<Decoder, &'static str> {
    let codings: Vec<String> = header(head, "content-encoding")
        .flat_map(|v| v.split(',').map(|c| c.trim().to_string()).collect::<Vec<_>>())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect();
    match codings.as_slice() {
        [] => Ok(Decoder::Identity),
        [c] if c == "gzip" || c == "x-gzip" => Ok(Decoder::Gzip(Box::new(flate2::write::GzDecoder::new(Vec::new())))),
        [c] if c == "deflate" => Ok(Decoder::Zlib(Box::new(flate2::write::ZlibDecoder::new(Vec::new())))),
        _ => Err("a content coding the gateway cannot read"),
    }
}

fn scrub_headers(headers: &[(String, Vec<u8>)], scrub: &mut Scrubber, dropped: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        if dropped.iter().any(|d| name.eq_ignore_ascii_case(d)) {
            continue;
        }
        let mut value = scrub.push(value);
        value.extend(scrub.finish());
        // Names too: a host that reads a body as a head would echo anything there.
        out.extend(scrub.push(name.as_bytes()));
        out.extend(scrub.finish());
        out.extend_from_slice(b": ");
        out.extend_from_slice(&value);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Passes one body on: raw bytes read per `framing`, decoded, scrubbed and
/// counted, written chunked (or plain for HTTP/1.0).
#[allow(clippy::too_many_arguments)]
async fn body<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    up: &mut R,
    w: &mut W,
    buf: &mut Vec<u8>,
    framing: Framing,
    mut decoder: Decoder,
    scrub: &mut Scrubber,
    tokens: &mut Option<TokenCount>,
    http10: bool,
    received: &AtomicU64,
) -> Result<(), &'static str> {
    if matches!(framing, Framing::None) {
        return Ok(());
    }
    let mut left = match framing {
        Framing::Length(n) => n,
        _ => u64::MAX,
    };
    let mut dechunk = matches!(framing, Framing::Chunked).then(Dechunk::default);
    let done = |left: u64, dechunk: &Option<Dechunk>| match framing {
        Framing::Length(_) => left == 0,
        Framing::Chunked => dechunk.as_ref().is_some_and(|d| d.state == Chunk::Done),
        _ => false,
    };
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        if buf.is_empty() {
            if done(left, &dechunk) {
                break;
            }
            match up.read(&mut chunk).await {
                Ok(0) if matches!(framing, Framing::UntilClose) => break,
                Ok(0) | Err(_) => return Err("closed inside a response body"),
                Ok(n) => {
                    received.fetch_add(n as u64, Ordering::Relaxed);
                    buf.extend_from_slice(&chunk[..n]);
                }
            }
        }
        // What of `buf` belongs to this body; the rest is the next response.
        let (raw, used) = match (&framing, dechunk.as_mut()) {
            (Framing::Chunked, Some(d)) => {
                let mut out = Vec::new();
                let used = d.feed(buf, &mut out)?;
                (out, used)
            }
            _ => {
                let n = (buf.len() as u64).min(left) as usize;
                left -= n as u64;
                (buf[..n].to_vec(), n)
            }
        };
        buf.drain(..used);
        // A little compressed input at a time: gzip expands up to a
        // thousandfold, and a hostile host's body must not become one
        // allocation of that size.
        for piece in raw.chunks(DECODE_STEP) {
            let decoded = decoder.decode(piece)?;
            send(w, scrub, tokens, &decoded, http10).await?;
        }
        if done(left, &dechunk) {
            break;
        }
    }
    let rest = decoder.finish()?;
    send(w, scrub, tokens, &rest, http10).await?;
    let tail = scrub.finish();
    write_chunk(w, &tail, http10).await?;
    if !http10 {
        w.write_all(b"0\r\n\r\n").await.map_err(|_| "the box went away")?;
    }
    Ok(())
}

async fn send<W: AsyncWrite + Unpin>(
    w: &mut W,
    scrub: &mut Scrubber,
    tokens: &mut Option<TokenCount>,
    data: &[u8],
    http10: bool,
) -> Result<(), &'static str> {
    if let Some(tokens) = tokens {
        tokens.feed(data);
    }
    let clean = scrub.push(data);
    write_chunk(w, &clean, http10).await
}

async fn write_chunk<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8], http10: bool) -> Result<(), &'static str> {
    if data.is_empty() {
        return Ok(());
    }
    let gone = |_| "the box went away";
    if !http10 {
        w.write_all(format!("{:x}\r\n", data.len()).as_bytes()).await.map_err(gone)?;
    }
    w.write_all(data).await.map_err(gone)?;
    if !http10 {
        w.write_all(b"\r\n").await.map_err(gone)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn values_are_cut_however_the_stream_is_split() {
        let text = b"a sk-REAL/x b \"sk-REAL\\/x\" sk-REAL/";
        for split in 0..text.len() {
            let mut s = Scrubber::new(&["sk-REAL/x".into()]);
            let mut out = s.push(&text[..split]);
            out.extend(s.push(&text[split..]));
            out.extend(s.finish());
            let out = String::from_utf8(out).unwrap();
            assert!(!out.contains("sk-REAL/x") && !out.contains("sk-REAL\\/x"), "{split}: {out}");
            assert!(out.ends_with("sk-REAL/"), "{out}");
        }
    }

    #[test]
    fn what_is_held_back_says_nothing_of_the_values() {
        // The same bytes pass in the same pieces whatever the value is: a
        // box cannot learn which text starts it from the pieces' sizes.
        let input: [&[u8]; 4] = [b"data: {\"x\":1}\n\n", b"guess sk-RE", b"AL-01", b"x\n"];
        let pieces = |value: &str| {
            let mut s = Scrubber::new(&[value.to_string()]);
            input.iter().map(|d| s.push(d).len()).collect::<Vec<_>>()
        };
        assert_eq!(pieces("sk-REAL-0123456789"), pieces("zz-OTHER-987654321"));
        // Events, which end in a newline, are not held back at all.
        let mut s = Scrubber::new(&["sk-REAL-0123456789".into()]);
        assert_eq!(s.push(b"data: {\"x\":1}\n\n"), b"data: {\"x\":1}\n\n");
        assert_eq!(s.push(b"event sk-REAL-01"), b"");
        assert_eq!(s.push(b"23456789!\n"), b"event [secret removed by moat]!\n");
    }

    #[test]
    fn values_are_cut_as_json_and_urls_spell_them() {
        let value = "sk+a/b\"c";
        for form in ["sk+a/b\\\"c", "sk+a\\/b\\\"c", "sk\\u002ba\\u002fb\\u0022c", "sk%2Ba%2Fb%22c", "sk%2ba%2fb%22c"] {
            let mut s = Scrubber::new(&[value.to_string()]);
            let mut out = s.push(format!("x {form} y").as_bytes());
            out.extend(s.finish());
            assert_eq!(out, b"x [secret removed by moat] y", "{form}");
        }
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

    #[test]
    fn chunked_bodies_decode_and_stop_at_their_end() {
        let raw = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nX-Trailer: y\r\n\r\nHTTP/1.1 200";
        for split in 1..raw.len() {
            let mut d = Dechunk::default();
            let mut out = Vec::new();
            let used = d.feed(&raw[..split], &mut out).unwrap();
            let used2 = d.feed(&raw[used..], &mut out).unwrap();
            assert_eq!(out, b"Wikipedia", "{split}");
            assert_eq!(&raw[used + used2..], b"HTTP/1.1 200", "{split}");
        }
        let mut d = Dechunk::default();
        assert!(d.feed(b"zz\r\n", &mut Vec::new()).is_err());
        assert!(d.feed(b"2\r\nabc\r\n", &mut Vec::new()).is_err());
    }

    #[tokio::test]
    async fn responses_are_scrubbed_decoded_and_reframed() {
        use flate2::write::GzEncoder;
        let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"your key is sk-REAL, {\"input_tokens\":2,\"output_tokens\":3}").unwrap();
        let gz = gz.finish().unwrap();
        let mut upstream = format!(
            "HTTP/1.1 200 OK\r\nX-Echo: sk-REAL\r\nContent-Encoding: gzip\r\nContent-Length: {}\r\n\r\n",
            gz.len()
        )
        .into_bytes();
        upstream.extend(gz);
        upstream.extend(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nsk-\r\n4\r\nREAL\r\n0\r\n\r\n");
        upstream.extend(b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx");
        let got = relay_all(&upstream, 3).await;
        assert!(!got.contains("sk-REAL"), "{got}");
        assert!(got.contains("X-Echo: [secret removed by moat]"), "{got}");
        assert!(got.contains("your key is [secret removed by moat]"), "{got}");
        assert!(!got.to_ascii_lowercase().contains("content-encoding: gzip"), "{got}");
        assert!(got.contains("cannot be checked for secrets: a content coding"), "{got}");
    }

    /// What the box gets for `upstream`, answering `n` requests, each of
    /// which went out while the box's one secret value was `sk-REAL`.
    async fn relay_all(upstream: &[u8], n: usize) -> String {
        relay_values(upstream, &vec![vec!["sk-REAL".to_string()]; n]).await
    }

    /// Same, each request with its own values.
    async fn relay_values(upstream: &[u8], values: &[Vec<String>]) -> String {
        let (to_box, mut from_gateway) = tokio::io::duplex(1 << 20);
        let (tx, rx) = mpsc::channel(values.len());
        for v in values {
            tx.send(Expect::response(false, false, false, v.clone().into())).await.unwrap();
        }
        drop(tx);
        relay(upstream, Arc::new(Mutex::new(to_box)), rx, Arc::default()).await;
        let mut got = Vec::new();
        from_gateway.read_to_end(&mut got).await.unwrap();
        String::from_utf8(got).unwrap()
    }

    #[tokio::test]
    async fn a_value_granted_later_is_cut_from_later_answers_and_reasons_are_scrubbed() {
        let upstream =
            b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsk-NEWHTTP/1.1 200 sk-NEW\r\nContent-Length: 6\r\n\r\nsk-NEW";
        let got = relay_values(upstream, &[vec![], vec!["sk-NEW".into()]]).await;
        // The first went out before the secret was granted: nothing to cut.
        assert!(got.contains("\r\n\r\n6\r\nsk-NEW\r\n0\r\n\r\n"), "{got}");
        assert_eq!(got.matches("sk-NEW").count(), 1, "{got}");
        assert!(got.contains("HTTP/1.1 200 [secret removed by moat]\r\n"), "{got}");
    }

    #[tokio::test]
    async fn framings_that_hide_the_body_are_refused() {
        for head in [
            "Transfer-Encoding: gzip, chunked",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
            "Content-Length: 6\r\nContent-Length: 7",
        ] {
            let upstream = format!("HTTP/1.1 200 OK\r\n{head}\r\n\r\nsk-REAL");
            let got = relay_all(upstream.as_bytes(), 1).await;
            assert!(got.starts_with("HTTP/1.1 502 Bad Gateway") && !got.contains("sk-REAL"), "{head}: {got}");
        }
    }

    #[test]
    fn token_counts_are_capped_and_only_json_and_events_are_read() {
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
        let head = |t: &str| ResponseHead {
            status: 200,
            reason: "OK".into(),
            headers: vec![("Content-Type".into(), t.as_bytes().to_vec())],
        };
        for (t, read) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/event-stream", true),
            ("application/vnd.api+json", true),
            ("application/octet-stream", false),
            ("text/plain", false),
        ] {
            assert_eq!(reports_usage(&head(t)), read, "{t}");
        }
    }
}
