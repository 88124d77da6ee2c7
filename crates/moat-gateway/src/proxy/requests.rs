//! HTTP on a box's connection, plain or inside TLS the gateway looks inside:
//! every request is read and judged (see [`super::judge`]) before it goes,
//! so that a kept-alive connection cannot change hosts or methods after the
//! first request. On a host one of the box's secrets is bound to, the secret
//! is written into each request and every answer is relayed through the
//! scrubber (see [`crate::secrets`]); elsewhere answers are copied as they
//! come.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use moat_core::egress::{LogEntry, LogKind, LogVerdict};
use moat_core::policy::{Ecosystem, HostName, Verdict};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

use super::judge::{judge, Allowed};
use super::push;
use super::SECRET_PORT;
use crate::boxnet::{BoxNet, Grounds};
use crate::http::chunked::ChunkedReader;
use crate::http::request::{self, Body, Head, Request};
use crate::http::write_flushed;
use crate::log::entry;
use crate::packages;
use crate::refusal::Refusal;
use crate::secrets::inject;
use crate::secrets::meter::{Armed, Metered};
use crate::secrets::relay::{self, Expect, InFlight};
use crate::zerocopy;

/// A connection requests are read from or forwarded to: plain TCP, or TLS
/// the gateway looks inside.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}
/// A connection of either kind.
pub type Stream = Box<dyn Io>;
type StreamReader = ReadHalf<Stream>;
type StreamWriter = WriteHalf<Stream>;

/// How long a request head may take to arrive on a kept-alive connection.
const NEXT_REQUEST: Duration = Duration::from_secs(120);
/// Requests a box may have sent ahead of their answers on a connection a
/// secret is bound to.
const MAX_PIPELINED: usize = 32;
/// How long the answers to requests before a refused one may take.
const REFUSED_DRAIN: Duration = Duration::from_secs(10);
/// How long, and how much, a refused box's further bytes are read before
/// its connection closes (see [`linger`]).
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1 << 20;
/// Buffer for each direction of a splice.
const SPLICE_BUFFER: usize = 64 << 10;

/// What one box connection is, for the HTTP code.
#[derive(Clone, Copy)]
pub struct Conn<'a> {
    /// The box.
    pub net: &'a BoxNet,
    /// The name it dialled.
    pub name: &'a HostName,
    /// The port it dialled.
    pub port: u16,
    /// What let it through (each request is judged by the policy as it is
    /// when the request comes).
    pub grounds: &'a Grounds,
    /// Looked inside (TLS to the box and to the host).
    pub tls: bool,
}

/// HTTP, plain or inside TLS (`tls`: then to the host over TLS too): every
/// request on the connection is read and checked (Host, and the policy's
/// method and target rules), so that a kept-alive connection cannot change
/// hosts or methods after the first request.
pub async fn http_connection(
    conn: Conn<'_>,
    stream: Stream,
    plain: Option<TcpStream>,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let Conn { net, name, port, grounds, tls } = conn;
    // A policy that no longer allows the host ends the connection.
    let revoked = net.on_revoked(name, port, grounds, |v| !matches!(v, Verdict::Deny(_)));
    // A host one of the box's secrets is bound to, over HTTPS on 443 (looked
    // inside always): the secret goes into requests, every response is
    // scrubbed, and killing a secret bound there ends the connection. (A
    // secret killed already is refused per request, with a reason.)
    // Counted here too: a connection cut mid-way is logged with what it got.
    let received = Arc::new(AtomicU64::new(0));
    let ended = if !(tls && port == SECRET_PORT) || net.secrets_for(name).is_empty() {
        tokio::select! {
            r = requests(conn, stream, plain, log, false, &received) => r,
            why = revoked => Err(why),
        }
    } else {
        tokio::select! {
            r = requests(conn, stream, plain, log, true, &received) => r,
            () = net.on_secret_killed(name) => Err(Refusal::SecretKilledMidway),
            why = revoked => Err(why),
        }
    };
    log.received = log.received.max(received.load(Ordering::Relaxed));
    ended
}

/// The secrets written into one request, counted in flight: given back
/// when this is dropped (the request refused, or its connection cut at any
/// point, a policy change or a killed secret among the causes), unless
/// handed to the request's [`Metered`], which gives them back with its
/// answer.
struct Admitted<'a> {
    armed: Vec<Armed>,
    net: &'a BoxNet,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.armed.iter().for_each(|a| a.meter.release(&self.net.id));
    }
}

/// The entry of a request whose head went to the host: logged when this
/// is dropped, however the request ended (its body sent whole, cut short by
/// the box, or the connection ended by the gateway), since the host may act
/// on what reached it (an effect the ledger must hold).
struct Sent<'a> {
    net: &'a BoxNet,
    /// `None` once another logs it (a metered request's, with its answer).
    entry: Option<LogEntry>,
    bytes: Arc<AtomicU64>,
    whole: bool,
}

impl Sent<'_> {
    fn cut(&mut self, why: &Refusal) {
        if let Some(entry) = self.entry.as_mut() {
            entry.reason = Some(format!("its body was cut short: {why}"));
        }
    }
}

impl Drop for Sent<'_> {
    fn drop(&mut self) {
        if let Some(mut entry) = self.entry.take() {
            entry.sent = self.bytes.load(Ordering::Relaxed);
            if !self.whole && entry.reason.is_none() {
                entry.reason = Some("its connection ended before its body was all sent".into());
            }
            self.net.log(entry);
        }
    }
}

/// The request loop of [`http_connection`]; `plain`: the box's socket
/// itself, for plain HTTP (responses are spliced to it); `bound`: the box
/// has secrets for this host (written into requests, cut from responses);
/// `received`: the bytes the host's answers brought, as they come.
async fn requests(
    conn: Conn<'_>,
    stream: Stream,
    plain: Option<TcpStream>,
    log: &mut LogEntry,
    bound: bool,
    received: &Arc<AtomicU64>,
) -> Result<(), Refusal> {
    let Conn { net, name, port, grounds, tls } = conn;
    let (mut from_box, to_box) = tokio::io::split(stream);
    let to_box = Arc::new(tokio::sync::Mutex::new(to_box));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut up: Option<(StreamWriter, AbortOnDrop)> = None;
    // Where a bound connection's relay learns what each response answers
    // (bounded: a box pipelining requests waits for their answers).
    let (expect_tx, expect_rx) = tokio::sync::mpsc::channel::<Expect>(MAX_PIPELINED);
    let mut expect_rx = Some(expect_rx);
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    // The box asked for the end after the request sent last.
    let mut last_request = false;
    let activity = Activity { received, in_flight: &in_flight };
    let result = loop {
        let request = match read_request(&mut from_box, &mut buf, activity).await {
            Ok(Some(r)) => r,
            Ok(None) => break Ok(()),
            Err(why) => {
                if up.is_none() {
                    refuse(&to_box, &why).await;
                }
                break Err(why);
            }
        };
        let mut req_log = entry(LogKind::Http, name.as_str(), port, LogVerdict::Deny);
        req_log.method = Some(request.method.clone());
        req_log.method_override = request.method_override.clone();
        req_log.target = Some(request.target.clone());
        let (policy, verdict) = net.standing(name, port, grounds);
        let rule = match judge(&request, name, port, &policy, &verdict) {
            Ok(rule) => rule,
            Err(why) => {
                req_log.rule = why.rule().map(ToString::to_string);
                req_log.reason = Some(why.to_string());
                net.log(req_log);
                // With requests before it in flight, their responses go
                // first (the cleanup below lets them finish); git's own
                // refusals are answered after them.
                if up.is_none() {
                    refuse(&to_box, &why).await;
                } else if matches!(why, Refusal::Git { .. }) {
                    answer_after(&mut up, bound, &expect_tx, &to_box, why.clone()).await;
                }
                break Err(why);
            }
        };
        req_log.rule = Some(rule.to_string());
        log.rule.get_or_insert_with(|| rule.to_string());
        // A registry's reads are answered by the gateway itself, under the
        // box's package rules (see crate::packages).
        if !bound && Ecosystem::of_host(name).is_some() && request.methods().all(|m| matches!(m, "GET" | "HEAD")) {
            let raw: Vec<u8> = buf.drain(..request.head_len.min(buf.len())).collect();
            let lines = request::head_lines(&raw).unwrap_or_default();
            let outcome = if !matches!(request.body, Body::Length(0)) {
                Err(Refusal::BadRequest("a GET with a body"))
            } else if up.is_some() {
                Err(Refusal::Package {
                    rule: "packages".into(),
                    why: "a registry read after other requests on one connection".into(),
                })
            } else {
                let asked = packages::answer::Asked {
                    net,
                    host: name,
                    port,
                    tls,
                    policy: &policy,
                    request: &request,
                    lines: &lines,
                };
                let mut writer = to_box.lock().await;
                packages::answer::answer(&net.registries, &asked, &mut *writer, &mut req_log).await
            };
            log.received += req_log.received;
            match outcome {
                Ok(()) => {
                    req_log.verdict = LogVerdict::Allow;
                    log.verdict = LogVerdict::Allow;
                    net.log(req_log);
                    if request.close {
                        let _ = to_box.lock().await.shutdown().await;
                        break Ok(());
                    }
                    continue;
                }
                Err(why) => {
                    match &why {
                        Refusal::Package { rule, .. } => req_log.rule = Some(rule.clone()),
                        Refusal::PackageCut(_) | Refusal::BadIndex(_) => req_log.rule = Some("packages".into()),
                        _ => {}
                    }
                    req_log.reason = Some(why.to_string());
                    net.log(req_log);
                    refuse_in_turn(&mut up, bound, &expect_tx, &to_box, &why).await;
                    break Err(why);
                }
            }
        }
        // A push goes nowhere until its commands (and pack, where a rule
        // asks for a fast-forward) are read and covered.
        if let Allowed::Push { repo, rules, body: true } = &rule {
            if request.expects_continue {
                let _ = write_flushed(&mut *to_box.lock().await, b"HTTP/1.1 100 Continue\r\n\r\n").await;
            }
            let push = push::Push { name, repo, rules };
            if let Err(why) = push::hold(&mut from_box, &mut buf, &request, push, &net.holds).await {
                req_log.reason = Some(why.to_string());
                net.log(req_log);
                refuse_in_turn(&mut up, bound, &expect_tx, &to_box, &why).await;
                break Err(why);
            }
        }
        let Outgoing { head, injected, values } = match outgoing(net, name, &mut buf, &request, bound) {
            Ok(out) => out,
            Err(refusal) => {
                req_log.reason = Some(refusal.to_string());
                net.log(req_log);
                // In its turn, after the responses before it.
                if up.is_none() {
                    refuse(&to_box, &refusal).await;
                } else if bound {
                    let _ = expect_tx.send(Expect::refused(refusal.clone())).await;
                }
                break Err(refusal);
            }
        };
        // In flight from here: given back however the request ends.
        let mut injected = Admitted { armed: injected, net };
        if up.is_none() {
            match dial(net, name, port, tls).await {
                Ok((stream, up_socket)) => {
                    let (up_read, up_write) = tokio::io::split(stream);
                    let (to_box, received) = (Arc::clone(&to_box), Arc::clone(received));
                    let box_socket = plain.as_ref().map(dup).transpose().ok().flatten();
                    let copier = match (bound, expect_rx.take(), up_socket, box_socket) {
                        (true, Some(rx), _, _) => tokio::spawn(relay::relay(up_read, to_box, rx, received)),
                        (_, _, Some(from), Some(to)) => tokio::spawn(async move {
                            let _ = zerocopy::copy(&from, &to, &received).await;
                        }),
                        _ => tokio::spawn(copy_responses(up_read, to_box, received)),
                    };
                    up = Some((up_write, AbortOnDrop(copier)));
                }
                Err(e) => {
                    req_log.verdict = LogVerdict::Error;
                    req_log.reason = Some(e.to_string());
                    net.log(req_log);
                    log.verdict = LogVerdict::Error;
                    refuse(&to_box, &e).await;
                    break Err(e);
                }
            }
        }
        req_log.verdict = LogVerdict::Allow;
        log.verdict = LogVerdict::Allow;
        let Some((up_write, _)) = up.as_mut() else {
            break Err(Refusal::NoUpstream);
        };
        // Counted as it goes (an answer may come before the body is all sent).
        let request_bytes = Arc::new(AtomicU64::new(0));
        // From its first byte on its way, the host may act on it: logged
        // however it ends.
        let mut sent = Sent { net, entry: Some(req_log), bytes: Arc::clone(&request_bytes), whole: false };
        if let Err(e) = write_counted(up_write, &head, &request_bytes).await {
            break Err(e.into());
        }
        log.sent += head.len() as u64;
        // On a bound connection the relay hears of the request before its
        // body goes (a client waiting for 100 Continue gets it); the entry of
        // a request with a secret in it is finished (bytes, tokens) and logged
        // with its response.
        if bound {
            let mut expect = Expect::response(request.method == "HEAD", request.http10, request.close, values.into());
            if !injected.armed.is_empty() {
                if let Some(entry) = sent.entry.take() {
                    let metered =
                        Metered::new(entry, std::mem::take(&mut injected.armed), net.logger(), &request_bytes);
                    expect.metered = Some(metered);
                }
            }
            expect.in_flight = Some(InFlight::new(&in_flight));
            if expect_tx.send(expect).await.is_err() {
                break Err(Refusal::AnswersEnded);
            }
        }
        match forward_body(&mut from_box, up_write, &mut buf, request.body, &request_bytes).await {
            Ok(n) => {
                log.sent += n;
                sent.whole = true;
            }
            Err(why) => {
                sent.cut(&why);
                break Err(why);
            }
        }
        drop(sent);
        // The box asked for the end (and on a bound connection HTTP/1.0
        // answers are framed by the close): nothing after this request is
        // read as one.
        if request.close || (bound && request.http10) {
            last_request = true;
            break Ok(());
        }
    };
    drop(expect_tx);
    if let Some((mut up_write, mut copier)) = up {
        // No more requests: the host finishes the ones it has, its answers
        // reach the box, then both ends close. (After a last request the
        // host closes by itself.)
        if !last_request {
            let _ = up_write.shutdown().await;
        }
        let wait = if result.is_ok() { NEXT_REQUEST } else { REFUSED_DRAIN };
        if !activity.until_idle(&mut copier.0, wait).await {
            // The copier may hold the box's side while it waits to write.
            copier.0.abort();
            let _ = (&mut copier.0).await;
        }
        let _ = to_box.lock().await.shutdown().await;
    }
    if result.is_err() {
        linger(&mut from_box).await;
    }
    log.received = received.load(Ordering::Relaxed);
    result
}

/// Reads what the box still sends after a refusal, a little while, before
/// the connection closes: closed with the box's bytes unread, it would be
/// reset, and the box's client could lose the refusal it was sent (a client
/// still sending its body when the refusal comes, most often).
async fn linger(from_box: &mut StreamReader) {
    let mut sink = vec![0u8; 16 << 10];
    let mut left = LINGER_BYTES;
    let _ = tokio::time::timeout(LINGER, async {
        while left > 0 {
            match from_box.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

/// A request's head as it goes out.
struct Outgoing {
    /// The head, every line ended by CRLF, secrets written in.
    head: Vec<u8>,
    /// The secrets written in.
    injected: Vec<Armed>,
    /// The values its answer is cut of: the box's, as the request goes out
    /// (those written into it among them).
    values: Vec<String>,
}

/// Takes `request`'s head off `buf` as it goes out: with the box's secrets
/// for this host written in where `bound` (read again per request: a revoked
/// or killed secret stops at the next one).
fn outgoing(
    net: &BoxNet,
    name: &HostName,
    buf: &mut Vec<u8>,
    request: &Request,
    bound: bool,
) -> Result<Outgoing, Refusal> {
    let raw: Vec<u8> = buf.drain(..request.head_len.min(buf.len())).collect();
    if !bound {
        let head = request::with_crlf(&raw).ok_or(Refusal::NotText)?;
        return Ok(Outgoing { head, injected: Vec::new(), values: Vec::new() });
    }
    let armed = net.secrets_for(name);
    let mut values = net.secret_values();
    values.extend(armed.iter().map(|a| a.secret.value.expose().to_string()));
    let rewritten = inject::rewrite(&raw, &armed, &net.id)?;
    let injected = rewritten.injected.iter().filter_map(|&i| armed.get(i).cloned()).collect();
    Ok(Outgoing { head: rewritten.head, injected, values })
}

/// Dials the host (over TLS where the box's side is looked inside). Plain
/// HTTP responses are spliced socket to socket: then also a second handle
/// on the upstream socket, to read.
async fn dial(net: &BoxNet, name: &HostName, port: u16, tls: bool) -> Result<(Stream, Option<TcpStream>), Refusal> {
    let unreachable = |e: &dyn std::fmt::Display| Refusal::Unreachable(e.to_string());
    if tls {
        let stream = net.upstream.dial_tls(name, port).await.map_err(|e| unreachable(&e))?;
        return Ok((Box::new(stream), None));
    }
    let stream = net.upstream.dial(name, port).await.map_err(|e| unreachable(&e))?;
    let copy = dup(&stream).map_err(|e| unreachable(&e))?;
    Ok((Box::new(stream), Some(copy)))
}

/// A second handle on a socket (for the side the splicer reads or writes).
pub fn dup(stream: &TcpStream) -> std::io::Result<TcpStream> {
    use std::os::fd::AsFd;
    let socket = std::net::TcpStream::from(stream.as_fd().try_clone_to_owned()?);
    socket.set_nonblocking(true)?;
    TcpStream::from_std(socket)
}

/// Ends a task when dropped (a connection cut mid-way leaves no copier behind).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What tells a quiet connection from an idle one: bytes still coming from
/// the host, or answers it still owes.
#[derive(Clone, Copy)]
struct Activity<'a> {
    received: &'a AtomicU64,
    in_flight: &'a AtomicUsize,
}

impl Activity<'_> {
    /// A mark to tell later whether anything happened since.
    fn mark(self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Whether the connection was idle since `mark`.
    fn idle_since(self, mark: u64) -> bool {
        self.received.load(Ordering::Relaxed) == mark && self.in_flight.load(Ordering::Relaxed) == 0
    }

    /// Waits for `task` to end (`true`), or for the connection to be idle
    /// for `idle` (`false`).
    async fn until_idle(self, task: &mut tokio::task::JoinHandle<()>, idle: Duration) -> bool {
        loop {
            let mark = self.mark();
            if tokio::time::timeout(idle, &mut *task).await.is_ok() {
                return true;
            }
            if self.idle_since(mark) {
                return false;
            }
        }
    }
}

/// Reads the next request head into `buf` (`None`: the box closed cleanly
/// between requests, or left the connection idle).
async fn read_request(
    from_box: &mut StreamReader,
    buf: &mut Vec<u8>,
    activity: Activity<'_>,
) -> Result<Option<Request>, Refusal> {
    loop {
        match request::read_head(buf) {
            Head::Request(r) => return Ok(Some(r)),
            Head::Refused(why) => return Err(Refusal::BadRequest(why)),
            Head::Incomplete => {}
        }
        let mut chunk = [0u8; 8192];
        let mark = activity.mark();
        match tokio::time::timeout(NEXT_REQUEST, from_box.read(&mut chunk)).await {
            Ok(Ok(0)) if buf.is_empty() => return Ok(None),
            Ok(Ok(0)) => return Err(Refusal::ClosedInHead),
            Ok(Ok(n)) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            Ok(Err(e)) => return Err(e.into()),
            // A box waiting on a long answer is not idle.
            Err(_) if buf.is_empty() => {
                if activity.idle_since(mark) {
                    return Ok(None);
                }
            }
            Err(_) => return Err(Refusal::SlowHead),
        }
    }
}

/// Writes `data` to the host (flushed), adding it to `sent`.
async fn write_counted(up: &mut StreamWriter, data: &[u8], sent: &AtomicU64) -> std::io::Result<()> {
    write_flushed(up, data).await?;
    sent.fetch_add(data.len() as u64, Ordering::Relaxed);
    Ok(())
}

/// Sends the body of the current request (first what `buf` holds of it),
/// adding what is sent to `counted` as it goes; leaves in `buf` whatever
/// follows it. Returns the bytes sent.
async fn forward_body(
    from_box: &mut StreamReader,
    up: &mut StreamWriter,
    buf: &mut Vec<u8>,
    body: Body,
    counted: &AtomicU64,
) -> Result<u64, Refusal> {
    let mut sent = 0u64;
    let mut chunk = vec![0u8; SPLICE_BUFFER];
    match body {
        Body::Length(mut left) => {
            let now = (buf.len() as u64).min(left) as usize;
            write_counted(up, buf.get(..now).unwrap_or_default(), counted).await?;
            buf.drain(..now);
            left -= now as u64;
            sent += now as u64;
            while left > 0 {
                let want = (chunk.len() as u64).min(left) as usize;
                let n = read_batch(from_box, chunk.get_mut(..want).unwrap_or_default()).await?;
                if n == 0 {
                    return Err(Refusal::ClosedInBody);
                }
                write_counted(up, chunk.get(..n).unwrap_or_default(), counted).await?;
                left -= n as u64;
                sent += n as u64;
            }
        }
        Body::Chunked => {
            let mut reader = ChunkedReader::default();
            let n = reader.feed(buf).map_err(Refusal::BadChunk)?;
            write_counted(up, buf.get(..n).unwrap_or_default(), counted).await?;
            buf.drain(..n);
            sent += n as u64;
            while !reader.done() {
                let got = read_batch(from_box, &mut chunk).await?;
                if got == 0 {
                    return Err(Refusal::ClosedInChunkedBody);
                }
                let read = chunk.get(..got).unwrap_or_default();
                let n = reader.feed(read).map_err(Refusal::BadChunk)?;
                let (body, after) = read.split_at(n.min(read.len()));
                write_counted(up, body, counted).await?;
                sent += n as u64;
                // Bytes after the body are the next request's.
                buf.extend_from_slice(after);
            }
        }
    }
    Ok(sent)
}

/// Reads into `buf` at least a byte (0: the end), and then whatever else
/// `from` has ready without waiting: a body goes on in few large writes
/// (over TLS, many records in one `writev`) rather than one a record.
async fn read_batch(from: &mut StreamReader, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = from.read(buf).await?;
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    while n > 0 && n < buf.len() {
        let mut rest = tokio::io::ReadBuf::new(buf.get_mut(n..).unwrap_or_default());
        match std::pin::Pin::new(&mut *from).poll_read(&mut cx, &mut rest) {
            std::task::Poll::Ready(Ok(())) if !rest.filled().is_empty() => n += rest.filled().len(),
            // The end, or nothing yet: the next read (with a real waker) sees it.
            std::task::Poll::Ready(Ok(())) | std::task::Poll::Pending => break,
            std::task::Poll::Ready(Err(e)) => return Err(e),
        }
    }
    Ok(n)
}

async fn copy_responses(
    mut up_read: StreamReader,
    to_box: Arc<tokio::sync::Mutex<StreamWriter>>,
    received: Arc<AtomicU64>,
) {
    let mut chunk = vec![0u8; SPLICE_BUFFER];
    loop {
        let n = match up_read.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if write_flushed(&mut *to_box.lock().await, chunk.get(..n).unwrap_or_default()).await.is_err() {
            break;
        }
        received.fetch_add(n as u64, Ordering::Relaxed);
    }
    let _ = to_box.lock().await.shutdown().await;
}

/// Answers the box with a refusal of the gateway's own on a connection that
/// had requests before it: in its turn where a relay orders the answers;
/// elsewhere once the copier of earlier answers is stopped (a git client
/// asks its next request only after reading the answer before it).
async fn answer_after(
    up: &mut Option<(StreamWriter, AbortOnDrop)>,
    bound: bool,
    expect_tx: &tokio::sync::mpsc::Sender<Expect>,
    to_box: &tokio::sync::Mutex<StreamWriter>,
    why: Refusal,
) {
    if bound {
        let _ = expect_tx.send(Expect::refused(why)).await;
        return;
    }
    if let Some((_, mut copier)) = up.take() {
        copier.0.abort();
        let _ = (&mut copier.0).await;
    }
    refuse(to_box, &why).await;
}

/// Answers the box with `why`: at once where nothing went to the host on
/// this connection, else after the answers before it (see [`answer_after`]).
async fn refuse_in_turn(
    up: &mut Option<(StreamWriter, AbortOnDrop)>,
    bound: bool,
    expect_tx: &tokio::sync::mpsc::Sender<Expect>,
    to_box: &tokio::sync::Mutex<StreamWriter>,
    why: &Refusal,
) {
    if up.is_none() {
        refuse(to_box, why).await;
    } else {
        answer_after(up, bound, expect_tx, to_box, why.clone()).await;
    }
}

/// Answers the box with an error of the gateway's own (only where no answer
/// from upstream may be on its way: the two would interleave), and closes.
async fn refuse(to_box: &tokio::sync::Mutex<StreamWriter>, why: &Refusal) {
    let mut w = to_box.lock().await;
    why.answer(&mut *w).await;
    let _ = w.shutdown().await;
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// The box's side keeps what it is given until flushed, as TLS keeps
    /// its last records when the socket is full; the host keeps the
    /// connection open after its answer (keep-alive).
    #[tokio::test]
    async fn an_answer_reaches_the_box_while_the_host_keeps_the_connection_open() {
        let (mut host, up) = tokio::io::duplex(1 << 20);
        let (to_box, mut from_gateway) = tokio::io::duplex(1 << 20);
        let up: Stream = Box::new(up);
        let holding: Stream = Box::new(tokio::io::BufWriter::new(to_box));
        let (up_read, _up_write) = tokio::io::split(up);
        let (_box_read, box_write) = tokio::io::split(holding);
        tokio::spawn(copy_responses(up_read, Arc::new(tokio::sync::Mutex::new(box_write)), Arc::default()));
        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        host.write_all(answer).await.unwrap();
        let mut got = vec![0u8; answer.len()];
        tokio::time::timeout(std::time::Duration::from_secs(5), from_gateway.read_exact(&mut got))
            .await
            .expect("the answer is held back")
            .unwrap();
        assert_eq!(got, answer);
    }
}
