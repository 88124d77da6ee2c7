//! The egress rows of `moat bench`: one client, run once inside a box's
//! network namespace (through the gateway) and once inside a test internet's
//! namespace (straight to the server), against the same servers:
//!
//! - a download over plain HTTP (every request read by the gateway);
//! - a fresh HTTPS request (new connection, handshake, small answer), for a
//!   host the gateway passes through and for one it looks inside;
//! - a DNS answer for an allowed name, from the gateway against the test
//!   internet's resolver;
//! - a git push of a 10 MiB pack over HTTPS (its command list checked by a
//!   push rule, and its pack read for a `--fast-forward` rule).
//!
//! The test internet is a network namespace of its own with one address
//! (TEST-NET-3) on `lo`, the servers bound there by this process. Nothing
//! leaves the machine.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moat_core::policy::{HostName, Policy, PushRule, Rule};
use moat_gateway::dns;
use moat_gateway::tls::intercept;
use moat_gateway::tls::leaves::LeafSigner;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use moat_box::host::egress::in_netns;

/// The test internet's one address.
pub const SERVER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The name it serves (and every name below it: see [`serve_dns`]).
pub const NAME: &str = "bench.test";
const CHUNK: usize = 256 << 10;

/// The test internet: its namespace, its CA, its servers (tasks of the
/// caller's runtime, ended with it).
pub struct BenchNet {
    name: String,
    /// The CA the servers' certificates chain to (PEM).
    pub ca: String,
}

impl BenchNet {
    /// Makes the namespace and starts the servers in it.
    pub fn start() -> Result<Self> {
        Self::start_with(None)
    }

    /// As [`start`](Self::start), its HTTPS server also answering for
    /// `registry`'s files (by Host and path), and its DNS server for the
    /// registries' names.
    pub fn start_with(registry: Option<Arc<Registry>>) -> Result<Self> {
        let name = format!("moat-bench-{}", std::process::id());
        let ip = |args: &[&str]| -> Result<()> {
            let out = Command::new("ip").args(args).output().context("run ip (apt-get install iproute2)")?;
            if !out.status.success() {
                bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
            }
            Ok(())
        };
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name])?;
        let mut net = Self { name, ca: String::new() };
        ip(&["-n", &net.name, "link", "set", "lo", "up"])?;
        ip(&["-n", &net.name, "addr", "add", &format!("{SERVER}/32"), "dev", "lo"])?;
        let (ca, key) = moat_core::box_ca::mint()?;
        let tls =
            intercept::box_config(LeafSigner::new(&key).map_err(anyhow::Error::msg)?).map_err(anyhow::Error::msg)?;
        let (http, https, dns) = in_netns(&net.path(), || -> Result<_> {
            Ok((
                std::net::TcpListener::bind((SERVER, 80))?,
                std::net::TcpListener::bind((SERVER, 443))?,
                UdpSocket::bind((SERVER, 53))?,
            ))
        })?;
        tokio::spawn(serve_http(http, None, None));
        tokio::spawn(serve_http(https, Some(tls), registry));
        std::thread::spawn(move || serve_dns(dns));
        net.ca = ca;
        Ok(net)
    }

    /// Its namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its namespace.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// What the gateway is told to reach it.
    pub fn gateway_hello(&self) -> moat_gateway::GatewayHello {
        moat_gateway::GatewayHello {
            upstream_dns: SocketAddr::from((SERVER, 53)),
            upstream_allow: vec![format!("{SERVER}/32")],
            upstream_roots: self.ca.clone(),
        }
    }
}

impl Drop for BenchNet {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// The secret the bench writes into requests (for [`NAME`], as a bearer token).
pub const SECRET: &str = "bench";

/// What [`SECRET`] is.
pub fn secret_spec() -> Result<moat_core::secrets::SecretSpec> {
    let name = moat_core::Name::new(SECRET)?;
    let env = moat_core::secrets::SecretSpec::default_env(&name);
    Ok(moat_core::secrets::SecretSpec {
        name,
        host: HostName::parse(NAME)?,
        header: "Authorization".into(),
        format: "Bearer {}".into(),
        env,
    })
}

/// The policy of the box through which traffic passes untouched (`look`:
/// every request is read, HTTPS included).
pub fn policy(look: bool) -> Result<Policy> {
    let mut policy = Policy::default();
    let words: &[&str] = if look { &["GET", NAME] } else { &[NAME] };
    policy.allow(Rule::parse(words)?);
    Ok(policy)
}

/// The policy of a box that pushes to `NAME/moat/bench` (`ff`: as
/// fast-forwards only, which the gateway decides from the pack).
pub fn push_policy(ff: bool) -> Result<Policy> {
    let place = format!("{NAME}/moat/bench");
    let mut words = vec![place.as_str(), "refs/heads/agent/*"];
    if ff {
        words.push("--fast-forward");
    }
    Ok(Policy { push: vec![PushRule::parse(&words)?], ..Policy::default() })
}

/// The policy of a box whose pushes are looked inside by a path rule and
/// no push rule: what the push rows pay for TLS alone.
pub fn push_by_path() -> Result<Policy> {
    let mut policy = Policy::default();
    policy.allow(Rule::parse(&["POST", &format!("{NAME}/moat/")])?);
    Ok(policy)
}

/// A push body: one update of `refs/heads/agent/bench`, then a pack of a
/// commit whose parent is the old id and a blob of `mib` MiB of noise
/// (stored, not compressed: a push of build output looks like this).
pub fn push_body(mib: usize) -> Result<Vec<u8>> {
    use moat_gateway::git::pack::{hex, Hash};
    let old = "1".repeat(40);
    let commit = format!(
        "tree {}\nparent {old}\nauthor b <b@b> 0 +0000\ncommitter b <b@b> 0 +0000\n\nbench\n",
        "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
    );
    let new = hex(&Hash::Sha1.commit_id(commit.as_bytes()));
    let mut body = Vec::new();
    let first = format!("{old} {new} refs/heads/agent/bench\0report-status ofs-delta");
    moat_gateway::git::pktline::encode(first.as_bytes(), &mut body);
    body.extend_from_slice(b"0000PACK\0\0\0\x02\0\0\0\x02");
    let mut noise = vec![0u8; mib << 20];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for b in &mut noise {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    for (kind, data) in [(1u8, commit.as_bytes()), (3, &noise[..])] {
        let mut size = data.len();
        let mut byte = (kind << 4) | (size & 15) as u8;
        size >>= 4;
        while size > 0 {
            body.push(byte | 0x80);
            byte = (size & 0x7f) as u8;
            size >>= 7;
        }
        body.push(byte);
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::none());
        z.write_all(data)?;
        body.extend(z.finish()?);
    }
    // The trailer (a checksum the gateway does not read) takes its place.
    body.extend_from_slice(&[0u8; 20]);
    Ok(body)
}

/// A stand-in registry: its files, (host, path) to (content type, body),
/// how long it takes to answer (milliseconds) and the link its answers
/// share (bytes a second), as a registry across the internet would be;
/// both changed between rounds.
#[derive(Default)]
pub struct Registry {
    /// The files.
    pub files: std::collections::HashMap<(String, String), (String, Vec<u8>)>,
    /// Milliseconds before each answer.
    pub delay_ms: std::sync::atomic::AtomicU64,
    /// Bytes a second all answers' bodies share (0: no limit).
    pub link_rate: std::sync::atomic::AtomicU64,
    /// When the link is next free.
    link_free: std::sync::Mutex<Option<Instant>>,
}

impl Registry {
    /// Sends `body` on `stream` at the link's rate, in turn with the other
    /// answers' pieces (a shared link, not a limit per connection).
    async fn send(&self, stream: &mut (impl AsyncWrite + Unpin), body: &[u8]) -> std::io::Result<()> {
        let rate = self.link_rate.load(std::sync::atomic::Ordering::Relaxed);
        if rate == 0 {
            return stream.write_all(body).await;
        }
        for piece in body.chunks(16 << 10) {
            let on_the_wire = Duration::from_secs_f64(piece.len() as f64 / rate as f64);
            let done = {
                let mut free = self.link_free.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                // A link idle a moment ago still owes that moment (a
                // sender woken late by the timer does not fall behind).
                let earliest = Instant::now().checked_sub(Duration::from_millis(10)).unwrap_or_else(Instant::now);
                let done = free.map_or(earliest, |at| at.max(earliest)) + on_the_wire;
                *free = Some(done);
                done
            };
            tokio::time::sleep_until(done.into()).await;
            stream.write_all(piece).await?;
        }
        Ok(())
    }
}

/// The registries' names the DNS server answers besides [`NAME`]'s.
pub const REGISTRY_NAMES: [&str; 2] = ["pypi.org", "registry.npmjs.org"];

/// Answers `GET /bytes/N` with N bytes, then closes; a POST (a push) is
/// read whole and answered with git's `unpack ok`; a file of `registry`,
/// with that file (and the connection stays open for the next).
async fn serve_http(
    listener: std::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    registry: Option<Arc<Registry>>,
) {
    let Ok(listener) = listener.set_nonblocking(true).and_then(|()| tokio::net::TcpListener::from_std(listener)) else {
        return;
    };
    while let Ok((stream, _)) = listener.accept().await {
        let (tls, registry) = (tls.clone(), registry.clone());
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            match tls {
                Some(config) => {
                    if let Ok(stream) = tokio_rustls::TlsAcceptor::from(config).accept(stream).await {
                        let _ = answer(stream, registry.as_deref()).await;
                    }
                }
                None => {
                    let _ = answer(stream, None).await;
                }
            }
        });
    }
}

async fn answer(mut stream: impl AsyncRead + AsyncWrite + Unpin, registry: Option<&Registry>) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    // A registry's files are answered on a kept-alive connection, as real
    // registries do; anything else once, then the connection closes.
    let text = loop {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await?;
            if n == 0 || head.len() > 8192 {
                return Ok(());
            }
            head.extend_from_slice(&buf[..n]);
        }
        let end = head.windows(4).position(|w| w == b"\r\n\r\n").map_or(head.len(), |i| i + 4);
        let text = String::from_utf8_lossy(&head[..end]).into_owned();
        let Some(registry) = registry else { break text };
        let host =
            text.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("host:").map(|h| h.trim().to_string()));
        let target = text.split_whitespace().nth(1).unwrap_or_default();
        let path = target.split('?').next().unwrap_or_default().replace("%2f", "/").replace("%2F", "/");
        let Some((content_type, body)) = host.and_then(|h| registry.files.get(&(h, path))) else { break text };
        let delay = registry.delay_ms.load(std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let answer_head =
            format!("HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n", body.len());
        stream.write_all(answer_head.as_bytes()).await?;
        if !text.starts_with("HEAD ") {
            registry.send(&mut stream, body).await?;
        }
        // What follows the head is the next request's.
        head.drain(..end);
    };
    if text.starts_with("POST ") {
        let end = head.windows(4).position(|w| w == b"\r\n\r\n").map_or(head.len(), |i| i + 4);
        let length: usize = text
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut left = length.saturating_sub(head.len() - end);
        let mut buf = vec![0u8; CHUNK];
        while left > 0 {
            let n = stream.read(&mut buf[..left.min(CHUNK)]).await?;
            if n == 0 {
                return Ok(());
            }
            left -= n;
        }
        let report = b"000eunpack ok\n0000";
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/x-git-receive-pack-result\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            report.len()
        );
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(report).await?;
        return stream.shutdown().await;
    }
    let size: usize = text.split_whitespace().nth(1).and_then(|p| p.strip_prefix("/bytes/")?.parse().ok()).unwrap_or(0);
    stream
        .write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let zeros = vec![0u8; CHUNK];
    let mut left = size;
    while left > 0 {
        let n = left.min(CHUNK);
        stream.write_all(&zeros[..n]).await?;
        left -= n;
    }
    stream.shutdown().await
}

/// Answers A queries for [`NAME`], the names below it and the registries'
/// ([`REGISTRY_NAMES`]) with [`SERVER`];
/// everything else NXDOMAIN.
fn serve_dns(socket: UdpSocket) {
    let below = format!(".{NAME}");
    let ours = |name: &HostName| {
        name.as_str() == NAME || name.as_str().ends_with(&below) || REGISTRY_NAMES.contains(&name.as_str())
    };
    let mut buf = [0u8; 512];
    while let Ok((n, peer)) = socket.recv_from(&mut buf) {
        let Ok(query) = dns::parse_query(&buf[..n]) else { continue };
        let reply = if query.name.as_ref().is_some_and(ours) && query.qtype == 1 {
            dns::answer(&query, dns::Rcode::NoError, Some(SERVER), None, 300)
        } else {
            dns::answer(&query, dns::Rcode::NxDomain, None, None, 0)
        };
        let _ = socket.send_to(&reply, peer);
    }
}

/// Asks `resolver` for [`NAME`]'s address; returns it and the time taken.
fn lookup(resolver: SocketAddr) -> Result<(Ipv4Addr, Duration)> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    socket.set_read_timeout(Some(Duration::from_secs(5)))?;
    let query = dns::upstream_query(0x4242, &HostName::parse(NAME)?, 1);
    let t = Instant::now();
    socket.send_to(&query, resolver)?;
    let mut buf = [0u8; 512];
    let n = socket.recv(&mut buf).context("no DNS answer")?;
    let took = t.elapsed();
    let addrs = dns::parse_upstream(&buf[..n], 0x4242, &HostName::parse(NAME)?).map_err(anyhow::Error::msg)?;
    match addrs.v4.first() {
        Some(ip) => Ok((*ip, took)),
        None => bail!("{resolver} gave {NAME} no address"),
    }
}

/// One push of `body` over TLS on a new connection to `ip`; fails unless
/// the server's `unpack ok` comes back (not a refusal of the gateway's).
fn push(ip: Ipv4Addr, tls: &Arc<rustls::ClientConfig>, body: &[u8]) -> Result<()> {
    let tcp = TcpStream::connect((ip, 443))?;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(Duration::from_secs(60)))?;
    let conn = rustls::ClientConnection::new(Arc::clone(tls), NAME.try_into()?)?;
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    let head = format!(
        "POST /moat/bench.git/git-receive-pack HTTP/1.1\r\nHost: {NAME}\r\nContent-Type: application/x-git-receive-pack-request\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut answer = Vec::new();
    let read = stream.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    if !answer.ends_with("unpack ok\n0000") {
        let why = match read {
            Err(e) => format!("reading the answer failed after {} bytes: {e}", answer.len()),
            Ok(_) => format!("{:?}", answer.lines().last().unwrap_or("(no answer)")),
        };
        bail!("the push to {ip} was not taken: {why}");
    }
    Ok(())
}

/// One `GET /bytes/size` on a new connection to `ip` (over TLS trusting
/// `tls`'s roots if given); returns the body bytes read.
fn fetch(ip: Ipv4Addr, tls: Option<&Arc<rustls::ClientConfig>>, size: u64, header: Option<&str>) -> Result<u64> {
    let port = if tls.is_some() { 443 } else { 80 };
    let tcp = TcpStream::connect((ip, port))?;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(Duration::from_secs(60)))?;
    let extra = header.map(|h| format!("{h}\r\n")).unwrap_or_default();
    let request = format!("GET /bytes/{size} HTTP/1.1\r\nHost: {NAME}\r\n{extra}Connection: close\r\n\r\n");
    let read = match tls {
        Some(config) => {
            let conn = rustls::ClientConnection::new(Arc::clone(config), NAME.try_into()?)?;
            let mut stream = rustls::StreamOwned::new(conn, tcp);
            stream.write_all(request.as_bytes())?;
            drain(&mut stream)?
        }
        None => {
            let mut tcp = tcp;
            tcp.write_all(request.as_bytes())?;
            drain(&mut tcp)?
        }
    };
    // Status line and headers are at most a line or three.
    if read < size {
        bail!("short answer: {read} bytes of {size}");
    }
    Ok(read)
}

fn drain(stream: &mut impl Read) -> Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => total += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Makes busybox box `name` of `account` with `policy` (not yet running).
pub async fn make_box(
    manager: &Arc<moat_core::BoxManager>,
    account: &moat_core::AccountId,
    name: &str,
    policy: Policy,
) -> Result<()> {
    let spec = moat_core::BoxSpec { policy, ..crate::bench::busybox(name)? };
    manager.create(account, spec, Box::new(|_: &str| {})).await?;
    Ok(())
}

/// A client in box `name` (made under `state_dir`), and the session that
/// keeps it running (a box without one is suspended).
pub async fn box_side(
    manager: &Arc<moat_core::BoxManager>,
    account: &moat_core::AccountId,
    name: &str,
    state_dir: &Path,
    net: &BenchNet,
) -> Result<(Side, moat_core::SessionGuard)> {
    let name = moat_core::Name::new(name)?;
    let (handle, session) = manager.open_session(account, &name).await?;
    let moat_core::NetAttach::Netns(netns) = &handle.network;
    let root = state_dir.join("pool/boxes").join(manager.get(account, &name)?.id.as_str());
    Ok((Side::boxed(netns, &root, net)?, session))
}

/// Where a measurement's client runs.
#[derive(Clone)]
pub struct Side {
    /// Its network namespace.
    pub netns: PathBuf,
    /// The resolver it asks.
    pub resolver: SocketAddr,
    /// The roots it trusts (PEM).
    pub roots: String,
    /// A header every request carries.
    pub header: Option<String>,
    /// Where it connects, if not to the address its resolver gives.
    pub to: Option<Ipv4Addr>,
}

impl Side {
    /// The client of the test internet itself.
    pub fn direct(net: &BenchNet) -> Self {
        Self {
            netns: net.path(),
            resolver: SocketAddr::from((SERVER, 53)),
            roots: net.ca.clone(),
            header: None,
            to: None,
        }
    }

    /// A box's client: its namespace, its gateway, its trust bundle.
    pub fn boxed(netns: &Path, box_root: &Path, net: &BenchNet) -> Result<Self> {
        let ca = std::fs::read_to_string(box_root.join("etc/moat/ca.pem")).context("the box's CA")?;
        let resolver = SocketAddr::from((Ipv4Addr::LOCALHOST, moat_core::egress::DNS_PORT));
        Ok(Self { netns: netns.to_path_buf(), resolver, roots: format!("{}\n{ca}", net.ca), header: None, to: None })
    }

    /// The same client, sending the placeholder of secret [`SECRET`] that
    /// the box at `box_root` holds, where the gateway writes the value.
    pub fn with_secret(mut self, box_root: &Path) -> Result<Self> {
        let env = std::fs::read_to_string(box_root.join("etc/environment")).context("the box's environment")?;
        let variable = format!("{}=", SECRET.to_ascii_uppercase());
        let placeholder = env.lines().find_map(|l| l.strip_prefix(&variable)).context("no placeholder in the box")?;
        self.header = Some(format!("Authorization: Bearer {placeholder}"));
        Ok(self)
    }

    /// Times `n` DNS answers.
    pub fn dns(&self, n: usize) -> Result<Vec<Duration>> {
        in_netns(&self.netns, || (0..n).map(|_| lookup(self.resolver).map(|(_, t)| t)).collect())
    }

    /// Times `n` fresh HTTPS requests with a small answer.
    pub fn https(&self, n: usize) -> Result<Vec<Duration>> {
        let config = intercept::upstream_config(&self.roots).map_err(anyhow::Error::msg)?;
        self.fetches(n, Some(&config), 100)
    }

    /// Times `n` HTTPS downloads of `bytes` each.
    pub fn https_download(&self, n: usize, bytes: u64) -> Result<Vec<Duration>> {
        let config = intercept::upstream_config(&self.roots).map_err(anyhow::Error::msg)?;
        self.fetches(n, Some(&config), bytes)
    }

    /// Times `n` plain HTTP downloads of `bytes` each.
    pub fn download(&self, n: usize, bytes: u64) -> Result<Vec<Duration>> {
        self.fetches(n, None, bytes)
    }

    /// Times `n` pushes of `body`, each on a new connection.
    pub fn pushes(&self, n: usize, body: &[u8]) -> Result<Vec<Duration>> {
        let config = intercept::upstream_config(&self.roots).map_err(anyhow::Error::msg)?;
        in_netns(&self.netns, || {
            let (ip, _) = lookup(self.resolver)?;
            (0..n)
                .map(|_| {
                    let t = Instant::now();
                    push(ip, &config, body)?;
                    Ok(t.elapsed())
                })
                .collect()
        })
    }

    /// Times `n` requests for `size` bytes, each on a new connection.
    fn fetches(&self, n: usize, tls: Option<&Arc<rustls::ClientConfig>>, size: u64) -> Result<Vec<Duration>> {
        in_netns(&self.netns, || {
            let ip = match self.to {
                Some(ip) => ip,
                None => lookup(self.resolver)?.0,
            };
            (0..n)
                .map(|_| {
                    let t = Instant::now();
                    fetch(ip, tls, size, self.header.as_deref())?;
                    Ok(t.elapsed())
                })
                .collect()
        })
    }
}
