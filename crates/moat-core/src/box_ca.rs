//! A box's TLS CA: minted by the privileged side with the box's identity (so
//! a duplicate gets its own), its certificate installed in the box, its key
//! kept on the host and handed to the gateway, which signs leaves with it for
//! the hosts it looks inside. Both ends name the CA from here, so that the
//! leaves the gateway signs chain to the certificate the box trusts.

use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// The common name of every box CA (the issuer every leaf names).
const CA_NAME: &str = "moat box CA";

/// A CA's private key (PEM), never shown in logs.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct CaKey(pub String);

impl std::fmt::Debug for CaKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CaKey(..)")
    }
}

/// A new CA, as PEM: (certificate, private key).
pub fn mint() -> Result<(String, String), rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut params = ca_params(CA_NAME);
    valid_for(&mut params, 20);
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The CA whose private key is `key_pem`, as the signer of leaves.
pub fn issuer(key_pem: &str) -> Result<Issuer<'static, KeyPair>, rcgen::Error> {
    Ok(Issuer::new(ca_params(CA_NAME), KeyPair::from_pem(key_pem)?))
}

/// A server certificate's parameters for host `name`, valid for two years,
/// naming the key of the CA that signs it.
pub fn leaf_params(name: &str) -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(vec![name.to_string()])?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    valid_for(&mut params, 2);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    Ok(params)
}

/// A server certificate for `name` and its own new key, as PEM, signed by
/// the CA whose private key is `ca_key_pem` (for a server that reads both
/// from files).
pub fn leaf_pem(ca_key_pem: &str, name: &str) -> Result<(String, String), rcgen::Error> {
    let key = KeyPair::generate()?;
    let cert = leaf_params(name)?.signed_by(&key, &issuer(ca_key_pem)?)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Makes a certificate valid from the start of last year until the start of
/// the year `years` from now.
pub fn valid_for(params: &mut CertificateParams, years: i32) {
    let year = this_year();
    params.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(year + years, 1, 1);
}

/// A CA named `name` that signs leaves only (a box's CA, the fleet's).
pub fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    // It signs leaves only, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

fn this_year() -> i32 {
    // Days since the epoch to a year, close enough for validity bounds.
    let days = crate::clock::now_ms() / 86_400_000;
    1970 + (days * 4 / 1461) as i32
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_minted_ca_signs_as_its_issuer() {
        let (cert, key) = mint().unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
        let signer = issuer(&key).unwrap();
        assert!(signer.key().serialize_pem() == key, "the issuer signs with the CA's own key");
        assert!(issuer(&mint().unwrap().0).is_err(), "a certificate is no key");
        assert_eq!(format!("{:?}", CaKey(key.clone())), "CaKey(..)");
        let (leaf, leaf_key) = leaf_pem(&key, "bench.test").unwrap();
        assert!(leaf.starts_with("-----BEGIN CERTIFICATE-----") && leaf_key.contains("PRIVATE KEY"), "{leaf}");
    }
}
