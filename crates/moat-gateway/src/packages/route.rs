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
    /// A path servers could read more than one way: refused.
    Ambiguous,
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

/// The hosts whose paths [`route`] reads.
const REGISTRIES: &[&str] =
    &["pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "index.crates.io", "static.crates.io"];

/// What `target` (origin form, normalised) on `host` asks for.
///
/// A registry's path is read as its server reads it: each segment
/// percent-decoded (cargo sends a version's `+` as `%2B`). A path a server
/// could read more than one way (an empty, `.` or `..` segment, `;`, `\`,
/// an encoded `/` but in an npm scope, an escape that does not decode) is
/// [`Wanted::Ambiguous`]: nginx merges `//`, others drop `;parameters`, and
/// a file fetched by a path the gateway read as something else would come
/// in unjudged.
pub fn route(host: &HostName, target: &str) -> Wanted {
    if !REGISTRIES.contains(&host.as_str()) {
        return Wanted::Other;
    }
    let path = target.split(['?', '#']).next().unwrap_or_default();
    let Some(parts) = segments(path) else { return Wanted::Ambiguous };
    let npm_scope = |i: usize| host.as_str() == "registry.npmjs.org" && i == 0;
    if parts.iter().enumerate().any(|(i, p)| p.contains('/') && !(npm_scope(i) && p.starts_with('@'))) {
        return Wanted::Ambiguous;
    }
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    let python_file = matches!(parts.first(), Some(&("packages" | "files")));
    let wanted = match (host.as_str(), parts.as_slice()) {
        ("pypi.org", ["simple", name]) => Package::new(Ecosystem::Pypi, name).map(Wanted::Index),
        ("pypi.org" | "files.pythonhosted.org", [.., file]) if python_file => route_python_file(file),
        // A scoped name's slash comes escaped (`@scope%2fname`).
        ("registry.npmjs.org", [name]) if !name.starts_with('-') => {
            Package::new(Ecosystem::Npm, name).map(Wanted::Index)
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
            "files.pythonhosted.org" | "pypi.org" => python_file && !path.ends_with(".metadata"),
            "registry.npmjs.org" => parts.len() > 1 && parts.contains(&"-") && parts.first() != Some(&"-"),
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

/// The segments of `path` percent-decoded, or `None` where servers could
/// read it more than one way (see [`route`]).
fn segments(path: &str) -> Option<Vec<String>> {
    let rest = path.strip_prefix('/')?;
    if rest.is_empty() {
        return Some(Vec::new());
    }
    // One trailing slash is the index's own form (`/simple/name/`).
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    rest.split('/')
        .map(|raw| {
            if raw.contains([';', '\\']) {
                return None;
            }
            let decoded = percent_decode(raw)?;
            let plain = !decoded.is_empty() && decoded != "." && decoded != ".." && !decoded.contains(['\\', ';', '%']);
            plain.then_some(decoded)
        })
        .collect()
}

/// `%XX` escapes decoded (to UTF-8 text only).
fn percent_decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3).filter(|h| h.iter().all(u8::is_ascii_hexdigit))?;
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
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
        assert_eq!(at("pypi.org", "/simple/..%2f/"), Wanted::Ambiguous);
        assert_eq!(
            file(at("static.crates.io", "/crates/wasi/0.11.0%2Bwasi-snapshot-preview1/download")).1,
            "0.11.0+wasi-snapshot-preview1"
        );
        assert!(matches!(at("registry.npmjs.org", "/@acme%2Fui"), Wanted::Index(p) if p.name == "@acme/ui"));
        assert_eq!(at("web.test", "/simple/x/"), Wanted::Other);
        assert_eq!(at("files.pythonhosted.org", "/packages/a/b/x-1.0.whl.metadata"), Wanted::Other);
        for (host, path) in
            [("files.pythonhosted.org", "/packages/a/b/x-1.0.egg"), ("registry.npmjs.org", "/x/-/y.zip")]
        {
            assert_eq!(at(host, path), Wanted::Unchecked, "{host}{path}");
        }
    }

    #[test]
    fn paths_servers_read_more_than_one_way_are_refused() {
        // Each would reach a file a lenient server serves, unjudged.
        for (host, path) in [
            ("pypi.org", "//files/moatdemo-1.0-py3-none-any.whl"),
            ("pypi.org", "/files//moatdemo-1.0-py3-none-any.whl"),
            ("pypi.org", "/files;x=1/moatdemo-1.0-py3-none-any.whl"),
            ("pypi.org", "/./files/moatdemo-1.0-py3-none-any.whl"),
            ("pypi.org", "/simple/../files/moatdemo-1.0-py3-none-any.whl"),
            ("files.pythonhosted.org", "/packages/a%2fb/moatdemo-1.0-py3-none-any.whl"),
            ("files.pythonhosted.org", "/packages\\a/moatdemo-1.0.tar.gz"),
            ("files.pythonhosted.org", "/packages/a/%zz.whl"),
            ("files.pythonhosted.org", "/packages/a/%+f.whl"),
            ("registry.npmjs.org", "//x/-/x-1.0.0.tgz"),
            ("registry.npmjs.org", "/x%2f-%2fx-1.0.0.tgz"),
            ("index.crates.io", "/se//rd/serde"),
            ("static.crates.io", "/crates/serde/1.0.0/download/."),
            ("static.crates.io", "/crates/x/..%2f/download"),
        ] {
            assert_eq!(at(host, path), Wanted::Ambiguous, "{host}{path}");
        }
        // Decoded, a plain path reads as itself, and is judged so.
        assert!(matches!(at("pypi.org", "/simple/%6doatdemo/"), Wanted::Index(p) if p.name == "moatdemo"));
        assert_eq!(file(at("pypi.org", "/%66iles/x/moatdemo-1.0-py3-none-any.whl")).0, "moatdemo");
    }
}
