//! Newtype ids: names users type, and ids the host uses for paths.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The SSH user name that always means the control plane; no box may take it.
pub const CONTROL_USER: &str = "moat";

/// A name a user picks for a box or an image: a DNS label (1-63 of `a-z`, `0-9`,
/// `-`, not starting or ending with `-`). DNS labels are safe as path components,
/// host names and SSH user names alike.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Name(String);

/// Why a string is not a [`Name`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Empty or longer than 63 bytes.
    #[error("name {0:?} must be 1 to 63 characters long")]
    Length(String),
    /// A character outside `a-z0-9-`, or a leading or trailing `-`.
    #[error("name {0:?} may hold only a-z, 0-9 and '-', and may not start or end with '-'")]
    Charset(String),
}

impl Name {
    /// Validates `s` as a DNS label.
    pub fn new(s: &str) -> Result<Self, NameError> {
        if s.is_empty() || s.len() > 63 {
            return Err(NameError::Length(s.to_string()));
        }
        let ok_chars = s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok_chars || s.starts_with('-') || s.ends_with('-') {
            return Err(NameError::Charset(s.to_string()));
        }
        Ok(Self(s.to_string()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Name {
    type Error = NameError;
    fn try_from(s: String) -> Result<Self, NameError> {
        Self::new(&s)
    }
}

impl From<Name> for String {
    fn from(n: Name) -> String {
        n.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// An account: the SHA-256 fingerprint of the SSH key that owns it
/// (`SHA256:...`, as `ssh-keygen -l` prints it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AccountId(pub String);

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// A box's host-side identity: random, never reused, never chosen by a user, so it
/// is what paths, cgroups and logs are keyed by. Read from bytes (the store, the
/// gateway's messages) only through [`BoxId::parse`]: deserializing checks it too.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct BoxId(String);

/// Why a string is not a [`BoxId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a box id (1 to 32 hex digits)")]
pub struct BoxIdError(String);

impl BoxId {
    /// A fresh random id (16 hex digits).
    pub fn random() -> Self {
        let mut bytes = [0u8; 8];
        // The kernel's CSPRNG does not fail after boot; a zero id would still be unique
        // enough to be caught by the store's constraint.
        let _ = getrandom::fill(&mut bytes);
        Self(hex::encode(bytes))
    }

    /// Rebuilds an id read back from the store; only hex digits are accepted, so an
    /// id is always a safe path component.
    pub fn parse(s: &str) -> Option<Self> {
        (!s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_hexdigit())).then(|| Self(s.to_string()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for BoxId {
    type Error = BoxIdError;
    fn try_from(s: String) -> Result<Self, BoxIdError> {
        Self::parse(&s).ok_or(BoxIdError(s))
    }
}

impl From<BoxId> for String {
    fn from(id: BoxId) -> String {
        id.0
    }
}

impl AsRef<str> for BoxId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BoxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// The account warm boxes belong to until `new` takes one (no SSH key's
/// account id looks like it).
pub const WARM_ACCOUNT: &str = "moat:warm";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for good in ["web", "a", "web-2", "0day", &"x".repeat(63)] {
            assert!(Name::new(good).is_ok(), "{good}");
        }
        for bad in ["", "-web", "web-", "Web", "we_b", "we.b", "../x", "a b", &"x".repeat(64)] {
            assert!(Name::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn box_ids_are_hex_and_distinct() {
        let (a, b) = (BoxId::random(), BoxId::random());
        assert_ne!(a, b);
        assert_eq!(BoxId::parse(a.as_str()), Some(a.clone()));
        assert_eq!(BoxId::parse("../etc"), None);
        // Read from JSON as it is checked when parsed.
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, format!("\"{a}\""));
        assert_eq!(serde_json::from_str::<BoxId>(&json).unwrap(), a);
        for bad in ["\"../etc\"", "\"\"", "\"0123456789abcdef0123456789abcdef0\"", "7"] {
            assert!(serde_json::from_str::<BoxId>(bad).is_err(), "{bad}");
        }
    }
}
