//! Package rules: which versions of which packages a box may download from
//! the registries the gateway knows (PyPI, npm, crates.io). They are data
//! here; the gateway reads each index and download against them
//! (`moat_gateway::packages`).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{glob_whole, HostName, PolicyError};

/// Most entries a lock may hold (the policy travels whole to the gateway).
pub const MAX_LOCKED: usize = 4096;
/// Most name patterns of each kind.
pub const MAX_PATTERNS: usize = 256;

/// A registry protocol the gateway knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ecosystem {
    /// PyPI: the simple index and its files.
    Pypi,
    /// The npm registry: package documents and tarballs.
    Npm,
    /// crates.io: the sparse index and downloads.
    Crates,
}

impl Ecosystem {
    /// Every ecosystem, in the order messages name them.
    pub const ALL: [Ecosystem; 3] = [Ecosystem::Pypi, Ecosystem::Npm, Ecosystem::Crates];

    /// Its name, as rules write it.
    pub fn name(self) -> &'static str {
        match self {
            Ecosystem::Pypi => "pypi",
            Ecosystem::Npm => "npm",
            Ecosystem::Crates => "crates",
        }
    }

    /// The ecosystem named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.name() == s)
    }

    /// The ecosystem whose registry `host` is, if the gateway knows it.
    pub fn of_host(host: &HostName) -> Option<Self> {
        match host.as_str() {
            "pypi.org" | "files.pythonhosted.org" => Some(Ecosystem::Pypi),
            "registry.npmjs.org" => Some(Ecosystem::Npm),
            "index.crates.io" | "static.crates.io" | "crates.io" => Some(Ecosystem::Crates),
            _ => None,
        }
    }

    /// A package name in the one form rules compare: PyPI's normal form
    /// (PEP 503: lower case, runs of `-_.` one `-`), crates.io's (lower
    /// case, `_` as `-`: the registry holds them as one name), npm's as is.
    pub fn normalise(self, name: &str) -> String {
        match self {
            Ecosystem::Pypi => {
                let mut out = String::with_capacity(name.len());
                for c in name.chars() {
                    if matches!(c, '-' | '_' | '.') {
                        if !out.ends_with('-') {
                            out.push('-');
                        }
                    } else {
                        out.push(c.to_ascii_lowercase());
                    }
                }
                out
            }
            Ecosystem::Crates => name.to_ascii_lowercase().replace('_', "-"),
            Ecosystem::Npm => name.to_string(),
        }
    }
}

impl fmt::Display for Ecosystem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Package names of one ecosystem: `pypi:requests`, `npm:@acme/*` (held as
/// that text, and checked again as it is decoded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NamePattern {
    /// The ecosystem.
    pub ecosystem: Ecosystem,
    /// The name, normalised, `*` matching any run.
    pub pattern: String,
}

impl NamePattern {
    /// Reads `ECOSYSTEM:PATTERN`.
    pub fn parse(s: &str) -> Result<Self, PolicyError> {
        let bad = || {
            PolicyError::BadPackages(format!("{s:?} is not ECOSYSTEM:NAME (pypi:, npm: or crates:, '*' for any run)"))
        };
        let (eco, pattern) = s.split_once(':').ok_or_else(bad)?;
        let ecosystem = Ecosystem::parse(eco).ok_or_else(bad)?;
        let ok = |c: char| c.is_ascii_alphanumeric() || "-_.@/*".contains(c);
        if pattern.is_empty() || pattern.len() > 214 || !pattern.chars().all(ok) {
            return Err(bad());
        }
        Ok(Self { ecosystem, pattern: ecosystem.normalise(pattern) })
    }

    /// Whether it names `name` (normalised) of `ecosystem`.
    pub fn matches(&self, ecosystem: Ecosystem, name: &str) -> bool {
        self.ecosystem == ecosystem && glob_whole(self.pattern.as_bytes(), name.as_bytes())
    }
}

impl TryFrom<String> for NamePattern {
    type Error = PolicyError;
    fn try_from(s: String) -> Result<Self, PolicyError> {
        Self::parse(&s)
    }
}

impl From<NamePattern> for String {
    fn from(p: NamePattern) -> String {
        p.to_string()
    }
}

impl fmt::Display for NamePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.ecosystem, self.pattern)
    }
}

/// A file's hash as an index promises it: `sha256:HEX` (also sha512, sha1).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct FileHash {
    /// `sha256`, `sha512` or `sha1`.
    pub algorithm: HashAlgorithm,
    /// The digest, lower-case hex.
    pub hex: String,
}

/// The hashes indexes promise files by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HashAlgorithm {
    /// SHA-1 (npm's `shasum`, where a package has no `integrity`).
    Sha1,
    /// SHA-256 (PyPI, crates.io).
    Sha256,
    /// SHA-512 (npm's `integrity`).
    Sha512,
}

impl HashAlgorithm {
    /// Its name, as hashes are written.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgorithm::Sha1 => "sha1",
            HashAlgorithm::Sha256 => "sha256",
            HashAlgorithm::Sha512 => "sha512",
        }
    }

    /// The digest's length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgorithm::Sha1 => 20,
            HashAlgorithm::Sha256 => 32,
            HashAlgorithm::Sha512 => 64,
        }
    }
}

impl FileHash {
    /// A hash of `algorithm` (`sha256`...) with `hex` digits, checked.
    pub fn new(algorithm: &str, hex: &str) -> Option<Self> {
        let algorithm = [HashAlgorithm::Sha1, HashAlgorithm::Sha256, HashAlgorithm::Sha512]
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(algorithm))?;
        let hex = hex.to_ascii_lowercase();
        let ok = hex.len() == algorithm.digest_len() * 2 && hex.bytes().all(|b| b.is_ascii_hexdigit());
        ok.then_some(Self { algorithm, hex })
    }

    /// Reads `ALGORITHM:HEX` (or `ALGORITHM=HEX`, as URLs and pip write it).
    pub fn parse(s: &str) -> Option<Self> {
        let (algorithm, hex) = s.split_once([':', '='])?;
        Self::new(algorithm, hex)
    }
}

impl TryFrom<String> for FileHash {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Self::parse(&s).ok_or_else(|| format!("{s:?} is not a file hash (sha256:HEX)"))
    }
}

impl From<FileHash> for String {
    fn from(h: FileHash) -> String {
        h.to_string()
    }
}

impl fmt::Display for FileHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.algorithm.name(), self.hex)
    }
}

/// One version a lock lets in, and the hashes its files may have (none
/// listed: any the index promises).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Locked {
    /// The ecosystem.
    pub ecosystem: Ecosystem,
    /// The name, normalised.
    pub name: String,
    /// The exact version.
    pub version: String,
    /// The hashes its files may have.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hashes: Vec<FileHash>,
}

/// What a version whose index gives no publish time meets under `min-age`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownAge {
    /// Let it in (and say so in the log).
    #[default]
    Allow,
    /// Refuse it.
    Deny,
}

/// How bad an advisory must be for `advisories` to refuse what it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Any advisory at all.
    Low,
    /// Medium or worse.
    Medium,
    /// High or worse.
    High,
    /// Critical only.
    Critical,
    /// Only reports of malicious packages (`MAL-` records).
    Malicious,
}

impl Severity {
    /// Every level, least first.
    pub const ALL: [Severity; 5] =
        [Severity::Low, Severity::Medium, Severity::High, Severity::Critical, Severity::Malicious];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Severity::Low => "low",
            Severity::Medium => "medium",
            Severity::High => "high",
            Severity::Critical => "critical",
            Severity::Malicious => "malicious",
        }
    }

    /// The level named `s` (case folded).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|l| l.name().eq_ignore_ascii_case(s))
    }
}

/// A box's package rules. Empty: the gateway checks files against their
/// index and caches them, and refuses nothing on their account.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackageRules {
    /// Refuse versions published less than this many seconds ago.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_age_secs: Option<u64>,
    /// Versions of no known age, under `min_age_secs`.
    #[serde(default)]
    pub unknown_age: UnknownAge,
    /// Names refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<NamePattern>,
    /// Where an ecosystem has any, the only names of it let in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_only: Vec<NamePattern>,
    /// Where an ecosystem has any entry, the only versions of it let in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lock: Vec<Locked>,
    /// Refuse versions the operator's OSV database names at this level or
    /// worse (malicious ones at every level).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advisories: Option<Severity>,
}

/// A version as an index describes it, for the rules to judge.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// The ecosystem.
    pub ecosystem: Ecosystem,
    /// The package's name, normalised.
    pub name: &'a str,
    /// The version.
    pub version: &'a str,
    /// When the index says it was published (seconds since the epoch).
    pub published: Option<u64>,
    /// The hash of the file asked for, where one is.
    pub hash: Option<&'a FileHash>,
}

/// Why a package or version is refused: the rule, and the reason in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The rule, as `policy NAME` shows it.
    pub rule: String,
    /// Why, for the client's output and the log.
    pub why: String,
}

impl PackageRules {
    /// Whether there are no rules at all.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Why the name `name` (normalised) of `ecosystem` is refused, if it is.
    pub fn refuse_name(&self, ecosystem: Ecosystem, name: &str) -> Option<Refused> {
        if let Some(p) = self.deny.iter().find(|p| p.matches(ecosystem, name)) {
            return Some(Refused {
                rule: format!("packages deny {p}"),
                why: format!("{ecosystem} package {name} is denied"),
            });
        }
        let only: Vec<_> = self.allow_only.iter().filter(|p| p.ecosystem == ecosystem).collect();
        if !only.is_empty() && !only.iter().any(|p| p.matches(ecosystem, name)) {
            let list = only.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ");
            return Some(Refused {
                rule: format!("packages allow-only {list}"),
                why: format!("{ecosystem} package {name} is not among those allowed"),
            });
        }
        let locked: Vec<_> = self.lock.iter().filter(|l| l.ecosystem == ecosystem).collect();
        if !locked.is_empty() && !locked.iter().any(|l| l.name == name) {
            return Some(Refused {
                rule: "packages lock".into(),
                why: format!("{ecosystem} package {name} is not in the lock"),
            });
        }
        None
    }

    /// Why version `c` is refused by the rules that need no database, if it
    /// is (`now`: seconds since the epoch). Its name is judged too.
    pub fn refuse_version(&self, c: &Candidate<'_>, now: u64) -> Option<Refused> {
        if let Some(refused) = self.refuse_name(c.ecosystem, c.name) {
            return Some(refused);
        }
        let locked: Vec<_> = self.lock.iter().filter(|l| l.ecosystem == c.ecosystem && l.name == c.name).collect();
        if !locked.is_empty() {
            let Some(entry) = locked.iter().find(|l| l.version == c.version) else {
                return Some(Refused {
                    rule: "packages lock".into(),
                    why: format!("{} {} {} is not the locked version", c.ecosystem, c.name, c.version),
                });
            };
            if let Some(hash) = c.hash {
                let same_kind = entry.hashes.iter().any(|h| h.algorithm == hash.algorithm);
                if same_kind && !entry.hashes.contains(hash) {
                    return Some(Refused {
                        rule: "packages lock".into(),
                        why: format!("{} {} {}: this file's hash is not in the lock", c.ecosystem, c.name, c.version),
                    });
                }
            }
        }
        let min_age = self.min_age_secs?;
        let rule = format!("packages min-age {}", age_text(min_age));
        match c.published {
            Some(at) if now.saturating_sub(at) < min_age => Some(Refused {
                rule,
                why: format!(
                    "{} {} {} was published {} ago, less than {}",
                    c.ecosystem,
                    c.name,
                    c.version,
                    age_text(now.saturating_sub(at)),
                    age_text(min_age)
                ),
            }),
            None if self.unknown_age == UnknownAge::Deny => Some(Refused {
                rule: format!("{rule} --unknown-age deny"),
                why: format!("{} {} {}: the index gives no publish time", c.ecosystem, c.name, c.version),
            }),
            _ => None,
        }
    }

    /// Applies an owner's change.
    pub fn apply(&mut self, change: PackagesChange) -> Result<(), PolicyError> {
        let full = |what: &str| PolicyError::BadPackages(format!("at most {MAX_PATTERNS} {what} patterns"));
        match change {
            PackagesChange::MinAge { secs, unknown } => {
                self.min_age_secs = secs;
                self.unknown_age = unknown;
            }
            PackagesChange::Deny(p) => {
                if !self.deny.contains(&p) {
                    (self.deny.len() < MAX_PATTERNS).then_some(()).ok_or_else(|| full("deny"))?;
                    self.deny.push(p);
                }
            }
            PackagesChange::AllowOnly(p) => {
                if !self.allow_only.contains(&p) {
                    (self.allow_only.len() < MAX_PATTERNS).then_some(()).ok_or_else(|| full("allow-only"))?;
                    self.allow_only.push(p);
                }
            }
            PackagesChange::Remove(p) => {
                self.deny.retain(|d| *d != p);
                self.allow_only.retain(|d| *d != p);
            }
            PackagesChange::Lock(entries) => {
                if entries.len() > MAX_LOCKED {
                    return Err(PolicyError::BadPackages(format!("a lock holds at most {MAX_LOCKED} versions")));
                }
                // A new lock of an ecosystem replaces its old one.
                let ecosystems: Vec<Ecosystem> = entries.iter().map(|l| l.ecosystem).collect();
                self.lock.retain(|l| !ecosystems.contains(&l.ecosystem));
                self.lock.extend(entries);
                if self.lock.len() > MAX_LOCKED {
                    return Err(PolicyError::BadPackages(format!("a lock holds at most {MAX_LOCKED} versions")));
                }
            }
            PackagesChange::Unlock(ecosystem) => self.lock.retain(|l| l.ecosystem != ecosystem),
            PackagesChange::Advisories(level) => self.advisories = level,
            PackagesChange::Clear => *self = Self::default(),
        }
        Ok(())
    }

    /// Its rules, a line each, as `policy NAME` shows them.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(secs) = self.min_age_secs {
            let unknown = match self.unknown_age {
                UnknownAge::Allow => "allow",
                UnknownAge::Deny => "deny",
            };
            out.push(format!("packages min-age {} --unknown-age {unknown}", age_text(secs)));
        }
        out.extend(self.deny.iter().map(|p| format!("packages deny {p}")));
        out.extend(self.allow_only.iter().map(|p| format!("packages allow-only {p}")));
        for eco in Ecosystem::ALL {
            let n = self.lock.iter().filter(|l| l.ecosystem == eco).count();
            if n > 0 {
                out.push(format!("packages lock {eco}: {n} versions"));
            }
        }
        if let Some(level) = self.advisories {
            out.push(format!("packages advisories --severity {}", level.name()));
        }
        out
    }
}

/// An age in the largest whole unit: `7d`, `3h`, `90s`.
pub fn age_text(secs: u64) -> String {
    match secs {
        s if s >= 86_400 && s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s >= 86_400 => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
        s if s >= 3600 => format!("{}h", s / 3600),
        s if s >= 60 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// A change to a box's package rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PackagesChange {
    /// Set (or, with `None`, drop) the minimum age, and what a version of
    /// unknown age meets.
    MinAge {
        /// Seconds.
        secs: Option<u64>,
        /// Unknown ages.
        unknown: UnknownAge,
    },
    /// Refuse names matching this.
    Deny(NamePattern),
    /// Let in only names matching these (per ecosystem).
    AllowOnly(NamePattern),
    /// Drop a `deny` or `allow-only` pattern.
    Remove(NamePattern),
    /// Let in only these versions (replacing the lock of their ecosystems).
    Lock(Vec<Locked>),
    /// Drop an ecosystem's lock.
    Unlock(Ecosystem),
    /// Turn advisories on at a level, or off.
    Advisories(Option<Severity>),
    /// Drop every package rule.
    Clear,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn candidate<'a>(name: &'a str, version: &'a str, published: Option<u64>) -> Candidate<'a> {
        Candidate { ecosystem: Ecosystem::Pypi, name, version, published, hash: None }
    }

    #[test]
    fn names_normalise_per_ecosystem() {
        assert_eq!(Ecosystem::Pypi.normalise("Foo__Bar.baz"), "foo-bar-baz");
        assert_eq!(Ecosystem::Crates.normalise("Serde_JSON"), "serde-json");
        assert_eq!(Ecosystem::Npm.normalise("@Acme/x_y"), "@Acme/x_y");
        assert_eq!(NamePattern::parse("pypi:Req_uests*").unwrap().to_string(), "pypi:req-uests*");
        for bad in ["requests", "rubygems:x", "pypi:", "npm:a b", "pypi:a\nb"] {
            assert!(NamePattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn each_rule_refuses_with_its_name() {
        let mut rules = PackageRules::default();
        rules.apply(PackagesChange::MinAge { secs: Some(7 * 86_400), unknown: UnknownAge::Allow }).unwrap();
        rules.apply(PackagesChange::Deny(NamePattern::parse("pypi:reqeusts").unwrap())).unwrap();
        let now = 100 * 86_400;
        let fresh = rules.refuse_version(&candidate("demo", "2.0", Some(now - 3600)), now).unwrap();
        assert_eq!(fresh.rule, "packages min-age 7d");
        assert!(fresh.why.contains("published 1h ago"), "{}", fresh.why);
        assert!(rules.refuse_version(&candidate("demo", "1.0", Some(now - 30 * 86_400)), now).is_none());
        assert!(rules.refuse_version(&candidate("demo", "1.0", None), now).is_none());
        assert_eq!(rules.refuse_name(Ecosystem::Pypi, "reqeusts").unwrap().rule, "packages deny pypi:reqeusts");
        assert!(rules.refuse_name(Ecosystem::Npm, "reqeusts").is_none());
        rules.apply(PackagesChange::MinAge { secs: Some(7 * 86_400), unknown: UnknownAge::Deny }).unwrap();
        assert!(rules.refuse_version(&candidate("demo", "1.0", None), now).is_some());

        rules.apply(PackagesChange::AllowOnly(NamePattern::parse("npm:@acme/*").unwrap())).unwrap();
        assert!(rules.refuse_name(Ecosystem::Npm, "@acme/ui").is_none());
        assert!(rules.refuse_name(Ecosystem::Npm, "left-pad").is_some());
        assert!(rules.refuse_name(Ecosystem::Crates, "serde").is_none(), "allow-only is per ecosystem");
        assert_eq!(rules.lines().len(), 3);
    }

    #[test]
    fn a_lock_lets_in_its_versions_and_hashes_alone() {
        let mut rules = PackageRules::default();
        assert!(FileHash::parse("sha256:").is_none());
        assert!(FileHash::parse(&format!("md5:{}", "ab".repeat(16))).is_none());
        let good = FileHash::new("sha256", &"ab".repeat(32)).unwrap();
        let other = FileHash::new("sha256", &"cd".repeat(32)).unwrap();
        let locked = Locked {
            ecosystem: Ecosystem::Pypi,
            name: "demo".into(),
            version: "1.0".into(),
            hashes: vec![good.clone()],
        };
        rules.apply(PackagesChange::Lock(vec![locked])).unwrap();
        let at = |version, hash| Candidate { ecosystem: Ecosystem::Pypi, name: "demo", version, published: None, hash };
        assert!(rules.refuse_version(&at("1.0", Some(&good)), 0).is_none());
        assert!(rules.refuse_version(&at("1.0", Some(&other)), 0).unwrap().why.contains("hash"));
        assert!(rules.refuse_version(&at("2.0", Some(&good)), 0).unwrap().why.contains("locked version"));
        assert!(rules.refuse_name(Ecosystem::Pypi, "other").is_some());
        assert!(rules.refuse_name(Ecosystem::Npm, "other").is_none(), "a lock is per ecosystem");
        assert_eq!(FileHash::parse(&format!("sha256={}", "AB".repeat(32))), Some(good));
    }
}
