//! One request through the edge: which box port it is for, whether it may
//! reach it (the privileged side decides; an allowed answer is kept a second),
//! then carried there and the answer streamed back. WebSocket upgrades
//! become a tunnel; server-sent events and any body stream as they come.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use moat_api::server::SIGN_IN_PATH;
use moat_api::ApiClient;
use moat_core::web::{WebHost, WebRefusal, WebRequestLog, WebSecret, WebVerdict, MAX_LOGGED_PATH};

use crate::body::{full, Counted, Deadlined, ResBody};
use crate::cookie;
use crate::hello::EdgeLimits;
use crate::host;
use crate::pages::Page;
use crate::upstream::{self, BoxConn, OpenError, Pool, Visit};
use moat_core::slots::Slots;

/// How long an allowed answer of the privileged side is reused for the same
/// URL and cookie (an `unshare` or `unexpose` takes at most this long to bite
/// on connections already open).
const CHECK_REUSE: Duration = Duration::from_secs(1);
/// Most answers kept.
const CHECKS_KEPT: usize = 10_000;

/// What the requests of one event loop of the edge share (the limits on
/// requests per box port are all loops' together).
pub struct Ctx {
    /// The privileged side.
    pub api: ApiClient,
    /// Box URLs are names right under it.
    pub domain: String,
    /// The limits.
    pub limits: EdgeLimits,
    /// Connections to box ports between requests.
    pub pool: Arc<Pool>,
    /// Requests in flight per box port.
    pub per_box: Arc<Slots<WebHost>>,
    /// Requests in flight per box port and visitor.
    pub per_visitor: Arc<Slots<(IpAddr, WebHost)>>,
    checks: Mutex<HashMap<CheckKey, (String, Instant)>>,
}

/// A URL and the cookie a visitor sent to it.
type CheckKey = (WebHost, Option<WebSecret>);

impl Ctx {
    /// A context for an event loop of the edge serving `domain`, counting
    /// requests in flight per box port in `per_box`, and per box port and
    /// visitor in `per_visitor`.
    pub fn new(
        api: ApiClient,
        domain: String,
        limits: EdgeLimits,
        per_box: Arc<Slots<WebHost>>,
        per_visitor: Arc<Slots<(IpAddr, WebHost)>>,
    ) -> Arc<Self> {
        Arc::new(Self { api, domain, limits, pool: Arc::default(), per_box, per_visitor, checks: Mutex::default() })
    }

    /// Who the visitor with `cookie` is to `host`'s box, if it may reach it.
    async fn check(&self, host: &WebHost, cookie: Option<&WebSecret>) -> Result<String, Page> {
        let key = (host.clone(), cookie.cloned());
        if let Some((who, at)) = self.checks.lock().unwrap_or_else(PoisonError::into_inner).get(&key) {
            if at.elapsed() < CHECK_REUSE {
                return Ok(who.clone());
            }
        }
        match self.api.web_check(host, cookie).await {
            Ok(WebVerdict::Allow { who }) => {
                let mut checks = self.checks.lock().unwrap_or_else(PoisonError::into_inner);
                if checks.len() >= CHECKS_KEPT {
                    checks.clear();
                }
                checks.insert(key, (who.clone(), Instant::now()));
                Ok(who)
            }
            Ok(WebVerdict::Refuse(r)) => Err(Page::Refused(r, Some(host.clone()))),
            Err(e) => Err(Page::Unreachable(host.name.to_string(), e.message)),
        }
    }
}

/// Answers one request from `peer`.
pub async fn handle(req: Request<Incoming>, ctx: Arc<Ctx>, peer: IpAddr) -> Response<ResBody> {
    match carry(req, &ctx, peer).await {
        Ok(res) => res,
        Err(page) => page.response(),
    }
}

async fn carry(mut req: Request<Incoming>, ctx: &Arc<Ctx>, peer: IpAddr) -> Result<Response<ResBody>, Page> {
    let started = Instant::now();
    let at_ms = moat_core::clock::now_ms();
    let original_host = host::of_request(&req)?.to_string();
    let host = host::parse(&original_host, &ctx.domain)?;
    if req.uri().path() == SIGN_IN_PATH {
        return sign_in(&req, ctx, &host).await;
    }
    if let Some(origin) = crate::origin::foreign(&req, &host, &ctx.domain, wants_upgrade(&req)) {
        return Err(Page::CrossBox(host.name.to_string(), origin));
    }
    let cookie = cookie::take(req.headers_mut());
    let who = ctx.check(&host, cookie.as_ref()).await?;
    let crowded = || Page::Crowded(host.name.to_string());
    let visitor = ctx.per_visitor.take(&(peer, host.clone())).ok_or_else(crowded)?;
    let slot = (ctx.per_box.take(&host).ok_or_else(crowded)?, visitor);
    let visit = Visit { host: host.clone(), who: who.clone() };
    let conn = match ctx.pool.take(&visit) {
        Some(conn) => conn,
        None => match upstream::open(&ctx.api, &ctx.pool, &visit, cookie.as_ref()).await {
            Ok(conn) => conn,
            Err(OpenError::Refused(r)) => return Err(Page::Refused(r, Some(host))),
            Err(OpenError::NoListener) => return Err(Page::NoListener(host.name.to_string(), host.port)),
            Err(OpenError::Failed(why)) => return Err(Page::Unreachable(host.name.to_string(), why)),
        },
    };
    let upgrade = wants_upgrade(&req);
    let downstream = upgrade.then(|| hyper::upgrade::on(&mut req));
    let method = req.method().clone();
    let path = logged_path(req.uri());
    let received = Arc::new(AtomicU64::new(0));
    let body_failed = Arc::new(AtomicBool::new(false));
    let upstream_req = outbound(req, &host, &original_host, peer, upgrade, ctx.limits, (&received, &body_failed))?;
    let BoxConn { mut sender, driver, session } = conn;
    let answered = session.nudging(ctx.limits.answer(), sender.send_request(upstream_req)).await;
    let mut res = match answered {
        Some(Ok(res)) => res,
        // The body being sent failed: the visitor's, not the box's, doing.
        Some(Err(e)) if body_failed.load(Ordering::Relaxed) => return Err(visitors_body(&e)),
        Some(Err(e)) => return Err(Page::Unreachable(host.name.to_string(), e.to_string())),
        None => return Err(Page::Slow(host.name.to_string(), ctx.limits.answer_secs)),
    };
    let status = res.status();
    if status == StatusCode::SWITCHING_PROTOCOLS && downstream.is_none() {
        return Err(Page::Unreachable(host.name.to_string(), "it switched protocols unasked".into()));
    }
    cookie::confine(res.headers_mut());
    let entry = move |sent: u64| WebRequestLog {
        at_ms,
        method: method.to_string(),
        path,
        status: status.as_u16(),
        received: received.load(Ordering::Relaxed),
        sent,
        ms: started.elapsed().as_millis() as u64,
        who,
    };
    if let (StatusCode::SWITCHING_PROTOCOLS, Some(downstream)) = (status, downstream) {
        let upstream = hyper::upgrade::on(&mut res);
        let log = entry(0);
        session.log(log);
        let ended = session.ended();
        tokio::spawn(async move {
            if let (Ok(down), Ok(up)) = (downstream.await, upstream.await) {
                // A tunnel ends with its session too (the visitor's access taken away).
                tokio::select! {
                    () = moat_core::splice::both_ways(TokioIo::new(down), TokioIo::new(up)) => {}
                    () = ended => {}
                }
            }
            // The tunnel held the box awake, and its port's slot, until now.
            drop((session, sender, driver, slot));
        });
        return Ok(res.map(|_| full(bytes::Bytes::new()).map_err(|never| match never {}).boxed_unsync()));
    }
    strip_hop_by_hop(res.headers_mut(), false);
    let pool = Arc::clone(&ctx.pool);
    let (parts, body) = res.into_parts();
    // Trailers are confined as the head is (browsers ignore cookies there
    // today; a box gets no say in what they may do tomorrow).
    let body = body.map_frame(confine_trailers as fn(Frame<Bytes>) -> Frame<Bytes>);
    let body = Counted::new(body, move |sent, clean| {
        session.log(entry(sent));
        if clean {
            pool.give(visit, BoxConn { sender, driver, session });
        }
        drop(slot);
    });
    Ok(Response::from_parts(parts, body.boxed_unsync()))
}

/// The page for a request whose body failed on its way to the box: it
/// stalled, or its chunks were not well formed (a 502 blamed the box).
fn visitors_body(e: &hyper::Error) -> Page {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(c) = cause {
        if c.is::<crate::body::Stalled>() {
            return Page::Bad("a request body that stalled");
        }
        cause = c.source();
    }
    Page::Bad("a request body that is not well formed")
}

/// A frame of a box's answer: its trailers, if it is them, confined.
fn confine_trailers(frame: Frame<Bytes>) -> Frame<Bytes> {
    match frame.into_trailers() {
        Ok(mut trailers) => {
            cookie::confine(&mut trailers);
            Frame::trailers(trailers)
        }
        Err(frame) => frame,
    }
}

/// Spends a sign-in link and sets the session cookie, sending the browser on
/// to the box's front page.
async fn sign_in(req: &Request<Incoming>, ctx: &Ctx, host: &WebHost) -> Result<Response<ResBody>, Page> {
    let link = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("link=")))
        .filter(|l| WebSecret::plausible(l))
        .map(|l| WebSecret(l.to_string()))
        .ok_or(Page::Refused(WebRefusal::LinkSpent, Some(host.clone())))?;
    let session = match ctx.api.web_sign_in(host, &link).await {
        Ok(Ok(session)) => session,
        Ok(Err(r)) => return Err(Page::Refused(r, Some(host.clone()))),
        Err(e) => return Err(Page::Unreachable(host.name.to_string(), e.message)),
    };
    let set = cookie::set(&session, moat_core::COOKIE_LIFETIME.as_secs());
    let mut res = Response::new(full(bytes::Bytes::new()).map_err(|never| match never {}).boxed_unsync());
    *res.status_mut() = StatusCode::SEE_OTHER;
    res.headers_mut().insert(header::LOCATION, HeaderValue::from_static("/"));
    res.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    // (Hex and fixed words: always a valid header value.)
    if let Ok(set) = HeaderValue::from_str(&set) {
        res.headers_mut().insert(header::SET_COOKIE, set);
    }
    Ok(res)
}

/// Whether the request asks to switch protocols (a WebSocket): HTTP/1.1
/// with `Upgrade` (HTTP/2 has no such thing here: the edge offers no
/// extended CONNECT, so browsers open WebSockets over HTTP/1.1).
fn wants_upgrade<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11 && req.headers().contains_key(header::UPGRADE)
}

/// The path and query as the log keeps them: cut short.
fn logged_path(uri: &Uri) -> String {
    let pq = uri.path_and_query().map_or("/", |pq| pq.as_str());
    pq.chars().take(MAX_LOGGED_PATH).collect()
}

/// Fields a server believes when a proxy in front of it sets them (Rails,
/// Flask's ProxyFix, Express's `trust proxy`, Django, Spring read these):
/// the edge is that proxy, so a visitor's are never passed on.
const FROM_A_PROXY: &[&str] = &[
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-forwarded-ssl",
    "x-forwarded-scheme",
    "x-forwarded-server",
    "x-forwarded",
    "forwarded",
    "forwarded-for",
    "x-real-ip",
    "x-client-ip",
    "x-cluster-client-ip",
    "true-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
    "x-original-url",
    "x-rewrite-url",
    "x-original-host",
    "front-end-https",
    "x-url-scheme",
];

/// The request as the box gets it: HTTP/1.1 in origin form, `Host` the box's
/// own `localhost:PORT` (dev servers refuse other hosts by default), the
/// visitor's host, address and scheme in `X-Forwarded-*` (never what the
/// visitor sent there), no hop-by-hop fields, the body streamed (and given
/// up if it stalls).
fn outbound(
    req: Request<Incoming>,
    host: &WebHost,
    original_host: &str,
    peer: IpAddr,
    upgrade: bool,
    limits: EdgeLimits,
    (received, failed): (&Arc<AtomicU64>, &Arc<AtomicBool>),
) -> Result<Request<ResBody>, Page> {
    let (mut parts, body) = req.into_parts();
    // hyper takes `gzip, chunked` and hands over the gzip'd bytes as if
    // they were the body: the box would read them as the body itself.
    let fields = parts.headers.get_all(header::TRANSFER_ENCODING);
    let codings = fields.iter().flat_map(|v| v.as_bytes().split(|b| *b == b','));
    if codings.map(<[u8]>::trim_ascii).any(|c| !c.eq_ignore_ascii_case(b"chunked")) {
        return Err(Page::Bad("a transfer coding other than chunked"));
    }
    let upgrade_to = parts.headers.get(header::UPGRADE).cloned();
    strip_hop_by_hop(&mut parts.headers, true);
    for name in FROM_A_PROXY {
        parts.headers.remove(*name);
    }
    let set = |headers: &mut HeaderMap, name: HeaderName, value: &str| -> Result<(), Page> {
        let value = HeaderValue::from_str(value).map_err(|_| Page::Bad("a host that is no header value"))?;
        headers.insert(name, value);
        Ok(())
    };
    set(&mut parts.headers, header::HOST, &format!("localhost:{}", host.port))?;
    set(&mut parts.headers, HeaderName::from_static("x-forwarded-for"), &peer.to_string())?;
    set(&mut parts.headers, HeaderName::from_static("x-forwarded-proto"), "https")?;
    set(&mut parts.headers, HeaderName::from_static("x-forwarded-host"), original_host)?;
    if let (true, Some(to)) = (upgrade, upgrade_to) {
        parts.headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, to);
    }
    let pq = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    parts.uri = pq.parse().map_err(|_| Page::Bad("a target that is no path"))?;
    parts.version = Version::HTTP_11;
    if parts.method == Method::CONNECT {
        return Err(Page::Bad("CONNECT is not carried to boxes"));
    }
    let received = Arc::clone(received);
    let body = Deadlined::new(body, limits.body(), Arc::clone(failed));
    let body = Counted::new(body, move |n, _| received.store(n, Ordering::Relaxed));
    Ok(Request::from_parts(parts, body.boxed_unsync()))
}

/// Takes out the fields that describe one hop (RFC 9110 7.6.1), and those the
/// `Connection` field names; on a request, also `TE`.
fn strip_hop_by_hop(headers: &mut HeaderMap, request: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    if request {
        headers.remove(header::TE);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_fields_go() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-kept"]);
    }

    #[test]
    fn logged_paths_are_cut() {
        let long: Uri = format!("/{}", "a".repeat(2000)).parse().unwrap();
        assert_eq!(logged_path(&long).len(), MAX_LOGGED_PATH);
        assert_eq!(logged_path(&"/x?y=1".parse().unwrap()), "/x?y=1");
    }
}
