//! Looking inside HTTPS, for hosts whose rules need each request seen. The
//! box is shown a certificate for the name it dialled, signed by its own CA
//! (see [`super::leaves`]); the gateway opens its own TLS connection to the real
//! host, verified against the host's roots; in between, requests are read
//! and checked exactly as plain HTTP is. Both sides speak HTTP/1.1 only (ALPN),
//! so that every request is one the gateway can parse.

use std::io;
use std::sync::Arc;

use moat_core::policy::HostName;
use moat_core::rewind::Rewind;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::BufReader;
use tokio::net::TcpStream;

use crate::tls::leaves::LeafSigner;

const HTTP_1_1: &[u8] = b"http/1.1";

/// ring's suites, AES-128-GCM first: as safe, and cheaper than AES-256 (10
/// rounds a block against 14) on both of a looked-inside connection's legs,
/// where the gateway decrypts and encrypts every byte (Go's TLS makes the
/// same choice on hardware with AES instructions).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite::*;
    Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: vec![
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS13_CHACHA20_POLY1305_SHA256,
            TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ],
        ..rustls::crypto::ring::default_provider()
    })
}

/// The TLS the gateway speaks to real hosts: roots from `roots_pem` only.
pub fn upstream_config(roots_pem: &str) -> Result<Arc<ClientConfig>, String> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
        // One root the library cannot use does not spoil the rest.
        let _ = cert.map_err(|e| e.to_string()).and_then(|c| roots.add(c).map_err(|e| e.to_string()));
    }
    if roots.is_empty() {
        return Err("no usable TLS roots for upstream connections".into());
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![HTTP_1_1.to_vec()];
    Ok(Arc::new(config))
}

/// The TLS a box is answered with: certificates from `signer`.
pub fn box_config(signer: LeafSigner) -> Result<Arc<ServerConfig>, String> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Leaves(signer)));
    // A box that offers only h2 fails the handshake rather than speaking
    // frames the gateway does not read.
    config.alpn_protocols = vec![HTTP_1_1.to_vec()];
    // The gateway's order, not the box's (OpenSSL's clients list AES-256 first).
    config.ignore_client_order = true;
    // Every box has its own config: rustls's default of 256 sessions is
    // allocated up front (~30 KiB a box); a box's few clients need far fewer.
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(32);
    Ok(Arc::new(config))
}

#[derive(Debug)]
struct Leaves(LeafSigner);

impl ResolvesServerCert for Leaves {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // The proxy has already checked the SNI against the dialled name.
        let name = HostName::parse(hello.server_name()?).ok()?;
        self.0.leaf(&name).inspect_err(|e| tracing::warn!(error = %e, "cannot sign a leaf")).ok()
    }
}

/// Bytes read from a socket at a time, whatever TLS asks for: rustls
/// reads 4 KiB a call once its buffer is empty, four calls a record. (Each
/// side of a connection looked inside holds one such buffer.)
const READ_AHEAD: usize = 32 << 10;

/// Completes the TLS handshake with the box, whose ClientHello (`early`) has
/// already been read off `stream`.
pub async fn accept(
    config: Arc<ServerConfig>,
    stream: TcpStream,
    early: Vec<u8>,
) -> io::Result<tokio_rustls::server::TlsStream<Rewind<BufReader<TcpStream>>>> {
    let stream = Rewind::new(early, BufReader::with_capacity(READ_AHEAD, stream));
    tokio_rustls::TlsAcceptor::from(config).accept(stream).await
}

/// Starts TLS to the real host over `stream`, verifying it is `name`.
pub async fn connect(
    config: Arc<ClientConfig>,
    stream: TcpStream,
    name: &HostName,
) -> io::Result<tokio_rustls::client::TlsStream<BufReader<TcpStream>>> {
    let server = ServerName::try_from(name.as_str().to_string()).map_err(io::Error::other)?;
    let stream = BufReader::with_capacity(READ_AHEAD, stream);
    tokio_rustls::TlsConnector::from(config).connect(server, stream).await
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A box's client (trusting its CA) through [`accept`], with the
    /// ClientHello read off first as the proxy does.
    #[tokio::test]
    async fn a_box_trusting_its_ca_completes_the_handshake_and_only_over_http_1_1() {
        let (ca, key) = moat_core::box_ca::mint().unwrap();
        let server = box_config(LeafSigner::new(&key).unwrap()).unwrap();
        let client_config = |alpn: &[&[u8]]| {
            let mut config = upstream_config(&ca).unwrap().as_ref().clone();
            config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            Arc::new(config)
        };
        for (alpn, works) in [(&[HTTP_1_1][..], true), (&[b"h2".as_slice()][..], false), (&[][..], true)] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let server = Arc::clone(&server);
            let serving = tokio::spawn(async move {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut early = vec![0u8; 5];
                stream.read_exact(&mut early).await.unwrap();
                let mut tls = accept(server, stream, early).await?;
                let mut got = [0u8; 4];
                tls.read_exact(&mut got).await?;
                tls.write_all(b"pong").await?;
                tls.shutdown().await?;
                io::Result::Ok(got)
            });
            let tcp = TcpStream::connect(addr).await.unwrap();
            let name = HostName::parse("registry.npmjs.org").unwrap();
            let client = connect(client_config(alpn), tcp, &name).await;
            if works {
                let mut client = client.unwrap();
                client.write_all(b"ping").await.unwrap();
                let mut answer = Vec::new();
                client.read_to_end(&mut answer).await.unwrap();
                assert_eq!(answer, b"pong");
                assert_eq!(&serving.await.unwrap().unwrap(), b"ping");
            } else {
                assert!(client.is_err(), "{alpn:?}");
                assert!(serving.await.unwrap().is_err());
            }
        }
    }

    /// A client listing AES-256 first (as OpenSSL's do) is answered with
    /// AES-128: the gateway's order.
    #[tokio::test]
    async fn the_gateway_picks_aes_128_whatever_the_box_lists_first() {
        let (ca, key) = moat_core::box_ca::mint().unwrap();
        let server = box_config(LeafSigner::new(&key).unwrap()).unwrap();
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let stock = rustls::crypto::ring::default_provider();
        assert_eq!(stock.cipher_suites[0].suite(), rustls::CipherSuite::TLS13_AES_256_GCM_SHA384);
        let client = ClientConfig::builder_with_provider(Arc::new(stock))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut early = vec![0u8; 5];
            stream.read_exact(&mut early).await.unwrap();
            let mut tls = accept(server, stream, early).await.unwrap();
            tls.write_all(b"x").await.unwrap();
        });
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = HostName::parse("registry.npmjs.org").unwrap();
        let mut tls = connect(Arc::new(client), tcp, &name).await.unwrap();
        let mut got = [0u8; 1];
        tls.read_exact(&mut got).await.unwrap();
        let suite = tls.get_ref().1.negotiated_cipher_suite().unwrap().suite();
        assert_eq!(suite, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    }
}
