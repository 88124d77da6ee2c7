//! The manager's side of pulled images: each an account's own, by the name
//! it gave it; the pulling itself (the fetch and unpack helpers, the pool's
//! layers) is the puller's, set once at start by the binary. Registry logins
//! are sealed with the secrets key and opened only to hand to the puller.

use std::sync::Arc;

use tokio::sync::{OwnedMutexGuard, OwnedSemaphorePermit, Semaphore};

use super::{BoxManager, ManagerError};
use crate::backend::Progress;
use crate::ids::{AccountId, Name};
use crate::keyed_locks::KeyedLocks;
use crate::secrets::SecretValue;
use crate::slots::{Slot, Slots};
use crate::store::images::StoredImage;

/// A registry login, opened.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct RegistryLogin {
    /// The registry it is for (`HOST[:PORT]`).
    pub registry: String,
    /// The user.
    pub user: String,
    /// The password or token.
    pub password: String,
}

impl std::fmt::Debug for RegistryLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegistryLogin {{ registry: {:?}, user: {:?}, password: [redacted] }}", self.registry, self.user)
    }
}

/// The account's logins, asked for by registry once the reference is read.
pub type Logins<'a> = &'a (dyn Fn(&str) -> Option<RegistryLogin> + Send + Sync);

/// What a pull made.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The reference in full (`registry/repo:tag` or `@digest`).
    pub reference: String,
    /// The name it is listed by unless the user gave one.
    pub name_hint: String,
    /// The image's subvolume in the pool (shared by every account that
    /// pulled the same manifest).
    pub key: Name,
    /// The manifest's digest.
    pub digest: String,
    /// Its layers' chain ids, bottom first.
    pub layers: Vec<String>,
    /// Its config, as served.
    pub config: String,
    /// Its blobs' size.
    pub bytes: u64,
    /// The manifest, as served (the linux/amd64 one of an index).
    pub manifest: String,
}

/// What pulls images into the pool.
pub trait ImagePuller: Send + Sync {
    /// Pulls `reference` (resolved against the operator's default
    /// registry), with `logins`, telling `progress` how it goes. Blocks.
    fn pull(&self, reference: &str, logins: Logins<'_>, progress: Progress<'_>) -> Result<Pulled, String>;
    /// The image `key` is no one's any more, nor are `layers` (no image of
    /// anyone's has them): drop them from the pool. Boxes keep their copies.
    fn forget(&self, key: Option<&Name>, layers: &[String]);
    /// Pushes `image` to `reference`, with `logins`, telling `progress` how
    /// it goes; the reference pushed and the manifest's digest. Blocks.
    fn push(
        &self,
        image: &StoredImage,
        reference: &str,
        logins: Logins<'_>,
        progress: Progress<'_>,
    ) -> Result<String, String>;
}

/// The `/etc/environment` variables that carry an image's `User` and
/// `WorkingDir` to the agent (which takes them out of every session's
/// environment).
pub const IMAGE_USER: &str = "MOAT_IMAGE_USER";
/// See [`IMAGE_USER`].
pub const IMAGE_WORKDIR: &str = "MOAT_IMAGE_WORKDIR";

/// The label logins are sealed under (the registry is inside the value).
const LOGIN_LABEL: &str = "registry-login";

/// Pulls and pushes running at once on this server: each holds a blocking
/// thread (the pool the backend's work shares) and a registry connection.
pub const TRANSFERS_AT_ONCE: usize = 4;
/// Pulls and pushes one account may have running or waiting.
pub const TRANSFERS_PER_ACCOUNT: usize = 8;

/// Whose pulls and pushes run: one at a time per account, the next waiting
/// its turn (a wait holds no thread, and ends with its client), at most
/// [`TRANSFERS_PER_ACCOUNT`] running or waiting (more are refused), and
/// [`TRANSFERS_AT_ONCE`] running in all. A slow registry holds its account's
/// turn and one of the server's, never every blocking thread.
pub(super) struct Transfers {
    asked: Arc<Slots<AccountId>>,
    turns: KeyedLocks<AccountId>,
    all: Arc<Semaphore>,
    /// Who is adding an image, one at a time per account: the count checked
    /// against `--max-images` stays true until the image is kept (36 saves at
    /// once made 36 images where 32 may be).
    places: KeyedLocks<AccountId>,
}

/// A pull's or push's turn, given back when dropped.
pub(super) struct Turn {
    _asked: Slot<AccountId>,
    _mine: OwnedMutexGuard<()>,
    _ours: OwnedSemaphorePermit,
}

impl Default for Transfers {
    fn default() -> Self {
        Self {
            asked: Slots::new(TRANSFERS_PER_ACCOUNT),
            turns: KeyedLocks::default(),
            all: Arc::new(Semaphore::new(TRANSFERS_AT_ONCE)),
            places: KeyedLocks::default(),
        }
    }
}

impl Transfers {
    /// Waits for a turn of `account`'s (refused if it has too many asked).
    async fn turn(&self, account: &AccountId) -> Result<Turn, ManagerError> {
        let asked = self.asked.take(account).ok_or(ManagerError::TooManyTransfers(TRANSFERS_PER_ACCOUNT))?;
        let mine = self.turns.hold(account).await;
        let ours = Arc::clone(&self.all).acquire_owned().await.map_err(|_| ManagerError::Closing)?;
        Ok(Turn { _asked: asked, _mine: mine, _ours: ours })
    }
}

impl BoxManager {
    /// Sets the puller (once; later calls are ignored).
    pub fn set_image_puller(&self, puller: Arc<dyn ImagePuller>) {
        let _ = self.puller.set(puller);
    }

    fn puller(&self) -> Result<Arc<dyn ImagePuller>, ManagerError> {
        self.puller.get().cloned().ok_or(ManagerError::NoPuller)
    }

    /// Pulls `reference` as the account's image `name` (or the name the
    /// reference suggests), replacing the one of that name it had.
    pub async fn pull_image(
        &self,
        account: &AccountId,
        reference: String,
        name: Option<Name>,
        mut progress: crate::ProgressSink,
    ) -> Result<StoredImage, ManagerError> {
        let puller = self.puller()?;
        let logins = self.logins(account)?;
        let turn = self.transfers.turn(account).await?;
        // Within the turn: no other pull of the account's adds one meanwhile.
        self.room_for_image(account, name.as_ref())?;
        let pulled = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            let find = move |registry: &str| logins.iter().find(|l| l.registry == registry).cloned();
            puller.pull(&reference, &find, &mut progress)
        })
        .await?
        .map_err(ManagerError::Pull)?;
        let name = match name {
            Some(name) => name,
            None => Name::new(&pulled.name_hint).map_err(|_| ManagerError::NameTooLong(pulled.name_hint.clone()))?,
        };
        if crate::images::BUILDABLE.contains(&name.as_str()) {
            return Err(ManagerError::Pull(format!("{name} is a built-in image's name: pull it --as another")));
        }
        let _place = self.transfers.places.hold(account).await;
        let image = StoredImage {
            account: account.clone(),
            name,
            key: pulled.key,
            reference: pulled.reference.clone(),
            digest: pulled.digest,
            layers: pulled.layers,
            config: pulled.config,
            bytes: pulled.bytes,
            created_ms: crate::clock::now_ms(),
            base_manifest: pulled.manifest,
            base_source: pulled.reference.clone(),
        };
        // A save of the account's may have taken the last place meanwhile.
        if let Err(full) = self.room_for_image(account, Some(&image.name)) {
            self.forget_unused(&image);
            return Err(full);
        }
        if let Some(old) = self.db(|s| s.put_image(&image))? {
            self.forget_unused(&old);
        }
        self.tell_durable_image(&image.key);
        Ok(image)
    }

    /// Makes the account's box `box_name`'s files as of now its image `image`
    /// (a template: a read-only snapshot), with the config of the image the
    /// box was made from if it was a pulled one (its Env, User, WorkingDir).
    pub async fn save_image(
        &self,
        account: &AccountId,
        box_name: &Name,
        image: Name,
    ) -> Result<StoredImage, ManagerError> {
        if crate::images::BUILDABLE.contains(&image.as_str()) {
            return Err(ManagerError::Pull(format!("{image} is a built-in image's name: save it as another")));
        }
        let rec = self.get(account, box_name)?;
        let _place = self.transfers.places.hold(account).await;
        self.room_for_image(account, Some(&image))?;
        let base = self.db(|s| s.images(Some(account)))?.into_iter().find(|i| i.key == rec.image);
        let key = Name::new(&format!("{}t{}", crate::images::PULLED_PREFIX, crate::ids::BoxId::random()))
            .map_err(|_| ManagerError::NameTooLong(image.to_string()))?;
        let (r, k) = (rec.clone(), key.clone());
        self.blocking(move |b| b.save_image(&r, &k)).await??;
        let saved = StoredImage {
            account: account.clone(),
            name: image,
            key,
            reference: format!(
                "box {box_name} (from {})",
                base.as_ref().map_or(rec.image.as_str(), |b| b.name.as_str())
            ),
            digest: "-".into(),
            // Its base's layers stay while it does (what a push would diff against).
            layers: base.as_ref().map(|b| b.layers.clone()).unwrap_or_default(),
            config: base.as_ref().map_or_else(|| "{}".into(), |b| b.config.clone()),
            bytes: 0,
            created_ms: crate::clock::now_ms(),
            base_manifest: base.as_ref().map(|b| b.base_manifest.clone()).unwrap_or_default(),
            base_source: base.map(|b| b.base_source).unwrap_or_default(),
        };
        if let Some(old) = self.db(|s| s.put_image(&saved))? {
            self.forget_unused(&old);
        }
        self.tell_durable_image(&saved.key);
        Ok(saved)
    }

    /// Refuses a new image of the account's past `--max-images`: one that
    /// replaces an image of the same name takes no new place (a pull without
    /// `--as` names its image only once pulled, so at the most it is refused).
    fn room_for_image(&self, account: &AccountId, name: Option<&Name>) -> Result<(), ManagerError> {
        let images = self.db(|s| s.images(Some(account)))?;
        let replaces = name.is_some_and(|name| images.iter().any(|i| &i.name == name));
        match images.len() >= self.config.max_images && !replaces {
            true => Err(ManagerError::TooManyImages(images.len())),
            false => Ok(()),
        }
    }

    /// Pushes the account's image `name` to `reference`; the line that
    /// says what was pushed.
    pub async fn push_image(
        &self,
        account: &AccountId,
        name: &Name,
        reference: String,
        mut progress: crate::ProgressSink,
    ) -> Result<String, ManagerError> {
        let puller = self.puller()?;
        let image = self.db(|s| s.image(account, name))?.ok_or_else(|| ManagerError::NoSuchImage(name.clone()))?;
        let logins = self.logins(account)?;
        let turn = self.transfers.turn(account).await?;
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            let find = move |registry: &str| logins.iter().find(|l| l.registry == registry).cloned();
            puller.push(&image, &reference, &find, &mut progress)
        })
        .await?
        .map_err(ManagerError::Pull)
    }

    /// The account's images.
    pub fn images(&self, account: &AccountId) -> Result<Vec<StoredImage>, ManagerError> {
        Ok(self.db(|s| s.images(Some(account)))?)
    }

    /// The account's image `name`, if it pulled one by that name.
    pub fn pulled_image(&self, account: &AccountId, name: &Name) -> Result<Option<StoredImage>, ManagerError> {
        Ok(self.db(|s| s.image(account, name))?)
    }

    /// Removes the account's image `name`; boxes made from it keep their files.
    pub fn remove_image(&self, account: &AccountId, name: &Name) -> Result<(), ManagerError> {
        let image = self.db(|s| s.image(account, name))?.ok_or_else(|| ManagerError::NoSuchImage(name.clone()))?;
        self.db(|s| s.remove_image(account, name))?;
        self.forget_unused(&image);
        Ok(())
    }

    /// Drops from the pool what of `gone` no image of anyone's still uses.
    fn forget_unused(&self, gone: &StoredImage) {
        let Ok(all) = self.db(|s| s.images(None)) else { return };
        let key = (!all.iter().any(|i| i.key == gone.key)).then_some(&gone.key);
        let layers: Vec<String> =
            gone.layers.iter().filter(|l| !all.iter().any(|i| i.layers.contains(l))).cloned().collect();
        if let Ok(puller) = self.puller() {
            puller.forget(key, &layers);
        }
        if let Some(key) = key {
            self.backend.image_removed(key);
        }
    }

    /// Keeps the account's login for `registry`, sealed.
    pub fn login(&self, account: &AccountId, login: RegistryLogin) -> Result<(), ManagerError> {
        let text = serde_json::to_string(&login).map_err(|e| ManagerError::Pull(e.to_string()))?;
        let value = SecretValue::new(&text)?;
        let label = Name::new(LOGIN_LABEL).map_err(|_| ManagerError::NameTooLong(LOGIN_LABEL.into()))?;
        let sealed = self.sealer()?.seal(account, &label, &value);
        Ok(self.db(|s| s.put_registry_login(account, &login.registry, &sealed))?)
    }

    /// The account's logins, opened (a login that does not open is left out).
    fn logins(&self, account: &AccountId) -> Result<Vec<RegistryLogin>, ManagerError> {
        let Ok(sealer) = self.sealer() else { return Ok(Vec::new()) };
        let label = Name::new(LOGIN_LABEL).map_err(|_| ManagerError::NameTooLong(LOGIN_LABEL.into()))?;
        let sealed = self.db(|s| s.registry_logins(account))?;
        Ok(sealed
            .iter()
            .filter_map(|(registry, sealed)| {
                let value = sealer.open(account, &label, sealed).ok()?;
                let login: RegistryLogin = serde_json::from_str(value.expose()).ok()?;
                (&login.registry == registry).then_some(login)
            })
            .collect())
    }

    /// The image a box of the account's is made from: its own pulled image
    /// of that name (its pool key), or one of the pool's own (built); never
    /// a pulled image by its key (another account's, perhaps).
    pub(super) fn resolve_image(
        &self,
        account: &AccountId,
        image: &Name,
    ) -> Result<(Name, Option<StoredImage>), ManagerError> {
        if let Some(pulled) = self.db(|s| s.image(account, image))? {
            return Ok((pulled.key.clone(), Some(pulled)));
        }
        if image.as_str().starts_with(crate::images::PULLED_PREFIX) {
            return Err(ManagerError::NoSuchImage(image.clone()));
        }
        Ok((image.clone(), None))
    }

    /// What a box of `image` gets in its `/etc/environment`: the image's
    /// `Env`, and its `User` and `WorkingDir` for the agent to take on (see
    /// moat-agent's `exec`). A `User` the image has no line for is refused.
    pub(super) fn image_session(&self, image: &StoredImage) -> Result<Vec<(String, Option<String>)>, ManagerError> {
        let config: serde_json::Value = serde_json::from_str(&image.config).unwrap_or_default();
        let run = &config["config"];
        let mut vars = Vec::new();
        for pair in run["Env"].as_array().into_iter().flatten().filter_map(|v| v.as_str()) {
            let Some((key, value)) = pair.split_once('=') else { continue };
            let ok = !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if ok && !value.contains('\n') {
                vars.push((key.to_string(), Some(value.to_string())));
            }
        }
        let text = |k: &str| run[k].as_str().map(str::trim).filter(|v| !v.is_empty() && !v.contains('\n'));
        if let Some(user) = text("User") {
            let name = user.split(':').next().unwrap_or(user);
            if name.parse::<u32>().is_err() && !self.backend.image_has_user(&image.key, name) {
                return Err(ManagerError::NoImageUser { image: image.name.clone(), user: user.to_string() });
            }
            vars.push((IMAGE_USER.to_string(), Some(user.to_string())));
        }
        if let Some(dir) = text("WorkingDir") {
            vars.push((IMAGE_WORKDIR.to_string(), Some(dir.to_string())));
        }
        Ok(vars)
    }
}
