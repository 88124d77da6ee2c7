//! TLS to PostgreSQL, asked for with `sslmode=require` in the store's DSN:
//! rustls (ring, as the rest of moat), and the server's certificate always
//! verified, its chain and its name (the DSN's host), against the CA in
//! `sslrootcert=FILE` or, without one, the host's roots. Stricter than
//! libpq's `require`, which encrypts but checks nothing: a store holds the
//! fleet's sealed keys and every account.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use postgres::Socket;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::store::StoreError;

/// The host's roots, where Debian keeps them.
const HOST_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// How the store's connections make TLS.
#[derive(Clone)]
pub(crate) struct PgTls {
    config: Arc<rustls::ClientConfig>,
}

impl PgTls {
    /// Trusting the CA certificates in `root_cert` (a PEM file), or the
    /// host's roots without one.
    pub(crate) fn new(root_cert: Option<&str>) -> Result<Self, StoreError> {
        let path = root_cert.unwrap_or(HOST_ROOTS);
        let pem = std::fs::read(path).map_err(|e| StoreError::Dsn(format!("sslrootcert {path}: {e}")))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
            let cert: CertificateDer<'static> =
                cert.map_err(|e| StoreError::Dsn(format!("sslrootcert {path}: not PEM certificates: {e}")))?;
            roots.add(cert).map_err(|e| StoreError::Dsn(format!("sslrootcert {path}: {e}")))?;
        }
        if roots.is_empty() {
            return Err(StoreError::Dsn(format!("sslrootcert {path}: no certificate in it")));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Dsn(format!("TLS to the store: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self { config: Arc::new(config) })
    }
}

impl MakeTlsConnect<Socket> for PgTls {
    type Stream = PgTlsStream;
    type TlsConnect = PgTlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<PgTlsConnect, io::Error> {
        let name = ServerName::try_from(domain.to_string())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{domain}: {e}")))?;
        Ok(PgTlsConnect { config: Arc::clone(&self.config), name })
    }
}

/// One connection's handshake.
pub(crate) struct PgTlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl TlsConnect<Socket> for PgTlsConnect {
    type Stream = PgTlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<PgTlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let tls = tokio_rustls::TlsConnector::from(self.config).connect(self.name, stream).await?;
            Ok(PgTlsStream(tls))
        })
    }
}

/// A connection to the store under TLS.
pub(crate) struct PgTlsStream(tokio_rustls::client::TlsStream<Socket>);

impl TlsStream for PgTlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for PgTlsStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for PgTlsStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// `dsn` without its `sslrootcert` parameter (which the PostgreSQL client
/// does not take), and that parameter's value: in a URL's query
/// (`postgres://h/db?sslmode=require&sslrootcert=/etc/moat/pg-ca.pem`) or
/// as a `key=value` word.
pub(crate) fn take_root_cert(dsn: &str) -> (String, Option<String>) {
    if dsn.starts_with("postgres://") || dsn.starts_with("postgresql://") {
        let Some((base, query)) = dsn.split_once('?') else { return (dsn.to_string(), None) };
        let (kept, found) = without_root_cert(query.split('&'));
        let dsn = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
        return (dsn, found);
    }
    let (kept, found) = without_root_cert(dsn.split_whitespace());
    (kept.join(" "), found)
}

/// The parameters but `sslrootcert=VALUE`, and that value (the last, if several).
fn without_root_cert<'a>(params: impl Iterator<Item = &'a str>) -> (Vec<&'a str>, Option<String>) {
    let (mut kept, mut found) = (Vec::new(), None);
    for param in params {
        match param.strip_prefix("sslrootcert=") {
            Some(value) => found = Some(value.to_string()),
            None => kept.push(param),
        }
    }
    (kept, found)
}

#[cfg(test)]
mod tests {
    use super::take_root_cert;
    use crate::box_ca;
    use crate::store::{Store, StoreError};

    /// A cluster serving TLS with a leaf for 127.0.0.1 from a CA of the
    /// test's, refusing TCP clients without TLS.
    #[test]
    fn a_store_over_tls_verifies_the_server_and_the_server_wants_tls() {
        let (ca, ca_key) = box_ca::mint().unwrap();
        let issuer = box_ca::issuer(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = vec![rcgen::SanType::IpAddress([127, 0, 0, 1].into())];
        box_ca::valid_for(&mut params, 1);
        let cert = params.signed_by(&key, &issuer).unwrap();
        let pg = moat_testkit::Postgres::start_tls(&cert.pem(), &key.serialize_pem());
        let dsn = pg.create_db();
        let dir = tempfile::tempdir().unwrap();
        let (ours, theirs) = (dir.path().join("ca.pem"), dir.path().join("other.pem"));
        std::fs::write(&ours, &ca).unwrap();
        std::fs::write(&theirs, box_ca::mint().unwrap().0).unwrap();

        // Verified TLS: the store opens, and the server says the session is encrypted.
        let store = Store::connect(&format!("{dsn}?sslmode=require&sslrootcert={}", ours.display())).unwrap();
        let sql = "SELECT CASE WHEN ssl THEN 1 ELSE 0 END FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
        assert_eq!(store.query_row(sql, &[]).unwrap().unwrap().get::<i64>(0).unwrap(), 1);
        // Without TLS the server refuses; with another CA, the server is not trusted.
        let plain = Store::connect(&dsn).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(plain.contains("no encryption"), "{plain}");
        let other = Store::connect(&format!("{dsn}?sslmode=require&sslrootcert={}", theirs.display()));
        let other = other.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(other.contains("certificate") && !other.contains("password"), "{other}");
        // A root certificate without TLS asked for is a mistake said at once.
        let lone = Store::connect(&format!("{dsn}?sslrootcert={}", ours.display()));
        assert!(matches!(lone, Err(StoreError::Dsn(_))), "{:?}", lone.err());
    }

    #[test]
    fn the_root_cert_is_taken_out_of_either_form() {
        let url = "postgres://moat:pw@db:5432/moat?sslmode=require&sslrootcert=/etc/moat/ca.pem&application_name=x";
        assert_eq!(
            take_root_cert(url),
            (
                "postgres://moat:pw@db:5432/moat?sslmode=require&application_name=x".into(),
                Some("/etc/moat/ca.pem".into())
            )
        );
        assert_eq!(
            take_root_cert("postgres://db/moat?sslrootcert=/c"),
            ("postgres://db/moat".into(), Some("/c".into()))
        );
        assert_eq!(take_root_cert("postgres://db/moat"), ("postgres://db/moat".into(), None));
        assert_eq!(
            take_root_cert("host=db sslmode=require sslrootcert=/c dbname=moat"),
            ("host=db sslmode=require dbname=moat".into(), Some("/c".into()))
        );
    }
}
