//! The gateway's own GET to a registry, on a box's behalf: a connection of
//! its own (`Connection: close`), the body undone of its transfer and
//! content codings and handed over in pieces, with a stall limit, so that a
//! slow or hostile registry holds nothing but this one request.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use moat_core::policy::HostName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::boxnet::BoxNet;
use crate::http::chunked::Dechunk;
use crate::http::response::{self, Decoder, Framing, ResponseHead};
use crate::refusal::Refusal;

/// How long a registry may go quiet mid-answer.
const STALL: Duration = Duration::from_secs(60);

/// An answer being read.
pub struct Fetch {
    /// Its head.
    pub head: ResponseHead,
    up: Box<dyn AsyncRead + Send + Unpin>,
    buf: Vec<u8>,
    framing: Framing,
    dechunk: Dechunk,
    decoder: Option<Decoder>,
    /// Body bytes left, under [`Framing::Length`].
    left: u64,
    done: bool,
}

/// Asks `host:port` (over TLS if `tls`) for `target`, with `headers` (name,
/// value) besides the gateway's own.
pub async fn get(
    net: &BoxNet,
    host: &HostName,
    port: u16,
    tls: bool,
    target: &str,
    headers: &[(&str, String)],
) -> Result<Fetch, Refusal> {
    let unreachable = |e: &dyn std::fmt::Display| Refusal::Unreachable(e.to_string());
    let mut up: Box<dyn crate::proxy::requests::Io> = if tls {
        Box::new(net.upstream.dial_tls(host, port).await.map_err(|e| unreachable(&e))?)
    } else {
        Box::new(net.upstream.dial(host, port).await.map_err(|e| unreachable(&e))?)
    };
    let mut request =
        format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nAccept-Encoding: gzip\r\nConnection: close\r\n");
    for (name, value) in headers {
        // Values come from the box's own head, already read as text lines.
        if !value.contains(['\r', '\n']) {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    request.push_str("\r\n");
    up.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    let counted = AtomicU64::new(0);
    let head = match tokio::time::timeout(STALL, response::read_head(&mut up, &mut buf, &counted)).await {
        Ok(Ok(Some(head))) => head,
        Ok(Ok(None)) => return Err(Refusal::Unreachable(format!("{host} closed without an answer"))),
        Ok(Err(why)) => return Err(Refusal::Unreachable(format!("{host}: {why}"))),
        Err(_) => return Err(Refusal::Unreachable(format!("{host} did not answer in {}s", STALL.as_secs()))),
    };
    let framing = response::framing(&head, false).map_err(|why| Refusal::Unreachable(format!("{host}: {why}")))?;
    let decoder = response::decoder(&head).map_err(|why| Refusal::Unreachable(format!("{host}: {why}")))?;
    let left = match framing {
        Framing::Length(n) => n,
        _ => 0,
    };
    let done = matches!(framing, Framing::None) || (matches!(framing, Framing::Length(0)));
    Ok(Fetch { head, up: Box::new(up), buf, framing, dechunk: Dechunk::default(), decoder: Some(decoder), left, done })
}

impl Fetch {
    /// The body's length as the box will see it, where the answer says it
    /// (framed by length, with no content coding to undo).
    pub fn length(&self) -> Option<u64> {
        match (&self.framing, &self.decoder) {
            (Framing::Length(n), Some(Decoder::Identity)) => Some(*n),
            _ => None,
        }
    }

    /// The value of header `name` (lower case), if it has one.
    pub fn header(&self, name: &str) -> Option<String> {
        response::header(&self.head, name).next()
    }

    /// The next piece of the body, decoded (`None`: it is over).
    pub async fn next(&mut self) -> Result<Option<Vec<u8>>, Refusal> {
        let bad = |why: &str| Refusal::Unreachable(format!("the registry's answer: {why}"));
        loop {
            if self.done {
                let Some(decoder) = self.decoder.take() else { return Ok(None) };
                let tail = decoder.finish().map_err(bad)?;
                return Ok((!tail.is_empty()).then_some(tail));
            }
            if self.buf.is_empty() {
                let mut chunk = vec![0u8; 64 << 10];
                let n = match tokio::time::timeout(STALL, self.up.read(&mut chunk)).await {
                    Ok(Ok(n)) => n,
                    Ok(Err(e)) => return Err(bad(&e.to_string())),
                    Err(_) => return Err(bad("stalled")),
                };
                if n == 0 {
                    if matches!(self.framing, Framing::UntilClose) {
                        self.done = true;
                        continue;
                    }
                    return Err(bad("cut short"));
                }
                chunk.truncate(n);
                self.buf = chunk;
            }
            let raw = std::mem::take(&mut self.buf);
            let body = match self.framing {
                Framing::Length(_) => {
                    let n = (raw.len() as u64).min(self.left) as usize;
                    self.left -= n as u64;
                    self.done = self.left == 0;
                    raw.get(..n).unwrap_or_default().to_vec()
                }
                Framing::Chunked => {
                    let mut out = Vec::with_capacity(raw.len());
                    self.dechunk.feed(&raw, &mut out).map_err(bad)?;
                    self.done = self.dechunk.done();
                    out
                }
                Framing::UntilClose => raw,
                Framing::None => Vec::new(),
            };
            let Some(decoder) = self.decoder.as_mut() else { return Ok(None) };
            let decoded = decoder.decode(&body).map_err(bad)?;
            if !decoded.is_empty() {
                return Ok(Some(decoded));
            }
        }
    }

    /// The whole body, at most `max` bytes of it decoded.
    pub async fn all(&mut self, max: usize) -> Result<Vec<u8>, Refusal> {
        let mut out = Vec::new();
        while let Some(piece) = self.next().await? {
            out.extend_from_slice(&piece);
            if out.len() > max {
                return Err(Refusal::Unreachable(format!("the registry's answer is larger than {} MiB", max >> 20)));
            }
        }
        Ok(out)
    }
}
