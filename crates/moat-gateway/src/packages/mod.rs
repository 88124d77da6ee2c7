//! The registries the gateway knows (PyPI, npm, crates.io), read as their
//! own protocols: on a connection it looks inside to one of their hosts,
//! the gateway answers every GET itself. It fetches a package's index and
//! drops the versions the box's package rules refuse (so installers pick the
//! newest allowed one), and it lets a file in only once its hash matched
//! what the index promised, keeping it in the cache every box shares.
//!
//! - [`route`]: what a request asks for; [`index`] with [`pypi`], [`npm`],
//!   [`crates_io`]: an index, read and rewritten; [`fetch`]: the gateway's
//!   own GET; [`cache`]: the shared, checked files; [`advisories`]: the
//!   operator's OSV database; [`answer`]: one request, answered.

pub mod advisories;
pub mod answer;
pub mod cache;
pub mod crates_io;
pub mod fetch;
pub mod index;
pub mod npm;
pub mod pypi;
pub mod route;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use moat_core::policy::packages::{Candidate, PackageRules, Refused, Severity};

use advisories::Advisories;
use cache::FileCache;
use index::Index;
use route::Package;

/// How long an index read for one box serves the next (installers ask the
/// same index many times in a run, and fifty copies ask it at once). After
/// that it is read again, and the old read serves only while the registry
/// cannot be reached (so a box reinstalls from the cache with it down; the
/// last read is kept in the cache too, for a gateway started meanwhile).
const INDEX_FRESH: Duration = Duration::from_secs(60);
/// Bytes of index bodies kept, at most.
const INDEX_BYTES: usize = 64 << 20;
/// Answers read whole into memory at once, every box together (each up to
/// [`index::MAX_INDEX`]): a box opening hundreds of connections for large
/// documents waits its turn instead of filling the gateway's memory.
const READS_AT_ONCE: usize = 16;

/// The package cache (its directory, open) and how large it may grow, and
/// where the operator's OSV database is (read at start).
#[derive(Debug, Default)]
pub struct PackagesConfig {
    /// The cache's directory (the gateway's own), if it has one.
    pub cache_dir: Option<std::os::fd::OwnedFd>,
    /// Its bound, in bytes.
    pub cache_bytes: u64,
    /// The OSV export, if the operator gave one.
    pub osv_db: Option<PathBuf>,
}

/// What every box's package requests share.
pub struct Registries {
    /// Turns to read an answer whole into memory.
    pub reads: tokio::sync::Semaphore,
    cache: Option<FileCache>,
    /// Read once, at the gateway's start.
    advisories: Advisories,
    indexes: Mutex<Indexes>,
}

/// An index as read, with the answer it came in.
pub struct Read {
    /// The index.
    pub index: Index,
    /// The body, as the registry sent it (decoded).
    pub body: Vec<u8>,
    /// Its content type.
    pub content_type: String,
}

#[derive(Default)]
struct Indexes {
    by_url: HashMap<String, (Instant, Arc<Read>)>,
    bytes: usize,
}

impl Registries {
    /// The shared state under `config` (a cache that cannot be opened is
    /// left out, and said so: files then pass checked, but not kept).
    pub fn new(config: PackagesConfig) -> Self {
        let cache = config.cache_dir.and_then(|dir| match FileCache::open(dir, config.cache_bytes) {
            Ok(cache) => Some(cache),
            Err(e) => {
                tracing::warn!(error = %e, "no package cache");
                None
            }
        });
        let advisories = match &config.osv_db {
            Some(dir) => {
                let db = Advisories::load(dir);
                tracing::info!(records = db.records, dir = %dir.display(), "OSV database read");
                db
            }
            None => Advisories::default(),
        };
        Self {
            reads: tokio::sync::Semaphore::new(READS_AT_ONCE),
            cache,
            advisories,
            indexes: Mutex::new(Indexes::default()),
        }
    }

    /// Keeps no files (a gateway that may not open them).
    pub fn forget_cache(&mut self) {
        self.cache = None;
    }

    /// The cache, if there is one.
    pub fn cache(&self) -> Option<&FileCache> {
        self.cache.as_ref()
    }

    /// Why `rules` refuse version `c` (`now`: seconds since the epoch),
    /// advisories included, if they do.
    pub fn refuse(&self, rules: &PackageRules, c: &Candidate<'_>, now: u64) -> Option<Refused> {
        if let Some(refused) = rules.refuse_version(c, now) {
            return Some(refused);
        }
        let level = rules.advisories?;
        let named = self.advisories.naming(c.ecosystem, c.name, c.version);
        let hit = named.iter().find(|a| a.malicious || (level != Severity::Malicious && a.severity >= Some(level)))?;
        let what = if hit.malicious { "reports it malicious".to_string() } else { "names it".to_string() };
        Some(Refused {
            rule: format!("packages advisories --severity {}", level.name()),
            why: format!("{} {} {}: advisory {} {what}", c.ecosystem, c.name, c.version, hit.id),
        })
    }

    /// The index at `url` if read lately.
    pub fn recent_index(&self, url: &str) -> Option<Arc<Read>> {
        let indexes = self.indexes.lock().unwrap_or_else(PoisonError::into_inner);
        let (at, read) = indexes.by_url.get(url)?;
        (at.elapsed() < INDEX_FRESH).then(|| Arc::clone(read))
    }

    /// The last index of `package` read at `url`, however long ago (for
    /// when the registry cannot be reached): in memory, or kept in the
    /// cache by this gateway or one before it.
    pub fn last_index(&self, url: &str, package: &Package) -> Option<Arc<Read>> {
        if let Some((_, read)) = self.indexes.lock().unwrap_or_else(PoisonError::into_inner).by_url.get(url) {
            return Some(Arc::clone(read));
        }
        let (content_type, body) = self.cache.as_ref()?.index(url)?;
        let index = Index::parse(package, &content_type, &body).ok()?;
        Some(Arc::new(Read { index, body, content_type }))
    }

    /// Keeps `read` as the index at `url`: fresh for [`INDEX_FRESH`], then
    /// kept for when the registry is down, the oldest going first once
    /// [`INDEX_BYTES`] are held; and in the cache, when it changed.
    pub fn keep_index(&self, url: String, read: Arc<Read>) {
        let changed = self.keep_index_in_memory(url.clone(), Arc::clone(&read));
        // Written outside the lock: other boxes' reads do not wait on the disk.
        if let Some(cache) = self.cache.as_ref().filter(|_| changed) {
            if let Err(e) = cache.keep_index(&url, &read.content_type, &read.body) {
                tracing::warn!(error = %e, "cannot keep a package index");
            }
        }
    }

    /// Keeps `read` in memory; whether it differs from the read it replaces.
    fn keep_index_in_memory(&self, url: String, read: Arc<Read>) -> bool {
        let mut indexes = self.indexes.lock().unwrap_or_else(PoisonError::into_inner);
        let Indexes { by_url, bytes } = &mut *indexes;
        let old = by_url.remove(&url);
        if let Some((_, old)) = &old {
            *bytes -= old.body.len();
        }
        let changed = old.is_none_or(|(_, old)| old.body != read.body || old.content_type != read.content_type);
        if read.body.len() > INDEX_BYTES {
            return changed;
        }
        while *bytes + read.body.len() > INDEX_BYTES {
            let Some(oldest) = by_url.iter().min_by_key(|(_, (at, _))| *at).map(|(u, _)| u.clone()) else { break };
            if let Some((_, gone)) = by_url.remove(&oldest) {
                *bytes -= gone.body.len();
            }
        }
        *bytes += read.body.len();
        by_url.insert(url, (Instant::now(), read));
        changed
    }
}

/// The URL an index of `package` is read at (its host, and target).
pub fn index_url(package: &Package) -> (&'static str, String) {
    use moat_core::policy::Ecosystem;
    match package.ecosystem {
        Ecosystem::Pypi => ("pypi.org", format!("/simple/{}/", package.name)),
        Ecosystem::Npm => ("registry.npmjs.org", format!("/{}", package.raw.replace('/', "%2f"))),
        Ecosystem::Crates => {
            let lower = package.raw.to_ascii_lowercase();
            ("index.crates.io", format!("/{}/{lower}", route::crate_prefix(&lower).join("/")))
        }
    }
}
