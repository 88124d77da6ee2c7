//! The OCI distribution API (v2), as a client: manifests (an index resolved
//! to linux/amd64), configs and layer blobs, each held to a size bound and a
//! deadline, each checked against its digest as it arrives.
//!
//! Auth is anonymous, a Bearer token from the realm a `401` names (with the
//! account's login, if it has one for the registry), or Basic with that
//! login. Names are resolved by the gateway's upstream resolver (the
//! operator's `--upstream-dns`, public addresses only but `--upstream-allow`),
//! never the host's. Redirects are followed (blob storage on another host is
//! normal) at most [`MAX_REDIRECTS`] times, to `https` only, through the same
//! resolver; credentials are never sent to another host.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use moat_core::policy::HostName;
use moat_gateway::upstream::Upstream;
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use reqwest::{StatusCode, Url};
use sha2::{Digest as _, Sha256};

use crate::digest::Digest;
use crate::manifest::{self, Descriptor, Fetched, Manifest, ManifestError, MAX_DOCUMENT};
use crate::reference::Reference;

/// Most redirects followed for one request.
pub const MAX_REDIRECTS: usize = 5;
/// Largest token answer read.
const MAX_TOKEN: u64 = 1 << 20;
/// How long a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A registry login, as `image login` took it.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct Login {
    /// The user.
    pub user: String,
    /// The password or token.
    pub password: String,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Login {{ user: {:?}, password: [redacted] }}", self.user)
    }
}

/// Fewest bytes of a blob each stall period must bring.
pub const MIN_PER_STALL: u64 = 64 << 10;

/// The bounds one pull is held to.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Bounds {
    /// Most bytes of blobs (compressed) one image may have.
    pub max_image: u64,
    /// Longest wait for the next bytes of an answer.
    pub stall: Duration,
    /// Longest a manifest, config or token request may take in all.
    pub document: Duration,
}

/// Why a request to a registry failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, TLS or HTTP failed.
    #[error("{what}: {why}")]
    Http {
        /// What was asked.
        what: String,
        /// The chain of causes.
        why: String,
    },
    /// The registry answered with an error status.
    #[error("{what}: the registry answered {status}")]
    Status {
        /// What was asked.
        what: String,
        /// Its answer.
        status: StatusCode,
    },
    /// It wants a login the account does not have.
    #[error("{0} asks for a login (ssh ... image login {0}, the password on stdin)")]
    NeedsLogin(String),
    /// The login (or the token it got) was refused.
    #[error("{0} refused the login")]
    LoginRefused(String),
    /// Its auth challenge cannot be followed.
    #[error("{registry}: {why}")]
    Auth {
        /// The registry.
        registry: String,
        /// Why.
        why: String,
    },
    /// An answer larger than allowed.
    #[error("{what} is over {limit} bytes")]
    TooLarge {
        /// What.
        what: String,
        /// The bound.
        limit: u64,
    },
    /// Too few bytes came in a stall period.
    #[error("{what}: under 64 KiB in {secs} s (the registry is too slow)")]
    TooSlow {
        /// What.
        what: String,
        /// The period.
        secs: u64,
    },
    /// No bytes came for too long.
    #[error("{what}: no bytes for {secs} s (the registry stalled)")]
    Stalled {
        /// What.
        what: String,
        /// The bound.
        secs: u64,
    },
    /// The bytes are not what their digest says.
    #[error("{what} does not match its digest (expected {expected}, got {got}): nothing of it is kept")]
    DigestMismatch {
        /// What.
        what: String,
        /// The digest asked for.
        expected: Digest,
        /// The digest of what came.
        got: Digest,
    },
    /// An address the upstream settings refuse.
    #[error("{0}")]
    Refused(String),
    /// A document that cannot be used.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// Writing a blob where the daemon asked failed.
    #[error("writing {what}: {source}")]
    Write {
        /// What.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn http_err(what: &str) -> impl Fn(reqwest::Error) -> ClientError + '_ {
    move |e| {
        let mut why = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            why.push_str(": ");
            why.push_str(&s.to_string());
            source = s.source();
        }
        ClientError::Http { what: what.to_string(), why }
    }
}

/// Names resolved by the gateway's upstream side.
struct Resolver(Arc<Upstream>);

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let upstream = Arc::clone(&self.0);
        let host = name.as_str().to_string();
        Box::pin(async move {
            let name = HostName::parse(&host).map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
            let addrs =
                upstream.resolve(&name).await.map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
            let addrs: reqwest::dns::Addrs = Box::new(addrs.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}

/// Whether the upstream settings let `url` be dialled: `https`, and an
/// address literal only where the gateway could dial it (names are checked
/// when they resolve).
fn may_visit(upstream: &Upstream, url: &Url) -> Result<(), String> {
    if url.scheme() != "https" {
        return Err(format!("{url}: only https is followed"));
    }
    let ip = match url.host() {
        Some(url::Host::Ipv4(ip)) => Some(IpAddr::V4(ip)),
        Some(url::Host::Ipv6(ip)) => Some(IpAddr::V6(ip)),
        Some(url::Host::Domain(_)) => None,
        None => return Err(format!("{url}: no host")),
    };
    match ip {
        Some(ip) if !upstream.may_dial(ip) => Err(format!("{url}: {ip} is not on the public internet")),
        _ => Ok(()),
    }
}

/// One repository of one registry, with the auth it has earned so far.
pub struct Registry {
    http: reqwest::Client,
    upstream: Arc<Upstream>,
    base: Url,
    registry: String,
    repository: String,
    login: Option<Login>,
    /// The `Authorization` value that worked last (a token, or Basic).
    auth: Mutex<Option<HeaderValue>>,
    bounds: Bounds,
}

/// An image's manifest and config, as fetched and checked.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The digest of the manifest (of linux/amd64's, for an index).
    pub manifest_digest: Digest,
    /// The manifest.
    pub manifest: Manifest,
    /// The config's bytes (its digest checked).
    pub config: Vec<u8>,
    /// The documents fetched, in order: an index (if there was one), then
    /// the manifest; for whoever checks their digests again.
    pub documents: Vec<Vec<u8>>,
}

impl Registry {
    /// A client for `reference`'s repository, dialling through `upstream`
    /// and verifying TLS with `tls`.
    pub fn new(
        reference: &Reference,
        upstream: Arc<Upstream>,
        tls: rustls::ClientConfig,
        login: Option<Login>,
        bounds: Bounds,
    ) -> Result<Self, ClientError> {
        let base = Url::parse(&format!("https://{}/", reference.registry))
            .map_err(|e| ClientError::Refused(format!("{}: {e}", reference.registry)))?;
        may_visit(&upstream, &base).map_err(ClientError::Refused)?;
        let policy_upstream = Arc::clone(&upstream);
        let redirects = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() > MAX_REDIRECTS {
                return attempt.error(format!("more than {MAX_REDIRECTS} redirects"));
            }
            match may_visit(&policy_upstream, attempt.url()) {
                Ok(()) => attempt.follow(),
                Err(why) => attempt.error(why),
            }
        });
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .dns_resolver(Arc::new(Resolver(Arc::clone(&upstream))))
            .no_proxy()
            .redirect(redirects)
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!("moat/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(http_err("make the HTTP client"))?;
        Ok(Self {
            http,
            upstream,
            base,
            registry: reference.registry.clone(),
            repository: reference.repository.clone(),
            login,
            auth: Mutex::new(None),
            bounds,
        })
    }

    fn url(&self, path: &str) -> Result<Url, ClientError> {
        self.base.join(&format!("v2/{}/{path}", self.repository)).map_err(|e| ClientError::Refused(e.to_string()))
    }

    fn auth(&self) -> Option<HeaderValue> {
        self.auth.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// GETs `url`, answering one auth challenge if the registry makes one.
    async fn get(&self, what: &str, url: Url, accept: Option<&str>) -> Result<reqwest::Response, ClientError> {
        let resp = self
            .send(what, self.bounds.document, || {
                let req = self.http.get(url.clone());
                match accept {
                    Some(accept) => req.header(ACCEPT, accept),
                    None => req,
                }
            })
            .await?;
        if !resp.status().is_success() {
            return Err(ClientError::Status { what: what.to_string(), status: resp.status() });
        }
        Ok(resp)
    }

    /// Sends the request `make` makes (again, after answering one auth
    /// challenge if the registry makes one), within `deadline` for its
    /// answer's head; the answer whatever its status but `401`.
    async fn send(
        &self,
        what: &str,
        deadline: Duration,
        make: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ClientError> {
        self.send_with(what, deadline, true, make).await
    }

    /// [`Self::send`], with the registry's `Authorization` only if `auth`
    /// (never to another host).
    async fn send_with(
        &self,
        what: &str,
        deadline: Duration,
        auth: bool,
        make: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ClientError> {
        let mut answered = false;
        loop {
            let mut req = make();
            if let Some(value) = self.auth().filter(|_| auth) {
                req = req.header(AUTHORIZATION, value);
            }
            let resp = tokio::time::timeout(deadline, req.send())
                .await
                .map_err(|_| ClientError::Stalled { what: what.to_string(), secs: deadline.as_secs() })?
                .map_err(http_err(what))?;
            if resp.status() == StatusCode::UNAUTHORIZED {
                if answered {
                    return Err(if self.login.is_some() {
                        ClientError::LoginRefused(self.registry.clone())
                    } else {
                        ClientError::NeedsLogin(self.registry.clone())
                    });
                }
                answered = true;
                self.answer_challenge(resp.headers()).await?;
                continue;
            }
            return Ok(resp);
        }
    }

    /// Earns the `Authorization` a `401`'s challenge asks for.
    async fn answer_challenge(&self, headers: &HeaderMap) -> Result<(), ClientError> {
        let auth_err = |why: &str| ClientError::Auth { registry: self.registry.clone(), why: why.to_string() };
        let challenge = headers
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| auth_err("answered 401 without a challenge"))?;
        let (scheme, params) =
            parse_challenge(challenge).ok_or_else(|| auth_err("sent a challenge moat cannot read"))?;
        let value = match scheme.as_str() {
            "basic" => {
                let login = self.login.as_ref().ok_or_else(|| ClientError::NeedsLogin(self.registry.clone()))?;
                basic(login)
            }
            "bearer" => {
                let token = self.token(&params).await?;
                format!("Bearer {token}")
            }
            _ => return Err(auth_err("asks for an auth scheme moat does not speak")),
        };
        let value = HeaderValue::from_str(&value).map_err(|_| auth_err("gave a token that is not a header value"))?;
        *self.auth.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
        Ok(())
    }

    /// A Bearer token from the challenge's realm (anonymous, or with the login).
    async fn token(&self, params: &[(String, String)]) -> Result<String, ClientError> {
        let auth_err = |why: String| ClientError::Auth { registry: self.registry.clone(), why };
        let param = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        let realm = param("realm").ok_or_else(|| auth_err("its Bearer challenge names no realm".into()))?;
        let mut url = Url::parse(realm).map_err(|e| auth_err(format!("its token realm {realm:?}: {e}")))?;
        may_visit(&self.upstream, &url).map_err(auth_err)?;
        {
            let mut query = url.query_pairs_mut();
            if let Some(service) = param("service") {
                query.append_pair("service", service);
            }
            let scope = param("scope").map_or_else(|| format!("repository:{}:pull", self.repository), str::to_string);
            query.append_pair("scope", &scope);
        }
        let mut req = self.http.get(url);
        if let Some(login) = &self.login {
            req = req.header(AUTHORIZATION, basic(login));
        }
        let what = "the token";
        let resp = tokio::time::timeout(self.bounds.document, req.send())
            .await
            .map_err(|_| ClientError::Stalled { what: what.into(), secs: self.bounds.document.as_secs() })?
            .map_err(http_err(what))?;
        match resp.status() {
            s if s.is_success() => {}
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN if self.login.is_some() => {
                return Err(ClientError::LoginRefused(self.registry.clone()))
            }
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Err(ClientError::NeedsLogin(self.registry.clone()))
            }
            status => return Err(ClientError::Status { what: what.into(), status }),
        }
        let body = self.read_bounded(what, resp, MAX_TOKEN).await?;
        #[derive(serde::Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let t: Token = serde_json::from_slice(&body).map_err(|e| auth_err(format!("its token answer: {e}")))?;
        t.token
            .or(t.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| auth_err("its token answer has no token".into()))
    }

    /// An answer's body, at most `limit` bytes, within the document deadline.
    async fn read_bounded(&self, what: &str, mut resp: reqwest::Response, limit: u64) -> Result<Vec<u8>, ClientError> {
        let too_large = || ClientError::TooLarge { what: what.to_string(), limit };
        if resp.content_length().is_some_and(|n| n > limit) {
            return Err(too_large());
        }
        let deadline = Instant::now() + self.bounds.document;
        let mut body = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let chunk = tokio::time::timeout(left, resp.chunk())
                .await
                .map_err(|_| ClientError::Stalled { what: what.to_string(), secs: self.bounds.document.as_secs() })?
                .map_err(http_err(what))?;
            let Some(chunk) = chunk else { return Ok(body) };
            if body.len() as u64 + chunk.len() as u64 > limit {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
    }

    /// The manifest `reference` names (its bytes and the type the registry
    /// said), its digest checked when it is pinned.
    async fn manifest(
        &self,
        reference: &str,
        expected: Option<&Digest>,
    ) -> Result<(Vec<u8>, Digest, Option<String>), ClientError> {
        let what = format!("manifest {reference}");
        let resp = self.get(&what, self.url(&format!("manifests/{reference}"))?, Some(manifest::ACCEPT)).await?;
        let content_type = resp.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
        let bytes = self.read_bounded(&what, resp, MAX_DOCUMENT).await?;
        let got = Digest::of(&bytes);
        if let Some(expected) = expected {
            if &got != expected {
                return Err(ClientError::DigestMismatch { what, expected: expected.clone(), got });
            }
        }
        Ok((bytes, got, content_type))
    }

    /// Resolves `reference` to its linux/amd64 manifest and config.
    pub async fn resolve(&self, reference: &Reference) -> Result<Resolved, ClientError> {
        let (bytes, digest, content_type) = self.manifest(&reference.manifest_ref(), reference.digest.as_ref()).await?;
        let mut documents = vec![bytes.clone()];
        let (manifest_digest, manifest) = match manifest::read(&bytes, content_type.as_deref())? {
            Fetched::Manifest(m) => (digest, m),
            Fetched::Index(entry) => {
                let (bytes, digest, content_type) = self.manifest(entry.digest.as_str(), Some(&entry.digest)).await?;
                documents.push(bytes.clone());
                match manifest::read(&bytes, content_type.as_deref())? {
                    Fetched::Manifest(m) => (digest, m),
                    Fetched::Index(_) => {
                        return Err(ManifestError::MediaType("an index inside an index".into()).into());
                    }
                }
            }
        };
        let total = manifest.layers.iter().fold(manifest.config.size, |sum, (d, _)| sum.saturating_add(d.size));
        if total > self.bounds.max_image {
            return Err(ClientError::TooLarge { what: format!("image {reference}"), limit: self.bounds.max_image });
        }
        let mut config = Vec::new();
        let desc = manifest.config.clone();
        if desc.size > MAX_DOCUMENT {
            return Err(ClientError::TooLarge { what: "the image config".into(), limit: MAX_DOCUMENT });
        }
        // A document, held to the documents' bound in all.
        let what = "the image config";
        let mut quiet = |_| {};
        let fetch = self.blob(&desc, what, &mut config, &mut quiet);
        tokio::time::timeout(self.bounds.document, fetch)
            .await
            .map_err(|_| ClientError::Stalled { what: what.to_string(), secs: self.bounds.document.as_secs() })??;
        Ok(Resolved { manifest_digest, manifest, config, documents })
    }

    /// Streams blob `desc` into `out`, at most its declared size, telling
    /// `progress` the bytes so far; fails unless the bytes match its digest.
    pub async fn blob(
        &self,
        desc: &Descriptor,
        what: &str,
        out: &mut dyn Write,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<(), ClientError> {
        let mut resp = self.get(what, self.url(&format!("blobs/{}", desc.digest))?, None).await?;
        let too_large = || ClientError::TooLarge { what: what.to_string(), limit: desc.size };
        if resp.content_length().is_some_and(|n| n > desc.size) {
            return Err(too_large());
        }
        let stall = self.bounds.stall;
        let mut hasher = Sha256::new();
        let mut got = 0u64;
        // A byte now and then is not progress: each stall period must bring
        // MIN_PER_STALL (or the rest), else a registry trickling one byte
        // every few seconds held the pull (and its slot) for days.
        let (mut period, mut at_period) = (tokio::time::Instant::now(), 0u64);
        loop {
            let chunk = tokio::time::timeout(stall, resp.chunk())
                .await
                .map_err(|_| ClientError::Stalled { what: what.to_string(), secs: stall.as_secs() })?
                .map_err(http_err(what))?;
            let Some(chunk) = chunk else { break };
            got = got.saturating_add(chunk.len() as u64);
            if period.elapsed() >= stall {
                if got - at_period < MIN_PER_STALL {
                    return Err(ClientError::TooSlow { what: what.to_string(), secs: stall.as_secs() });
                }
                (period, at_period) = (tokio::time::Instant::now(), got);
            }
            if got > desc.size {
                return Err(too_large());
            }
            hasher.update(&chunk);
            out.write_all(&chunk).map_err(|source| ClientError::Write { what: what.to_string(), source })?;
            progress(got);
        }
        let digest = Digest::from_hasher(hasher);
        if digest != desc.digest {
            return Err(ClientError::DigestMismatch {
                what: what.to_string(),
                expected: desc.digest.clone(),
                got: digest,
            });
        }
        Ok(())
    }
}

/// Pushing: blobs found, mounted from another repository of the registry or
/// uploaded whole, then the manifest under a tag (the distribution API's
/// monolithic upload: `POST` for a session, `PUT` with the digest).
impl Registry {
    /// Whether the repository holds blob `digest`.
    pub async fn has_blob(&self, digest: &Digest) -> Result<bool, ClientError> {
        let what = format!("blob {}", digest.short());
        let url = self.url(&format!("blobs/{digest}"))?;
        let resp = self.send(&what, self.bounds.document, || self.http.head(url.clone())).await?;
        match resp.status() {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            status => Err(ClientError::Status { what, status }),
        }
    }

    /// Asks the registry to mount blob `digest` from its repository `from`;
    /// whether it did (a registry that will not starts an upload instead,
    /// which is left to expire).
    pub async fn mount_blob(&self, digest: &Digest, from: &str) -> Result<bool, ClientError> {
        let what = format!("mount of blob {} from {from}", digest.short());
        let mut url = self.url("blobs/uploads/")?;
        url.query_pairs_mut().append_pair("mount", digest.as_str()).append_pair("from", from);
        let resp = self.send(&what, self.bounds.document, || self.http.post(url.clone())).await?;
        match resp.status() {
            StatusCode::CREATED => Ok(true),
            s if s.is_success() => Ok(false),
            status => Err(ClientError::Status { what, status }),
        }
    }

    /// Uploads `bytes` as blob `digest` (checked here first).
    pub async fn upload_blob(&self, digest: &Digest, bytes: bytes::Bytes) -> Result<(), ClientError> {
        let what = format!("upload of blob {}", digest.short());
        let got = Digest::of(&bytes);
        if &got != digest {
            return Err(ClientError::DigestMismatch { what, expected: digest.clone(), got });
        }
        let start = self.url("blobs/uploads/")?;
        let resp = self.send(&what, self.bounds.document, || self.http.post(start.clone())).await?;
        if resp.status() != StatusCode::ACCEPTED {
            return Err(ClientError::Status { what, status: resp.status() });
        }
        let location = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ClientError::Refused(format!("{what}: the registry named no upload location")))?;
        let mut url = self.base.join(location).map_err(|e| ClientError::Refused(format!("{what}: {e}")))?;
        may_visit(&self.upstream, &url).map_err(ClientError::Refused)?;
        url.query_pairs_mut().append_pair("digest", digest.as_str());
        // The login goes to the registry's own host only (an upload may be
        // sent to storage elsewhere).
        let same_host =
            (url.host_str(), url.port_or_known_default()) == (self.base.host_str(), self.base.port_or_known_default());
        // The whole body may take a while: the stall bound per megabyte.
        let deadline = self.bounds.stall.saturating_mul(u32::try_from(bytes.len() >> 20).unwrap_or(u32::MAX).max(1));
        let resp = self
            .send_with(&what, deadline, same_host, || {
                self.http
                    .put(url.clone())
                    .header(CONTENT_TYPE, "application/octet-stream")
                    .body(reqwest::Body::from(bytes.clone()))
            })
            .await?;
        match resp.status() {
            StatusCode::CREATED | StatusCode::NO_CONTENT | StatusCode::OK => Ok(()),
            status => Err(ClientError::Status { what, status }),
        }
    }

    /// Puts `manifest` (of `media_type`) under `tag`.
    pub async fn put_manifest(&self, tag: &str, media_type: &str, manifest: bytes::Bytes) -> Result<(), ClientError> {
        let what = format!("manifest {tag}");
        let url = self.url(&format!("manifests/{tag}"))?;
        let resp = self
            .send(&what, self.bounds.document, || {
                self.http.put(url.clone()).header(CONTENT_TYPE, media_type).body(reqwest::Body::from(manifest.clone()))
            })
            .await?;
        match resp.status() {
            s if s.is_success() => Ok(()),
            status => Err(ClientError::Status { what, status }),
        }
    }
}

fn basic(login: &Login) -> String {
    let pair = format!("{}:{}", login.user, login.password);
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
}

/// Reads `SCHEME k="v", k2=v2` (RFC 7235, one challenge): the scheme in
/// lower case and its parameters.
fn parse_challenge(header: &str) -> Option<(String, Vec<(String, String)>)> {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    let mut params = Vec::new();
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key.trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            let end = quoted.find('"')?;
            (quoted.get(..end)?, quoted.get(end + 1..)?)
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after.get(..end)?.trim(), after.get(end..)?)
        };
        params.push((key, value.to_string()));
        rest = next.trim_start().trim_start_matches(',').trim_start();
        if params.len() > 16 {
            return None;
        }
    }
    Some((scheme.to_ascii_lowercase(), params))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn challenges_are_read() {
        let (scheme, params) = parse_challenge(
            r#"Bearer realm="https://auth.test/token",service="registry.test",scope="repository:a/b:pull""#,
        )
        .unwrap();
        assert_eq!(scheme, "bearer");
        assert_eq!(params[0], ("realm".to_string(), "https://auth.test/token".to_string()));
        assert_eq!(params[2].1, "repository:a/b:pull");
        let (scheme, params) = parse_challenge(r#"Basic realm="Registry Realm""#).unwrap();
        assert_eq!((scheme.as_str(), params.len()), ("basic", 1));
        assert!(parse_challenge(r#"Bearer realm="unterminated"#).is_none());
        assert!(parse_challenge(&"Bearer ".chars().chain("a=b,".repeat(40).chars()).collect::<String>()).is_none());
    }

    #[test]
    fn logins_never_print() {
        let login = Login { user: "u".into(), password: "hunter2".into() };
        assert!(!format!("{login:?}").contains("hunter2"));
    }
}
