//! TLS between fleet members: TLS 1.3 only, both sides present a certificate
//! from the fleet's CA and trust nothing else, and the connection speaks one
//! protocol (ALPN [`ALPN`]). Which member the peer is, and whether it may be
//! one, is [`crate::peer`]'s question, asked once the handshake is done.

use std::fmt;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// The protocol a fleet connection speaks: moat-api's messages in frames.
pub const ALPN: &[u8] = b"moat-api/1";

/// A failure reading a member's identity or building its TLS setup.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM that does not hold what it should.
    #[error("{what}: {detail}")]
    Pem {
        /// Which one.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// rustls refused the setup.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// What a member proves itself with: the fleet CA it trusts, its
/// certificate, and its key.
#[derive(Clone)]
pub struct Identity {
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: Arc<PrivateKeyDer<'static>>,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Identity { key: [redacted], .. }")
    }
}

fn pem<T>(what: &'static str, parsed: Result<T, rustls::pki_types::pem::Error>) -> Result<T, TlsError> {
    parsed.map_err(|e| TlsError::Pem { what, detail: e.to_string() })
}

impl Identity {
    /// From PEM: the fleet CA's certificate, the member's certificate and its key.
    pub fn from_pem(ca: &str, cert: &str, key: &str) -> Result<Self, TlsError> {
        Ok(Self {
            ca: pem("the fleet CA certificate", CertificateDer::from_pem_slice(ca.as_bytes()))?,
            cert: pem("the member certificate", CertificateDer::from_pem_slice(cert.as_bytes()))?,
            key: Arc::new(pem("the member key", PrivateKeyDer::from_pem_slice(key.as_bytes()))?),
        })
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, TlsError> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone())?;
        Ok(Arc::new(roots))
    }

    /// What a node answers with: it asks every peer for a certificate of the fleet.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots()?, provider())
            .build()
            .map_err(|e| TlsError::Rustls(rustls::Error::General(e.to_string())))?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Arc::new(config))
    }

    /// What a router dials with: it trusts only the fleet's CA.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Arc::new(config))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}
