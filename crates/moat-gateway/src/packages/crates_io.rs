//! crates.io's sparse index: a file per crate, a JSON line per version
//! (`vers`, `cksum`: the `.crate`'s sha256, and `pubtime` where the
//! registry records one). A refused version's line is left out.

use moat_core::policy::packages::FileHash;
use serde_json::Value;

use super::index::{epoch, Entry};

/// The versions of an index file.
pub fn parse(body: &[u8]) -> Result<Vec<Entry>, String> {
    let text = std::str::from_utf8(body).map_err(|_| "not UTF-8")?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("line {}: not JSON: {e}", n + 1))?;
        let field = |k: &str| v.get(k).and_then(Value::as_str);
        let (Some(name), Some(version)) = (field("name"), field("vers")) else {
            return Err(format!("line {}: no \"name\" or \"vers\"", n + 1));
        };
        let hash = field("cksum").and_then(|c| FileHash::new("sha256", c));
        let published = field("pubtime").and_then(epoch);
        out.push(Entry { version: version.to_string(), file: format!("{name}-{version}.crate"), hash, published });
    }
    Ok(out)
}

/// The file without the lines of versions `keep` refuses.
pub fn rewrite(body: &[u8], keep: &dyn Fn(&str) -> bool) -> Result<Vec<u8>, String> {
    let text = std::str::from_utf8(body).map_err(|_| "not UTF-8")?;
    let mut out = String::with_capacity(text.len());
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        if v.get("vers").and_then(Value::as_str).is_some_and(keep) {
            out.push_str(line);
            out.push('\n');
        }
    }
    Ok(out.into_bytes())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn lines_per_version() {
        let body = format!(
            "{{\"name\":\"Demo\",\"vers\":\"1.0.0\",\"cksum\":\"{}\",\"yanked\":false}}\n{{\"name\":\"Demo\",\"vers\":\"2.0.0\",\"cksum\":\"x\",\"pubtime\":\"2025-06-01T00:00:00Z\"}}\n",
            "ab".repeat(32)
        );
        let entries = parse(body.as_bytes()).unwrap();
        assert_eq!((entries[0].file.as_str(), entries[0].published), ("Demo-1.0.0.crate", None));
        assert!(entries[0].hash.is_some() && entries[1].hash.is_none());
        assert!(entries[1].published.is_some());
        let out = String::from_utf8(rewrite(body.as_bytes(), &|v| v == "1.0.0").unwrap()).unwrap();
        assert_eq!(out.lines().count(), 1);
        assert!(parse(b"{\"vers\":1}\n").is_err());
        assert!(parse(b"garbage\n").is_err());
    }
}
