//! `moat serve --http-listen ADDR --http-domain DOMAIN`: boxes' web URLs.
//! The privileged side's part: the certificate (the operator's, or a leaf of
//! moat's own CA, made once in the state dir), and the confined HTTP edge
//! started and restarted as the front door is.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use moat_api::server::{Answer, WebSite};
use moat_web::{EdgeLimits, WebHello};

use crate::privsep::Confined;

/// Flags of `moat serve` for web URLs.
#[derive(Args, Clone)]
pub struct WebArgs {
    /// Serve boxes' web URLs (HTTPS) on this address (port 0 picks one; it is printed).
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// The domain box URLs are under: https://PORT-NAME-OWNER.DOMAIN (its
    /// wildcard *.DOMAIN must resolve to this server).
    #[arg(long)]
    http_domain: Option<String>,
    /// A certificate chain (PEM) for *.DOMAIN [default: one of moat's own CA,
    /// kept in STATE_DIR/web; its path is printed].
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The port box URLs name, if not the one listened on (behind a port
    /// forward: 443 is left out of URLs).
    #[arg(long)]
    http_url_port: Option<u16>,
    /// The uid and gid the HTTP edge runs as; must own nothing.
    #[arg(long, default_value_t = moat_core::record::WEB_EDGE_ID)]
    http_edge_id: u32,
    /// Connections at once from one address.
    #[arg(long, default_value_t = EdgeLimits::default().per_source)]
    http_max_per_source: usize,
    /// Requests in flight at once to one box port.
    #[arg(long, default_value_t = EdgeLimits::default().per_box)]
    http_max_per_box: usize,
    /// Seconds a TLS handshake or a request's head may take.
    #[arg(long, default_value_t = EdgeLimits::default().head_secs)]
    http_head_timeout: u64,
    /// Seconds a request body may go without a byte.
    #[arg(long, default_value_t = EdgeLimits::default().body_secs)]
    http_body_timeout: u64,
    /// Seconds a box has to begin answering a request.
    #[arg(long, default_value_t = EdgeLimits::default().answer_secs)]
    http_answer_timeout: u64,
    /// Event loops (threads) the HTTP edge serves in [default: one per CPU
    /// but one, at least one: the boxes' servers need a CPU too].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    http_loops: Option<u16>,
}

/// The HTTP edge as [`crate::privsep::supervise`] runs it.
pub struct WebEdge {
    id: u32,
    hello: WebHello,
}

impl Confined for WebEdge {
    fn names(&self) -> (&'static str, &'static str) {
        ("moat-web-edge", "web-edge")
    }

    fn id(&self) -> u32 {
        self.id
    }

    fn hello(&self) -> Result<Vec<u8>> {
        Ok(serde_json::to_vec(&self.hello)?)
    }
}

/// What `serve` starts: where the edge listens, what it is told, and where
/// URLs point.
pub struct Planned {
    listener: std::net::TcpListener,
    edge: WebEdge,
    /// Where URLs point (for the privileged side's answers).
    pub site: WebSite,
}

impl WebArgs {
    /// The edge these flags ask for (none without --http-listen), its
    /// listener bound; prints where it listens and, with moat's own CA, where
    /// the CA's certificate is.
    pub fn plan(&self, state_dir: &Path) -> Result<Option<Planned>> {
        let (listen, domain) = match (self.http_listen, &self.http_domain) {
            (None, None) => return Ok(None),
            (Some(listen), Some(domain)) => (listen, domain.trim_end_matches('.').to_ascii_lowercase()),
            _ => bail!("--http-listen and --http-domain go together"),
        };
        if domain.is_empty() || !domain.split('.').all(|l| moat_core::Name::new(l).is_ok()) {
            bail!("--http-domain {domain:?}: not a domain name (labels of a-z, 0-9 and '-')");
        }
        let (cert_pem, key_pem) = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => (read(cert)?, read(key)?),
            _ => own_site(state_dir, &domain)?,
        };
        // Refused now, with its reason, rather than by the edge at each start.
        moat_web::site::server_config(&cert_pem, &key_pem).context("--tls-cert/--tls-key")?;
        let listener = std::net::TcpListener::bind(listen).with_context(|| format!("listen on {listen}"))?;
        let addr = listener.local_addr()?;
        println!("http listening on {addr}");
        let limits = EdgeLimits {
            per_source: self.http_max_per_source.max(1),
            per_box: self.http_max_per_box.max(1),
            head_secs: self.http_head_timeout.max(1),
            body_secs: self.http_body_timeout.max(1),
            answer_secs: self.http_answer_timeout.max(1),
            ..EdgeLimits::default()
        };
        let site = WebSite { domain: domain.clone(), port: self.http_url_port.unwrap_or(addr.port()) };
        let loops = self.http_loops.map_or(0, usize::from);
        let hello = WebHello { domain, cert_pem, key_pem, limits, loops };
        Ok(Some(Planned { listener, edge: WebEdge { id: self.http_edge_id, hello }, site }))
    }
}

impl Planned {
    /// Runs the edge until this process ends, restarting it when it dies.
    pub async fn supervise<A: Answer>(self, answerer: Arc<A>) -> Result<()> {
        crate::privsep::supervise(self.listener, self.edge, answerer).await
    }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))
}

/// moat's own CA (made the first time, kept in STATE_DIR/web) and a leaf for
/// `*.DOMAIN` it signs at each start; prints the CA certificate's path.
fn own_site(state_dir: &Path, domain: &str) -> Result<(String, String)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = state_dir.join("web");
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    if !cert_path.exists() || !key_path.exists() {
        let (cert, key) = moat_web::site::mint_ca()?;
        let write = |path: &Path, text: &str, mode: u32| -> Result<()> {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(mode)
                .open(path)
                .with_context(|| format!("write {}", path.display()))?;
            std::io::Write::write_all(&mut file, text.as_bytes())?;
            Ok(())
        };
        write(&key_path, &key, 0o600)?;
        write(&cert_path, &cert, 0o644)?;
    }
    let (cert, key) = (read(&cert_path)?, read(&key_path)?);
    println!("web CA {}", cert_path.display());
    Ok(moat_web::site::issue(domain, &cert, &key)?)
}
