//! Every TCP connection a box makes to the outside lands here (its namespace
//! redirects it). The address it dialled says which name it meant (a fake
//! address the DNS server gave it); the policy decides; what the connection
//! says about itself (TLS SNI, every HTTP request's Host) must agree; then the
//! gateway dials the real host and splices. This file takes the connection
//! as far as knowing what it speaks; [`requests`] reads HTTP request by
//! request, and [`judge`] decides each.

pub mod judge;
pub mod push;
pub mod requests;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use moat_core::egress::{LogEntry, LogKind, LogVerdict};
use moat_core::policy::{HostName, Rule, Verdict, DEFAULT_PORTS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::ask::Asked;
use crate::boxnet::{BoxNet, Grounds};
use crate::fake::is_fake;
use crate::log::entry;
use crate::refusal::Refusal;
use crate::tls::hello::{self, Hello};
use crate::tls::intercept;
use crate::{http, zerocopy};
use requests::{dup, http_connection, Conn};

/// How long a box has to send the first bytes of a TLS or HTTP connection.
const FIRST_BYTES: Duration = Duration::from_secs(10);
/// How long the gateway waits for a client that may be waiting for the
/// server to speak first (only where a rule allows raw TCP).
const SERVER_FIRST: Duration = Duration::from_millis(500);
/// The port a secret is written in on: its host's HTTPS (the one its grant
/// allows); other ports of the host the policy allows never get it.
const SECRET_PORT: u16 = 443;

/// Takes connections on `listener` until the task is dropped.
pub async fn serve(net: Arc<BoxNet>, listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let net = Arc::clone(&net);
        // Subscribed here, not in the task: a cut just after the accept
        // ends this connection too.
        let cut = net.on_cut();
        tokio::spawn(async move {
            let Some(dialled) = original_destination(&stream) else { return };
            let permit = match net.gate.admit() {
                Ok(permit) => permit,
                Err(why) => {
                    let mut e = entry(LogKind::Tcp, dialled.ip().to_string(), dialled.port(), LogVerdict::Deny);
                    e.reason = Some(why.to_string());
                    net.log(e);
                    return;
                }
            };
            tokio::select! {
                _ = connection(&net, stream, dialled) => {}
                _ = cut => {}
            }
            drop(permit);
        });
    }
}

/// An attempt waiting on its owner's answer: logged if the wait is dropped
/// (the connection cut) before the answer came.
struct LogUnlessAnswered<'a>(&'a BoxNet, Option<LogEntry>);

impl LogUnlessAnswered<'_> {
    fn answered(mut self) {
        self.1 = None;
    }
}

impl Drop for LogUnlessAnswered<'_> {
    fn drop(&mut self) {
        if let Some(entry) = self.1.take() {
            self.0.log(entry);
        }
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
        let why = if fake.is_some() { Refusal::NoName } else { Refusal::RawAddress };
        e.reason = Some(why.to_string());
        net.log(e);
        return;
    };
    let mut grounds = Grounds::Policy;
    let (policy, mut verdict) = net.standing(&name, port, &grounds);
    let mut log = entry(LogKind::Tcp, name.as_str(), port, LogVerdict::Deny);
    if let Verdict::Deny(rule) = &verdict {
        log.rule = rule.as_ref().map(Rule::to_string);
        let asked = match rule {
            Some(_) => Asked::NotAsked,
            None => {
                // The wait ends with the box's network too (suspended once the
                // box went idle): the attempt is logged all the same.
                let mut gone = log.clone();
                gone.reason = Some("the box's network ended before its owner answered".into());
                let pending = LogUnlessAnswered(net, Some(gone));
                let asked = net.asked(&policy, &name, port).await;
                pending.answered();
                asked
            }
        };
        match asked {
            Asked::NotAsked => {}
            Asked::Refused(why) => log.reason = Some(why.to_string()),
            Asked::Allowed(why) => {
                // "Always" is in the policy now; "once" is for this name alone.
                if matches!(net.policy().decide(&name, port), Verdict::Deny(None)) {
                    grounds = Grounds::Owner(Rule::exact(name.clone(), port));
                }
                verdict = net.standing(&name, port, &grounds).1;
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
        Sniffed::Tls => tls_connection(net, stream, &name, port, &grounds, &verdict, &mut log).await,
        Sniffed::Http => {
            let conn = Conn { net, name: &name, port, grounds: &grounds, tls: false };
            match dup(&stream) {
                Ok(plain) => http_connection(conn, Box::new(stream), Some(plain), &mut log).await,
                Err(e) => Err(e.into()),
            }
        }
        Sniffed::Raw => match &verdict {
            Verdict::Allow(rule) => {
                log.rule = Some(rule.to_string());
                splice(net, stream, Vec::new(), &name, port, &grounds, &mut log).await
            }
            _ => Err(Refusal::NotTlsOrHttp),
        },
        Sniffed::Refused(why) => Err(why),
    };
    if let Err(why) = outcome {
        log.reason = Some(why.to_string());
    }
    net.log(log);
}

enum Sniffed {
    Tls,
    Http,
    Raw,
    Refused(Refusal),
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
        Ok(Ok(n)) if n > 0 => n.min(first.len()),
        Ok(_) => return Sniffed::Refused(Refusal::ClosedAtOnce),
        Err(_) if raw_ok => return Sniffed::Raw,
        Err(_) => return Sniffed::Refused(Refusal::Silent),
    };
    let first = first.get(..n).unwrap_or_default();
    if first.first() == Some(&0x16) {
        Sniffed::Tls
    } else if http::request::looks_like_http(first) || (n < 17 && first.iter().all(u8::is_ascii_uppercase)) {
        Sniffed::Http
    } else if raw_ok {
        Sniffed::Raw
    } else {
        Sniffed::Refused(Refusal::NotTlsOrHttp)
    }
}

async fn tls_connection(
    net: &BoxNet,
    mut stream: TcpStream,
    name: &HostName,
    port: u16,
    grounds: &Grounds,
    verdict: &Verdict,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let mut buf = Vec::with_capacity(4096);
    let sni = loop {
        match hello::read_hello(&buf) {
            Hello::Name(sni) => break sni,
            Hello::Refused(why) => return Err(Refusal::BadHello(why)),
            Hello::Incomplete => {
                let mut chunk = [0u8; 4096];
                match tokio::time::timeout(FIRST_BYTES, stream.read(&mut chunk)).await {
                    Ok(Ok(n)) if n > 0 => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
                    _ => return Err(Refusal::IncompleteHello),
                }
            }
        }
    };
    if sni != *name {
        return Err(Refusal::SniDiffers(sni));
    }
    // Looked inside where rules name methods or paths, or where a secret
    // of the box's is bound to the host; passed through untouched elsewhere.
    match verdict {
        Verdict::Allow(rule) if port != SECRET_PORT || net.secrets_for(name).is_empty() => {
            log.rule = Some(rule.to_string());
            splice(net, stream, buf, name, port, grounds, log).await
        }
        _ => {
            if let Verdict::Allow(rule) = verdict {
                log.rule = Some(rule.to_string());
            }
            let Some(config) = net.tls.clone() else { return Err(Refusal::NoCa) };
            let stream = match tokio::time::timeout(FIRST_BYTES, intercept::accept(config, stream, buf)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return Err(Refusal::BoxTls(e.to_string())),
                Err(_) => return Err(Refusal::BoxTls("timed out".into())),
            };
            let conn = Conn { net, name, port, grounds, tls: true };
            http_connection(conn, Box::new(stream), None, log).await
        }
    }
}

/// Dials `name:port`, sends `early` (what the box sent already), and copies
/// both ways until both sides are done, or until a change of policy no
/// longer lets the connection through untouched.
async fn splice(
    net: &BoxNet,
    stream: TcpStream,
    early: Vec<u8>,
    name: &HostName,
    port: u16,
    grounds: &Grounds,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let mut upstream = match net.upstream.dial(name, port).await {
        Ok(up) => up,
        Err(e) => {
            log.verdict = LogVerdict::Error;
            return Err(Refusal::Unreachable(e.to_string()));
        }
    };
    log.verdict = LogVerdict::Allow;
    // Whatever goes now is unknown to the gateway: an effect it cannot name.
    log.opaque = true;
    upstream.write_all(&early).await?;
    let (sent, received) = (AtomicU64::new(early.len() as u64), AtomicU64::new(0));
    let copied = tokio::select! {
        copied = zerocopy::bidirectional(&stream, &upstream, &sent, &received) => copied.map_err(Refusal::from),
        why = net.on_revoked(name, port, grounds, |v| matches!(v, Verdict::Allow(_))) => Err(why),
    };
    log.sent = sent.into_inner();
    log.received = received.into_inner();
    copied
}
