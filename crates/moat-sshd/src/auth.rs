//! Who may connect: the operator's authorized_keys file, where each key is an
//! account, and the server's own host key.

use std::path::{Path, PathBuf};
use std::process::Command;

use moat_core::AccountId;
use russh::keys::{HashAlg, PrivateKey, PublicKey};

/// An authentication setup failure.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// Reading or creating a key file failed.
    #[error("{path}: {detail}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
}

/// The authorized keys, re-read on every authentication so that the operator can
/// add or revoke a key without a restart.
#[derive(Debug, Clone)]
pub struct AuthorizedKeys {
    path: PathBuf,
}

impl AuthorizedKeys {
    /// Keys from `path` (OpenSSH authorized_keys format; options are ignored).
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    /// The account of the key whose text (`TYPE BASE64`, as [`key_text`]
    /// writes it) is `key`. The text, which comes from the front door, is
    /// only compared with the listed keys', never parsed.
    pub fn account_for_text(&self, key: &str) -> Option<AccountId> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        let listed = text.lines().filter_map(parse_line).find(|k| key_text(k).as_deref() == Some(key))?;
        Some(account_id(&listed))
    }

    /// Whether a key of `account` is listed now.
    pub fn lists(&self, account: &AccountId) -> bool {
        let Ok(text) = std::fs::read_to_string(&self.path) else { return false };
        text.lines().filter_map(parse_line).any(|k| account_id(&k) == *account)
    }
}

/// A public key as `TYPE BASE64`, without its comment.
pub fn key_text(key: &PublicKey) -> Option<String> {
    let text = key.to_openssh().ok()?;
    let mut words = text.split_whitespace();
    Some(format!("{} {}", words.next()?, words.next()?))
}

/// An account's id: the key's SHA-256 fingerprint, as `ssh-keygen -l` shows it.
pub fn account_id(key: &PublicKey) -> AccountId {
    AccountId(key.fingerprint(HashAlg::Sha256).to_string())
}

/// Parses one authorized_keys line: `[options] type base64 [comment]`.
fn parse_line(line: &str) -> Option<PublicKey> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    // Try from each word: options come first and never parse as a key type.
    let words: Vec<&str> = line.split_whitespace().collect();
    (0..words.len()).find_map(|i| {
        let rest = words.get(i..)?.join(" ");
        PublicKey::from_openssh(&rest).ok()
    })
}

/// Loads the host key at `path`, creating an Ed25519 key with `ssh-keygen` the
/// first time.
pub fn load_or_create_host_key(path: &Path) -> Result<PrivateKey, AuthError> {
    let err = |detail: String| AuthError::KeyFile { path: path.to_path_buf(), detail };
    if !path.exists() {
        let out = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "moat host key", "-f"])
            .arg(path)
            .output()
            .map_err(|e| err(format!("run ssh-keygen: {e}")))?;
        if !out.status.success() {
            return Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string()));
        }
    }
    russh::keys::load_secret_key(path, None).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop";
    const OTHER: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB7yXyjJ0+rbhLFq3MmYqOyvoOhC2jh+f2QCJ3e1rmCV bob";

    #[test]
    fn listed_keys_map_to_their_fingerprint() {
        let dir = std::env::temp_dir().join(format!("moat-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("authorized_keys");
        std::fs::write(&file, format!("# comment\n\nno-pty,command=\"x\" {KEY}\n")).unwrap();
        let keys = AuthorizedKeys::new(file);
        let alice = PublicKey::from_openssh(KEY).unwrap();
        let bob = PublicKey::from_openssh(OTHER).unwrap();
        let account = keys.account_for_text(&key_text(&alice).unwrap()).unwrap();
        assert_eq!(account, account_id(&alice));
        assert!(account.0.starts_with("SHA256:"));
        assert_eq!(keys.account_for_text(&key_text(&bob).unwrap()), None);
        // Only the exact text of a listed key matches.
        assert_eq!(keys.account_for_text(KEY), None);
        assert_eq!(keys.account_for_text(""), None);
        // Whether an account is listed follows the file as it is now.
        assert!(keys.lists(&account) && !keys.lists(&account_id(&bob)));
        std::fs::write(dir.join("authorized_keys"), format!("{OTHER}\n")).unwrap();
        assert!(!keys.lists(&account) && keys.lists(&account_id(&bob)));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
