//! Secrets at the gateway, the response side. On a connection to a host
//! that one of the box's secrets is bound to, every response is read before
//! the box sees it: the box's secret values are cut out of its headers and
//! body (which is decoded first when the host compressed it anyway, though
//! asked not to; an encoding the gateway cannot read is refused), and the
//! LLM tokens it reports are counted. The body reaches the box re-framed
//! (chunked, or until close for HTTP/1.0), never compressed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Mutex};

use crate::http::chunked::Dechunk;
use crate::http::response::{self, decoder, framing, header, Decoder, Framing, ResponseHead};
use crate::http::write_flushed;
use crate::refusal::Refusal;
use crate::secrets::meter::{Metered, TokenCount};
use crate::secrets::scrub::Scrubber;

/// Compressed bytes decoded at once (at most about a megabyte out).
const DECODE_STEP: usize = 1024;

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
    pub refusal: Option<Refusal>,
    /// Counts the response as still to come while it lives.
    pub in_flight: Option<InFlight>,
}

impl Expect {
    /// The response to a request the host was sent.
    pub fn response(head: bool, http10: bool, close: bool, values: Arc<[String]>) -> Self {
        Self { head, http10, close, values, metered: None, refusal: None, in_flight: None }
    }

    /// The gateway's own answer to a refused request.
    pub fn refused(refusal: Refusal) -> Self {
        Self { refusal: Some(refusal), ..Self::response(false, false, true, Arc::from([])) }
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
        if let Some(refusal) = &req.refusal {
            refusal.answer(&mut *to_box.lock().await).await;
            break;
        }
        let mut scrub = Scrubber::new(&req.values);
        // Counted from here: the head is part of what the request cost.
        let start = received.load(Ordering::Relaxed);
        let head = loop {
            let head = match response::read_head(&mut up, &mut buf, &received).await {
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
            if write_flushed(&mut *to_box.lock().await, &out).await.is_err() {
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
                Refusal::Uncheckable(why).answer(&mut *to_box.lock().await).await;
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
            metered.status(head.status);
            let bytes = received.load(Ordering::Relaxed).saturating_sub(start);
            let used = match sent {
                Ok(()) => tokens.as_ref().map_or(0, TokenCount::total),
                Err(_) => tokens.as_ref().map_or(0, TokenCount::total_cut),
            };
            metered.finish(bytes, used, sent.err());
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
        Framing::Chunked => dechunk.as_ref().is_some_and(Dechunk::done),
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
                    buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
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
                (buf.get(..n).unwrap_or_default().to_vec(), n)
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
        write_flushed(w, b"0\r\n\r\n").await.map_err(|_| "the box went away")?;
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
    // Each piece goes out as it comes (a streamed event is not held back).
    w.flush().await.map_err(gone)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn only_json_and_events_are_read_for_token_counts() {
        let head = |t: &str| ResponseHead {
            version: 1,
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
        // The body as the box reads it (its chunks' sizes are the scrubber's).
        let first = got.split_once("\r\n\r\n").unwrap().1;
        let mut body = Vec::new();
        crate::http::chunked::Dechunk::default().feed(first.as_bytes(), &mut body).unwrap();
        assert!(String::from_utf8(body).unwrap().starts_with("your key is [secret removed by moat]"), "{got}");
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

    /// A writer that keeps what it is given until flushed, as TLS keeps its
    /// last records when the socket is full.
    #[tokio::test]
    async fn each_answer_reaches_the_box_while_the_host_keeps_the_connection_open() {
        let (mut host, up) = tokio::io::duplex(1 << 20);
        let (to_box, mut from_gateway) = tokio::io::duplex(1 << 20);
        let (tx, rx) = mpsc::channel(1);
        tx.send(Expect::response(false, false, false, Arc::from([]))).await.unwrap();
        let holding = Arc::new(Mutex::new(tokio::io::BufWriter::new(to_box)));
        tokio::spawn(relay(up, holding, rx, Arc::default()));
        host.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").await.unwrap();
        let mut got = Vec::new();
        let mut chunk = [0u8; 256];
        while !got.ends_with(b"0\r\n\r\n") {
            let n = tokio::time::timeout(std::time::Duration::from_secs(5), from_gateway.read(&mut chunk))
                .await
                .expect("the answer is held back")
                .unwrap();
            got.extend_from_slice(&chunk[..n]);
        }
        assert!(String::from_utf8_lossy(&got).contains("5\r\nhello\r\n"));
        drop(tx);
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
}
