//! One GET to a registry, answered by the gateway: an index rewritten
//! under the box's package rules, a file checked against its index (from
//! the shared cache, or fetched, hashed and kept), anything else relayed.
//! A refusal is the caller's to answer (see [`Refusal::Package`]).

use std::io::{Read as _, Seek as _, Write as _};
use std::sync::Arc;

use moat_core::egress::{LogEntry, PackageFile};
use moat_core::policy::packages::{Candidate, HashAlgorithm};
use moat_core::policy::{HostName, Policy, Verdict};
use sha2::Digest as _;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::fetch::{self, Fetch};
use super::index::{Entry, Index, MAX_INDEX};
use super::route::{route, Package, Wanted};
use super::{index_url, Read, Registries};
use crate::boxnet::BoxNet;
use crate::git::pack::hex;
use crate::http::request::Request;
use crate::refusal::Refusal;

/// Largest package file let in.
const MAX_FILE: u64 = 4 << 30;
/// Files larger than this go to the box as they come (all but the last
/// piece until the hash matched); smaller ones wait whole, so that a
/// refusal reaches the client as a message rather than a cut download.
const STREAM_ABOVE: u64 = 1 << 20;

/// What one request is, for [`answer`].
pub struct Asked<'a> {
    /// The box.
    pub net: &'a BoxNet,
    /// The registry's host, and the port the box dialled.
    pub host: &'a HostName,
    /// The port.
    pub port: u16,
    /// Over TLS.
    pub tls: bool,
    /// The box's policy on this connection.
    pub policy: &'a Policy,
    /// The request.
    pub request: &'a Request,
    /// The request's head lines (its headers are read for what goes on).
    pub lines: &'a [String],
}

/// Answers `asked` on `to_box`, filling in `log`.
pub async fn answer<W: AsyncWrite + Unpin + ?Sized>(
    registries: &Registries,
    asked: &Asked<'_>,
    to_box: &mut W,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let head_only = asked.request.method == "HEAD";
    let answered = match route(asked.host, &asked.request.target) {
        Wanted::Index(package) => index(registries, asked, &package, to_box, head_only, log).await,
        Wanted::File { package, version, file } => {
            self::file(registries, asked, &package, &version, &file, to_box, head_only, log).await
        }
        Wanted::Unchecked => Err(Refusal::Package {
            rule: "packages".into(),
            why: "not a package file the gateway can check against its index".into(),
        }),
        Wanted::Ambiguous => Err(Refusal::Package {
            rule: "packages".into(),
            why: "a registry path servers read more than one way (empty, dot or encoded segments)".into(),
        }),
        Wanted::Other => {
            let _turn = registries.reads.acquire().await.map_err(|_| Refusal::Io("the gateway is stopping".into()))?;
            relay(asked, to_box, head_only, log).await
        }
    };
    // TLS holds the last records until flushed: the box would wait on them.
    answered?;
    Ok(to_box.flush().await?)
}

/// The box's header `name` (lower case), if it sent one.
fn header<'a>(lines: &'a [String], name: &str) -> Option<&'a str> {
    lines.iter().skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// What goes on of the box's headers (its client and its credentials).
fn passed_on(lines: &[String]) -> Vec<(&'static str, String)> {
    ["User-Agent", "Authorization"]
        .into_iter()
        .filter_map(|name| header(lines, name).map(|v| (name, v.to_string())))
        .collect()
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Reads the index of `package` (as the box would: its Accept for PyPI, the
/// full document for npm), from a recent read where one serves.
async fn read_index(
    registries: &Registries,
    asked: &Asked<'_>,
    package: &Package,
    json: bool,
) -> Result<Result<Arc<Read>, Fetch>, Refusal> {
    use moat_core::policy::Ecosystem;
    let (host, target) = index_url(package);
    let host = HostName::parse(host).map_err(|e| Refusal::Unreachable(e.to_string()))?;
    // The index is read on the box's behalf: its policy must let it.
    if matches!(asked.policy.decide(&host, 443), Verdict::Deny(_)) {
        return Err(Refusal::Package {
            rule: "packages".into(),
            why: format!("the index of {} at {host} is not allowed", package.name),
        });
    }
    let accept = match package.ecosystem {
        Ecosystem::Pypi if json => "application/vnd.pypi.simple.v1+json",
        Ecosystem::Pypi => "text/html",
        Ecosystem::Npm => "application/json",
        Ecosystem::Crates => "*/*",
    };
    let mut headers = passed_on(asked.lines);
    let private = headers.iter().any(|(n, _)| *n == "Authorization");
    let key = format!("{host}{target} {accept}");
    if !private {
        if let Some(read) = registries.recent_index(&key) {
            return Ok(Ok(read));
        }
    }
    headers.push(("Accept", accept.to_string()));
    let _turn = registries.reads.acquire().await.map_err(|_| Refusal::Io("the gateway is stopping".into()))?;
    let mut fetched = match fetch::get(asked.net, &host, 443, true, &target, &headers).await {
        Ok(fetched) => fetched,
        // The registry is down: the last read serves (its files come from the cache).
        Err(down @ Refusal::Unreachable(_)) => match registries.last_index(&key, package).filter(|_| !private) {
            Some(read) => return Ok(Ok(read)),
            None => return Err(down),
        },
        Err(other) => return Err(other),
    };
    if fetched.head.status != 200 {
        if fetched.head.status >= 500 {
            if let Some(read) = registries.last_index(&key, package).filter(|_| !private) {
                return Ok(Ok(read));
            }
        }
        return Ok(Err(fetched));
    }
    let content_type = fetched.header("content-type").unwrap_or_default();
    let body = fetched.all(MAX_INDEX).await?;
    let index = Index::parse(package, &content_type, &body)
        .map_err(|why| Refusal::BadIndex(format!("the index of {} {}: {why}", package.ecosystem, package.name)))?;
    let read = Arc::new(Read { index, body, content_type });
    if !private {
        registries.keep_index(key, Arc::clone(&read));
    }
    Ok(Ok(read))
}

fn candidate<'a>(package: &'a Package, e: &'a Entry) -> Candidate<'a> {
    Candidate {
        ecosystem: package.ecosystem,
        name: &package.name,
        version: &e.version,
        published: e.published,
        hash: e.hash.as_ref(),
    }
}

async fn index<W: AsyncWrite + Unpin + ?Sized>(
    registries: &Registries,
    asked: &Asked<'_>,
    package: &Package,
    to_box: &mut W,
    head_only: bool,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let rules = &asked.policy.packages;
    let json = header(asked.lines, "accept").is_some_and(|a| a.contains("application/vnd.pypi.simple.v1+json"));
    let read = match read_index(registries, asked, package, json).await? {
        Ok(read) => read,
        Err(mut other) => return relay_fetched(&mut other, to_box, head_only, log).await,
    };
    // Each entry judged once (an npm document may list thousands).
    let now = now();
    let refusals: Vec<_> =
        read.index.entries.iter().map(|e| registries.refuse(rules, &candidate(package, e), now)).collect();
    let keep: Vec<bool> = refusals.iter().map(Option::is_none).collect();
    let left = keep.iter().filter(|k| **k).count();
    let all = keep.len();
    // Where some versions pass, the index lists them alone (installers pick
    // the newest of those); where none does (a refused name, every version
    // too new), it goes whole, and the download is refused with the rule,
    // which pip, npm and cargo all print (pip shows nothing of an index's).
    let body = if left == 0 {
        if all > 0 {
            log.reason = Some("every version is refused: the index goes whole, its downloads are refused".into());
        }
        None
    } else {
        if left < all {
            let mut rules: Vec<&str> = refusals.iter().flatten().map(|r| r.rule.as_str()).collect();
            rules.sort_unstable();
            rules.dedup();
            log.reason = Some(format!("{} of {all} files left out by {}", all - left, rules.join(", ")));
        }
        read.index
            .rewrite(&read.body, &keep)
            .map_err(|why| Refusal::BadIndex(format!("the index of {} {}: {why}", package.ecosystem, package.name)))?
    };
    let body = body.as_deref().unwrap_or(&read.body);
    let content_type = if read.content_type.is_empty() { "application/octet-stream" } else { &read.content_type };
    write_head(to_box, 200, "OK", content_type, body.len() as u64, asked.request.close).await?;
    if !head_only {
        to_box.write_all(body).await?;
    }
    log.status = Some(200);
    log.received = body.len() as u64;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn file<W: AsyncWrite + Unpin + ?Sized>(
    registries: &Registries,
    asked: &Asked<'_>,
    package: &Package,
    version: &str,
    file: &str,
    to_box: &mut W,
    head_only: bool,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let rules = &asked.policy.packages;
    let mut record = PackageFile {
        ecosystem: package.ecosystem,
        name: package.name.clone(),
        version: version.into(),
        file: file.into(),
        hash: None,
        cached: false,
    };
    log.package = Some(record.clone());
    if let Some(refused) = rules.refuse_name(package.ecosystem, &package.name) {
        return Err(Refusal::Package { rule: refused.rule, why: refused.why });
    }
    let read = match read_index(registries, asked, package, true).await? {
        Ok(read) => read,
        Err(fetched) => {
            return Err(Refusal::BadIndex(format!(
                "the index of {} {} answered {}",
                package.ecosystem, package.name, fetched.head.status
            )))
        }
    };
    let Some(entry) = read.index.entry(version, file) else {
        return Err(Refusal::Package {
            rule: "packages".into(),
            why: format!("{} {} {version}: {file} is not in the package's index", package.ecosystem, package.name),
        });
    };
    if let Some(refused) = registries.refuse(rules, &candidate(package, entry), now()) {
        return Err(Refusal::Package { rule: refused.rule, why: refused.why });
    }
    let Some(hash) = entry.hash.clone() else {
        return Err(Refusal::Package {
            rule: "packages".into(),
            why: format!("{} {} {version}: the index promises no hash for {file}", package.ecosystem, package.name),
        });
    };
    record.hash = Some(hash.to_string());
    if let Some((mut cached, size)) = registries.cache().and_then(|c| c.get(&hash)) {
        record.cached = true;
        log.package = Some(record);
        return send_file(&mut cached, size, to_box, head_only, asked.request.close, log).await;
    }
    log.package = Some(record);
    let mut fetched =
        fetch::get(asked.net, asked.host, asked.port, asked.tls, &asked.request.target, &passed_on(asked.lines))
            .await?;
    if fetched.head.status != 200 {
        return relay_fetched(&mut fetched, to_box, head_only, log).await;
    }
    // Kept on the host as it comes, until its hash is known. A large file
    // whose answer gives its length goes to the box a piece behind, the last
    // piece only once the hash matched (a wrong file ends short, which
    // every client reads as broken); others wait whole.
    let mut spool = match registries.cache().map(|c| c.spool()) {
        Some(Ok(spool)) => spool,
        Some(Err(e)) => return Err(Refusal::Io(format!("the package cache: {e}"))),
        None => return Err(Refusal::Io("the gateway has no package cache to check files in".into())),
    };
    let streamed = fetched.length().filter(|n| *n > STREAM_ABOVE && *n <= MAX_FILE);
    if let Some(length) = streamed {
        write_head(to_box, 200, "OK", "application/octet-stream", length, asked.request.close).await?;
        log.status = Some(200);
    }
    let mut hasher = Hasher::new(hash.algorithm);
    let mut size = 0u64;
    let mut held: Vec<u8> = Vec::new();
    while let Some(piece) = fetched.next().await? {
        size += piece.len() as u64;
        if size > streamed.unwrap_or(MAX_FILE) {
            let why = format!("{file} is longer than its registry said, or than {} GiB", MAX_FILE >> 30);
            return Err(if streamed.is_some() { Refusal::PackageCut(why) } else { Refusal::Unreachable(why) });
        }
        hasher.update(&piece);
        spool.file.write_all(&piece)?;
        if streamed.is_some() && !head_only && !held.is_empty() {
            to_box.write_all(&held).await?;
            log.received += held.len() as u64;
        }
        held = piece;
    }
    let got = hasher.finish();
    if got != hash.hex {
        let why = format!("{file}: its hash is {}:{got}, not the {hash} its index promised", hash.algorithm.name());
        return Err(match streamed {
            Some(_) => Refusal::PackageCut(why),
            None => Refusal::Package { rule: "packages".into(), why },
        });
    }
    if streamed.is_some() && size != streamed.unwrap_or(0) {
        return Err(Refusal::PackageCut(format!("{file} ended short of the length its registry said")));
    }
    let kept = |spool| {
        if let Some(cache) = registries.cache() {
            if let Err(e) = cache.keep(spool, &hash, size) {
                tracing::warn!(error = %e, "cannot keep a package file");
            }
        }
    };
    if streamed.is_some() {
        if !head_only {
            to_box.write_all(&held).await?;
            log.received += held.len() as u64;
        }
        kept(spool);
        return Ok(());
    }
    spool.file.rewind()?;
    let mut served = spool.file.try_clone()?;
    kept(spool);
    send_file(&mut served, size, to_box, head_only, asked.request.close, log).await
}

/// Sends `size` bytes of `file` as a 200 answer.
async fn send_file<W: AsyncWrite + Unpin + ?Sized>(
    file: &mut std::fs::File,
    size: u64,
    to_box: &mut W,
    head_only: bool,
    close: bool,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    write_head(to_box, 200, "OK", "application/octet-stream", size, close).await?;
    log.status = Some(200);
    if head_only {
        return Ok(());
    }
    let mut chunk = vec![0u8; 256 << 10];
    let mut left = size;
    while left > 0 {
        let n = file.read(&mut chunk)?;
        if n == 0 {
            return Err(Refusal::Io("a package file ended early".into()));
        }
        let n = (n as u64).min(left) as usize;
        to_box.write_all(chunk.get(..n).unwrap_or_default()).await?;
        left -= n as u64;
        log.received += n as u64;
    }
    Ok(())
}

/// Relays a request the rules have nothing to say about.
async fn relay<W: AsyncWrite + Unpin + ?Sized>(
    asked: &Asked<'_>,
    to_box: &mut W,
    head_only: bool,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let mut headers = passed_on(asked.lines);
    if let Some(accept) = header(asked.lines, "accept") {
        headers.push(("Accept", accept.to_string()));
    }
    let mut fetched = fetch::get(asked.net, asked.host, asked.port, asked.tls, &asked.request.target, &headers).await?;
    relay_fetched(&mut fetched, to_box, head_only, log).await
}

/// Passes on an answer as it came (status, type, redirect, body: at most
/// [`MAX_INDEX`] bytes, as this is never a package file).
async fn relay_fetched<W: AsyncWrite + Unpin + ?Sized>(
    fetched: &mut Fetch,
    to_box: &mut W,
    head_only: bool,
    log: &mut LogEntry,
) -> Result<(), Refusal> {
    let body = fetched.all(MAX_INDEX).await?;
    let status = fetched.head.status;
    let reason = fetched.head.reason.clone();
    let content_type = fetched.header("content-type").unwrap_or_else(|| "application/octet-stream".into());
    let location =
        fetched.head.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case("location")).map(|(_, v)| v.clone());
    let mut head =
        format!("HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n", body.len());
    if let Some(location) = location.and_then(|l| String::from_utf8(l).ok()).filter(|l| !l.contains(['\r', '\n'])) {
        head.push_str(&format!("Location: {location}\r\n"));
    }
    head.push_str("\r\n");
    // Written while a read turn is held: a box that stops reading, or reads
    // slowly, gives it up (and the body's memory).
    let written = async {
        write_unstalled(to_box, head.as_bytes()).await?;
        if !head_only {
            write_unstalled(to_box, &body).await?;
        }
        Ok::<(), Refusal>(())
    };
    match tokio::time::timeout(RELAY_TIME, written).await {
        Ok(written) => written?,
        Err(_) => return Err(Refusal::Io("the box read its answer too slowly".into())),
    }
    log.status = Some(status);
    log.received = body.len() as u64;
    Ok(())
}

/// How long a box may stop reading an answer the gateway holds whole.
const READ_PAUSE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long it may take to read all of one (at most [`MAX_INDEX`], from the
/// gateway on its own host).
const RELAY_TIME: std::time::Duration = std::time::Duration::from_secs(60);

/// Writes `bytes` to the box, which must take each 64 KiB of them within
/// [`READ_PAUSE`].
async fn write_unstalled<W: AsyncWrite + Unpin + ?Sized>(to_box: &mut W, bytes: &[u8]) -> Result<(), Refusal> {
    for piece in bytes.chunks(64 << 10) {
        match tokio::time::timeout(READ_PAUSE, to_box.write_all(piece)).await {
            Ok(written) => written?,
            Err(_) => return Err(Refusal::Io("the box stopped reading its answer".into())),
        }
    }
    Ok(())
}

async fn write_head<W: AsyncWrite + Unpin + ?Sized>(
    to_box: &mut W,
    status: u16,
    reason: &str,
    content_type: &str,
    length: u64,
    close: bool,
) -> std::io::Result<()> {
    let connection = if close { "close" } else { "keep-alive" };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\nCache-Control: no-store\r\nConnection: {connection}\r\n\r\n"
    );
    to_box.write_all(head.as_bytes()).await
}

/// A file's hash as it comes in, by the index's algorithm.
enum Hasher {
    Sha1(sha1::Sha1),
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Hasher {
    fn new(algorithm: HashAlgorithm) -> Self {
        match algorithm {
            HashAlgorithm::Sha1 => Self::Sha1(<sha1::Sha1 as sha1::Digest>::new()),
            HashAlgorithm::Sha256 => Self::Sha256(sha2::Sha256::new()),
            HashAlgorithm::Sha512 => Self::Sha512(sha2::Sha512::new()),
        }
    }

    fn update(&mut self, data: &[u8]) {
        match self {
            Self::Sha1(h) => sha1::Digest::update(h, data),
            Self::Sha256(h) => h.update(data),
            Self::Sha512(h) => h.update(data),
        }
    }

    fn finish(self) -> String {
        match self {
            Self::Sha1(h) => hex(&sha1::Digest::finalize(h)),
            Self::Sha256(h) => hex(&h.finalize()),
            Self::Sha512(h) => hex(&h.finalize()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[tokio::test(start_paused = true)]
    async fn a_box_that_stops_reading_gives_its_turn_up() {
        let (mut ours, _never_read) = tokio::io::duplex(1024);
        let started = tokio::time::Instant::now();
        let err = super::write_unstalled(&mut ours, &vec![7u8; 1 << 20]).await.unwrap_err();
        assert_eq!(
            (started.elapsed(), err.to_string()),
            (super::READ_PAUSE, "the box stopped reading its answer".into())
        );
    }
}
