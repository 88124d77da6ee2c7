//! The certificate the edge presents: the operator's wildcard certificate for
//! `*.DOMAIN`, or, without one, a leaf signed by a CA of moat's own (made
//! once, kept in the state dir, its certificate's path printed so that
//! browsers on a LAN or in tests can trust it). ECDSA P-256: what every
//! browser takes.

use std::sync::Arc;

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The CA's common name.
const CA_NAME: &str = "moat web CA";

/// A failure making or reading the edge's certificate.
#[derive(Debug, thiserror::Error)]
pub enum SiteError {
    /// rcgen refused.
    #[error("certificate: {0}")]
    Cert(#[from] rcgen::Error),
    /// A PEM that does not hold what it should.
    #[error("{0}: not a PEM certificate chain and key")]
    Pem(&'static str),
    /// rustls refused the certificate or key.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A new CA: (certificate, key), PEM.
pub fn mint_ca() -> Result<(String, String), SiteError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let cert = ca_params().self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn ca_params() -> CertificateParams {
    let mut params = moat_core::box_ca::ca_params(CA_NAME);
    moat_core::box_ca::valid_for(&mut params, 10);
    params
}

/// A leaf for `*.DOMAIN` signed by the CA whose key is `ca_key_pem`: (chain
/// with the CA's certificate after it, key), PEM.
pub fn issue(domain: &str, ca_cert_pem: &str, ca_key_pem: &str) -> Result<(String, String), SiteError> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    let issuer = Issuer::new(ca_params(), ca_key);
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("*.{domain}"));
    params.distinguished_name = dn;
    params.subject_alt_names = vec![SanType::DnsName(format!("*.{domain}").try_into()?)];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    // Browsers refuse leaves valid for more than 398 days.
    let now = std::time::SystemTime::now();
    params.not_before = (now - std::time::Duration::from_secs(86_400)).into();
    params.not_after = (now + std::time::Duration::from_secs(300 * 86_400)).into();
    let cert = params.signed_by(&key, &issuer)?;
    Ok((format!("{}{ca_cert_pem}", cert.pem()), key.serialize_pem()))
}

/// The TLS setup of the edge: `cert_pem` (leaf first) and `key_pem`,
/// speaking HTTP/2 or HTTP/1.1 as the browser prefers (ALPN).
pub fn server_config(cert_pem: &str, key_pem: &str) -> Result<Arc<rustls::ServerConfig>, SiteError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|_| SiteError::Pem("the certificate"))?;
    if chain.is_empty() {
        return Err(SiteError::Pem("the certificate"));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|_| SiteError::Pem("the key"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_minted_site_loads() {
        let (ca, ca_key) = mint_ca().unwrap();
        let (chain, key) = issue("moat.test", &ca, &ca_key).unwrap();
        assert_eq!(chain.matches("BEGIN CERTIFICATE").count(), 2);
        server_config(&chain, &key).unwrap();
        assert!(server_config("junk", &key).is_err());
    }
}
