//! A package's index as its registry answers it, read into the files it
//! promises (each with its version, hash and publish time), and rewritten
//! without the versions the box's rules refuse. One format per file:
//! [`pypi`] (PEP 691 JSON and PEP 503 HTML), [`npm`], [`crates_io`].

use moat_core::policy::packages::FileHash;

use super::route::Package;
use super::{crates_io, npm, pypi};

/// Largest index read (npm's documents of old, busy packages run to tens of MB).
pub const MAX_INDEX: usize = 64 << 20;
/// Most files one index may list.
pub const MAX_ENTRIES: usize = 200_000;

/// One file an index promises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its version.
    pub version: String,
    /// Its file name (a wheel's, a tarball's, `NAME-VERSION.crate`).
    pub file: String,
    /// The hash the index promises for it (the strongest given).
    pub hash: Option<FileHash>,
    /// When it was published, in seconds since the epoch, where the index says.
    pub published: Option<u64>,
}

/// The formats an index comes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// PyPI's simple API as JSON (PEP 691): hashes and upload times.
    PypiJson,
    /// PyPI's simple API as HTML (PEP 503): hashes in the links, no times.
    PypiHtml,
    /// An npm package document (the full one: `time` holds publish times).
    Npm,
    /// A crates.io sparse index file: a JSON line per version.
    Crates,
}

/// A package's index, read.
#[derive(Debug, Clone)]
pub struct Index {
    /// Its format.
    pub format: Format,
    /// Every file it lists.
    pub entries: Vec<Entry>,
}

impl Index {
    /// Reads `body`, the index of `package` answered as `content_type`.
    pub fn parse(package: &Package, content_type: &str, body: &[u8]) -> Result<Self, String> {
        use moat_core::policy::Ecosystem;
        if body.len() > MAX_INDEX {
            return Err(format!("larger than {} MiB", MAX_INDEX >> 20));
        }
        let (format, entries) = match package.ecosystem {
            Ecosystem::Pypi if content_type.contains("json") => (Format::PypiJson, pypi::parse_json(body)?),
            Ecosystem::Pypi => (Format::PypiHtml, pypi::parse_html(body)?),
            Ecosystem::Npm => (Format::Npm, npm::parse(body)?),
            Ecosystem::Crates => (Format::Crates, crates_io::parse(body)?),
        };
        if entries.len() > MAX_ENTRIES {
            return Err(format!("more than {MAX_ENTRIES} files"));
        }
        Ok(Self { format, entries })
    }

    /// The entry for `file` of `version` (PyPI lists files; npm and crates.io
    /// one file a version).
    pub fn entry(&self, version: &str, file: &str) -> Option<&Entry> {
        match self.format {
            Format::PypiJson | Format::PypiHtml => self.entries.iter().find(|e| e.file == file),
            Format::Npm | Format::Crates => self.entries.iter().find(|e| e.version == version),
        }
    }

    /// `body` without the entries `keep` refuses (`None`: it keeps all, and
    /// `body` goes as it came).
    pub fn rewrite(&self, body: &[u8], keep: &dyn Fn(&Entry) -> bool) -> Result<Option<Vec<u8>>, String> {
        if self.entries.iter().all(keep) {
            return Ok(None);
        }
        let dropped = |file: &str, version: &str| {
            self.entries
                .iter()
                .any(|e| !keep(e) && (e.file == file || (self.format == Format::Npm && e.version == version)))
        };
        let out = match self.format {
            Format::PypiJson => pypi::rewrite_json(body, &|file| !dropped(file, ""))?,
            Format::PypiHtml => pypi::rewrite_html(body, &|file| !dropped(file, ""))?,
            Format::Npm => npm::rewrite(body, &|version| !dropped("", version))?,
            Format::Crates => {
                crates_io::rewrite(body, &|version| self.entries.iter().any(|e| e.version == version && keep(e)))?
            }
        };
        Ok(Some(out))
    }
}

/// Seconds since the epoch of an RFC 3339 time (`2024-05-01T10:00:00.123Z`).
pub fn epoch(text: &str) -> Option<u64> {
    let at = chrono::DateTime::parse_from_rfc3339(text.trim()).ok()?;
    u64::try_from(at.timestamp()).ok()
}
