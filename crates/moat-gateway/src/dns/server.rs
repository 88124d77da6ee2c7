//! The DNS server a box talks to: a name the policy allows gets its fake
//! address; every other name gets NXDOMAIN at once, except in ask mode, where
//! it gets a fake address too and the owner is asked when the box dials it
//! (so the question can name the port, and a client waits on a connection
//! longer than on a lookup). Nothing a box asks is ever sent upstream, so a
//! query cannot carry data out.

use std::sync::Arc;
use std::time::Duration;

use moat_core::egress::{LogKind, LogVerdict};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use crate::boxnet::BoxNet;
use crate::dns::{self, Rcode};
use crate::log::entry;

/// TTL of answers: fake addresses never change for a box.
const TTL: u32 = 300;
/// A TCP DNS connection idle this long is closed.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// Answers one message from the box (`None`: not worth an answer).
pub fn answer(net: &BoxNet, msg: &[u8]) -> Option<Vec<u8>> {
    let query = match dns::parse_query(msg) {
        Ok(q) => q,
        Err(e) => {
            let mut log = entry(LogKind::Dns, "?", 0, LogVerdict::Deny);
            log.reason = Some(format!("malformed query: {e}"));
            net.log(log);
            return dns::format_error(msg);
        }
    };
    let qtype = type_name(query.qtype);
    let mut log = entry(LogKind::Dns, query.shown.clone(), 0, LogVerdict::Deny);
    log.method = Some(qtype);
    let policy = net.policy();
    let reply = match &query.name {
        _ if query.qclass != dns::CLASS_IN => {
            log.reason = Some("not class IN".into());
            dns::answer(&query, Rcode::Refused, None, None, 0)
        }
        None => {
            log.reason = Some("not a host name".into());
            dns::answer(&query, Rcode::NxDomain, None, None, 0)
        }
        Some(name) if !policy.allows_name(name) && !net.may_ask(&policy, name) => {
            dns::answer(&query, Rcode::NxDomain, None, None, 0)
        }
        Some(name) => match query.qtype {
            dns::TYPE_A => match net.fake_addr(name) {
                Some(addr) => {
                    log.verdict = LogVerdict::Allow;
                    log.reason = Some(addr.to_string());
                    dns::answer(&query, Rcode::NoError, Some(addr), None, TTL)
                }
                None => {
                    log.verdict = LogVerdict::Error;
                    log.reason = Some("the box holds too many names".into());
                    dns::answer(&query, Rcode::ServFail, None, None, 0)
                }
            },
            // The name exists; it has no records of other types for the box
            // (no IPv6 fake addresses yet).
            _ => {
                log.verdict = LogVerdict::Allow;
                dns::answer(&query, Rcode::NoError, None, None, TTL)
            }
        },
    };
    if log.verdict == LogVerdict::Allow && query.name.as_ref().is_some_and(|n| !policy.allows_name(n)) {
        log.rule = Some("ask mode: the owner is asked when it is dialled".into());
    }
    net.log(log);
    Some(reply)
}

fn type_name(qtype: u16) -> String {
    match qtype {
        dns::TYPE_A => "A".into(),
        dns::TYPE_AAAA => "AAAA".into(),
        dns::TYPE_CNAME => "CNAME".into(),
        15 => "MX".into(),
        16 => "TXT".into(),
        33 => "SRV".into(),
        64 => "SVCB".into(),
        65 => "HTTPS".into(),
        other => format!("TYPE{other}"),
    }
}

/// Serves DNS over UDP on `socket` until the task is dropped.
pub async fn serve_udp(net: Arc<BoxNet>, socket: UdpSocket) {
    loop {
        if socket.readable().await.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let received = crate::scratch::with(|buf| {
            let (n, peer) = socket.try_recv_from(buf)?;
            Ok::<_, std::io::Error>((answer(&net, buf.get(..n).unwrap_or_default()), peer))
        });
        if let Ok((Some(reply), peer)) = received {
            let _ = socket.send_to(&reply, peer).await;
        }
    }
}

/// Serves DNS over TCP on `listener` until the task is dropped.
pub async fn serve_tcp(net: Arc<BoxNet>, listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(permit) = net.gate.admit() else { continue };
        let net = Arc::clone(&net);
        // Subscribed before the task runs: a cut just after the accept
        // ends this stream too.
        let cut = net.on_cut();
        tokio::spawn(async move {
            tokio::select! {
                _ = serve_stream(&net, stream) => {}
                _ = cut => {}
            }
            drop(permit);
        });
    }
}

async fn serve_stream(net: &BoxNet, mut stream: TcpStream) {
    loop {
        let Ok(Ok(len)) = tokio::time::timeout(TCP_IDLE, stream.read_u16()).await else { return };
        let mut msg = vec![0; usize::from(len)];
        if !matches!(tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut msg)).await, Ok(Ok(_))) {
            return;
        }
        let Some(reply) = answer(net, &msg) else { return };
        let mut framed = (reply.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&reply);
        if stream.write_all(&framed).await.is_err() {
            return;
        }
    }
}
