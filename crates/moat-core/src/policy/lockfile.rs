//! Lock files as `policy NAME packages lock` reads them (from stdin): pip's
//! `requirements.txt` with hashes, npm's `package-lock.json` (v2 and v3),
//! `Cargo.lock`. Each becomes the exact versions (and hashes) a box may
//! download; anything else in them (paths, git sources, markers) is left out.

use base64::Engine as _;

use super::packages::{Ecosystem, FileHash, Locked, MAX_LOCKED};
use super::PolicyError;

/// Largest lock file read.
pub const MAX_LOCK_FILE: usize = 8 << 20;

/// The versions `text` locks, whichever of the three kinds it is.
pub fn read_lock(text: &str) -> Result<Vec<Locked>, PolicyError> {
    let bad = |why: &str| PolicyError::BadPackages(format!("lock: {why}"));
    if text.len() > MAX_LOCK_FILE {
        return Err(bad("larger than 8 MiB"));
    }
    let trimmed = text.trim_start();
    let entries = if trimmed.starts_with('{') {
        package_lock(trimmed).map_err(|e| bad(&e))?
    } else if text.lines().any(|l| l.trim() == "[[package]]") {
        cargo_lock(text)
    } else {
        requirements(text).map_err(|e| bad(&e))?
    };
    if entries.is_empty() {
        return Err(bad("no pinned versions found (requirements.txt with ==, package-lock.json, or Cargo.lock)"));
    }
    if entries.len() > MAX_LOCKED {
        return Err(bad(&format!("more than {MAX_LOCKED} versions")));
    }
    Ok(entries)
}

/// `name==version` lines, each with any `--hash=sha256:HEX` after it (on
/// the same line or continued with `\`).
fn requirements(text: &str) -> Result<Vec<Locked>, String> {
    let joined = text.replace("\\\r\n", " ").replace("\\\n", " ");
    let mut out = Vec::new();
    for (n, line) in joined.lines().enumerate() {
        let line = line.split(" #").next().unwrap_or_default().trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('-') {
            continue;
        }
        let mut words = line.split_whitespace();
        let spec = words.next().unwrap_or_default();
        // Markers (`; python_version < "3.8"`) do not change what may come in.
        let spec = spec.split(';').next().unwrap_or_default();
        let Some((name, version)) = spec.split_once("==") else {
            return Err(format!("line {}: {spec:?} is not pinned (NAME==VERSION)", n + 1));
        };
        let name = name.split('[').next().unwrap_or_default().trim();
        if name.is_empty() || version.is_empty() {
            return Err(format!("line {}: {spec:?} is not NAME==VERSION", n + 1));
        }
        let mut hashes = Vec::new();
        for word in words {
            if let Some(h) = word.strip_prefix("--hash=") {
                hashes.push(FileHash::parse(h).ok_or_else(|| format!("line {}: bad hash {h:?}", n + 1))?);
            }
        }
        out.push(Locked {
            ecosystem: Ecosystem::Pypi,
            name: Ecosystem::Pypi.normalise(name),
            version: version.trim().to_string(),
            hashes,
        });
    }
    Ok(out)
}

/// `packages` of a v2/v3 lock: `node_modules/NAME` keys with `version` and
/// `integrity` (linked and bundled entries have none and are left out).
fn package_lock(text: &str) -> Result<Vec<Locked>, String> {
    let doc: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let Some(packages) = doc.get("packages").and_then(|p| p.as_object()) else {
        return Err("a package-lock.json of lockfileVersion 2 or 3 has a \"packages\" object".into());
    };
    let mut out = Vec::new();
    for (path, entry) in packages {
        let Some((_, name)) = path.rsplit_once("node_modules/") else { continue };
        let name = entry.get("name").and_then(|n| n.as_str()).unwrap_or(name);
        let Some(version) = entry.get("version").and_then(|v| v.as_str()) else { continue };
        if entry.get("link").and_then(|l| l.as_bool()) == Some(true) {
            continue;
        }
        let hashes = entry.get("integrity").and_then(|i| i.as_str()).map(integrity).unwrap_or_default();
        out.push(Locked { ecosystem: Ecosystem::Npm, name: name.to_string(), version: version.to_string(), hashes });
    }
    Ok(out)
}

/// npm's `integrity`: Subresource Integrity, `sha512-BASE64` (several
/// space-separated).
pub fn integrity(text: &str) -> Vec<FileHash> {
    text.split_whitespace()
        .filter_map(|one| {
            let (algorithm, b64) = one.split_once('-')?;
            let b64 = b64.split('?').next()?;
            let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
            FileHash::new(algorithm, &hex::encode(raw))
        })
        .collect()
}

/// `[[package]]` tables with a registry source and a checksum.
fn cargo_lock(text: &str) -> Vec<Locked> {
    let mut out = Vec::new();
    for table in text.split("[[package]]").skip(1) {
        let field = |key: &str| {
            table.lines().find_map(|l| {
                let (k, v) = l.split_once('=')?;
                (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
            })
        };
        let (Some(name), Some(version)) = (field("name"), field("version")) else { continue };
        // Workspace members and path or git dependencies come from no registry.
        if !field("source").is_some_and(|s| s.starts_with("registry+") || s.starts_with("sparse+")) {
            continue;
        }
        let hashes = field("checksum").and_then(|c| FileHash::new("sha256", &c)).into_iter().collect();
        out.push(Locked { ecosystem: Ecosystem::Crates, name: Ecosystem::Crates.normalise(&name), version, hashes });
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn requirements_with_hashes() {
        let text = format!(
            "# pinned\nRequests[socks]==2.31.0 \\\n    --hash=sha256:{} \\\n    --hash=sha256:{}\nidna==3.4 ; python_version>'3'\n",
            "ab".repeat(32),
            "cd".repeat(32)
        );
        let lock = read_lock(&text).unwrap();
        assert_eq!(lock.len(), 2);
        assert_eq!((lock[0].name.as_str(), lock[0].version.as_str(), lock[0].hashes.len()), ("requests", "2.31.0", 2));
        assert_eq!((lock[1].name.as_str(), lock[1].hashes.len()), ("idna", 0));
        assert!(read_lock("requests>=2\n").unwrap_err().to_string().contains("not pinned"));
        assert!(read_lock("x==1 --hash=sha256:zz\n").is_err());
        assert!(read_lock("\n# nothing\n").is_err());
    }

    #[test]
    fn package_lock_v3() {
        let text = r#"{"lockfileVersion": 3, "packages": {
            "": {"name": "app"},
            "node_modules/a": {"version": "1.0.0", "integrity": "sha512-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=="},
            "node_modules/a/node_modules/@s/b": {"version": "2.0.0"},
            "node_modules/l": {"resolved": "../l", "link": true}}}"#;
        let lock = read_lock(text).unwrap();
        assert_eq!(lock.len(), 2);
        assert_eq!(lock[0].hashes[0].to_string(), format!("sha512:{}", "00".repeat(64)));
        assert_eq!(lock[1].name, "@s/b");
        assert!(read_lock("{\"lockfileVersion\": 1, \"dependencies\": {}}").is_err());
        assert!(read_lock("{not json").is_err());
    }

    #[test]
    fn cargo_lock_registry_packages() {
        let text = format!(
            "version = 3\n\n[[package]]\nname = \"app\"\nversion = \"0.1.0\"\n\n[[package]]\nname = \"serde_json\"\nversion = \"1.0.1\"\nsource = \"registry+https://github.com/rust-lang/crates.io-index\"\nchecksum = \"{}\"\n",
            "ef".repeat(32)
        );
        let lock = read_lock(&text).unwrap();
        assert_eq!(lock.len(), 1);
        assert_eq!((lock[0].name.as_str(), lock[0].version.as_str()), ("serde-json", "1.0.1"));
        assert_eq!(lock[0].hashes.len(), 1);
    }
}
