//! Leaf certificates for the hosts the gateway looks inside: each signed by
//! the box's own CA (see [`moat_core::box_ca`], which the privileged side
//! mints it with), whose key the gateway is handed; the box trusts that CA and
//! nothing else does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use moat_core::box_ca;
use moat_core::policy::HostName;
use rcgen::{Issuer, KeyPair};
use rustls::crypto::ring::sign::any_ecdsa_type;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

pub use moat_core::box_ca::CaKey;

/// Most leaves a box's CA keeps signed at once; past it the oldest go.
const MAX_LEAVES: usize = 4096;

/// Signs leaf certificates for one box, one per host name, kept for reuse.
pub struct LeafSigner {
    issuer: Issuer<'static, KeyPair>,
    /// One key for every leaf of the box (signing a certificate is cheap;
    /// making a key is not).
    leaf_key: KeyPair,
    signing_key: Arc<dyn rustls::sign::SigningKey>,
    leaves: Mutex<HashMap<HostName, Arc<CertifiedKey>>>,
}

impl LeafSigner {
    /// A signer for the CA whose private key is `key_pem`.
    pub fn new(key_pem: &str) -> Result<Self, String> {
        let issuer = box_ca::issuer(key_pem).map_err(|e| format!("box CA key: {e}"))?;
        let leaf_key = KeyPair::generate().map_err(|e| e.to_string())?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let signing_key = any_ecdsa_type(&der).map_err(|e| e.to_string())?;
        Ok(Self { issuer, leaf_key, signing_key, leaves: Mutex::new(HashMap::new()) })
    }

    /// The certificate (and key) the box is shown for `name`.
    pub fn leaf(&self, name: &HostName) -> Result<Arc<CertifiedKey>, String> {
        let mut leaves = self.leaves.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(leaf) = leaves.get(name) {
            return Ok(Arc::clone(leaf));
        }
        let params = box_ca::leaf_params(name.as_str()).map_err(|e| e.to_string())?;
        let cert = params.signed_by(&self.leaf_key, &self.issuer).map_err(|e| e.to_string())?;
        let chain: Vec<CertificateDer<'static>> = vec![cert.der().clone()];
        let leaf = Arc::new(CertifiedKey::new(chain, Arc::clone(&self.signing_key)));
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(name.clone(), Arc::clone(&leaf));
        Ok(leaf)
    }
}

impl std::fmt::Debug for LeafSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafSigner").finish_non_exhaustive()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn leaves_name_the_host_and_chain_to_the_ca() {
        let (ca_pem, key_pem) = box_ca::mint().unwrap();
        let signer = LeafSigner::new(&key_pem).unwrap();
        let name = HostName::parse("pypi.org").unwrap();
        let leaf = signer.leaf(&name).unwrap();
        assert!(Arc::ptr_eq(&leaf, &signer.leaf(&name).unwrap()), "leaves are reused");
        // Verified as a client would: the CA as the only root.
        let mut roots = rustls::RootCertStore::empty();
        let ca = rustls::pki_types::pem::PemObject::from_pem_slice(ca_pem.as_bytes()).unwrap();
        roots.add(ca).unwrap();
        use rustls::client::danger::ServerCertVerifier;
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let server = rustls::pki_types::ServerName::try_from("pypi.org").unwrap();
        let now = rustls::pki_types::UnixTime::now();
        verifier.verify_server_cert(&leaf.cert[0], &[], &server, &[], now).unwrap();
        let other = rustls::pki_types::ServerName::try_from("evil.example").unwrap();
        assert!(verifier.verify_server_cert(&leaf.cert[0], &[], &other, &[], now).is_err());
        // Another box's CA does not vouch for this box's leaves.
        let (_, other_key) = box_ca::mint().unwrap();
        let stranger = LeafSigner::new(&other_key).unwrap().leaf(&name).unwrap();
        assert!(verifier.verify_server_cert(&stranger.cert[0], &[], &server, &[], now).is_err());
    }
}
