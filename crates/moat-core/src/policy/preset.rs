//! The policies moat ships by name (`new --policy`, `policy NAME preset`,
//! `serve --default-policy`): none, read-only registries, GitHub read-only.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{HostName, Policy, PolicyError, Rule};

/// The presets moat ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// Nothing at all.
    None,
    /// Read-only access (GET and HEAD) to the host's package registries.
    Registries,
    /// Clone and fetch from GitHub over HTTPS, never push.
    GithubRead,
}

impl Preset {
    /// Every preset, in the order `help` names them.
    pub const ALL: [Preset; 3] = [Preset::None, Preset::Registries, Preset::GithubRead];

    /// Its name, as users type it.
    pub fn name(self) -> &'static str {
        match self {
            Preset::None => "none",
            Preset::Registries => "registries",
            Preset::GithubRead => "github-read",
        }
    }

    /// Every preset's name, for messages: `none, registries, github-read`.
    pub fn names() -> String {
        Self::ALL.map(Preset::name).join(", ")
    }

    /// The preset named `name`.
    pub fn parse(name: &str) -> Result<Self, PolicyError> {
        Self::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| PolicyError::NoPreset(name.to_string()))
    }

    /// Its policy. `registries` is read-only access (GET and HEAD) to the
    /// given registry hosts.
    pub fn policy(self, registries: &[HostName]) -> Result<Policy, PolicyError> {
        let rule = |text: &str| {
            let words: Vec<&str> = text.split(' ').collect();
            Rule::parse(&words)
        };
        let mut policy = Policy::default();
        match self {
            Preset::None => {}
            Preset::Registries => {
                for host in registries {
                    policy.allow(Rule { methods: vec!["GET".into(), "HEAD".into()], ..rule(host.as_str())? });
                }
            }
            Preset::GithubRead => {
                for text in GITHUB_READ {
                    policy.allow(rule(text)?);
                }
                policy.deny(rule("github.com/*git-receive-pack")?);
            }
        }
        Ok(policy)
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The hosts of the `github-read` preset and what they allow: clone and fetch
/// over HTTPS (the smart protocol's ref advertisement and `git-upload-pack`),
/// never `git-receive-pack`, and no API writes.
const GITHUB_READ: &[&str] = &[
    "GET,HEAD github.com",
    "POST github.com/*/git-upload-pack",
    "GET,HEAD codeload.github.com",
    "GET,HEAD objects.githubusercontent.com",
    "GET,HEAD raw.githubusercontent.com",
    "GET,HEAD api.github.com",
];

/// Registries every host's tools default to; [`preset`] adds the ones the
/// host itself is configured with.
pub const DEFAULT_REGISTRIES: &[&str] = &[
    "deb.debian.org",
    "security.debian.org",
    "pypi.org",
    "files.pythonhosted.org",
    "registry.npmjs.org",
    "index.crates.io",
    "static.crates.io",
    "crates.io",
];

/// The policy of the preset named `name` (see [`Preset::policy`]).
pub fn preset(name: &str, registries: &[HostName]) -> Result<Policy, PolicyError> {
    Preset::parse(name)?.policy(registries)
}
