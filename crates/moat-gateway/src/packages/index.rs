//! A package's index as its registry answers it, read into the files it
//! promises (each with its version, hash and publish time), and rewritten
//! without the versions the box's rules refuse. One format per file:
//! [`pypi`] (PEP 691 JSON and PEP 503 HTML), [`npm`], [`crates_io`].

use std::collections::HashSet;

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

    /// `body` without the entries `keep` says no to (`keep[i]` for
    /// `entries[i]`; `None`: it keeps all, and `body` goes as it came).
    pub fn rewrite(&self, body: &[u8], keep: &[bool]) -> Result<Option<Vec<u8>>, String> {
        let judged = self.entries.iter().zip(keep.iter().chain(std::iter::repeat(&true)));
        let (kept, dropped): (Vec<_>, Vec<_>) = judged.partition(|(_, keep)| **keep);
        if dropped.is_empty() {
            return Ok(None);
        }
        let files: HashSet<&str> = dropped.iter().map(|(e, _)| e.file.as_str()).collect();
        let versions: HashSet<&str> = dropped.iter().map(|(e, _)| e.version.as_str()).collect();
        let kept_versions: HashSet<&str> = kept.iter().map(|(e, _)| e.version.as_str()).collect();
        let out = match self.format {
            Format::PypiJson => pypi::rewrite_json(body, &|file| !files.contains(file))?,
            Format::PypiHtml => pypi::rewrite_html(body, &|file| !files.contains(file))?,
            Format::Npm => npm::rewrite(body, &|version| !versions.contains(version))?,
            Format::Crates => crates_io::rewrite(body, &|version| kept_versions.contains(version))?,
        };
        Ok(Some(out))
    }
}

/// Seconds since the epoch of an RFC 3339 time (`2024-05-01T10:00:00.123Z`).
pub fn epoch(text: &str) -> Option<u64> {
    let at = chrono::DateTime::parse_from_rfc3339(text.trim()).ok()?;
    u64::try_from(at.timestamp()).ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use moat_core::policy::Ecosystem;

    #[test]
    fn a_rewrite_leaves_out_what_keep_refuses_and_nothing_else() {
        let package = Package { ecosystem: Ecosystem::Crates, raw: "demo".into(), name: "demo".into() };
        let body = b"{\"name\":\"demo\",\"vers\":\"1.0.0\"}\n{\"name\":\"demo\",\"vers\":\"2.0.0\"}\n";
        let index = Index::parse(&package, "text/plain", body).unwrap();
        assert_eq!(index.rewrite(body, &[true, true]).unwrap(), None, "kept whole: sent as it came");
        let out = index.rewrite(body, &[true, false]).unwrap().unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "{\"name\":\"demo\",\"vers\":\"1.0.0\"}\n");
        let none = index.rewrite(body, &[false, false]).unwrap().unwrap();
        assert!(none.is_empty());
    }
}
