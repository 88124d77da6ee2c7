//! Secrets: values a box may use but never holds. The box gets a placeholder
//! (random, its own, re-minted on dup); the gateway writes the real value
//! into one header of requests to one host, and only there. Values are
//! sealed at rest (ChaCha20-Poly1305, the key in a file of its own beside the
//! database) and opened only to hand them to the gateway.

use std::fmt;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use serde::{Deserialize, Serialize};

use crate::ids::{AccountId, Name};
use crate::policy::HostName;

/// Longest value accepted.
pub const MAX_VALUE: usize = 8 << 10;
/// Shortest value accepted: a response scrubbed of a short value would tell
/// a box whether its guess of the whole value was right.
pub const MIN_VALUE: usize = 16;
/// What a placeholder starts with (the rest is 40 random hex digits).
pub const PLACEHOLDER_PREFIX: &str = "moat-placeholder-";
/// Variables a secret may not be put in: the box's own plumbing, and those
/// that change how the programs it runs start (a placeholder in
/// `LD_PRELOAD` broke every dynamically linked program of the box).
const RESERVED_VARIABLES: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "TERM",
    "LANG",
    "PWD",
    "OLDPWD",
    "HOSTNAME",
    "MAIL",
    "TZ",
    "TMPDIR",
    "IFS",
    "ENV",
    "BASH_ENV",
    "PROMPT_COMMAND",
    "SHELLOPTS",
    "BASHOPTS",
    "CDPATH",
    "GLOBIGNORE",
    "PS1",
    "PS2",
    "PS3",
    "PS4",
    "GCONV_PATH",
    "GLIBC_TUNABLES",
    "NODE_OPTIONS",
    "NODE_PATH",
    "PERL5OPT",
    "PERL5LIB",
    "RUBYOPT",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
];
/// Prefixes of such variables (the loader's, the locale's, sshd's, malloc's, moat's).
const RESERVED_PREFIXES: &[&str] = &["LD_", "LC_", "SSH_", "MALLOC_", "MOAT_"];

/// Whether a secret may not be put in variable `name`.
fn reserved(name: &str) -> bool {
    RESERVED_VARIABLES.contains(&name) || RESERVED_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Whether two header names name the same header, as the servers that
/// read `_` as `-` (CGI, Rack, PHP) see it.
pub fn same_header(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes().zip(b.bytes()).all(|(x, y)| {
            let fold = |c: u8| if c == b'_' { b'-' } else { c.to_ascii_lowercase() };
            fold(x) == fold(y)
        })
}

/// A secret's value: never printed, never logged. A value that decodes is
/// checked as [`SecretValue::new`] checks one (it goes into HTTP headers).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SecretValue(String);

impl TryFrom<String> for SecretValue {
    type Error = SecretError;
    fn try_from(s: String) -> Result<Self, SecretError> {
        Self::new(&s)
    }
}

impl From<SecretValue> for String {
    fn from(v: SecretValue) -> String {
        v.0
    }
}

impl SecretValue {
    /// A value, checked: [`MIN_VALUE`] to [`MAX_VALUE`] bytes of printable
    /// ASCII (it goes into an HTTP header), surrounding whitespace dropped.
    pub fn new(text: &str) -> Result<Self, SecretError> {
        let text = text.trim();
        let printable = text.bytes().all(|b| (0x20..0x7f).contains(&b));
        if text.len() < MIN_VALUE || text.len() > MAX_VALUE || !printable {
            return Err(SecretError::BadValue);
        }
        Ok(Self(text.to_string()))
    }

    /// The value itself, for the one place that writes it into a request.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretValue(..)")
    }
}

/// Headers a secret may not be written into: written there, it would change
/// where the request goes or where it ends (or be dropped at the next hop).
const FRAMING_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "proxy-connection",
];

/// Why a secret or a change to it is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The value is empty, too long, or not printable ASCII.
    #[error("a secret's value is 16 to 8192 printable ASCII characters, on stdin")]
    BadValue,
    /// Not an HTTP header name.
    #[error("{0:?} is not an HTTP header name")]
    BadHeader(String),
    /// A header that frames or routes the request, or lives for one hop.
    #[error("{0:?} frames or routes the request (or lives for one hop): a secret cannot go there")]
    FramingHeader(String),
    /// A format without exactly one `{}`, or with characters a header cannot hold.
    #[error("{0:?} is not a format: printable ASCII with exactly one {{}} where the value goes")]
    BadFormat(String),
    /// Not a variable a secret may be put in.
    #[error("{0:?} is not a variable a secret may be put in (A-Z, 0-9, _; not PATH, HOME, LD_PRELOAD and the like)")]
    BadVariable(String),
    /// A limit of zero, or a period of none.
    #[error("a limit is a positive number; a period is like 60s, 1h or 1d")]
    BadLimit,
    /// The sealed value does not open (wrong key, or the row was edited).
    #[error("the secret's stored value does not open with this server's key")]
    Unsealable,
}

/// What a secret is, but its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretSpec {
    /// Its name (per account).
    pub name: Name,
    /// The one host it is sent to.
    pub host: HostName,
    /// The one header it is written into.
    pub header: String,
    /// How the header's value is made: `{}` is the secret (e.g. `Bearer {}`).
    pub format: String,
    /// The variable that holds the placeholder in a granted box.
    pub env: String,
}

impl SecretSpec {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), SecretError> {
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if self.header.is_empty() || self.header.len() > 64 || !self.header.bytes().all(token) {
            return Err(SecretError::BadHeader(self.header.clone()));
        }
        if FRAMING_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(&self.header)) {
            return Err(SecretError::FramingHeader(self.header.clone()));
        }
        let printable = self.format.bytes().all(|b| (0x20..0x7f).contains(&b));
        if self.format.matches("{}").count() != 1 || !printable || self.format.len() > 256 {
            return Err(SecretError::BadFormat(self.format.clone()));
        }
        let first_ok = self.env.bytes().next().is_some_and(|b| b.is_ascii_uppercase() || b == b'_');
        let rest_ok = self.env.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if !first_ok || !rest_ok || self.env.len() > 64 || reserved(&self.env) {
            return Err(SecretError::BadVariable(self.env.clone()));
        }
        Ok(())
    }

    /// The variable a secret named `name` is put in unless told: its name in
    /// upper case, `-` as `_`.
    pub fn default_env(name: &Name) -> String {
        name.as_str().to_ascii_uppercase().replace('-', "_")
    }
}

/// What a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitKind {
    /// Requests the value was written into.
    Requests,
    /// LLM tokens the host reported using for them.
    Tokens,
    /// Bytes both ways of those requests and their responses.
    Bytes,
}

impl LimitKind {
    /// Its name, as the commands spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
            Self::Bytes => "bytes",
        }
    }
}

/// One limit: at most `amount` of `kind` per `per_secs` (ever, without).
/// One that decodes is checked as [`Limit::new`] checks one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "LimitFields")]
pub struct Limit {
    /// What it counts.
    pub kind: LimitKind,
    /// How many.
    pub amount: u64,
    /// Over how long a window, in seconds (`None`: in all).
    pub per_secs: Option<u64>,
}

/// A limit's fields as they decode, before they are checked.
#[derive(Deserialize)]
struct LimitFields {
    kind: LimitKind,
    amount: u64,
    per_secs: Option<u64>,
}

impl TryFrom<LimitFields> for Limit {
    type Error = SecretError;
    fn try_from(f: LimitFields) -> Result<Self, SecretError> {
        Self::new(f.kind, f.amount, f.per_secs)
    }
}

impl Limit {
    /// A limit, checked.
    pub fn new(kind: LimitKind, amount: u64, per_secs: Option<u64>) -> Result<Self, SecretError> {
        if amount == 0 || per_secs == Some(0) {
            return Err(SecretError::BadLimit);
        }
        Ok(Self { kind, amount, per_secs })
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.amount, self.kind.as_str())?;
        if let Some(per) = self.per_secs {
            write!(f, " per {per}s")?;
        }
        Ok(())
    }
}

/// What a secret was used for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretUse {
    /// Requests it was written into.
    pub requests: u64,
    /// LLM tokens the host reported.
    pub tokens: u64,
    /// Bytes both ways.
    pub bytes: u64,
}

impl SecretUse {
    /// How much of `kind`.
    pub fn of(&self, kind: LimitKind) -> u64 {
        match kind {
            LimitKind::Requests => self.requests,
            LimitKind::Tokens => self.tokens,
            LimitKind::Bytes => self.bytes,
        }
    }
}

/// A limit that applies to one box's use, or to every box's together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopedLimit {
    /// The box (`None`: all together).
    pub box_name: Option<Name>,
    /// The limit.
    pub limit: Limit,
}

/// A secret as its owner sees it: never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretInfo {
    /// What it is.
    pub spec: SecretSpec,
    /// Whether `secret kill` stopped it.
    pub killed: bool,
    /// The boxes it is granted to.
    pub boxes: Vec<Name>,
    /// Its limits.
    pub limits: Vec<ScopedLimit>,
    /// Use per box (boxes since removed included), and in all.
    pub used: Vec<(String, SecretUse)>,
}

/// A secret as the gateway gets it for one box.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoxSecret {
    /// The secret's number (shared by every box it is granted to).
    pub id: i64,
    /// Its name.
    pub name: String,
    /// The host.
    pub host: HostName,
    /// The header.
    pub header: String,
    /// The header's value, `{}` the secret.
    pub format: String,
    /// This box's placeholder.
    pub placeholder: String,
    /// The value.
    pub value: SecretValue,
    /// Stopped by `secret kill`: every use is refused.
    pub killed: bool,
    /// Limits on every box's use together, with that use so far.
    pub shared_limits: Vec<Limit>,
    /// Limits on this box's use, with this box's use so far.
    pub own_limits: Vec<Limit>,
    /// Every box's use so far (for limits without a period).
    pub used_by_all: SecretUse,
    /// This box's use so far.
    pub used_by_box: SecretUse,
}

/// A new placeholder: unguessable, and recognisable as one.
pub fn new_placeholder() -> String {
    let mut bytes = [0u8; 20];
    // getrandom only fails before the kernel's pool is ready, long past here.
    let _ = getrandom::fill(&mut bytes);
    format!("{PLACEHOLDER_PREFIX}{}", hex::encode(bytes))
}

/// Seals and opens values with the server's key.
pub struct Sealer(LessSafeKey);

impl Sealer {
    /// A sealer with a 32-byte key.
    pub fn new(key: &[u8; 32]) -> Result<Self, SecretError> {
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, key).map_err(|_| SecretError::Unsealable)?;
        Ok(Self(LessSafeKey::new(unbound)))
    }

    /// `value` sealed for `account`'s secret `name` (a row moved to another
    /// secret does not open).
    pub fn seal(&self, account: &AccountId, name: &Name, value: &SecretValue) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        let _ = getrandom::fill(&mut nonce);
        let mut data = value.0.as_bytes().to_vec();
        let aad = format!("{}\0{}", account.0, name);
        // Sealing fails only for inputs of more than 256 GiB.
        let _ =
            self.0.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad.as_bytes()), &mut data);
        let mut out = nonce.to_vec();
        out.extend(data);
        out
    }

    /// Opens what [`seal`](Self::seal) made.
    pub fn open(&self, account: &AccountId, name: &Name, sealed: &[u8]) -> Result<SecretValue, SecretError> {
        let (nonce, data) = sealed.split_at_checked(NONCE_LEN).ok_or(SecretError::Unsealable)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SecretError::Unsealable)?;
        let aad = format!("{}\0{}", account.0, name);
        let mut data = data.to_vec();
        let plain =
            self.0.open_in_place(nonce, Aad::from(aad.as_bytes()), &mut data).map_err(|_| SecretError::Unsealable)?;
        let text = std::str::from_utf8(plain).map_err(|_| SecretError::Unsealable)?;
        Ok(SecretValue(text.to_string()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec() -> SecretSpec {
        SecretSpec {
            name: Name::new("anthropic").unwrap(),
            host: HostName::parse("api.anthropic.com").unwrap(),
            header: "x-api-key".into(),
            format: "{}".into(),
            env: "ANTHROPIC_API_KEY".into(),
        }
    }

    #[test]
    fn specs_are_checked() {
        assert!(spec().validate().is_ok());
        let bad = [
            SecretSpec { header: "x api".into(), ..spec() },
            SecretSpec { header: "x-api:".into(), ..spec() },
            SecretSpec { header: "Host".into(), ..spec() },
            SecretSpec { header: "content-length".into(), ..spec() },
            SecretSpec { header: "Transfer-Encoding".into(), ..spec() },
            SecretSpec { format: "Bearer".into(), ..spec() },
            SecretSpec { format: "{} {}".into(), ..spec() },
            SecretSpec { format: "Bearer {}\r\nX-Evil: 1".into(), ..spec() },
            SecretSpec { env: "PATH".into(), ..spec() },
            SecretSpec { env: "LD_PRELOAD".into(), ..spec() },
            SecretSpec { env: "BASH_ENV".into(), ..spec() },
            SecretSpec { env: "SSH_CONNECTION".into(), ..spec() },
            SecretSpec { env: "IFS".into(), ..spec() },
            SecretSpec { env: "1X".into(), ..spec() },
            SecretSpec { env: "lower".into(), ..spec() },
        ];
        for s in bad {
            assert!(s.validate().is_err(), "{s:?}");
        }
        assert!(SecretValue::new("sk-1\r\nX: y").is_err() && SecretValue::new("  ").is_err());
        assert!(SecretValue::new("sk-too-short").is_err());
        assert_eq!(SecretValue::new(" sk-abc-0123456789\n").unwrap().expose(), "sk-abc-0123456789");
        assert_eq!(format!("{:?}", SecretValue::new("sk-abc-0123456789").unwrap()), "SecretValue(..)");
        assert_eq!(SecretSpec::default_env(&Name::new("my-key").unwrap()), "MY_KEY");
        // A variable that merely starts like one reserved is the owner's.
        assert!(SecretSpec { env: "LDAP_TOKEN".into(), ..spec() }.validate().is_ok());
    }

    #[test]
    fn sealed_values_open_only_where_they_were_sealed() {
        let sealer = Sealer::new(&[7; 32]).unwrap();
        let (alice, bob) = (AccountId("a".into()), AccountId("b".into()));
        let name = Name::new("k").unwrap();
        let value = SecretValue::new("sk-secret-0123456789").unwrap();
        let sealed = sealer.seal(&alice, &name, &value);
        assert!(!sealed.windows(9).any(|w| w == b"sk-secret"));
        assert_eq!(sealer.open(&alice, &name, &sealed).unwrap(), value);
        assert!(sealer.open(&bob, &name, &sealed).is_err());
        assert!(Sealer::new(&[8; 32]).unwrap().open(&alice, &name, &sealed).is_err());
        assert!(sealer.open(&alice, &name, &sealed[..5]).is_err());
        let p = new_placeholder();
        assert!(
            p.starts_with(PLACEHOLDER_PREFIX) && p.len() == PLACEHOLDER_PREFIX.len() + 40 && p != new_placeholder()
        );
    }

    #[test]
    fn values_and_limits_that_decode_are_checked() {
        let value = SecretValue::new("sk-REAL-0123456789").unwrap();
        let json = serde_json::to_string(&value).unwrap();
        assert_eq!(serde_json::from_str::<SecretValue>(&json).unwrap(), value);
        for bad in [r#""short""#, r#""sk-REAL-0123456789\r\nx-evil: 1""#, r#""""#] {
            assert!(serde_json::from_str::<SecretValue>(bad).is_err(), "{bad}");
        }
        let limit = Limit::new(LimitKind::Requests, 10, Some(60)).unwrap();
        let json = serde_json::to_string(&limit).unwrap();
        assert_eq!(serde_json::from_str::<Limit>(&json).unwrap(), limit);
        for bad in [r#"{"kind":"requests","amount":0,"per_secs":60}"#, r#"{"kind":"tokens","amount":5,"per_secs":0}"#] {
            assert!(serde_json::from_str::<Limit>(bad).is_err(), "{bad}");
        }
    }
}
