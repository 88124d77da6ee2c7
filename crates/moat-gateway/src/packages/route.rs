//! What a request to a registry asks for, from its host and path alone: a
//! package's index (its versions and files), one file of one version, or
//! something else the gateway passes on as it is (`config.json`, search).

use moat_core::policy::{Ecosystem, HostName};

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wanted {
    /// A package's index: PyPI's simple page, npm's package document,
    /// crates.io's sparse index file.
    Index(Package),
    /// A file of a version: a wheel or sdist, a tarball, a `.crate`.
    File {
        /// Whose.
        package: Package,
        /// The version, as the path names it.
        version: String,
        /// The file's name, as the index lists it.
        file: String,
    },
    /// A path under a registry's files that is none of the files the
    /// gateway can check: refused, so that no file comes in unjudged.
    Unchecked,
    /// Anything else (metadata, `config.json`, search): passed on.
    Other,
}

/// A package of an ecosystem.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Package {
    /// The ecosystem.
    pub ecosystem: Ecosystem,
    /// The name as the registry spells it in paths.
    pub raw: String,
    /// The name normalised (see [`Ecosystem::normalise`]), as rules see it.
    pub name: String,
}

impl Package {
    fn new(ecosystem: Ecosystem, raw: &str) -> Option<Self> {
        let ok = |c: char| c.is_ascii_alphanumeric() || "-_.@/".contains(c);
        let sane = !raw.is_empty() && raw.len() <= 214 && raw.chars().all(ok) && !raw.contains("..");
        sane.then(|| Self { ecosystem, raw: raw.to_string(), name: ecosystem.normalise(raw) })
    }
}

/// What `target` (origin form, normalised) on `host` asks for.
pub fn route(host: &HostName, target: &str) -> Wanted {
    let path = target.split(['?', '#']).next().unwrap_or_default();
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let wanted = match (host.as_str(), parts.as_slice()) {
        ("pypi.org", ["simple", name]) => Package::new(Ecosystem::Pypi, name).map(Wanted::Index),
        ("pypi.org" | "files.pythonhosted.org", [.., file])
            if path.starts_with("/packages/") || path.starts_with("/files/") =>
        {
            route_python_file(file)
        }
        ("registry.npmjs.org", [name]) if !name.starts_with('-') => {
            // A scoped name's slash comes escaped (`@scope%2fname`).
            let name = name.replace("%2f", "/").replace("%2F", "/");
            Package::new(Ecosystem::Npm, &name).map(Wanted::Index)
        }
        ("registry.npmjs.org", [scope, name]) if scope.starts_with('@') => {
            Package::new(Ecosystem::Npm, &format!("{scope}/{name}")).map(Wanted::Index)
        }
        ("registry.npmjs.org", [name @ .., "-", file]) => npm_file(&name.join("/"), file),
        ("index.crates.io", [prefix @ .., name])
            if prefix.iter().copied().eq(crate_prefix(name).iter().map(String::as_str)) =>
        {
            Package::new(Ecosystem::Crates, name).map(Wanted::Index)
        }
        ("static.crates.io", ["crates", name, version, "download"]) => crate_file(name, version),
        ("static.crates.io", ["crates", name, file]) => file
            .strip_suffix(".crate")
            .and_then(|f| f.strip_prefix(&format!("{name}-")))
            .and_then(|version| crate_file(name, version)),
        _ => None,
    };
    wanted.unwrap_or_else(|| {
        let files = match host.as_str() {
            "files.pythonhosted.org" | "pypi.org" => {
                (path.starts_with("/packages/") || path.starts_with("/files/")) && !path.ends_with(".metadata")
            }
            "registry.npmjs.org" => path.contains("/-/") && !path.starts_with("/-/"),
            "static.crates.io" => true,
            _ => false,
        };
        if files {
            Wanted::Unchecked
        } else {
            Wanted::Other
        }
    })
}

/// The directories of a sparse index a crate's file sits under.
pub fn crate_prefix(name: &str) -> Vec<String> {
    let lower = name.to_ascii_lowercase();
    match lower.len() {
        0 => vec!["".into()],
        1 => vec!["1".into()],
        2 => vec!["2".into()],
        3 => vec!["3".into(), lower.get(..1).unwrap_or_default().into()],
        _ => vec![lower.get(..2).unwrap_or_default().into(), lower.get(2..4).unwrap_or_default().into()],
    }
}

/// A version as registries write them (PEP 440's `!` and `+` among them).
fn sane_version(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 128
        && !v.contains("..")
        && v.chars().all(|c| c.is_ascii_alphanumeric() || ".-+_!".contains(c))
}

fn crate_file(name: &str, version: &str) -> Option<Wanted> {
    if !sane_version(version) {
        return None;
    }
    let package = Package::new(Ecosystem::Crates, name)?;
    let file = format!("{}-{version}.crate", package.raw);
    Some(Wanted::File { package, version: version.to_string(), file })
}

/// `NAME/-/BASENAME-VERSION.tgz` (`@scope/name/-/name-1.0.0.tgz`).
fn npm_file(name: &str, file: &str) -> Option<Wanted> {
    let package = Package::new(Ecosystem::Npm, name)?;
    let base = name.rsplit('/').next()?;
    let version = file.strip_suffix(".tgz")?.strip_prefix(base)?.strip_prefix('-')?;
    sane_version(version).then(|| Wanted::File { version: version.to_string(), file: file.to_string(), package })
}

/// A wheel (`NAME-VERSION(-BUILD)?-PY-ABI-PLATFORM.whl`) or an sdist
/// (`NAME-VERSION.tar.gz` or `.zip`).
pub fn route_python_file(file: &str) -> Option<Wanted> {
    let (name, version) = if let Some(stem) = file.strip_suffix(".whl") {
        let mut parts = stem.split('-');
        (parts.next()?, parts.next()?)
    } else {
        let stem = [".tar.gz", ".zip", ".tar.bz2", ".tgz"].iter().find_map(|ext| file.strip_suffix(ext))?;
        stem.rsplit_once('-')?
    };
    let package = Package::new(Ecosystem::Pypi, name)?;
    sane_version(version).then(|| Wanted::File { version: version.to_string(), file: file.to_string(), package })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    fn at(host: &str, target: &str) -> Wanted {
        route(&HostName::parse(host).unwrap(), target)
    }

    fn file(w: Wanted) -> (String, String, String) {
        match w {
            Wanted::File { package, version, file } => (package.name, version, file),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn each_registry_s_paths() {
        assert!(matches!(at("pypi.org", "/simple/Demo_Pkg/"), Wanted::Index(p) if p.name == "demo-pkg"));
        assert_eq!(at("pypi.org", "/simple/"), Wanted::Other);
        assert_eq!(
            file(at("files.pythonhosted.org", "/packages/ab/cd/demo_pkg-1.0-py3-none-any.whl")),
            ("demo-pkg".into(), "1.0".into(), "demo_pkg-1.0-py3-none-any.whl".into())
        );
        assert_eq!(file(at("pypi.org", "/files/demo-2.0.tar.gz?x=1")).1, "2.0");
        assert!(matches!(at("registry.npmjs.org", "/@acme%2fui"), Wanted::Index(p) if p.name == "@acme/ui"));
        assert!(matches!(at("registry.npmjs.org", "/left-pad"), Wanted::Index(_)));
        assert_eq!(at("registry.npmjs.org", "/-/npm/v1/security/audits"), Wanted::Other);
        assert_eq!(
            file(at("registry.npmjs.org", "/@acme/ui/-/ui-1.2.3.tgz")),
            ("@acme/ui".into(), "1.2.3".into(), "ui-1.2.3.tgz".into())
        );
        assert_eq!(file(at("registry.npmjs.org", "/x/-/x-1.0.0-rc.1.tgz")).1, "1.0.0-rc.1");
        assert!(matches!(at("index.crates.io", "/se/rd/serde"), Wanted::Index(p) if p.name == "serde"));
        assert!(matches!(at("index.crates.io", "/3/l/log"), Wanted::Index(_)));
        assert_eq!(at("index.crates.io", "/xx/yy/serde"), Wanted::Other, "a prefix not the name's");
        assert_eq!(at("index.crates.io", "/config.json"), Wanted::Other);
        assert_eq!(file(at("static.crates.io", "/crates/serde/1.0.0/download")).2, "serde-1.0.0.crate");
        assert_eq!(at("pypi.org", "/simple/..%2f/"), Wanted::Other);
        assert_eq!(at("web.test", "/simple/x/"), Wanted::Other);
        assert_eq!(at("files.pythonhosted.org", "/packages/a/b/x-1.0.whl.metadata"), Wanted::Other);
        for (host, path) in [
            ("files.pythonhosted.org", "/packages/a/b/x-1.0.egg"),
            ("registry.npmjs.org", "/x/-/y.zip"),
            ("static.crates.io", "/crates/x/..%2f/download"),
        ] {
            assert_eq!(at(host, path), Wanted::Unchecked, "{host}{path}");
        }
    }
}
