//! Every TCP connection a box makes to the outside lands here (its namespace
//! redirects it). The address it dialled says which name it meant (a fake
//! address the DNS server gave it); the policy decides; what the connection
//! says about itself (TLS SNI, every HTTP request's Host) must agree; then the
//! gateway dials the real host and splices.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use moat_core::egress::{LogEntry, LogKind, LogVerdict};
use moat_core::policy::{HostName, Policy, Rule, Verdict, DEFAULT_PORTS};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};

use crate::boxnet::{entry, Asked, BoxNet};
use crate::fake::is_fake;
use crate::http::{self, Body, ChunkedReader, Head};
use crate::inject::{self, Armed, Metered, Refusal};
use crate::intercept;
use crate::scrub::{self, Expect, InFlight};
use crate::tls::{self, Hello};
use crate::zerocopy;

/// A connection requests are read from or forwarded to: plain TCP, or TLS
/// the gateway looks inside.
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}
type Stream = Box<dyn Io>;
type StreamReader = ReadHalf<Stream>;
type StreamWriter = WriteHalf<Stream>;

/// How long a box has to send the first bytes of a TLS or HTTP connection.
const FIRST_BYTES: Duration = Duration::from_secs(10);
/// How long the gateway waits for a client that may be waiting for the
/// server to speak first (only where a rule allows raw TCP).
const SERVER_FIRST: Duration = Duration::from_millis(500);
/// How long a request head may take to arrive on a kept-alive connection.
const NEXT_REQUEST: Duration = Duration::from_secs(120);
/// The port a secret is written in on: its host's HTTPS (the one its grant
/// allows); other ports of the host the policy allows never get it.
const SECRET_PORT: u16 = 443;
/// Requests a box may have sent ahead of their answers on a connection a
/// secret is bound to.
const MAX_PIPELINED: usize = 32;
/// How long the answers to requests before a refused one may take.
const REFUSED_DRAIN: Duration = Duration::from_secs(10);
/// Buffer for each direction of a splice.
const SPLICE_BUFFER: usize = 64 << 10;

/// Takes connections on `listener` until the task is dropped.
pub async fn serve(net: Arc<BoxNet>, listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let net = Arc::clone(&net);
        tokio::spawn(async move {
            let Some(dialled) = original_destination(&stream) else { return };
            let Ok(permit) = Arc::clone(&net.connections).try_acquire_owned() else {
                let mut e = entry(LogKind::Tcp, dialled.ip().to_string(), dialled.port(), LogVerdict::Deny);
                e.reason = Some("too many open connections".into());
                net.log(e);
                return;
            };
            let cut = net.on_cut();
            tokio::select! {
                _ = connection(&net, stream, dialled) => {}
                _ = cut => {}
            }
            drop(permit);
        });
    }
}

/// Where the box meant to connect, before its namespace redirected it here.
fn original_destination(stream: &TcpStream) -> Option<SocketAddr> {
    match stream.local_addr().ok()? {
        SocketAddr::V4(_) => rustix::net::sockopt::ip_original_dst(stream).ok().map(SocketAddr::V4),
        SocketAddr::V6(_) => rustix::net::sockopt::ipv6_original_dst(stream).ok().map(SocketAddr::V6),
    }
}

async fn connection(net: &BoxNet, stream: TcpStream, dialled: SocketAddr) {
    let port = dialled.port();
    let fake = match dialled.ip() {
        IpAddr::V4(ip) if is_fake(ip) => Some(ip),
        _ => None,
    };
    let Some(name) = fake.and_then(|ip| net.name_at(ip)) else {
        let mut e = entry(LogKind::Tcp, dialled.ip().to_string(), port, LogVerdict::Deny);
        e.reason = Some(if fake.is_some() {
            "an address the gateway gave no name".into()
        } else {
            "a raw address (only names the policy allows are reachable)".into()
        });
        net.log(e);
        return;
    };
    let mut policy = net.policy();
    let mut verdict = policy.decide(&name, port);
    let mut log = entry(LogKind::Tcp, name.as_str(), port, LogVerdict::Deny);
    if let Verdict::Deny(rule) = &verdict {
        log.rule = rule.as_ref().map(Rule::to_string);
        let asked = match rule {
            Some(_) => Asked::NotAsked,
            None => net.asked(&policy, &name, port).await,
        };
        match asked {
            Asked::NotAsked => {}
            Asked::Refused(why) => log.reason = Some(why.into()),
            Asked::Allowed(why) => {
                // "Always" is in the policy now; "once" is for this name alone.
                policy = net.policy();
                verdict = match policy.decide(&name, port) {
                    Verdict::Deny(None) => Verdict::Allow(Rule::exact(name.clone(), port)),
                    other => other,
                };
                log.reason = Some(why.into());
            }
        }
        if matches!(verdict, Verdict::Deny(_)) {
            net.log(log);
            return;
        }
    }
    let _ = stream.set_nodelay(true);
    let outcome = match sniff(&stream, &verdict, port).await {
        Sniffed::Tls => tls_connection(net, stream, &name, port, &policy, &verdict, &mut log).await,
        Sniffed::Http => {
            let conn = Conn { net, name: &name, port, policy: &policy, verdict: &verdict, tls: false };
            match dup(&stream) {
                Ok(plain) => http_connection(conn, Box::new(stream), Some(plain), &mut log).await,
                Err(e) => Err(e.to_string()),
            }
        }
        Sniffed::Raw => match &verdict {
            Verdict::Allow(rule) => {
                log.rule = Some(rule.to_string());
                splice(net, stream, Vec::new(), &name, port, &mut log).await
            }
            _ => Err("not TLS or HTTP".into()),
        },
        Sniffed::Refused(why) => Err(why.into()),
    };
    if let Err(why) = outcome {
        log.reason = Some(why);
    }
    net.log(log);
}

enum Sniffed {
    Tls,
    Http,
    Raw,
    Refused(&'static str),
}

/// What the connection speaks, from its first bytes (left unread).
async fn sniff(stream: &TcpStream, verdict: &Verdict, port: u16) -> Sniffed {
    // Raw TCP only where a rule names this port itself (a rule that names no
    // port means HTTP and HTTPS), never on 80 or 443.
    let raw_ok = matches!(verdict, Verdict::Allow(r) if r.ports.as_deref() != Some(&DEFAULT_PORTS[..]))
        && !DEFAULT_PORTS.contains(&port);
    let mut first = [0u8; 17];
    let wait = if raw_ok { SERVER_FIRST } else { FIRST_BYTES };
    let n = match tokio::time::timeout(wait, stream.peek(&mut first)).await {
        Ok(Ok(n)) if n > 0 => n,
        Ok(_) => return Sniffed::Refused("closed before sending anything"),
        Err(_) if raw_ok => return Sniffed::Raw,
        Err(_) => return Sniffed::Refused("sent nothing"),
    };
    if first[0] == 0x16 {
        Sniffed::Tls
    } else if http::looks_like_http(&first[..n]) || (n < first.len() && first[..n].iter().all(u8::is_ascii_uppercase)) {
        Sniffed::Http
    } else if raw_ok {
        Sniffed::Raw
    } else {
        Sniffed::Refused("not TLS or HTTP")
    }
}

async fn tls_connection(
    net: &BoxNet,
    mut stream: TcpStream,
    name: &HostName,
    port: u16,
    policy: &Policy,
    verdict: &Verdict,
    log: &mut LogEntry,
) -> Result<(), String> {
    let mut buf = Vec::with_capacity(4096);
    let sni = loop {
        match tls::read_hello(&buf) {
            Hello::Name(sni) => break sni,
            Hello::Refused(why) => return Err(why.into()),
            Hello::Incomplete => {
                let mut chunk = [0u8; 4096];
                match tokio::time::timeout(FIRST_BYTES, stream.read(&mut chunk)).await {
                    Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                    _ => return Err("incomplete ClientHello".into()),
                }
            }
        }
    };
    if sni != *name {
        return Err(format!("SNI {sni} differs from the dialled name"));
    }
    // Looked inside where rules name methods or paths, or where a secret
    // of the box's is bound to the host; passed through untouched elsewhere.
    match verdict {
        Verdict::Allow(rule) if port != SECRET_PORT || net.secrets_for(name).is_empty() => {
            log.rule = Some(rule.to_string());
            splice(net, stream, buf, name, port, log).await
        }
        _ => {
            if let Verdict::Allow(rule) = verdict {
                log.rule = Some(rule.to_string());
            }
            let Some(config) = net.tls.clone() else {
                return Err("this host must be looked inside (its rules name methods or paths, or a secret \
                            is bound to it), and this box has no CA to do it with (made before boxes had one: \
                            dup it)"
                    .into());
            };
            let stream = match tokio::time::timeout(FIRST_BYTES, intercept::accept(config, stream, buf)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return Err(format!("TLS with the box: {e}")),
                Err(_) => return Err("TLS with the box: timed out".into()),
            };
            let conn = Conn { net, name, port, policy, verdict, tls: true };
            http_connection(conn, Box::new(stream), None, log).await
        }
    }
}

/// Dials `name:port`, sends `early` (what the box sent already), and copies
/// both ways until both sides are done.
async fn splice(
    net: &BoxNet,
    stream: TcpStream,
    early: Vec<u8>,
    name: &HostName,
    port: u16,
    log: &mut LogEntry,
) -> Result<(), String> {
    let upstream = match net.upstream.dial(name, port).await {
        Ok(up) => up,
        Err(e) => {
            log.verdict = LogVerdict::Error;
            return Err(e.to_string());
        }
    };
    log.verdict = LogVerdict::Allow;
    let mut upstream = upstream;
    upstream.write_all(&early).await.map_err(|e| e.to_string())?;
    log.sent = early.len() as u64;
    match zerocopy::bidirectional(&stream, &upstream).await {
        Ok((sent, received)) => {
            log.sent += sent;
            log.received = received;
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// HTTP, plain or inside TLS (`tls`: then to the host over TLS too): every
/// request on the connection is read and checked (Host, and the policy's
/// method and target rules), so that a kept-alive connection cannot change
/// hosts or methods after the first request.
async fn http_connection(
    conn: Conn<'_>,
    stream: Stream,
    plain: Option<TcpStream>,
    log: &mut LogEntry,
) -> Result<(), String> {
    let Conn { net, name, port, tls, .. } = conn;
    // A host one of the box's secrets is bound to, over HTTPS on 443 (looked
    // inside always): the secret goes into requests, every response is
    // scrubbed, and killing a secret bound there ends the connection. (A
    // secret killed already is refused per request, with a reason.)
    if !(tls && port == SECRET_PORT) || net.secrets_for(name).is_empty() {
        return requests(conn, stream, plain, log, false).await;
    }
    tokio::select! {
        r = requests(conn, stream, plain, log, true) => r,
        () = net.on_secret_killed(name) => Err("a secret bound to this host was killed".into()),
    }
}

/// The request loop of [`http_connection`]; `plain`: the box's socket
/// itself, for plain HTTP (responses are spliced to it); `bound`: the box
/// has secrets for this host (written into requests, cut from responses).
async fn requests(
    conn: Conn<'_>,
    stream: Stream,
    plain: Option<TcpStream>,
    log: &mut LogEntry,
    bound: bool,
) -> Result<(), String> {
    let Conn { net, name, port, policy, verdict, tls } = conn;
    let (mut from_box, to_box) = tokio::io::split(stream);
    let to_box = Arc::new(tokio::sync::Mutex::new(to_box));
    let received = Arc::new(AtomicU64::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut up: Option<(StreamWriter, AbortOnDrop)> = None;
    // Where a bound connection's relay learns what each response answers
    // (bounded: a box pipelining requests waits for their answers).
    let (expect_tx, expect_rx) = tokio::sync::mpsc::channel::<Expect>(MAX_PIPELINED);
    let mut expect_rx = Some(expect_rx);
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    // The box asked for the end after the request sent last.
    let mut last_request = false;
    let activity = Activity { received: &received, in_flight: &in_flight };
    let result = loop {
        let request = match read_request(&mut from_box, &mut buf, activity).await {
            Ok(Some(r)) => r,
            Ok(None) => break Ok(()),
            Err(why) => {
                if up.is_none() {
                    refuse(&to_box, 400, &why).await;
                }
                break Err(why);
            }
        };
        let mut req_log = entry(LogKind::Http, name.as_str(), port, LogVerdict::Deny);
        req_log.method = Some(request.method.clone());
        req_log.target = Some(request.target.clone());
        // A protocol switch would hand every later byte through unread (and
        // a server that does not switch reads them as requests): refused.
        let decided = if request.upgrade {
            Err("protocol switches (Upgrade) are not passed through the gateway".to_string())
        } else if request.host != *name || request.port.is_some_and(|p| p != port) {
            Err(format!("Host {} differs from the dialled name", request.host))
        } else {
            match verdict {
                Verdict::Allow(rule) => Ok(rule.clone()),
                _ => policy.decide_request(name, port, &request.method, &request.target).map_err(|rule| match rule {
                    Some(rule) => {
                        req_log.rule = Some(rule.to_string());
                        "refused by rule".into()
                    }
                    None => "no rule allows this request".into(),
                }),
            }
        };
        let rule = match decided {
            Ok(rule) => rule,
            Err(why) => {
                req_log.reason = Some(why.clone());
                net.log(req_log);
                // With requests before it in flight, their responses go
                // first (the cleanup below lets them finish).
                if up.is_none() {
                    refuse(&to_box, 403, &why).await;
                }
                break Err(why);
            }
        };
        req_log.rule = Some(rule.to_string());
        log.rule.get_or_insert_with(|| rule.to_string());
        // The head as it goes out: with the box's secrets for this host
        // written in (read again per request: a revoked or killed secret
        // stops at the next one).
        let raw: Vec<u8> = buf.drain(..request.head_len).collect();
        let mut injected: Vec<Armed> = Vec::new();
        // The values its answer is cut of: the box's, as the request goes
        // out (those written into it among them).
        let mut values = Vec::new();
        let rewritten = if bound {
            let armed = net.secrets_for(name);
            values = net.secret_values();
            values.extend(armed.iter().map(|a| a.secret.value.expose().to_string()));
            inject::rewrite(&raw, &armed, &net.id).map(|r| {
                injected = r.injected.iter().filter_map(|&i| armed.get(i).cloned()).collect();
                r.head
            })
        } else {
            http::with_crlf(&raw).ok_or(Refusal { status: 400, why: "a head that is not text".into() })
        };
        let head = match rewritten {
            Ok(head) => head,
            Err(refusal) => {
                req_log.reason = Some(refusal.why.clone());
                net.log(req_log);
                // In its turn, after the responses before it.
                if up.is_none() {
                    refuse(&to_box, refusal.status, &refusal.why).await;
                } else if bound {
                    let _ = expect_tx.send(Expect::refused(refusal.status, refusal.why.clone())).await;
                }
                break Err(refusal.why);
            }
        };
        if up.is_none() {
            // Plain HTTP responses are spliced socket to socket: a second
            // handle on the upstream socket to read, one on the box's to write.
            let dialled: Result<(Stream, Option<TcpStream>), String> = if tls {
                net.upstream
                    .dial_tls(name, port)
                    .await
                    .map(|s| (Box::new(s) as Stream, None))
                    .map_err(|e| e.to_string())
            } else {
                match net.upstream.dial(name, port).await {
                    Ok(s) => dup(&s).map(|copy| (Box::new(s) as Stream, Some(copy))).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            };
            match dialled {
                Ok((stream, up_socket)) => {
                    let (up_read, up_write) = tokio::io::split(stream);
                    let (to_box, received) = (Arc::clone(&to_box), Arc::clone(&received));
                    let box_socket = plain.as_ref().map(dup).transpose().ok().flatten();
                    let copier = match (bound, expect_rx.take(), up_socket, box_socket) {
                        (true, Some(rx), _, _) => tokio::spawn(scrub::relay(up_read, to_box, rx, received)),
                        (_, _, Some(from), Some(to)) => tokio::spawn(async move {
                            let _ = zerocopy::copy(&from, &to, &received).await;
                        }),
                        _ => tokio::spawn(copy_responses(up_read, to_box, received)),
                    };
                    up = Some((up_write, AbortOnDrop(copier)));
                }
                Err(e) => {
                    // Admitted, never sent: not in flight.
                    injected.iter().for_each(|a| a.meter.release(&net.id));
                    req_log.verdict = LogVerdict::Error;
                    req_log.reason = Some(e.clone());
                    net.log(req_log);
                    log.verdict = LogVerdict::Error;
                    refuse(&to_box, 502, &e).await;
                    break Err(e);
                }
            }
        }
        req_log.verdict = LogVerdict::Allow;
        log.verdict = LogVerdict::Allow;
        let Some((up_write, _)) = up.as_mut() else {
            injected.iter().for_each(|a| a.meter.release(&net.id));
            break Err("no upstream".into());
        };
        // Counted as it goes (an answer may come before the body is all sent).
        let request_bytes = Arc::new(AtomicU64::new(0));
        if let Err(e) = write_counted(up_write, &head, &request_bytes).await {
            injected.iter().for_each(|a| a.meter.release(&net.id));
            break Err(e.to_string());
        }
        log.sent += head.len() as u64;
        // On a bound connection the relay hears of the request before its
        // body goes (a client waiting for 100 Continue gets it); the entry of
        // a request with a secret in it is finished (bytes, tokens) and logged
        // with its response.
        let mut plain_log = Some(req_log);
        if bound {
            let mut expect = Expect::response(request.method == "HEAD", request.http10, request.close, values.into());
            if !injected.is_empty() {
                if let Some(entry) = plain_log.take() {
                    let metered = Metered::new(entry, std::mem::take(&mut injected), net.logger(), &request_bytes);
                    expect.metered = Some(metered);
                }
            }
            expect.in_flight = Some(InFlight::new(&in_flight));
            if expect_tx.send(expect).await.is_err() {
                break Err("the host's answers ended".into());
            }
        }
        match forward_body(&mut from_box, up_write, &mut buf, request.body, &request_bytes).await {
            Ok(n) => {
                log.sent += n;
                if let Some(mut entry) = plain_log {
                    entry.sent = request_bytes.load(Ordering::Relaxed);
                    net.log(entry);
                }
            }
            Err(why) => break Err(why),
        }
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
    log.received = received.load(Ordering::Relaxed);
    result
}

/// What one box connection is, for the HTTP code.
#[derive(Clone, Copy)]
struct Conn<'a> {
    net: &'a BoxNet,
    name: &'a HostName,
    port: u16,
    policy: &'a Policy,
    verdict: &'a Verdict,
    /// Looked inside (TLS to the box and to the host).
    tls: bool,
}

/// A second handle on a socket (for the side the splicer reads or writes).
fn dup(stream: &TcpStream) -> std::io::Result<TcpStream> {
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
) -> Result<Option<http::Request>, String> {
    loop {
        match http::read_head(buf) {
            Head::Request(r) => return Ok(Some(r)),
            Head::Refused(why) => return Err(why.into()),
            Head::Incomplete => {}
        }
        let mut chunk = [0u8; 8192];
        let mark = activity.mark();
        match tokio::time::timeout(NEXT_REQUEST, from_box.read(&mut chunk)).await {
            Ok(Ok(0)) if buf.is_empty() => return Ok(None),
            Ok(Ok(0)) => return Err("closed inside a request head".into()),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(e)) => return Err(e.to_string()),
            // A box waiting on a long answer is not idle.
            Err(_) if buf.is_empty() => {
                if activity.idle_since(mark) {
                    return Ok(None);
                }
            }
            Err(_) => return Err("request head too slow".into()),
        }
    }
}

/// Writes `data` to the host, adding it to `sent`.
async fn write_counted(up: &mut StreamWriter, data: &[u8], sent: &AtomicU64) -> std::io::Result<()> {
    up.write_all(data).await?;
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
) -> Result<u64, String> {
    let mut sent = 0u64;
    let mut chunk = vec![0u8; SPLICE_BUFFER];
    match body {
        Body::Length(mut left) => {
            let now = (buf.len() as u64).min(left) as usize;
            write_counted(up, &buf[..now], counted).await.map_err(|e| e.to_string())?;
            buf.drain(..now);
            left -= now as u64;
            sent += now as u64;
            while left > 0 {
                let want = (chunk.len() as u64).min(left) as usize;
                let n = from_box.read(&mut chunk[..want]).await.map_err(|e| e.to_string())?;
                if n == 0 {
                    return Err("closed inside a request body".into());
                }
                write_counted(up, &chunk[..n], counted).await.map_err(|e| e.to_string())?;
                left -= n as u64;
                sent += n as u64;
            }
        }
        Body::Chunked => {
            let mut reader = ChunkedReader::default();
            let n = reader.feed(buf)?;
            write_counted(up, &buf[..n], counted).await.map_err(|e| e.to_string())?;
            buf.drain(..n);
            sent += n as u64;
            while !reader.done() {
                let got = from_box.read(&mut chunk).await.map_err(|e| e.to_string())?;
                if got == 0 {
                    return Err("closed inside a chunked body".into());
                }
                let n = reader.feed(&chunk[..got])?;
                write_counted(up, &chunk[..n], counted).await.map_err(|e| e.to_string())?;
                sent += n as u64;
                // Bytes after the body are the next request's.
                buf.extend_from_slice(&chunk[n..got]);
            }
        }
    }
    Ok(sent)
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
        if to_box.lock().await.write_all(&chunk[..n]).await.is_err() {
            break;
        }
        received.fetch_add(n as u64, Ordering::Relaxed);
    }
    let _ = to_box.lock().await.shutdown().await;
}

/// Answers the box with an error of the gateway's own (only where no answer
/// from upstream may be on its way: the two would interleave), and closes.
async fn refuse(to_box: &tokio::sync::Mutex<StreamWriter>, code: u16, why: &str) {
    let mut w = to_box.lock().await;
    scrub::refuse(&mut *w, code, why).await;
    let _ = w.shutdown().await;
}
