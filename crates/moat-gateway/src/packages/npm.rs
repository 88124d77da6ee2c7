//! npm's package documents: `versions` (each with `dist.tarball` and
//! `dist.integrity` or `dist.shasum`) and `time` (publish times, in the
//! full document the gateway asks for). A refused version leaves both, and
//! a dist-tag that named it moves to the newest version left.

use moat_core::policy::integrity;
use moat_core::policy::packages::FileHash;
use serde_json::Value;

use super::index::{epoch, Entry};

/// The versions of a document.
pub fn parse(body: &[u8]) -> Result<Vec<Entry>, String> {
    let doc: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let versions = doc.get("versions").and_then(Value::as_object).ok_or("no \"versions\" object")?;
    let times = doc.get("time").and_then(Value::as_object);
    let mut out = Vec::with_capacity(versions.len());
    for (version, meta) in versions {
        let dist = meta.get("dist").ok_or_else(|| format!("version {version} has no \"dist\""))?;
        let tarball =
            dist.get("tarball").and_then(Value::as_str).ok_or_else(|| format!("version {version} has no tarball"))?;
        let file = tarball.split(['?', '#']).next().unwrap_or_default().rsplit('/').next().unwrap_or_default();
        let strongest = dist
            .get("integrity")
            .and_then(Value::as_str)
            .map(integrity)
            .unwrap_or_default()
            .into_iter()
            .max_by_key(|h| h.algorithm);
        let hash =
            strongest.or_else(|| dist.get("shasum").and_then(Value::as_str).and_then(|s| FileHash::new("sha1", s)));
        let published = times.and_then(|t| t.get(version)).and_then(Value::as_str).and_then(epoch);
        out.push(Entry { version: version.clone(), file: file.to_string(), hash, published });
    }
    Ok(out)
}

/// The document without the versions `keep` refuses.
pub fn rewrite(body: &[u8], keep: &dyn Fn(&str) -> bool) -> Result<Vec<u8>, String> {
    let mut doc: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let versions = doc.get_mut("versions").and_then(Value::as_object_mut).ok_or("no \"versions\" object")?;
    versions.retain(|v, _| keep(v));
    let left: Vec<String> = versions.keys().cloned().collect();
    if let Some(times) = doc.get_mut("time").and_then(Value::as_object_mut) {
        // `created` and `modified` stay; refused versions' times go.
        times.retain(|k, _| k == "created" || k == "modified" || keep(k));
    }
    let newest = newest(&left);
    if let Some(tags) = doc.get_mut("dist-tags").and_then(Value::as_object_mut) {
        let gone = |v: &Value| v.as_str().is_none_or(|v| !left.iter().any(|l| l == v));
        match &newest {
            Some(newest) => tags.values_mut().filter(|v| gone(v)).for_each(|v| *v = Value::String(newest.clone())),
            None => tags.retain(|_, v| !gone(v)),
        }
    }
    serde_json::to_vec(&doc).map_err(|e| e.to_string())
}

/// The highest release (not a pre-release) of `versions`, else the highest of all.
fn newest(versions: &[String]) -> Option<String> {
    let parsed: Vec<semver::Version> = versions.iter().filter_map(|v| semver::Version::parse(v).ok()).collect();
    let best = parsed.iter().filter(|v| v.pre.is_empty()).max().or_else(|| parsed.iter().max());
    best.map(ToString::to_string)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    const DOC: &str = r#"{"name":"demo","dist-tags":{"latest":"2.0.0","next":"3.0.0-rc.1"},
        "versions":{
          "1.0.0":{"dist":{"tarball":"https://registry.npmjs.org/demo/-/demo-1.0.0.tgz","shasum":"0123456789abcdef0123456789abcdef01234567"}},
          "2.0.0":{"dist":{"tarball":"https://registry.npmjs.org/demo/-/demo-2.0.0.tgz","integrity":"sha512-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=="}},
          "3.0.0-rc.1":{"dist":{"tarball":"https://registry.npmjs.org/demo/-/demo-3.0.0-rc.1.tgz"}}},
        "time":{"created":"2019-01-01T00:00:00Z","1.0.0":"2019-01-01T00:00:00Z","2.0.0":"2030-01-01T00:00:00Z"}}"#;

    #[test]
    fn versions_with_hashes_and_times() {
        let entries = parse(DOC.as_bytes()).unwrap();
        assert_eq!(entries.len(), 3);
        let one = entries.iter().find(|e| e.version == "1.0.0").unwrap();
        assert_eq!((one.file.as_str(), one.published), ("demo-1.0.0.tgz", Some(1_546_300_800)));
        assert_eq!(one.hash.as_ref().unwrap().algorithm, moat_core::policy::packages::HashAlgorithm::Sha1);
        let two = entries.iter().find(|e| e.version == "2.0.0").unwrap();
        assert_eq!(two.hash.as_ref().unwrap().algorithm, moat_core::policy::packages::HashAlgorithm::Sha512);
        for bad in ["{}", r#"{"versions":{"1.0.0":{}}}"#, "not json"] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_refused_version_goes_and_its_tags_move() {
        let out = rewrite(DOC.as_bytes(), &|v| v != "2.0.0").unwrap();
        let doc: Value = serde_json::from_slice(&out).unwrap();
        assert!(doc["versions"].get("2.0.0").is_none() && doc["time"].get("2.0.0").is_none());
        assert_eq!(doc["dist-tags"]["latest"], "1.0.0");
        assert_eq!(doc["dist-tags"]["next"], "3.0.0-rc.1");
        assert_eq!(doc["time"]["created"], "2019-01-01T00:00:00Z");
    }
}
