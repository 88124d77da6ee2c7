//! The gateway's own GET to a registry, on a box's behalf: the body undone
//! of its transfer and content codings and handed over in pieces, with a
//! stall limit, so that a slow or hostile registry holds nothing but this
//! one request. A connection whose answer was read to its exact end is kept
//! a while for the same box's next read of that host ([`Idle`]): a registry
//! read costs a request, not a TCP and TLS handshake each.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use moat_core::policy::HostName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::boxnet::BoxNet;
use crate::http::chunked::Dechunk;
use crate::http::response::{self, Decoder, Framing, ResponseHead};
use crate::proxy::requests::Io;
use crate::refusal::Refusal;

/// How long a registry may go quiet mid-answer.
const STALL: Duration = Duration::from_secs(60);
/// How long a kept connection waits for the box's next read.
const IDLE_FOR: Duration = Duration::from_secs(15);
/// Most connections kept for one box.
const MAX_IDLE: usize = 8;

/// Where a connection goes: host, port, TLS.
type Key = (HostName, u16, bool);

/// A kept connection: where it goes, and since when it waits.
type Kept = (Key, Box<dyn Io>, Instant);

/// One box's connections to registries whose last answer ended cleanly.
#[derive(Default)]
pub struct Idle(Mutex<Vec<Kept>>);

impl Idle {
    fn take(&self, key: &Key) -> Option<Box<dyn Io>> {
        let mut kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|(_, _, since)| since.elapsed() < IDLE_FOR);
        let at = kept.iter().rposition(|(k, _, _)| k == key)?;
        Some(kept.swap_remove(at).1)
    }

    fn give(&self, key: Key, conn: Box<dyn Io>) {
        let mut kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|(_, _, since)| since.elapsed() < IDLE_FOR);
        if kept.len() >= MAX_IDLE {
            kept.remove(0);
        }
        kept.push((key, conn, Instant::now()));
    }
}

/// An answer being read.
pub struct Fetch {
    /// Its head.
    pub head: ResponseHead,
    up: Option<Box<dyn Io>>,
    buf: Vec<u8>,
    framing: Framing,
    dechunk: Dechunk,
    decoder: Option<Decoder>,
    /// Body bytes left, under [`Framing::Length`].
    left: u64,
    done: bool,
    /// Where the connection goes back once the answer was read to its end.
    home: Option<(Arc<Idle>, Key)>,
    /// Bytes came past the answer's end.
    overrun: bool,
}

/// Asks `host:port` (over TLS if `tls`) for `target`, with `headers` (name,
/// value) besides the gateway's own: on a connection kept from the box's
/// last read of that host if one is (asked again on a new one if that one
/// turns out closed before any byte of an answer), else a new one.
pub async fn get(
    net: &BoxNet,
    host: &HostName,
    port: u16,
    tls: bool,
    target: &str,
    headers: &[(&str, String)],
) -> Result<Fetch, Refusal> {
    let mut request = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nAccept-Encoding: gzip\r\n");
    for (name, value) in headers {
        // Values come from the box's own head, already read as text lines.
        if !value.contains(['\r', '\n']) {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    request.push_str("\r\n");
    let key: Key = (host.clone(), port, tls);
    let idle = &net.registry_conns;
    let (up, buf, head) = loop {
        let kept = idle.take(&key);
        let reused = kept.is_some();
        let mut up = match kept {
            Some(up) => up,
            None => dial(net, host, port, tls).await?,
        };
        let mut buf = Vec::new();
        let counted = AtomicU64::new(0);
        let asked = async {
            up.write_all(request.as_bytes()).await.map_err(|_| "closed")?;
            response::read_head(&mut up, &mut buf, &counted).await
        };
        match tokio::time::timeout(STALL, asked).await {
            Ok(Ok(Some(head))) => break (up, buf, head),
            // A kept connection the registry closed meanwhile: a new one.
            Ok(Ok(None) | Err(_)) if reused && counted.load(Ordering::Relaxed) == 0 => continue,
            Ok(Ok(None)) => return Err(Refusal::Unreachable(format!("{host} closed without an answer"))),
            Ok(Err(why)) => return Err(Refusal::Unreachable(format!("{host}: {why}"))),
            Err(_) => return Err(Refusal::Unreachable(format!("{host} did not answer in {}s", STALL.as_secs()))),
        }
    };
    let framing = response::framing(&head, false).map_err(|why| Refusal::Unreachable(format!("{host}: {why}")))?;
    let decoder = response::decoder(&head).map_err(|why| Refusal::Unreachable(format!("{host}: {why}")))?;
    let left = match framing {
        Framing::Length(n) => n,
        _ => 0,
    };
    let done = matches!(framing, Framing::None) || (matches!(framing, Framing::Length(0)));
    // Kept after this answer only where its end is its framing's, not the
    // connection's.
    let again = head.version == 1
        && !response::header(&head, "connection").any(|v| v.split(',').any(|t| t.trim() == "close"))
        && matches!(framing, Framing::Length(_) | Framing::Chunked | Framing::None);
    let home = again.then(|| (Arc::clone(idle), key));
    Ok(Fetch {
        head,
        up: Some(up),
        buf,
        framing,
        dechunk: Dechunk::default(),
        decoder: Some(decoder),
        left,
        done,
        home,
        overrun: false,
    })
}

/// A new connection to `host:port`, over TLS if `tls`.
async fn dial(net: &BoxNet, host: &HostName, port: u16, tls: bool) -> Result<Box<dyn Io>, Refusal> {
    let unreachable = |e: &dyn std::fmt::Display| Refusal::Unreachable(e.to_string());
    Ok(if tls {
        Box::new(net.upstream.dial_tls(host, port).await.map_err(|e| unreachable(&e))?)
    } else {
        Box::new(net.upstream.dial(host, port).await.map_err(|e| unreachable(&e))?)
    })
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
                self.keep();
                return Ok((!tail.is_empty()).then_some(tail));
            }
            if self.buf.is_empty() {
                let mut chunk = vec![0u8; 64 << 10];
                let Some(up) = self.up.as_mut() else { return Err(bad("cut short")) };
                let n = match tokio::time::timeout(STALL, up.read(&mut chunk)).await {
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
                    self.overrun |= n < raw.len();
                    raw.get(..n).unwrap_or_default().to_vec()
                }
                Framing::Chunked => {
                    let mut out = Vec::with_capacity(raw.len());
                    let used = self.dechunk.feed(&raw, &mut out).map_err(bad)?;
                    self.done = self.dechunk.done();
                    self.overrun |= used < raw.len();
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

    /// The answer was read to its end: its connection goes back for the
    /// box's next read, unless bytes came past that end (a registry that
    /// answers more than it was asked is not asked again on it).
    fn keep(&mut self) {
        if let (Some((idle, key)), Some(up)) = (self.home.take(), self.up.take()) {
            if self.buf.is_empty() && !self.overrun {
                idle.give(key, up);
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn conn() -> Box<dyn Io> {
        Box::new(tokio::io::duplex(64).0)
    }

    fn key(host: &str, port: u16) -> Key {
        (HostName::parse(host).unwrap(), port, true)
    }

    #[tokio::test]
    async fn a_kept_connection_serves_only_its_own_host_and_port_once() {
        let idle = Idle::default();
        idle.give(key("pypi.org", 443), conn());
        assert!(idle.take(&key("registry.npmjs.org", 443)).is_none());
        assert!(idle.take(&key("pypi.org", 80)).is_none());
        assert!(idle.take(&key("pypi.org", 443)).is_some());
        assert!(idle.take(&key("pypi.org", 443)).is_none(), "taken twice");
    }

    #[tokio::test]
    async fn at_most_max_idle_are_kept_the_oldest_going_first() {
        let idle = Idle::default();
        for port in 0..MAX_IDLE as u16 + 2 {
            idle.give(key("pypi.org", port), conn());
        }
        assert!(idle.take(&key("pypi.org", 0)).is_none() && idle.take(&key("pypi.org", 1)).is_none());
        for port in 2..MAX_IDLE as u16 + 2 {
            assert!(idle.take(&key("pypi.org", port)).is_some(), "{port}");
        }
    }
}
