//! HTTP/1.x responses as the gateway reads them from a host whose answers it
//! checks (those a secret is bound to): the head, how the body is framed and
//! coded (anything that could hide the body's bytes is refused), and the
//! gateway's own answer to a request it will not send.

use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest response head read.
const MAX_HEAD: usize = 64 << 10;
const MAX_HEADERS: usize = 128;

/// A response head, as read.
pub struct ResponseHead {
    /// The minor version of HTTP/1 it answered in (0 or 1).
    pub version: u8,
    /// The status code.
    pub status: u16,
    /// The reason phrase, control characters removed.
    pub reason: String,
    /// The headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Reads the next response head from `up` into `buf` (`None`: the host
/// closed between responses), counting what it reads into `received`; the
/// head leaves `buf`, what follows it stays.
pub async fn read_head<R: AsyncRead + Unpin>(
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
                let version = resp.version.unwrap_or(0);
                buf.drain(..n);
                return Ok(Some(ResponseHead { version, status, reason, headers }));
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
                buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
            }
        }
    }
}

/// The values of header `name`, trimmed, in lower case.
pub fn header<'a>(head: &'a ResponseHead, name: &str) -> impl Iterator<Item = String> + 'a {
    let name = name.to_string();
    head.headers
        .iter()
        .filter(move |(n, _)| n.eq_ignore_ascii_case(&name))
        .map(|(_, v)| String::from_utf8_lossy(v).trim().to_ascii_lowercase())
}

/// How a response's body is framed. Only plain chunked is read as a
/// transfer coding: any other would hide the body's bytes from the scrubber.
pub fn framing(head: &ResponseHead, to_head: bool) -> Result<Framing, &'static str> {
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

/// How the body is coded: only gzip and deflate are decoded.
pub fn decoder(head: &ResponseHead) -> Result<Decoder, &'static str> {
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

/// How a response's body is framed.
pub enum Framing {
    /// No body (a HEAD request's answer, 204, 304).
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Until the host closes.
    UntilClose,
}

/// Undoes a body's content coding.
pub enum Decoder {
    /// Not coded.
    Identity,
    /// gzip.
    Gzip(Box<flate2::write::GzDecoder<Vec<u8>>>),
    /// deflate (zlib).
    Zlib(Box<flate2::write::ZlibDecoder<Vec<u8>>>),
}

impl Decoder {
    /// Decodes more of the body.
    pub fn decode(&mut self, data: &[u8]) -> Result<Vec<u8>, &'static str> {
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

    /// What is left at the end of the body.
    pub fn finish(self) -> Result<Vec<u8>, &'static str> {
        match self {
            Self::Identity => Ok(Vec::new()),
            Self::Gzip(d) => d.finish().map_err(|_| "a cut gzip body"),
            Self::Zlib(d) => d.finish().map_err(|_| "a cut deflate body"),
        }
    }
}

/// The gateway's own answer to a request it will not send (the connection
/// ends after it).
pub async fn answer_own<W: AsyncWrite + Unpin>(w: &mut W, status: u16, why: &str) {
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

/// The gateway's refusal of a package request: 403 with the reason in the
/// status line (pip prints it) and in a JSON body's `error` (npm prints
/// that; cargo prints the body).
pub async fn answer_package<W: AsyncWrite + Unpin>(w: &mut W, why: &str) {
    let why: String = why.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let body = serde_json::json!({ "error": format!("moat: {why}") }).to_string() + "\n";
    let reply = format!(
        "HTTP/1.1 403 Forbidden by moat: {why}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = w.write_all(reply.as_bytes()).await;
}

/// The gateway's own answer in git's smart HTTP (a refused push, on git's
/// own channel): 200, the service's content type, then the connection ends.
pub async fn answer_git<W: AsyncWrite + Unpin>(w: &mut W, content_type: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nCache-Control: no-cache\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut reply = head.into_bytes();
    reply.extend_from_slice(body);
    let _ = w.write_all(&reply).await;
}
