//! The box lifecycle: creating → running ⇄ stopped → deleted.
//!
//! The manager owns the rules (who may see which box, what gets rolled back) and
//! leaves the isolation to a [`Backend`]. Backend calls block, so they run on
//! tokio's blocking pool; one lock per box keeps two sessions from booting the
//! same box twice.

mod access;
mod ask;
mod checkpoints;
mod copies;
mod durable;
mod effects;
mod fleet;
mod images;
mod meter;
mod moves;
mod network;
mod packages;
mod secrets;
mod services;
mod session;
mod warm;
mod web;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

pub use durable::{Durability, DurableHooks, ImageFetch};
pub use fleet::{LEASE, LEASE_RENEW};
pub use images::{ImagePuller, Logins, Pulled, RegistryLogin, IMAGE_USER, IMAGE_WORKDIR};
pub use meter::{SecretUsage, UsageReport};
pub use network::{NetworkHooks, Wait};
pub use session::SessionGuard;
pub use warm::WARM_ACCOUNT;
pub use web::{WebOpenError, COOKIE_LIFETIME, LINK_LIFETIME, PUBLIC};

use crate::backend::{Backend, BackendError, BackendKind, BoxHandle};
use crate::ids::{AccountId, BoxId, Name};
use crate::limits::{Limits, LimitsError};
use crate::policy::Policy;
use crate::record::{BoxRecord, BoxState};
use crate::store::{Store, StoreError};

/// A lifecycle operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// No such box for this account (also what another account's box looks like).
    #[error("no box named {0}")]
    NoSuchBox(Name),
    /// The requested limits cannot be used.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// No such image, and it is not one moat knows how to build.
    #[error("no image named {0}")]
    NoSuchImage(Name),
    /// The account's image is on another node, and not (yet) in the object store.
    #[error("image {0} is not on this node, nor in the object store yet (saved or pulled on another node just now? try again)")]
    ImageNotHere(Name),
    /// An image kept in the object store could not be fetched.
    #[error("image {0} is kept in the object store but could not be fetched: {1}")]
    ImageFetch(Name, String),
    /// The box is still being made.
    #[error("box {0} is still being created")]
    Busy(Name),
    /// The name came to mean another box while the operation waited for the
    /// one it named (a promote, or a removal and a new box, ran meanwhile).
    #[error("box {0} changed while this waited its turn (a promote or a removal ran meanwhile): try again")]
    Replaced(Name),
    /// `promote` of a box that is not a duplicate.
    #[error("box {0} was not duplicated from another box")]
    NoParent(Name),
    /// `promote` of a box whose parent was removed.
    #[error("the box {0} was duplicated from no longer exists")]
    ParentGone(Name),
    /// The account has as many boxes as the operator allows.
    #[error("you have {0} boxes, the most this server allows; remove one first")]
    TooManyBoxes(usize),
    /// The account has as many images as the operator allows.
    #[error("you have {0} images, the most this server allows; remove one first (image rm NAME)")]
    TooManyImages(usize),
    /// A limit above the operator's maximum.
    #[error("{what} may be at most {max} on this server")]
    OverMax {
        /// Which limit.
        what: &'static str,
        /// The operator's maximum, as text.
        max: String,
    },
    /// With the new box, the account's memory limits would add up to more than
    /// the operator allows.
    #[error("with this box your boxes' memory limits add up to {asked}; this server allows {max} per account")]
    MemoryBudget {
        /// The sum with the new box, as text.
        asked: String,
        /// The budget, as text.
        max: String,
    },
    /// The account's boxes already hold all the disk the operator allows.
    #[error("your boxes hold {used} on disk, all this server allows per account ({max}); remove boxes or files first")]
    DiskBudget {
        /// What they hold, as text.
        used: String,
        /// The budget, as text.
        max: String,
    },
    /// A name no box may have: the control plane's user name.
    #[error("\"{0}\" is the control plane's user name (ssh {0}@HOST); pick another name")]
    ReservedName(Name),
    /// A name built from another is too long to be a name.
    #[error("{0}: the name would be too long")]
    NameTooLong(String),
    /// A secret, or a change to one, that is refused.
    #[error(transparent)]
    Secret(#[from] crate::secrets::SecretError),
    /// No secret of the account's by this name.
    #[error("no secret named {0}")]
    NoSuchSecret(Name),
    /// The account has a secret by this name already.
    #[error("a secret named {0} exists already (secret rm it first)")]
    SecretExists(Name),
    /// The box holds another secret for the same header of the same host, or
    /// in the same variable.
    #[error("box {box_name} has secret {other} for the same header or variable already (secret revoke it first)")]
    SecretClash {
        /// The box.
        box_name: Name,
        /// The secret it has.
        other: Name,
    },
    /// The server was started without a key to seal secrets with.
    #[error("this server keeps no secrets (it has no key to seal them with)")]
    NoSecretKey,
    /// The box has no checkpoint by this label.
    #[error("box {0} has no checkpoint {1} (see: checkpoints {0})")]
    NoSuchCheckpoint(Name, Name),
    /// The box has a checkpoint by this label already.
    #[error("box {0} has a checkpoint {1} already (checkpoint rm {0} {1} first, or pick another label)")]
    CheckpointExists(Name, Name),
    /// The box has as many checkpoints as the operator allows.
    #[error("box {0} has {1} checkpoints, the most this server allows (a restore keeps one more); remove one first")]
    TooManyCheckpoints(Name, usize),
    /// No open question of the account's has this number.
    #[error("no open question {0} (answered already, or lapsed)")]
    NoSuchQuestion(u64),
    /// A fleet node holds no open question of that number (another may).
    #[error("no open question {0} on this node")]
    QuestionElsewhere(u64),
    /// A policy rule or preset that does not parse.
    #[error(transparent)]
    Policy(#[from] crate::policy::PolicyError),
    /// The box belongs to another node of the fleet.
    #[error("box {name} is on node {node}{}", match lapsed {
        Some(secs) => format!(", which is not answering (its lease lapsed {secs} s ago)"),
        None => String::new(),
    })]
    OnOtherNode {
        /// The box.
        name: Name,
        /// The node that holds it.
        node: String,
        /// Seconds since that node's lease lapsed, if it has.
        lapsed: Option<u64>,
    },
    /// This node cannot take the new box (full, cordoned, or its lease
    /// lapsed): a fleet's router tries another.
    #[error(transparent)]
    NoRoomHere(StoreError),
    /// `new --node` named a node this is not (or none on a single host).
    #[error("no node named {0} here")]
    NoSuchNode(String),
    /// A move that cannot be asked or carried out.
    #[error("{0}")]
    CannotMove(String),
    /// The box is leaving this node.
    #[error("box {name} is moving to node {to}; try again in a moment")]
    Leaving {
        /// The box.
        name: Name,
        /// Where it goes.
        to: String,
    },
    /// This node's lease lapsed: it acts on no box until it has renewed it.
    #[error("node {0} has lost its lease in the fleet's store and serves no box until it has it back")]
    Fenced(String),
    /// The server was started without an HTTP edge.
    #[error("this server gives no web URLs (moat serve --http-listen ADDR --http-domain DOMAIN)")]
    NoWebEdge,
    /// Port 0 cannot be exposed.
    #[error("port 0 is no port")]
    PortZero,
    /// A URL's first label would be too long.
    #[error("{0}: {1} (pick a shorter box name)")]
    LabelTooLong(String, String),
    /// The port is not exposed.
    #[error("port {port} of {name} is not exposed (expose {name} {port} first)")]
    NotExposed {
        /// The box.
        name: Name,
        /// The port.
        port: u16,
    },
    /// A box shared with the account that owns it.
    #[error("{name} is yours: share it with another account's key")]
    ShareWithSelf {
        /// The box.
        name: Name,
    },
    /// The box is not shared with that account.
    #[error("{name} is not shared with {with}")]
    NotShared {
        /// The box.
        name: Name,
        /// The account.
        with: AccountId,
    },
    /// An image's `User` that the image has no line for.
    #[error("image {image} runs as user {user:?}, which its /etc/passwd does not have")]
    NoImageUser {
        /// The image.
        image: Name,
        /// Its `User`.
        user: String,
    },
    /// `new --run` of an image that names no program to run.
    #[error("image {0} names no Entrypoint or Cmd to --run")]
    NothingToRun(Name),
    /// `log --service` of a box made without `--run`.
    #[error("{0} has no service (a box made with new --image I --run has one)")]
    NoService(Name),
    /// `log --service` of a stopped box.
    #[error("{0} is stopped: its service runs while it does (start {0})")]
    ServiceStopped(Name),
    /// A pull failed (the reason, in one line).
    #[error("{0}")]
    Pull(String),
    /// This server pulls no images.
    #[error("this server pulls no images")]
    NoPuller,
    /// The account has as many pulls and pushes running or waiting as it may.
    #[error("you have {0} pulls and pushes running or waiting already (they go one at a time): wait for them")]
    TooManyTransfers(usize),
    /// What it waited for is gone: the server is shutting down.
    #[error("this server is shutting down")]
    Closing,
    /// The store failed.
    #[error(transparent)]
    Store(StoreError),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A blocking task panicked or was cancelled.
    #[error("internal task failed")]
    Join(#[from] tokio::task::JoinError),
}

impl From<StoreError> for ManagerError {
    /// A box the account's cap refused (checked as it is added) is told as
    /// the check before it tells it.
    fn from(e: StoreError) -> Self {
        use crate::limits::format_size;
        match e {
            StoreError::AccountBoxes(n) => Self::TooManyBoxes(usize::try_from(n).unwrap_or(usize::MAX)),
            StoreError::AccountMemory { asked, max } => {
                Self::MemoryBudget { asked: format_size(asked), max: format_size(max) }
            }
            e => Self::Store(e),
        }
    }
}

/// Refuses the control plane's user name as a box name: no box could be reached by it.
fn reserved(name: &Name) -> Result<(), ManagerError> {
    if name.as_str() == crate::ids::CONTROL_USER {
        return Err(ManagerError::ReservedName(name.clone()));
    }
    Ok(())
}

/// What `new` asks for.
#[derive(Debug, Clone)]
pub struct BoxSpec {
    /// The box's name.
    pub name: Name,
    /// Its image.
    pub image: Name,
    /// Its limits.
    pub limits: Limits,
    /// Its egress policy.
    pub policy: Policy,
    /// What isolates it (`None`: the operator's default).
    pub backend: Option<BackendKind>,
    /// Keep its image's Entrypoint and Cmd running as its service (`new --run`).
    pub run: bool,
}

/// Progress lines for long work, sent to whoever is waiting.
pub type ProgressSink = Box<dyn FnMut(&str) + Send>;

/// The operator's lifecycle settings.
#[derive(Debug, Clone, Copy)]
pub struct ManagerConfig {
    /// How long a box with no session keeps running before it is suspended
    /// (unless the box sets its own).
    pub idle_grace: Duration,
    /// How long a box may stay suspended before its memory is released (it is
    /// stopped; its files stay). `None`: never.
    pub park_after: Option<Duration>,
    /// How often the meter samples every box.
    pub meter_interval: Duration,
    /// Most boxes one account may have.
    pub max_boxes: usize,
    /// The largest limits an account may ask for, per box.
    pub max_limits: Limits,
    /// Most memory the limits of one account's boxes may add up to.
    pub max_memory_per_account: u64,
    /// Most bytes one account's boxes may hold on disk together (enforced by
    /// the backend as they write; here new boxes are refused once it is spent).
    pub max_disk_per_account: u64,
    /// Most checkpoints one box may have.
    pub max_checkpoints: usize,
    /// Most images (pulled and saved) one account may have: each holds disk
    /// outside its boxes', up to `--max-image-size` or a box's disk.
    pub max_images: usize,
    /// Boxes kept booted ahead of demand (one of each kind, image, limits
    /// and backend, for the kinds `new` asked for last); 0: none.
    pub warm_boxes: usize,
    /// How long a warm box of a kind other than an image's default is kept
    /// once its kind is no longer asked for (a VM's QEMU runs all the while).
    pub warm_kept: Duration,
    /// What isolates a box whose `new` does not say.
    pub default_backend: BackendKind,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            idle_grace: Duration::from_secs(10),
            park_after: None,
            meter_interval: Duration::from_secs(30),
            max_boxes: 32,
            max_limits: Limits { cpus: 64, memory: 64 << 30, pids: 1 << 16, disk: 256 << 30 },
            max_memory_per_account: 256 << 30,
            max_disk_per_account: 256 << 30,
            max_checkpoints: 32,
            max_images: 32,
            warm_boxes: 1,
            warm_kept: Duration::from_secs(600),
            default_backend: BackendKind::Ns,
        }
    }
}

/// How many `diff`s run at once (the rest wait their turn).
pub const DIFFS_AT_ONCE: usize = 2;

/// Runs the lifecycle over a store and a backend.
pub struct BoxManager {
    store: Store,
    /// The node this is (`store.node()`, kept: asked on every request).
    node: String,
    fence: fleet::Fence,
    backend: Arc<dyn Backend>,
    config: ManagerConfig,
    box_locks: Mutex<HashMap<BoxId, Arc<tokio::sync::Mutex<()>>>>,
    image_lock: tokio::sync::Mutex<()>,
    diff_turns: tokio::sync::Semaphore,
    /// One comparison at a time per account, so that one account cannot
    /// hold every one of `diff_turns` (a box can make its own take minutes).
    account_diff_turns: crate::keyed_locks::KeyedLocks<AccountId>,
    sessions: Mutex<HashMap<BoxId, session::Sessions>>,
    holders: access::Holders,
    /// Pulls and pushes running, per account and in all (see [`images`]).
    transfers: images::Transfers,
    network: std::sync::OnceLock<Arc<dyn NetworkHooks>>,
    durable: std::sync::OnceLock<Arc<dyn DurableHooks>>,
    puller: std::sync::OnceLock<Arc<dyn ImagePuller>>,
    /// Whether an account's key is still listed (unset: every account is).
    accounts: std::sync::OnceLock<web::AccountCheck>,
    egress_follow: tokio::sync::broadcast::Sender<(BoxId, crate::egress::LogEntry)>,
    questions: ask::Questions,
    sealer: std::sync::OnceLock<crate::secrets::Sealer>,
    warm: Mutex<warm::Warm>,
    leaving: moves::Leaving,
    mover_wake: tokio::sync::Notify,
    web: Mutex<web::WebGrants>,
    web_log: Mutex<Vec<(BoxId, crate::egress::LogEntry)>>,
}

impl BoxManager {
    /// A manager over `store` and `backend`.
    pub fn new(store: Store, backend: Arc<dyn Backend>, config: ManagerConfig) -> Arc<Self> {
        let cap = crate::store::AccountCap {
            boxes: u64::try_from(config.max_boxes).unwrap_or(u64::MAX),
            memory: config.max_memory_per_account,
        };
        Arc::new(Self {
            node: store.node_name().to_string(),
            fence: fleet::Fence::default(),
            store: store.capped(cap),
            backend,
            config,
            box_locks: Mutex::new(HashMap::new()),
            image_lock: tokio::sync::Mutex::new(()),
            diff_turns: tokio::sync::Semaphore::new(DIFFS_AT_ONCE),
            account_diff_turns: crate::keyed_locks::KeyedLocks::default(),
            sessions: Mutex::new(HashMap::new()),
            holders: access::Holders::default(),
            transfers: images::Transfers::default(),
            network: std::sync::OnceLock::new(),
            durable: std::sync::OnceLock::new(),
            puller: std::sync::OnceLock::new(),
            accounts: std::sync::OnceLock::new(),
            egress_follow: tokio::sync::broadcast::channel(4096).0,
            questions: ask::Questions::default(),
            sealer: std::sync::OnceLock::new(),
            warm: Mutex::default(),
            leaving: moves::Leaving::default(),
            mover_wake: tokio::sync::Notify::new(),
            web: Mutex::default(),
            web_log: Mutex::default(),
        })
    }

    /// The operator's settings, limits included (what `whoami` shows).
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// The account's box `name`, read again under its lock (which the caller
    /// holds while it keeps the guard). A box still being created, or replaced
    /// by another of the same name meanwhile, is busy.
    async fn locked(
        &self,
        account: &AccountId,
        name: &Name,
    ) -> Result<(BoxRecord, tokio::sync::OwnedMutexGuard<()>), ManagerError> {
        let first = self.get(account, name)?;
        let guard = self.lock_for(&first.id).lock_owned().await;
        let rec = self.get(account, name)?;
        if rec.id != first.id {
            return Err(ManagerError::Replaced(rec.name));
        }
        if rec.state == BoxState::Creating {
            return Err(ManagerError::Busy(rec.name));
        }
        self.here(&rec)?;
        if let Some(to) = self.leaving.to(&rec.id) {
            return Err(ManagerError::Leaving { name: rec.name, to });
        }
        Ok((rec, guard))
    }

    /// Runs a store call (SQLite, with fsync on writes) off the async worker.
    fn db<T>(&self, f: impl FnOnce(&Store) -> T) -> T {
        in_place(|| f(&self.store))
    }

    /// What isolates a box made to `spec`.
    fn backend_of(&self, spec: &BoxSpec) -> BackendKind {
        spec.backend.unwrap_or(self.config.default_backend)
    }

    fn lock_for(&self, id: &BoxId) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.box_locks.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(locks.entry(id.clone()).or_default())
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Backend) -> T + Send + 'static,
    ) -> Result<T, ManagerError> {
        let backend = Arc::clone(&self.backend);
        Ok(tokio::task::spawn_blocking(move || f(backend.as_ref())).await?)
    }

    /// `limits` with each one left at its default brought within the
    /// operator's maximum (a server with `--max-disk 8G` takes a plain `new`;
    /// a limit asked for above the maximum is still refused).
    fn defaults_within_max(&self, limits: Limits) -> Limits {
        let (default, max) = (Limits::default(), self.config.max_limits);
        let within = |asked: u64, default: u64, max: u64| if asked == default { asked.min(max) } else { asked };
        Limits {
            cpus: u32::try_from(within(limits.cpus.into(), default.cpus.into(), max.cpus.into()))
                .unwrap_or(limits.cpus),
            memory: within(limits.memory, default.memory, max.memory),
            pids: u32::try_from(within(limits.pids.into(), default.pids.into(), max.pids.into()))
                .unwrap_or(limits.pids),
            disk: within(limits.disk, default.disk, max.disk),
        }
    }

    /// Refuses a new box the operator's limits do not allow: early, before
    /// any work (the store checks the account's box count and memory again
    /// as it adds the box, for creates at once).
    fn check_quota(&self, account: &AccountId, limits: &Limits) -> Result<(), ManagerError> {
        let max = self.config.max_limits;
        let over = |what, max: String| Err(ManagerError::OverMax { what, max });
        if limits.cpus > max.cpus {
            return over("--cpus", max.cpus.to_string());
        }
        if limits.memory > max.memory {
            return over("--memory", crate::limits::format_size(max.memory));
        }
        if limits.pids > max.pids {
            return over("--pids", max.pids.to_string());
        }
        if limits.disk > max.disk {
            return over("--disk", crate::limits::format_size(max.disk));
        }
        let (boxes, memory) = self.db(|s| s.account_totals(account))?;
        let boxes = usize::try_from(boxes).unwrap_or(usize::MAX);
        if boxes >= self.config.max_boxes {
            return Err(ManagerError::TooManyBoxes(boxes));
        }
        use crate::limits::{format_measured, format_size};
        let memory = memory.saturating_add(limits.memory);
        if memory > self.config.max_memory_per_account {
            let (asked, max) = (format_size(memory), format_size(self.config.max_memory_per_account));
            return Err(ManagerError::MemoryBudget { asked, max });
        }
        // In a fleet, what the account's boxes hold on the other nodes too.
        let elsewhere = match self.node.is_empty() {
            true => 0,
            false => self.db(|s| s.account_disk_elsewhere(&self.node, account, crate::clock::now_ms()))?,
        };
        let disk = self.backend.account_disk_usage(account).unwrap_or(0).saturating_add(elsewhere);
        if disk >= self.config.max_disk_per_account {
            let (used, max) = (format_measured(disk), format_size(self.config.max_disk_per_account));
            return Err(ManagerError::DiskBudget { used, max });
        }
        Ok(())
    }

    /// Finds the account's box, or says it does not exist.
    pub fn get(&self, account: &AccountId, name: &Name) -> Result<BoxRecord, ManagerError> {
        self.db(|s| s.get(account, name))?.ok_or_else(|| ManagerError::NoSuchBox(name.clone()))
    }

    /// Whether the account once had a box called `name` that it no longer has
    /// under that name (removed, or renamed by `promote`).
    pub fn was_box(&self, account: &AccountId, name: &Name) -> Result<bool, ManagerError> {
        Ok(self.db(|s| s.is_retired(account, name))? && self.db(|s| s.get(account, name))?.is_none())
    }

    /// The account's boxes.
    pub fn list(&self, account: &AccountId) -> Result<Vec<BoxRecord>, ManagerError> {
        Ok(self.db(|s| s.list(Some(account)))?)
    }

    /// How many boxes the account has.
    pub fn count(&self, account: &AccountId) -> Result<usize, ManagerError> {
        Ok(usize::try_from(self.db(|s| s.account_totals(account))?.0).unwrap_or(usize::MAX))
    }

    /// Makes sure `image` exists here: building it if moat knows how, or
    /// fetching it from the object store if it is kept there (a pulled or
    /// saved image another node made).
    pub async fn ensure_image(&self, image: &Name, mut progress: ProgressSink) -> Result<(), ManagerError> {
        let name = image.clone();
        if self.blocking(move |b| b.has_image(&name)).await? {
            return Ok(());
        }
        // One build or fetch at a time; whoever waited finds the image made.
        let _guard = self.image_lock.lock().await;
        let name = image.clone();
        if self.blocking(move |b| b.has_image(&name)).await? {
            return Ok(());
        }
        if !crate::images::BUILDABLE.contains(&image.as_str()) {
            let Some(hooks) = self.durable.get() else { return Err(ManagerError::NoSuchImage(image.clone())) };
            progress(&format!("image {image}: fetching it from the object store"));
            return match hooks.fetch_image(image).await {
                Ok(true) => Ok(()),
                Ok(false) => Err(ManagerError::NoSuchImage(image.clone())),
                Err(e) => Err(ManagerError::ImageFetch(image.clone(), e)),
            };
        }
        let name = image.clone();
        self.blocking(move |b| b.build_image(&name, &mut progress)).await??;
        Ok(())
    }

    /// Creates and boots a box. On any failure nothing is left behind.
    pub async fn create(
        self: &Arc<Self>,
        account: &AccountId,
        spec: BoxSpec,
        progress: ProgressSink,
    ) -> Result<BoxRecord, ManagerError> {
        let started = std::time::Instant::now();
        let mut spec = spec;
        spec.limits = self.defaults_within_max(spec.limits);
        spec.limits.validate()?;
        reserved(&spec.name)?;
        if !self.serving() {
            return Err(ManagerError::NoRoomHere(StoreError::NodeUnavailable(self.node.clone())));
        }
        self.check_quota(account, &spec.limits)?;
        let (image, pulled) = self.resolve_image(account, &spec.image)?;
        spec.image = image;
        if self.db(|s| s.get(account, &spec.name))?.is_some() {
            return Err(StoreError::NameTaken(spec.name).into());
        }
        // A pulled image is here before its settings are read from its files
        // (it may be in the object store only); a built-in one is made after
        // the warm pool is asked, off the path of a create that takes a box.
        let mut progress = Some(progress);
        if let Some(image) = &pulled {
            let sink = progress.take().unwrap_or_else(|| Box::new(|_: &str| {}));
            self.ensure_image(&spec.image, sink).await.map_err(|e| match e {
                ManagerError::NoSuchImage(_) => ManagerError::ImageNotHere(image.name.clone()),
                e => e,
            })?;
        }
        let session = pulled.as_ref().map(|p| self.image_session(p)).transpose()?.unwrap_or_default();
        let service = match (spec.run, &pulled) {
            (false, _) => None,
            (true, Some(image)) => Some(services::image_command(image)?),
            (true, None) => return Err(ManagerError::NothingToRun(spec.image.clone())),
        };
        // A box booted ahead has no image session of its own: pulled images get none.
        if pulled.is_none() {
            if let Some(made) = self.take_warm(account, &spec).await {
                return made;
            }
        }
        if let Some(sink) = progress {
            self.ensure_image(&spec.image, sink).await?;
        }
        let made = (&spec.image, spec.limits, self.backend_of(&spec));
        let insert = || self.db(|s| s.insert_new(account, &spec.name, made, now(), &spec.policy));
        // Boxes booted ahead give way to a box someone asked for.
        let inserted = match insert() {
            Err(StoreError::NodeFull { .. }) if self.give_way_warm().await => insert(),
            inserted => inserted,
        };
        let rec = inserted.map_err(|e| match e {
            StoreError::NodeFull { .. } | StoreError::NodeUnavailable(_) => ManagerError::NoRoomHere(e),
            e => e.into(),
        })?;
        if let Some(argv) = &service {
            if let Err(e) = self.db(|s| s.set_service(&rec.id, Some(argv))) {
                let _ = self.db(|s| s.delete(&rec.id));
                return Err(e.into());
            }
        }
        let rec = self
            .finish_new(rec, move |b, r| {
                b.create(r)?;
                b.set_environment(r, &session).and_then(|()| b.start(r)).map(Some).inspect_err(|_| {
                    let _ = b.destroy(r);
                })
            })
            .await?;
        tracing::info!(box_id = %rec.id, name = %rec.name, pid = ?rec.pid, took = ?started.elapsed(), "box created");
        // The next `new` of this image may find one ready.
        if pulled.is_none() {
            self.refill_warm(self.kind_of(&spec));
        }
        Ok(rec)
    }

    /// Makes and boots a box just inserted in state `creating` (with `make`, which
    /// undoes its own work on failure), then records it running (or suspended,
    /// if `make` left it so: no handle), or forgets it.
    async fn finish_new(
        self: &Arc<Self>,
        mut rec: BoxRecord,
        make: impl FnOnce(&dyn Backend, &BoxRecord) -> Result<Option<BoxHandle>, BackendError> + Send + 'static,
    ) -> Result<BoxRecord, ManagerError> {
        let lock = self.lock_for(&rec.id);
        let _guard = lock.lock().await;
        let r = rec.clone();
        let handle = match self.blocking(move |b| make(b, &r)).await {
            Ok(Ok(handle)) => handle,
            Ok(Err(e)) => {
                self.db(|s| s.delete(&rec.id))?;
                return Err(e.into());
            }
            Err(e) => {
                self.db(|s| s.delete(&rec.id))?;
                return Err(e);
            }
        };
        self.known_here(&rec);
        let Some(handle) = handle else {
            self.db(|s| s.set_state(&rec.id, BoxState::Suspended, None))?;
            rec.state = BoxState::Suspended;
            return Ok(rec);
        };
        self.db(|s| s.set_state(&rec.id, BoxState::Running, Some(handle.pid)))?;
        rec.state = BoxState::Running;
        rec.pid = Some(handle.pid);
        self.network_up(&rec, &handle, false);
        self.tell_service(&rec).await;
        self.schedule_idle(&rec.id);
        // Made, and frozen if the fence closed meanwhile.
        self.still_serving(&rec);
        Ok(rec)
    }

    /// Stops and deletes a box and everything it held.
    pub async fn remove(&self, account: &AccountId, name: &Name) -> Result<(), ManagerError> {
        let (rec, _guard) = self.locked(account, name).await?;
        self.meter_box(&rec).await?;
        let r = rec.clone();
        self.blocking(move |b| {
            b.stop(&r)?;
            b.destroy(&r)
        })
        .await??;
        self.network_down(&rec.id);
        self.db(|s| s.delete(&rec.id))?;
        self.db(|s| s.retire_name(account, &rec.name))?;
        self.db(|s| s.forget_meter(&rec.id))?;
        self.db(|s| s.forget_egress(&rec.id))?;
        self.tell_durable_removed(&rec.id);
        self.db(|s| s.forget_effects(&rec.id))?;
        self.box_locks.lock().unwrap_or_else(PoisonError::into_inner).remove(&rec.id);
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner).remove(&rec.id);
        tracing::info!(box_id = %rec.id, name = %rec.name, "box removed");
        Ok(())
    }

    /// Called once at start: rolls back boxes a crash left half-made, notes
    /// which boxes are still running, and starts the idle rule for them (no
    /// session survives a restart). Suspended boxes stay suspended.
    pub async fn recover(self: &Arc<Self>) -> Result<(), ManagerError> {
        for rec in self.db(Store::list_here)? {
            let r = rec.clone();
            match rec.state {
                BoxState::Creating => {
                    tracing::warn!(box_id = %rec.id, name = %rec.name, "rolling back a half-created box");
                    self.blocking(move |b| {
                        let _ = b.stop(&r);
                        b.destroy(&r)
                    })
                    .await??;
                    self.db(|s| s.delete(&rec.id))?;
                }
                BoxState::Running | BoxState::Stopped => {
                    // A crash during `dup` may have left it frozen.
                    let handle = self
                        .blocking(move |b| {
                            let _ = b.thaw(&r);
                            b.handle(&r)
                        })
                        .await?;
                    let running = handle.is_some();
                    if let Some(handle) = &handle {
                        self.network_up(&rec, handle, false);
                    }
                    let state = if running { BoxState::Running } else { BoxState::Stopped };
                    if state != rec.state {
                        // The time since the last sample is downtime (a host
                        // reboot, a crash): bill it as the state found now.
                        self.meter_box(&BoxRecord { state, ..rec.clone() }).await?;
                        self.db(|s| s.set_state(&rec.id, state, rec.pid.filter(|_| running)))?;
                    }
                    if running {
                        self.schedule_idle(&rec.id);
                    }
                }
                BoxState::Suspended => {
                    // Its network namespace lives on, frozen: attach it so a
                    // resume finds its gateway there. Frozen again first: a
                    // crash during its resume may have thawed it, and a
                    // suspended box is served only once it resumes.
                    let r = rec.clone();
                    let handle = self
                        .blocking(move |b| {
                            let handle = b.handle(&r)?;
                            if let Err(e) = b.suspend(&r) {
                                tracing::warn!(box_id = %r.id, error = %e, "cannot freeze a suspended box again");
                            }
                            Some(handle)
                        })
                        .await?;
                    if let Some(handle) = handle {
                        self.network_up(&rec, &handle, true);
                    }
                }
            }
        }
        Ok(())
    }
}

use crate::clock::now;

/// Runs blocking work (a store call, a hook that enters a namespace) where it
/// is, without stalling the async worker it is called from: tokio moves that
/// worker's other tasks to another thread meanwhile. (On a single-threaded
/// runtime, as unit tests are, it simply runs.)
fn in_place<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests;
