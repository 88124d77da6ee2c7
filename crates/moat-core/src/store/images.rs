//! Pulled images in the state store: each an account's own, by the name it
//! gave it, with the pool's key for its subvolume, where it came from, its
//! layers' chain ids (bottom first) and its config. Registry logins, sealed
//! like secrets, are kept beside them.

use serde::{Deserialize, Serialize};

use super::sql::{args, Row};
use super::{Store, StoreError};
use crate::ids::{AccountId, Name};

/// A pulled image, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredImage {
    /// Whose.
    pub account: AccountId,
    /// The account's name for it (what `new --image` takes).
    pub name: Name,
    /// Its subvolume in the pool's `images/` (what boxes are snapshots of).
    pub key: Name,
    /// What was pulled (`registry/repo:tag` or `@digest`).
    pub reference: String,
    /// The manifest's digest.
    pub digest: String,
    /// Its layers' chain ids (hex), bottom first.
    pub layers: Vec<String>,
    /// Its config (JSON, as the registry served it).
    pub config: String,
    /// Its blobs' size (compressed).
    pub bytes: u64,
    /// When it was pulled (ms).
    pub created_ms: u64,
    /// The manifest of the pulled image it is or was saved from, as served
    /// (`""`: made from a built-in image, or pulled before moat kept it):
    /// what a push names as its base layers.
    #[serde(default)]
    pub base_manifest: String,
    /// Where that manifest came from (`registry/repo:tag`; `""` as above):
    /// where a push mounts its base layers from.
    #[serde(default)]
    pub base_source: String,
}

const COLUMNS: &str =
    "account, name, key, reference, digest, layers, config, bytes, created_ms, base_manifest, base_source";

fn from_row(r: &Row) -> Result<StoredImage, StoreError> {
    let name: String = r.get(1)?;
    let corrupt = || StoreError::Corrupt(format!("image {name}"));
    let layers: String = r.get(5)?;
    Ok(StoredImage {
        account: AccountId(r.get(0)?),
        name: Name::new(&name).map_err(|_| corrupt())?,
        key: Name::new(&r.get::<String>(2)?).map_err(|_| corrupt())?,
        reference: r.get(3)?,
        digest: r.get(4)?,
        layers: serde_json::from_str(&layers).map_err(|_| corrupt())?,
        config: r.get(6)?,
        bytes: r.get(7)?,
        created_ms: r.get(8)?,
        base_manifest: r.get(9)?,
        base_source: r.get(10)?,
    })
}

impl Store {
    /// Records `image`, replacing the account's image of that name (a pull
    /// again of a moved tag); the one replaced, if any.
    pub fn put_image(&self, image: &StoredImage) -> Result<Option<StoredImage>, StoreError> {
        let old = self.image(&image.account, &image.name)?;
        let layers = serde_json::to_string(&image.layers).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.execute(
            "DELETE FROM images WHERE account = ?1 AND name = ?2",
            &args![&image.account.0, image.name.as_str()],
        )?;
        self.execute(
            &format!("INSERT INTO images ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"),
            &args![
                &image.account.0,
                image.name.as_str(),
                image.key.as_str(),
                &image.reference,
                &image.digest,
                &layers,
                &image.config,
                image.bytes,
                image.created_ms,
                &image.base_manifest,
                &image.base_source
            ],
        )?;
        Ok(old)
    }

    /// The account's image called `name`.
    pub fn image(&self, account: &AccountId, name: &Name) -> Result<Option<StoredImage>, StoreError> {
        let rows = self.query(
            &format!("SELECT {COLUMNS} FROM images WHERE account = ?1 AND name = ?2"),
            &args![&account.0, name.as_str()],
        )?;
        rows.first().map(from_row).transpose()
    }

    /// The account's images (every account's with `None`), by name.
    pub fn images(&self, account: Option<&AccountId>) -> Result<Vec<StoredImage>, StoreError> {
        let rows = match account {
            Some(a) => {
                self.query(&format!("SELECT {COLUMNS} FROM images WHERE account = ?1 ORDER BY name"), &args![&a.0])?
            }
            None => self.query(&format!("SELECT {COLUMNS} FROM images ORDER BY name"), &[])?,
        };
        rows.iter().map(from_row).collect()
    }

    /// Forgets the account's image `name`; whether it had one.
    pub fn remove_image(&self, account: &AccountId, name: &Name) -> Result<bool, StoreError> {
        Ok(self.execute("DELETE FROM images WHERE account = ?1 AND name = ?2", &args![&account.0, name.as_str()])? == 1)
    }

    /// Keeps the account's login for `registry` (sealed), replacing any.
    pub fn put_registry_login(&self, account: &AccountId, registry: &str, sealed: &[u8]) -> Result<(), StoreError> {
        self.execute("DELETE FROM registry_logins WHERE account = ?1 AND registry = ?2", &args![&account.0, registry])?;
        self.execute(
            "INSERT INTO registry_logins (account, registry, sealed) VALUES (?1, ?2, ?3)",
            &args![&account.0, registry, sealed],
        )?;
        Ok(())
    }

    /// The account's sealed logins, by registry.
    pub fn registry_logins(&self, account: &AccountId) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let rows = self.query("SELECT registry, sealed FROM registry_logins WHERE account = ?1", &args![&account.0])?;
        rows.iter().map(|r| Ok((r.get(0)?, r.get(1)?))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(images_are_per_account_and_replaced_by_name);
    fn images_are_per_account_and_replaced_by_name(db: &TestDb) {
        let store = db.open();
        let (a, b) = (AccountId("SHA256:a".into()), AccountId("SHA256:b".into()));
        let image = |account: &AccountId, digest: &str| StoredImage {
            account: account.clone(),
            name: Name::new("tiny").unwrap(),
            key: Name::new(&format!("tiny-{digest}")).unwrap(),
            reference: "registry.test/moat/tiny:v1".into(),
            digest: format!("sha256:{digest}"),
            layers: vec!["ab".repeat(32)],
            config: "{}".into(),
            bytes: 42,
            created_ms: 7,
            base_manifest: format!("{{\"layers\":[\"{digest}\"]}}"),
            base_source: "registry.test/moat/tiny:v1".into(),
        };
        assert_eq!(store.put_image(&image(&a, "one")).unwrap(), None);
        store.put_image(&image(&b, "two")).unwrap();
        let old = store.put_image(&image(&a, "three")).unwrap().unwrap();
        assert_eq!(old.digest, "sha256:one");
        let mine = store.images(Some(&a)).unwrap();
        assert_eq!(mine, vec![image(&a, "three")]);
        assert_eq!(store.images(None).unwrap().len(), 2);
        assert!(store.remove_image(&a, &Name::new("tiny").unwrap()).unwrap());
        assert!(store.image(&a, &Name::new("tiny").unwrap()).unwrap().is_none());
        assert!(store.image(&b, &Name::new("tiny").unwrap()).unwrap().is_some());
        store.put_registry_login(&a, "registry.test", b"sealed").unwrap();
        store.put_registry_login(&a, "registry.test", b"again").unwrap();
        assert_eq!(store.registry_logins(&a).unwrap(), vec![("registry.test".to_string(), b"again".to_vec())]);
        assert!(store.registry_logins(&b).unwrap().is_empty());
    }
}
