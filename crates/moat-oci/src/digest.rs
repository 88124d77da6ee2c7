//! Content addresses (`sha256:HEX`) and the chain ids layers are kept under.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// A SHA-256 content address, `sha256:` and 64 lowercase hex digits. Only
/// SHA-256 is accepted: it is what every registry serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

/// Why a string is not a [`Digest`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a sha256 digest")]
pub struct DigestError(pub String);

impl Digest {
    /// Parses `sha256:HEX`.
    pub fn parse(s: &str) -> Result<Self, DigestError> {
        let hex = s.strip_prefix("sha256:").ok_or_else(|| DigestError(shorten(s)))?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(DigestError(shorten(s)));
        }
        Ok(Self(s.to_string()))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self::from_hasher(Sha256::new_with_prefix(bytes))
    }

    /// The digest a hasher fed with the content holds.
    pub fn from_hasher(hasher: Sha256) -> Self {
        Self(format!("sha256:{}", hex::encode(hasher.finalize())))
    }

    /// The 64 hex digits: a safe path component.
    pub fn hex(&self) -> &str {
        self.0.strip_prefix("sha256:").unwrap_or(&self.0)
    }

    /// The whole address.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 12 hex digits, as people read a digest.
    pub fn short(&self) -> &str {
        self.hex().get(..12).unwrap_or(self.hex())
    }
}

fn shorten(s: &str) -> String {
    s.chars().take(80).collect()
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Digest {
    type Error = DigestError;
    fn try_from(s: String) -> Result<Self, DigestError> {
        Self::parse(&s)
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

/// The keys layers are kept under, one per layer of `blobs` (bottom first):
/// the first is its blob's digest, each next `sha256(parent + " " + blob)`, the
/// OCI chain id's rule. It is computed over the compressed blobs' digests, which
/// the daemon checks itself, rather than the config's diff ids, which only the
/// confined unpacker can check: a layer shared between accounts is keyed by
/// what the trusted side saw.
pub fn chain(blobs: &[Digest]) -> Vec<Digest> {
    let mut out: Vec<Digest> = Vec::with_capacity(blobs.len());
    for blob in blobs {
        let next = match out.last() {
            None => blob.clone(),
            Some(parent) => Digest::of(format!("{parent} {blob}").as_bytes()),
        };
        out.push(next);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_strictly() {
        let d = Digest::of(b"");
        assert_eq!(d.as_str(), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(Digest::parse(d.as_str()).unwrap(), d);
        assert_eq!(d.short(), "e3b0c44298fc");
        for bad in [
            "",
            "sha256:",
            "sha512:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85",
            "sha256:../../../../etc/passwd/../../../../../../../../../../../../../../",
        ] {
            assert!(Digest::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn chains_follow_the_oci_rule() {
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let c = chain(&[a.clone(), b.clone()]);
        assert_eq!(c[0], a);
        assert_eq!(c[1], Digest::of(format!("{a} {b}").as_bytes()));
        // A shared base keeps its keys whatever comes on top.
        assert_eq!(chain(std::slice::from_ref(&a))[0], c[0]);
        assert_ne!(chain(&[b, a])[1], c[1]);
    }
}
