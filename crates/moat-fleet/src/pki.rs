//! The fleet's certificates: one CA (made by `moat fleet init`, its key
//! kept in the operator's state dir) and a leaf per member, a node or a
//! front door, whose serial is registered in the store with its role. Keys
//! are Ed25519: the cheapest to sign and check in the handshake every
//! request between hosts makes.

use std::fmt;

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType,
    SerialNumber,
};

/// The common name of the fleet's CA (the issuer every leaf names).
const CA_NAME: &str = "moat fleet CA";

/// What a member of the fleet is: a node or a front door (as the store
/// keeps it).
pub use moat_core::store::fleet::MemberRole as Role;

/// A role as typed (`node`, `front`).
pub fn parse_role(s: &str) -> Result<Role, PkiError> {
    Role::parse(s).ok_or_else(|| PkiError::Role(s.to_string()))
}

/// A failure making or reading certificates.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// rcgen refused.
    #[error("certificate: {0}")]
    Cert(#[from] rcgen::Error),
    /// A member name that cannot be a certificate's DNS name.
    #[error("{0:?} is not a member name (lowercase letters, digits and '-', at most 63, starting with a letter)")]
    Name(String),
    /// Not `node` nor `front`.
    #[error("{0:?} is not a role (node or front)")]
    Role(String),
    /// No randomness.
    #[error("no randomness: {0}")]
    Random(String),
}

/// Whether `name` may name a member: it is its certificate's DNS name, which
/// a router checks when it dials a node.
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 63
        && chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-')
}

/// The fleet's CA.
pub struct Ca {
    cert_pem: String,
    key: KeyPair,
}

impl fmt::Debug for Ca {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Ca(..)")
    }
}

/// A member's certificate and key.
pub struct Leaf {
    /// Its serial, as [`crate::serial::of`] reads it back.
    pub serial: String,
    /// The certificate.
    pub cert: rcgen::Certificate,
    /// Its key.
    pub key: KeyPair,
}

impl fmt::Debug for Leaf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leaf").field("serial", &self.serial).finish_non_exhaustive()
    }
}

impl Ca {
    /// A new CA.
    pub fn mint() -> Result<Self, PkiError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519)?;
        let mut params = moat_core::box_ca::ca_params(CA_NAME);
        moat_core::box_ca::valid_for(&mut params, 20);
        let cert = params.self_signed(&key)?;
        Ok(Self { cert_pem: cert.pem(), key })
    }

    /// The CA of this certificate and key (PEM).
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Self, PkiError> {
        Ok(Self { cert_pem: cert_pem.to_string(), key: KeyPair::from_pem(key_pem)? })
    }

    /// Its certificate (PEM): what every member trusts.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Its private key (PEM).
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// A certificate for member `name` of `role`, with a fresh random serial.
    pub fn issue(&self, role: Role, name: &str) -> Result<Leaf, PkiError> {
        if !valid_name(name) {
            return Err(PkiError::Name(name.to_string()));
        }
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("moat {} {name}", role.as_str()));
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::DnsName(name.try_into()?)];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // A front door only dials; a node answers (and may dial another node).
        params.extended_key_usages = match role {
            Role::Node => vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
            Role::Front => vec![ExtendedKeyUsagePurpose::ClientAuth],
        };
        let serial = random_serial()?;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        moat_core::box_ca::valid_for(&mut params, 10);
        let ca = moat_core::box_ca::ca_params(CA_NAME);
        let issuer = Issuer::from_params(&ca, &self.key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok(Leaf { serial: hex::encode(serial), cert, key })
    }
}

/// Sixteen random bytes read back unchanged from the DER: the first is
/// neither zero (it would be dropped) nor has its top bit set (DER would
/// lead it with a zero to keep it positive).
fn random_serial() -> Result<[u8; 16], PkiError> {
    let mut serial = [0u8; 16];
    getrandom::fill(&mut serial).map_err(|e| PkiError::Random(e.to_string()))?;
    serial[0] = (serial[0] & 0x7f).max(1);
    Ok(serial)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for good in ["n1", "node-2", "f"] {
            assert!(valid_name(good), "{good}");
        }
        for bad in ["", "1n", "N1", "n_1", "n.1", "n-", &"n".repeat(64)] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert!(Ca::mint().unwrap().issue(Role::Node, "../x").is_err());
    }

    #[test]
    fn a_loaded_ca_issues_as_the_minted_one() {
        let ca = Ca::mint().unwrap();
        let again = Ca::load(ca.cert_pem(), &ca.key_pem()).unwrap();
        let a = again.issue(Role::Node, "n1").unwrap();
        let b = again.issue(Role::Node, "n1").unwrap();
        assert_ne!(a.serial, b.serial);
        assert!(a.cert.pem().starts_with("-----BEGIN CERTIFICATE-----"));
    }
}
