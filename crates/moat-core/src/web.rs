//! Web URLs: a box's port reached at `https://PORT-NAME-OWNER.DOMAIN`, what
//! the HTTP edge and the privileged side agree on. The edge parses a request's
//! `Host` into a [`WebHost`]; the privileged side decides from it (and the
//! visitor's cookie) whether the request reaches the box ([`WebVerdict`]).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{AccountId, Name};

/// How many hex digits of an account's fingerprint hash make its slug: 40
/// bits, so that two accounts sharing one is as unlikely as it needs to be
/// for a name both use (the lookup is by name and slug together).
const OWNER_DIGITS: usize = 10;

/// An account as it appears in URLs: a short, stable, lowercase slug of its
/// id (never the id itself, which holds `:` and `/` and mixed case).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Owner(String);

/// Why a string is not an [`Owner`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an owner (10 lowercase hex digits)")]
pub struct OwnerError(String);

impl Owner {
    /// The slug of `account`.
    pub fn of(account: &AccountId) -> Self {
        let digest = ring::digest::digest(&ring::digest::SHA256, account.0.as_bytes());
        let mut hex = hex::encode(digest.as_ref());
        hex.truncate(OWNER_DIGITS);
        Self(hex)
    }

    /// Validates a slug as typed or decoded.
    pub fn parse(s: &str) -> Result<Self, OwnerError> {
        let ok = s.len() == OWNER_DIGITS && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        ok.then(|| Self(s.to_string())).ok_or_else(|| OwnerError(s.to_string()))
    }

    /// The slug as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Owner {
    type Error = OwnerError;
    fn try_from(s: String) -> Result<Self, OwnerError> {
        Self::parse(&s)
    }
}

impl From<Owner> for String {
    fn from(o: Owner) -> String {
        o.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which box port a URL names: the first label of its host, `PORT-NAME-OWNER`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebHost {
    /// The port in the box.
    pub port: u16,
    /// The box.
    pub name: Name,
    /// Whose box.
    pub owner: Owner,
}

/// Why a host label names no box port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    /// Not `PORT-NAME-OWNER`.
    #[error("not PORT-NAME-OWNER")]
    Shape,
    /// Longer than a DNS label may be.
    #[error("{0} bytes: a DNS label holds at most 63")]
    TooLong(usize),
}

/// The longest DNS label.
pub const MAX_LABEL: usize = 63;

impl WebHost {
    /// The host's first label, `PORT-NAME-OWNER` (a DNS label only if at most
    /// [`MAX_LABEL`] bytes: [`WebHost::label_fits`]).
    pub fn label(&self) -> String {
        format!("{}-{}-{}", self.port, self.name, self.owner)
    }

    /// Whether [`WebHost::label`] is a DNS label (a long box name may leave no
    /// room for the port and owner).
    pub fn label_fits(&self) -> Result<(), LabelError> {
        let len = self.label().len();
        if len > MAX_LABEL {
            return Err(LabelError::TooLong(len));
        }
        Ok(())
    }

    /// Reads a label as [`WebHost::label`] writes it (lowercase; a port
    /// without leading zeros, not 0).
    pub fn parse_label(label: &str) -> Result<Self, LabelError> {
        if label.len() > MAX_LABEL {
            return Err(LabelError::TooLong(label.len()));
        }
        let (port, rest) = label.split_once('-').ok_or(LabelError::Shape)?;
        let (name, owner) = rest.rsplit_once('-').ok_or(LabelError::Shape)?;
        let digits = !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && !port.starts_with('0');
        let port: u16 = match digits {
            true => port.parse().map_err(|_| LabelError::Shape)?,
            false => return Err(LabelError::Shape),
        };
        let name = Name::new(name).map_err(|_| LabelError::Shape)?;
        let owner = Owner::parse(owner).map_err(|_| LabelError::Shape)?;
        Ok(Self { port, name, owner })
    }
}

impl fmt::Display for WebHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// One exposed port of a box, as `urls` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exposure {
    /// The box.
    pub name: Name,
    /// Whose box (its slug).
    pub owner: Owner,
    /// The port in the box.
    pub port: u16,
    /// Reached without signing in.
    pub public: bool,
    /// Its URL (`https://PORT-NAME-OWNER.DOMAIN`), if this server has an HTTP edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Shared with you by its owner (not one of your boxes).
    #[serde(default)]
    pub shared: bool,
}

/// Why a web request does not reach a box: each is a page the edge shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum WebRefusal {
    /// No such box, or the port is not exposed (404; the same page for both,
    /// so that a URL tells a stranger nothing).
    #[error("nothing is served here")]
    NotFound,
    /// A private URL and no valid sign-in (401).
    #[error("sign in with a link from 'url NAME PORT'")]
    SignIn,
    /// Signed in, but as an account the box is not shared with (401 too).
    #[error("the box is not shared with your key")]
    NotShared,
    /// A sign-in link that is unknown, used, or expired (401).
    #[error("this sign-in link was used already or has expired")]
    LinkSpent,
    /// The box is stopped (503): `start` boots it.
    #[error("the box is stopped")]
    Stopped,
    /// The box is being made, or is busy with an operation that holds it (503).
    #[error("the box is busy")]
    Busy,
}

/// What the privileged side says about a web request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebVerdict {
    /// It may reach the box port, on behalf of `who` (an account, or
    /// `public`).
    Allow {
        /// Who the visitor is, as the log shows it.
        who: String,
    },
    /// It may not.
    Refuse(WebRefusal),
}

/// A sign-in link's secret or a session cookie's value: random, URL-safe,
/// never shown in logs.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WebSecret(pub String);

impl fmt::Debug for WebSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebSecret([redacted])")
    }
}

impl WebSecret {
    /// A new one: 32 random bytes, as hex.
    pub fn random() -> Self {
        let mut bytes = [0u8; 32];
        // The kernel's CSPRNG does not fail after boot.
        let _ = getrandom::fill(&mut bytes);
        Self(hex::encode(bytes))
    }

    /// Whether `s` could be one (what the edge checks before asking).
    pub fn plausible(s: &str) -> bool {
        s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
    }
}

/// One request through the edge, for the box's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebRequestLog {
    /// When it began (ms since the epoch).
    pub at_ms: u64,
    /// Method.
    pub method: String,
    /// Path (and query), cut to [`MAX_LOGGED_PATH`].
    pub path: String,
    /// The status answered.
    pub status: u16,
    /// Bytes of request body.
    pub received: u64,
    /// Bytes of response body.
    pub sent: u64,
    /// Milliseconds until the response ended.
    pub ms: u64,
    /// Who (an account, or `public`).
    pub who: String,
}

/// The longest path a log entry keeps.
pub const MAX_LOGGED_PATH: usize = 512;

#[cfg(test)]
mod tests {
    use super::*;

    fn host(port: u16, name: &str) -> WebHost {
        WebHost { port, name: Name::new(name).unwrap(), owner: Owner::of(&AccountId("SHA256:abc".into())) }
    }

    #[test]
    fn labels_read_back_and_nothing_else_does() {
        for h in [host(3000, "web"), host(1, "a-b-c"), host(65535, "x")] {
            assert_eq!(WebHost::parse_label(&h.label()).unwrap(), h);
        }
        let owner = Owner::of(&AccountId("SHA256:abc".into()));
        for bad in [
            String::new(),
            "web".into(),
            format!("3000-{owner}"),
            format!("03000-web-{owner}"),
            format!("0-web-{owner}"),
            format!("65536-web-{owner}"),
            format!("+1-web-{owner}"),
            format!("3000-Web-{owner}"),
            format!("3000-web-{}", owner.as_str().to_uppercase()),
            format!("3000--{owner}"),
            "3000-web-abc".into(),
            format!("3000-{}-{owner}", "x".repeat(60)),
        ] {
            assert!(WebHost::parse_label(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn owners_are_stable_and_distinct() {
        let (a, b) = (AccountId("SHA256:a".into()), AccountId("SHA256:b".into()));
        assert_eq!(Owner::of(&a), Owner::of(&a));
        assert_ne!(Owner::of(&a), Owner::of(&b));
        assert!(Owner::parse(Owner::of(&a).as_str()).is_ok());
        assert!(serde_json::from_str::<Owner>("\"../etc/pas\"").is_err());
    }

    #[test]
    fn long_names_leave_no_room() {
        assert!(host(3000, &"x".repeat(40)).label_fits().is_ok());
        assert!(host(3000, &"x".repeat(60)).label_fits().is_err());
    }
}
