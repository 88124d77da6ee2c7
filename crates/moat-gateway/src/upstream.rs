//! The gateway's side towards the internet: resolving a name with the
//! operator's resolver (never the box's say, never the host's libc), refusing
//! answers that point anywhere but the public internet, and dialling.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moat_core::policy::HostName;
use tokio::net::{TcpStream, UdpSocket};

use crate::dns;
use crate::messages::GatewayHello;
use crate::tls::intercept;

/// How long one upstream DNS attempt may take (two are made).
const DNS_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a dial may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bounds on how long answers are kept, whatever their TTL says.
const MIN_TTL: u32 = 5;
const MAX_TTL: u32 = 300;
/// Most names kept in the cache.
const CACHE_SIZE: usize = 4096;

impl GatewayHello {
    /// The upstream configuration it describes.
    pub fn upstream(&self) -> Result<UpstreamConfig, String> {
        let allow = self.upstream_allow.iter().map(|c| c.parse::<Cidr>()).collect::<Result<_, _>>()?;
        let tls = match intercept::upstream_config(&self.upstream_roots) {
            Ok(tls) => Some(tls),
            Err(e) => {
                tracing::warn!(error = %e, "HTTPS the gateway looks inside will fail");
                None
            }
        };
        Ok(UpstreamConfig { dns: self.upstream_dns, allow, tls })
    }
}

/// An address range, `ADDR/PREFIX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not an address range (e.g. 203.0.113.0/24)");
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(bad());
        }
        Ok(Self { addr, prefix })
    }
}

impl Cidr {
    /// Whether `ip` is in the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => prefix_eq(&net.octets(), &ip.octets(), self.prefix),
            (IpAddr::V6(net), IpAddr::V6(ip)) => prefix_eq(&net.octets(), &ip.octets(), self.prefix),
            _ => false,
        }
    }
}

fn prefix_eq(a: &[u8], b: &[u8], bits: u8) -> bool {
    let (whole, rest) = (usize::from(bits / 8), bits % 8);
    match (a.get(..whole), b.get(..whole)) {
        (Some(a), Some(b)) if a == b => {}
        _ => return false,
    }
    rest == 0 || matches!((a.get(whole), b.get(whole)), (Some(x), Some(y)) if (x ^ y) >> (8 - rest) == 0)
}

/// Whether `ip` is an address on the public internet: not loopback, private,
/// shared (CGNAT), link-local, multicast, documentation, benchmarking,
/// reserved, or an IPv6 form that embeds or tunnels to IPv4.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => is_public_v6(v6),
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    const NOT_PUBLIC: &[(u32, u8)] = &[
        (0x0000_0000, 8),  // "this network"
        (0x0a00_0000, 8),  // private
        (0x6440_0000, 10), // shared address space (CGNAT)
        (0x7f00_0000, 8),  // loopback
        (0xa9fe_0000, 16), // link-local
        (0xac10_0000, 12), // private
        (0xc000_0000, 24), // IETF protocol assignments
        (0xc000_0200, 24), // TEST-NET-1
        (0xc058_6300, 24), // 6to4 relay anycast
        (0xc0a8_0000, 16), // private
        (0xc612_0000, 15), // benchmarking (our fake range)
        (0xc633_6400, 24), // TEST-NET-2
        (0xcb00_7100, 24), // TEST-NET-3
        (0xe000_0000, 4),  // multicast
        (0xf000_0000, 4),  // reserved, broadcast
    ];
    let n = u32::from(ip);
    !NOT_PUBLIC.iter().any(|&(net, bits)| n >> (32 - bits) == net >> (32 - bits))
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let [s0, s1, ..] = ip.segments();
    // Only global unicast (2000::/3) is public; within it, documentation,
    // Teredo, 6to4 and ORCHID-style special ranges are not.
    let global = s0 & 0xe000 == 0x2000;
    let special = s0 == 0x2001 && (s1 < 0x0200 || s1 == 0x0db8) || s0 == 0x2002 || s0 == 0x3fff;
    global && !special
}

/// The operator's settings for the gateway's upstream side.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// The resolver asked for names (UDP, TCP when an answer is truncated).
    pub dns: SocketAddr,
    /// Ranges that may be dialled although they are not public (a test
    /// internet only).
    pub allow: Vec<Cidr>,
    /// TLS to real hosts where the gateway looks inside HTTPS (`None`: the
    /// host has no roots, and such connections fail).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// Resolves and dials, with a small cache of answers.
pub struct Upstream {
    config: UpstreamConfig,
    cache: Mutex<HashMap<HostName, (Instant, Vec<IpAddr>)>>,
}

/// Why a name could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The resolver did not answer usably.
    #[error("resolving {0}: {1}")]
    Resolve(HostName, String),
    /// It answered with no address.
    #[error("{0} has no address")]
    NoAddress(HostName),
    /// Every address it gave is one the gateway may not dial.
    #[error("{0} resolves to {1}, which is not on the public internet")]
    NotPublic(HostName, IpAddr),
    /// It resolves to an address of the gateway's own host.
    #[error("{0} resolves to {1}, an address of this host")]
    ThisHost(HostName, IpAddr),
    /// Dialling failed.
    #[error("connecting to {0}: {1}")]
    Dial(HostName, std::io::Error),
    /// TLS to it failed (its certificate, most often).
    #[error("TLS to {0}: {1}")]
    Tls(HostName, String),
}

impl Upstream {
    /// An upstream side with `config`.
    pub fn new(config: UpstreamConfig) -> Self {
        Self { config, cache: Mutex::new(HashMap::new()) }
    }

    /// Whether the gateway may dial `ip`.
    pub fn may_dial(&self, ip: IpAddr) -> bool {
        is_public(ip) || self.is_allowed_range(ip)
    }

    fn is_allowed_range(&self, ip: IpAddr) -> bool {
        self.config.allow.iter().any(|c| c.contains(ip))
    }

    /// The addresses of `name` the gateway may dial (never empty).
    pub async fn resolve(&self, name: &HostName) -> Result<Vec<IpAddr>, UpstreamError> {
        if let Some((until, addrs)) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            if *until > Instant::now() {
                return Ok(addrs.clone());
            }
        }
        let (v4, v6) = tokio::join!(self.query(name, dns::TYPE_A), self.query(name, dns::TYPE_AAAA));
        let v4 = v4?;
        // An IPv6 failure is not fatal when IPv4 answered.
        let v6 = v6.unwrap_or_default();
        let ttl = [v4.ttl, v6.ttl].into_iter().filter(|t| *t > 0).min().unwrap_or(MIN_TTL).clamp(MIN_TTL, MAX_TTL);
        let all: Vec<IpAddr> =
            v4.v4.iter().map(|a| IpAddr::V4(*a)).chain(v6.v6.iter().map(|a| IpAddr::V6(*a))).collect();
        if all.is_empty() {
            return Err(UpstreamError::NoAddress(name.clone()));
        }
        // One address the gateway may not dial makes the whole answer suspect
        // (DNS rebinding mixes a public address with a private one).
        if let Some(bad) = all.iter().find(|ip| !self.may_dial(**ip)) {
            return Err(UpstreamError::NotPublic(name.clone(), *bad));
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= CACHE_SIZE {
            let now = Instant::now();
            cache.retain(|_, (until, _)| *until > now);
            if cache.len() >= CACHE_SIZE {
                cache.clear();
            }
        }
        cache.insert(name.clone(), (Instant::now() + Duration::from_secs(ttl.into()), all.clone()));
        Ok(all)
    }

    async fn query(&self, name: &HostName, qtype: u16) -> Result<dns::Resolved, UpstreamError> {
        let fail = |why: String| UpstreamError::Resolve(name.clone(), why);
        let mut last = String::from("no answer");
        for _ in 0..2 {
            match tokio::time::timeout(DNS_TIMEOUT, self.query_udp(name, qtype)).await {
                Ok(Ok(r)) if r.truncated => return self.query_tcp(name, qtype).await.map_err(|e| fail(e.to_string())),
                Ok(Ok(r)) if r.rcode == 0 || r.rcode == 3 => return Ok(r),
                Ok(Ok(r)) => last = format!("resolver answered with code {}", r.rcode),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "timed out".into(),
            }
        }
        Err(fail(last))
    }

    async fn query_udp(&self, name: &HostName, qtype: u16) -> std::io::Result<dns::Resolved> {
        let bind: SocketAddr =
            if self.config.dns.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().map_err(std::io::Error::other)?;
        let socket = UdpSocket::bind(bind).await?;
        socket.connect(self.config.dns).await?;
        let id = random_id();
        socket.send(&dns::upstream_query(id, name, qtype)).await?;
        let mut buf = vec![0; 4096];
        loop {
            let n = socket.recv(&mut buf).await?;
            // Anything not our answer (a stray, a spoof) is skipped.
            if let Ok(r) = dns::parse_upstream(buf.get(..n).unwrap_or_default(), id, name) {
                return Ok(r);
            }
        }
    }

    async fn query_tcp(&self, name: &HostName, qtype: u16) -> std::io::Result<dns::Resolved> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let work = async {
            let mut stream = TcpStream::connect(self.config.dns).await?;
            let id = random_id();
            let query = dns::upstream_query(id, name, qtype);
            let mut framed = (query.len() as u16).to_be_bytes().to_vec();
            framed.extend_from_slice(&query);
            stream.write_all(&framed).await?;
            let len = usize::from(stream.read_u16().await?);
            let mut buf = vec![0; len];
            stream.read_exact(&mut buf).await?;
            dns::parse_upstream(&buf, id, name).map_err(std::io::Error::other)
        };
        tokio::time::timeout(DNS_TIMEOUT, work).await.map_err(|_| std::io::Error::other("timed out"))?
    }

    /// Connects to `name:port`, trying its addresses in turn.
    pub async fn dial(&self, name: &HostName, port: u16) -> Result<TcpStream, UpstreamError> {
        let addrs = self.resolve(name).await?;
        let mut last = std::io::Error::other("no address");
        for ip in addrs {
            match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect((ip, port))).await {
                // A public address of this host's own is still this host: a
                // connection to one of its own addresses leaves from that address.
                Ok(Ok(stream)) if !self.is_allowed_range(ip) && is_local(&stream) => {
                    return Err(UpstreamError::ThisHost(name.clone(), ip));
                }
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(stream);
                }
                Ok(Err(e)) => last = e,
                Err(_) => last = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"),
            }
        }
        Err(UpstreamError::Dial(name.clone(), last))
    }

    /// Connects to `name:port` over TLS, the host verified as `name`.
    pub async fn dial_tls(
        &self,
        name: &HostName,
        port: u16,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::io::BufReader<TcpStream>>, UpstreamError> {
        let Some(tls) = &self.config.tls else {
            return Err(UpstreamError::Tls(name.clone(), "this host has no TLS roots to verify it with".into()));
        };
        let stream = self.dial(name, port).await?;
        let handshake = crate::tls::intercept::connect(Arc::clone(tls), stream, name);
        match tokio::time::timeout(DIAL_TIMEOUT, handshake).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(UpstreamError::Tls(name.clone(), e.to_string())),
            Err(_) => Err(UpstreamError::Tls(name.clone(), "handshake timed out".into())),
        }
    }
}

/// Whether a connection ends on this host.
fn is_local(stream: &TcpStream) -> bool {
    match (stream.local_addr(), stream.peer_addr()) {
        (Ok(local), Ok(peer)) => local.ip() == peer.ip(),
        _ => true,
    }
}

fn random_id() -> u16 {
    let mut id = [0u8; 2];
    let _ = getrandom::fill(&mut id);
    u16::from_ne_bytes(id)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connections_to_this_host_are_seen() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        assert!(is_local(&stream));
    }

    #[test]
    fn public_or_not() {
        for ip in ["1.1.1.1", "151.101.0.223", "2606:4700::1111", "2a00:1450::1"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "198.18.0.5",
            "203.0.113.7",
            "::1",
            "::",
            "fe80::1",
            "fc00::1",
            "::ffff:127.0.0.1",
            "64:ff9b::a00:1",
            "2001:db8::1",
            "2002:a00:1::",
            "2001::1",
            "ff02::1",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        let test_net: Cidr = "203.0.113.0/24".parse().unwrap();
        assert!(test_net.contains("203.0.113.200".parse().unwrap()));
        assert!(!test_net.contains("203.0.114.1".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()) && !v6.contains("fe12::1".parse().unwrap()));
    }
}
