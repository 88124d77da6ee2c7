//! Image references, as `docker pull` reads them: `[REGISTRY/]REPO[:TAG][@DIGEST]`.
//! The first part is a registry when it has a `.` or a `:` or is
//! `localhost`; otherwise the operator's default registry (`--registry`) is
//! meant, and on Docker Hub a one-part name is under `library/`.

use std::fmt;

use crate::digest::Digest;

/// Docker Hub's API host, and the name people give it.
pub const DOCKER_HUB: &str = "registry-1.docker.io";
const DOCKER_HUB_NAMES: &[&str] = &["docker.io", "index.docker.io", DOCKER_HUB];

/// An image reference, resolved against the default registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `HOST[:PORT]`.
    pub registry: String,
    /// The repository path (`library/python`).
    pub repository: String,
    /// The tag (`latest` unless given; ignored when a digest is).
    pub tag: String,
    /// A digest pinning the manifest, if given.
    pub digest: Option<Digest>,
}

/// Why a reference does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    /// Empty, too long or with characters no registry allows.
    #[error("{0:?} is not an image reference (like python:3.12-slim or ghcr.io/org/img@sha256:...)")]
    Malformed(String),
    /// A short name with no default registry to resolve it against.
    #[error("{0:?} names no registry and the server has no default (moat serve --registry)")]
    NoRegistry(String),
    /// The digest part is not a sha256 digest.
    #[error(transparent)]
    Digest(#[from] crate::digest::DigestError),
}

impl Reference {
    /// Parses `text`, resolving a short name against `default_registry`.
    pub fn parse(text: &str, default_registry: Option<&str>) -> Result<Self, ReferenceError> {
        let bad = || ReferenceError::Malformed(text.chars().take(120).collect());
        if text.is_empty() || text.len() > 512 {
            return Err(bad());
        }
        let (rest, digest) = match text.split_once('@') {
            Some((rest, digest)) => (rest, Some(Digest::parse(digest)?)),
            None => (text, None),
        };
        // A tag follows the last ':' after the last '/' (a port is before it).
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest.get(last_slash..).and_then(|tail| tail.rfind(':')) {
            Some(i) => {
                let at = last_slash + i;
                (rest.get(..at).ok_or_else(bad)?, rest.get(at + 1..).ok_or_else(bad)?)
            }
            None => (rest, "latest"),
        };
        if !valid_tag(tag) {
            return Err(bad());
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, repo)) if first.contains(['.', ':']) || first == "localhost" => {
                (first.to_string(), repo.to_string())
            }
            _ => {
                let registry = default_registry.ok_or_else(|| ReferenceError::NoRegistry(text.to_string()))?;
                (registry.to_string(), name.to_string())
            }
        };
        if !valid_registry(&registry) {
            return Err(bad());
        }
        let registry = if DOCKER_HUB_NAMES.contains(&registry.as_str()) { DOCKER_HUB.to_string() } else { registry };
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        if !valid_repository(&repository) {
            return Err(bad());
        }
        Ok(Self { registry, repository, tag: tag.to_string(), digest })
    }

    /// What the manifest is asked for by: the digest if pinned, else the tag.
    pub fn manifest_ref(&self) -> String {
        self.digest.as_ref().map_or_else(|| self.tag.clone(), |d| d.to_string())
    }

    /// A name for the image in the account's list: the repository's last
    /// part and the tag, as a box name may be spelled (`python-3.12-slim`
    /// becomes `python-3-12-slim`).
    pub fn local_name(&self) -> String {
        let last = self.repository.rsplit('/').next().unwrap_or(&self.repository);
        let tail = if self.digest.is_some() {
            self.digest.as_ref().map(|d| d.short().to_string()).unwrap_or_default()
        } else {
            self.tag.clone()
        };
        let raw = if tail == "latest" { last.to_string() } else { format!("{last}-{tail}") };
        let mut name: String = raw
            .to_ascii_lowercase()
            .chars()
            .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' })
            .collect();
        while name.contains("--") {
            name = name.replace("--", "-");
        }
        let name = name.trim_matches('-');
        name.chars().take(63).collect::<String>().trim_end_matches('-').to_string()
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        match &self.digest {
            Some(d) => write!(f, "@{d}"),
            None => write!(f, ":{}", self.tag),
        }
    }
}

fn valid_tag(tag: &str) -> bool {
    (1..=128).contains(&tag.len())
        && tag.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        && !tag.starts_with(['.', '-'])
}

fn valid_registry(host: &str) -> bool {
    let (name, port) = match host.rsplit_once(':') {
        Some((name, port)) => (name, Some(port)),
        None => (host, None),
    };
    (1..=253).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !name.starts_with(['-', '.'])
        && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0))
}

fn valid_repository(repo: &str) -> bool {
    (1..=255).contains(&repo.len())
        && repo.split('/').all(|part| {
            !part.is_empty()
                && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && part.starts_with(|c: char| c.is_ascii_alphanumeric())
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn references_resolve_like_docker_pull() {
        let r = Reference::parse("python:3.12-slim", Some("docker.io")).unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_str()),
            (DOCKER_HUB, "library/python", "3.12-slim")
        );
        assert_eq!(r.local_name(), "python-3-12-slim");
        let d = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let r = Reference::parse(&format!("ghcr.io/org/img@{d}"), None).unwrap();
        assert_eq!((r.registry.as_str(), r.repository.as_str()), ("ghcr.io", "org/img"));
        assert_eq!(r.manifest_ref(), d);
        assert_eq!(r.local_name(), "img-e3b0c44298fc");
        let r = Reference::parse("registry.test:5000/moat/tiny:v1", None).unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_str()),
            ("registry.test:5000", "moat/tiny", "v1")
        );
        let r = Reference::parse("moat/tiny", Some("registry.test")).unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_str()),
            ("registry.test", "moat/tiny", "latest")
        );
        assert_eq!(r.local_name(), "tiny");
        assert_eq!(r.to_string(), "registry.test/moat/tiny:latest");
    }

    #[test]
    fn bad_references_are_refused() {
        assert!(matches!(Reference::parse("tiny", None), Err(ReferenceError::NoRegistry(_))));
        for bad in [
            "",
            "UPPER/case",
            "reg.test/../x",
            "reg.test//x",
            "reg.test/x:",
            "reg.test/x:-tag",
            "reg.test/x@sha256:zz",
            "reg.test:99999/x",
            "reg.test/x y",
            "-reg.test/x",
        ] {
            assert!(Reference::parse(bad, Some("reg.test")).is_err(), "{bad}");
        }
    }
}
