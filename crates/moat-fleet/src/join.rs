//! `moat fleet init`, `token` and `join`: how a host becomes a member.
//!
//! `init` makes the fleet's CA (its key stays in the operator's state dir),
//! the fleet's SSH host key and the fleet key: 32 bytes that seal the host
//! key in the store and are every node's secrets key. `token` issues a
//! certificate for a named node or front door, registers its serial, and
//! prints a token carrying all a member needs (the store's DSN, the CA's
//! certificate, the member's certificate and key, the fleet key); `join`
//! claims the serial once (a second use of a token is refused) and writes
//! the member's state dir:
//!
//! ```text
//! DIR/fleet.json      {"store": DSN, "member": {"role", "name", "serial"}}   0600
//! DIR/fleet-ca.pem    the fleet CA's certificate
//! DIR/fleet.pem       the member's certificate
//! DIR/fleet-key.pem   the member's key                                     0600
//! DIR/fleet.key       the fleet key (32 bytes)                             0600
//! ```
//!
//! The init dir holds `fleet.json` (no member), `fleet-ca.pem`,
//! `fleet-ca.key` (0600) and `fleet.key`.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use base64::Engine;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use serde::{Deserialize, Serialize};

use crate::pki::{Ca, PkiError, Role};
use crate::store::{FleetAdmin, StoreFailure};
use crate::tls::{Identity, TlsError};

/// What every token starts with.
const TOKEN_PREFIX: &str = "moat-join-";
/// The fleet setting holding the CA's certificate.
pub const SETTING_CA: &str = "ca_cert";
/// The fleet setting holding the sealed SSH host key.
pub const SETTING_HOST_KEY: &str = "host_key";
/// What the host key is sealed for (another sealed value does not open as it).
const HOST_KEY_AAD: &[u8] = b"moat fleet ssh host key";

/// A failure of `init`, `token`, `join`, or reading a member's state dir.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreFailure),
    /// Making a certificate failed.
    #[error(transparent)]
    Pki(#[from] PkiError),
    /// A PEM did not read.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A file.
    #[error("{path}: {source}")]
    File {
        /// Which.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not a token `moat fleet token` printed.
    #[error("not a moat join token ({0})")]
    Token(String),
    /// Already done.
    #[error("{0}")]
    Already(String),
    /// The sealed host key does not open with this fleet key.
    #[error("the fleet's host key does not open with this fleet key (another fleet's?)")]
    Unsealable,
    /// A file of the state dir that is not what it should be.
    #[error("{path}: {detail}")]
    Corrupt {
        /// Which.
        path: PathBuf,
        /// Why.
        detail: String,
    },
}

/// The fleet key: seals the host key, and is every node's secrets key.
#[derive(Clone)]
pub struct FleetKey(pub [u8; 32]);

impl fmt::Debug for FleetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FleetKey([redacted])")
    }
}

impl FleetKey {
    fn aead(&self) -> Result<LessSafeKey, JoinError> {
        let key = UnboundKey::new(&CHACHA20_POLY1305, &self.0).map_err(|_| JoinError::Unsealable)?;
        Ok(LessSafeKey::new(key))
    }

    /// The host key (OpenSSH text) sealed: nonce, then ciphertext and tag.
    pub fn seal_host_key(&self, host_key: &str) -> Result<Vec<u8>, JoinError> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| JoinError::Pki(PkiError::Random(e.to_string())))?;
        let mut data = host_key.as_bytes().to_vec();
        self.aead()?
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(HOST_KEY_AAD), &mut data)
            .map_err(|_| JoinError::Unsealable)?;
        Ok([nonce.as_slice(), &data].concat())
    }

    /// Opens what [`seal_host_key`](Self::seal_host_key) made.
    pub fn open_host_key(&self, sealed: &[u8]) -> Result<String, JoinError> {
        let (nonce, data) = sealed.split_at_checked(NONCE_LEN).ok_or(JoinError::Unsealable)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| JoinError::Unsealable)?;
        let mut data = data.to_vec();
        let plain =
            self.aead()?.open_in_place(nonce, Aad::from(HOST_KEY_AAD), &mut data).map_err(|_| JoinError::Unsealable)?;
        String::from_utf8(plain.to_vec()).map_err(|_| JoinError::Unsealable)
    }
}

/// Which member a state dir is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberConfig {
    /// Node or front door.
    pub role: Role,
    /// Its name.
    pub name: String,
    /// Its certificate's serial.
    pub serial: String,
}

/// `fleet.json`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetConfig {
    /// The store's DSN (holds its password: the file is 0600).
    pub store: String,
    /// The member this dir is, once joined.
    pub member: Option<MemberConfig>,
}

impl fmt::Debug for FleetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetConfig").field("store", &"[redacted]").field("member", &self.member).finish()
    }
}

/// What a join token carries.
#[derive(Clone, Serialize, Deserialize)]
pub struct Token {
    /// The store's DSN.
    pub store: String,
    /// The member it makes.
    pub member: MemberConfig,
    /// The fleet CA's certificate (PEM).
    pub ca: String,
    /// The member's certificate (PEM).
    pub cert: String,
    /// The member's key (PEM).
    pub key: String,
    /// The fleet key, hex.
    pub fleet_key: String,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token").field("member", &self.member).finish_non_exhaustive()
    }
}

impl Token {
    /// As printed: one word.
    pub fn encode(&self) -> Result<String, JoinError> {
        let json = serde_json::to_vec(self).map_err(|e| JoinError::Token(e.to_string()))?;
        Ok(format!("{TOKEN_PREFIX}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)))
    }

    /// Reads a printed token.
    pub fn decode(text: &str) -> Result<Self, JoinError> {
        let body = text.trim().strip_prefix(TOKEN_PREFIX).ok_or_else(|| JoinError::Token("no prefix".into()))?;
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|e| JoinError::Token(e.to_string()))?;
        serde_json::from_slice(&json).map_err(|e| JoinError::Token(e.to_string()))
    }

    fn fleet_key(&self) -> Result<FleetKey, JoinError> {
        let bytes = hex::decode(&self.fleet_key).map_err(|e| JoinError::Token(e.to_string()))?;
        Ok(FleetKey(bytes.try_into().map_err(|_| JoinError::Token("the fleet key is not 32 bytes".into()))?))
    }
}

/// Writes `bytes` to a new file `dir/name` with `mode`.
fn write_new(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> Result<(), JoinError> {
    let path = dir.join(name);
    let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&path);
    file.and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .map_err(|source| JoinError::File { path, source })
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>, JoinError> {
    let path = dir.join(name);
    std::fs::read(&path).map_err(|source| JoinError::File { path, source })
}

fn read_text(dir: &Path, name: &str) -> Result<String, JoinError> {
    String::from_utf8(read(dir, name)?)
        .map_err(|_| JoinError::Corrupt { path: dir.join(name), detail: "not text".into() })
}

fn json<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> Result<T, JoinError> {
    serde_json::from_slice(&read(dir, name)?)
        .map_err(|e| JoinError::Corrupt { path: dir.join(name), detail: e.to_string() })
}

fn fleet_key(dir: &Path) -> Result<FleetKey, JoinError> {
    let bytes = read(dir, "fleet.key")?;
    let key = bytes
        .try_into()
        .map_err(|_| JoinError::Corrupt { path: dir.join("fleet.key"), detail: "not 32 bytes".into() })?;
    Ok(FleetKey(key))
}

/// Makes a fleet in `store` (reached by `dsn`), its CA's key in `dir`, with
/// `host_key` (OpenSSH text) as the host key every front door presents.
pub fn init(store: &impl FleetAdmin, dsn: &str, dir: &Path, host_key: &str) -> Result<(), JoinError> {
    if store.setting(SETTING_CA)?.is_some() {
        return Err(JoinError::Already("this store already holds a fleet (its CA is in fleet_settings)".into()));
    }
    if dir.join("fleet-ca.key").exists() {
        return Err(JoinError::Already(format!("{} already holds a fleet CA", dir.display())));
    }
    let ca = Ca::mint()?;
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| JoinError::Pki(PkiError::Random(e.to_string())))?;
    let key = FleetKey(key);
    let config = FleetConfig { store: dsn.to_string(), member: None };
    let config = serde_json::to_vec_pretty(&config).map_err(|e| JoinError::Token(e.to_string()))?;
    // Files first: a store with a CA nobody holds the key of is a dead end.
    write_new(dir, "fleet-ca.key", ca.key_pem().as_bytes(), 0o600)?;
    write_new(dir, "fleet-ca.pem", ca.cert_pem().as_bytes(), 0o644)?;
    write_new(dir, "fleet.key", &key.0, 0o600)?;
    write_new(dir, "fleet.json", &config, 0o600)?;
    store.set_setting(SETTING_HOST_KEY, &key.seal_host_key(host_key)?)?;
    store.set_setting(SETTING_CA, ca.cert_pem().as_bytes())?;
    Ok(())
}

/// The DSN `init` wrote in `dir` (for `token` without `--store`).
pub fn admin_store(dir: &Path) -> Result<String, JoinError> {
    Ok(json::<FleetConfig>(dir, "fleet.json")?.store)
}

/// Issues a member `name` of `role` from the CA in `dir` and registers it;
/// the token that joins it.
pub fn token(store: &impl FleetAdmin, dir: &Path, role: Role, name: &str) -> Result<String, JoinError> {
    let config: FleetConfig = json(dir, "fleet.json")?;
    let ca = Ca::load(&read_text(dir, "fleet-ca.pem")?, &read_text(dir, "fleet-ca.key")?)?;
    let leaf = ca.issue(role, name)?;
    store.register_member(&leaf.serial, role, name)?;
    Token {
        store: config.store,
        member: MemberConfig { role, name: name.to_string(), serial: leaf.serial },
        ca: ca.cert_pem().to_string(),
        cert: leaf.cert.pem(),
        key: leaf.key.serialize_pem(),
        fleet_key: hex::encode(fleet_key(dir)?.0),
    }
    .encode()
}

/// Joins with `token` (its store is `store`), writing the member's files
/// into `dir`.
pub fn join(store: &impl FleetAdmin, token: &Token, dir: &Path) -> Result<(), JoinError> {
    if dir.join("fleet-key.pem").exists() {
        return Err(JoinError::Already(format!("{} already holds a fleet member's key", dir.display())));
    }
    // Checked before the token is spent.
    Identity::from_pem(&token.ca, &token.cert, &token.key)?;
    let key = token.fleet_key()?;
    if let Ok(existing) = fleet_key(dir) {
        if existing.0 != key.0 {
            return Err(JoinError::Already(format!("{} holds another fleet's key", dir.join("fleet.key").display())));
        }
    }
    store.claim_member(&token.member.serial).map_err(|e| {
        JoinError::Already(format!("this token cannot join {} {} ({e})", token.member.role.as_str(), token.member.name))
    })?;
    let config = FleetConfig { store: token.store.clone(), member: Some(token.member.clone()) };
    let config = serde_json::to_vec_pretty(&config).map_err(|e| JoinError::Token(e.to_string()))?;
    write_new(dir, "fleet-ca.pem", token.ca.as_bytes(), 0o644).or_else(|e| {
        match dir.join("fleet-ca.pem").exists() {
            true => Ok(()),
            false => Err(e),
        }
    })?;
    write_new(dir, "fleet.pem", token.cert.as_bytes(), 0o644)?;
    write_new(dir, "fleet-key.pem", token.key.as_bytes(), 0o600)?;
    if !dir.join("fleet.key").exists() {
        write_new(dir, "fleet.key", &key.0, 0o600)?;
    }
    let path = dir.join("fleet.json");
    let _ = std::fs::remove_file(&path);
    write_new(dir, "fleet.json", &config, 0o600)
}

/// A joined member's state dir as one message (what a token carried): how
/// `moat front` hands it to its router, which opens no files.
pub fn read_member(dir: &Path) -> Result<Token, JoinError> {
    let config: FleetConfig = json(dir, "fleet.json")?;
    let member = config.member.ok_or_else(|| JoinError::Corrupt {
        path: dir.join("fleet.json"),
        detail: "no member: run `moat fleet join TOKEN --state-dir DIR` first".into(),
    })?;
    Ok(Token {
        store: config.store,
        member,
        ca: read_text(dir, "fleet-ca.pem")?,
        cert: read_text(dir, "fleet.pem")?,
        key: read_text(dir, "fleet-key.pem")?,
        fleet_key: hex::encode(fleet_key(dir)?.0),
    })
}

/// A joined member's state dir, read.
#[derive(Debug)]
pub struct FleetDir {
    /// `fleet.json`.
    pub config: FleetConfig,
    /// Which member it is.
    pub member: MemberConfig,
    /// Its TLS identity.
    pub identity: Identity,
    /// The fleet key.
    pub fleet_key: FleetKey,
}

impl FleetDir {
    /// Reads the member state dir `dir` (made by [`join`]).
    pub fn load(dir: &Path) -> Result<Self, JoinError> {
        Self::from_token(&read_member(dir)?)
    }

    /// The member a token (or [`read_member`]) describes.
    pub fn from_token(token: &Token) -> Result<Self, JoinError> {
        Ok(Self {
            config: FleetConfig { store: token.store.clone(), member: Some(token.member.clone()) },
            member: token.member.clone(),
            identity: Identity::from_pem(&token.ca, &token.cert, &token.key)?,
            fleet_key: token.fleet_key()?,
        })
    }

    /// The fleet's SSH host key (OpenSSH text), unsealed from the store.
    pub fn host_key(&self, store: &impl FleetAdmin) -> Result<String, JoinError> {
        let sealed = store.setting(SETTING_HOST_KEY)?.ok_or_else(|| {
            JoinError::Store(StoreFailure("the store holds no fleet host key (run `moat fleet init`)".into()))
        })?;
        self.fleet_key.open_host_key(&sealed)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Admin {
        settings: Mutex<HashMap<String, Vec<u8>>>,
        members: Mutex<HashMap<String, (Role, String, bool)>>,
    }

    impl FleetAdmin for Admin {
        fn setting(&self, name: &str) -> Result<Option<Vec<u8>>, StoreFailure> {
            Ok(self.settings.lock().unwrap().get(name).cloned())
        }
        fn set_setting(&self, name: &str, value: &[u8]) -> Result<(), StoreFailure> {
            self.settings.lock().unwrap().insert(name.into(), value.to_vec());
            Ok(())
        }
        fn register_member(&self, serial: &str, role: Role, name: &str) -> Result<(), StoreFailure> {
            self.members.lock().unwrap().insert(serial.into(), (role, name.into(), false));
            Ok(())
        }
        fn claim_member(&self, serial: &str) -> Result<(), StoreFailure> {
            match self.members.lock().unwrap().get_mut(serial) {
                Some((_, _, joined @ false)) => {
                    *joined = true;
                    Ok(())
                }
                _ => Err(StoreFailure("already joined".into())),
            }
        }
    }

    const HOST_KEY: &str =
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n";

    #[test]
    fn init_token_join_make_a_member_once() {
        let admin_dir = tempfile::tempdir().unwrap();
        let node_dir = tempfile::tempdir().unwrap();
        let store = Admin::default();
        init(&store, "postgres://moat:pw@127.0.0.1:5432/moat", admin_dir.path(), HOST_KEY).unwrap();
        assert!(matches!(init(&store, "x", admin_dir.path(), HOST_KEY), Err(JoinError::Already(_))));
        assert_eq!(admin_store(admin_dir.path()).unwrap(), "postgres://moat:pw@127.0.0.1:5432/moat");

        let text = token(&store, admin_dir.path(), Role::Node, "n1").unwrap();
        assert!(text.starts_with(TOKEN_PREFIX) && !text.contains(char::is_whitespace));
        let decoded = Token::decode(&text).unwrap();
        assert!(!format!("{decoded:?}").contains("pw"));
        join(&store, &decoded, node_dir.path()).unwrap();
        // Once only, even into a fresh dir.
        let again = tempfile::tempdir().unwrap();
        assert!(matches!(join(&store, &decoded, again.path()), Err(JoinError::Already(_))));

        let dir = FleetDir::load(node_dir.path()).unwrap();
        assert_eq!(dir.member, MemberConfig { role: Role::Node, name: "n1".into(), serial: decoded.member.serial });
        assert_eq!(dir.host_key(&store).unwrap(), HOST_KEY);
        assert!(dir.identity.server_config().is_ok() && dir.identity.client_config().is_ok());
        use std::os::unix::fs::PermissionsExt;
        for secret in ["fleet.json", "fleet-key.pem", "fleet.key"] {
            let mode = std::fs::metadata(node_dir.path().join(secret)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{secret}");
        }
        // Another fleet's key does not open the host key.
        let other = FleetKey([7; 32]);
        assert!(matches!(
            other.open_host_key(&store.setting(SETTING_HOST_KEY).unwrap().unwrap()),
            Err(JoinError::Unsealable)
        ));
    }

    #[test]
    fn tokens_that_are_not_refuse_cleanly() {
        for bad in ["", "moat-join-", "moat-join-!!!", "moat-join-e30", "hello"] {
            assert!(matches!(Token::decode(bad), Err(JoinError::Token(_))), "{bad}");
        }
    }
}
