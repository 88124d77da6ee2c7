//! The operator's OSV database (`--osv-db DIR`: the JSON records of an OSV
//! export, refreshed by the operator; moat never fetches it): which
//! versions of which packages an advisory names, how bad it says it is,
//! and whether it reports a malicious package (`MAL-` records).

use std::collections::HashMap;
use std::path::Path;

use moat_core::policy::packages::Severity;
use moat_core::policy::Ecosystem;
use serde_json::Value;

/// Largest record read.
const MAX_RECORD: u64 = 4 << 20;

/// One advisory's claim on one package.
#[derive(Debug, Clone)]
struct Affected {
    id: String,
    malicious: bool,
    severity: Option<Severity>,
    versions: Vec<String>,
    /// `(introduced, fixed or last_affected (inclusive), ...)` in order.
    ranges: Vec<(String, Option<String>, bool)>,
}

/// The records, by (ecosystem, normalised name).
#[derive(Debug, Default)]
pub struct Advisories {
    by_package: HashMap<(Ecosystem, String), Vec<Affected>>,
    /// Records read.
    pub records: usize,
}

/// An advisory that names a version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    /// Its id (`MAL-2024-1`, `GHSA-...`).
    pub id: String,
    /// Whether it reports a malicious package.
    pub malicious: bool,
    /// Its severity, where it gives one.
    pub severity: Option<Severity>,
}

impl Advisories {
    /// Reads every `*.json` beneath `dir` (records it cannot read are
    /// skipped, and counted in the log).
    pub fn load(dir: &Path) -> Self {
        let mut out = Self::default();
        let mut skipped = 0usize;
        let mut dirs = vec![dir.to_path_buf()];
        while let Some(d) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else { continue };
            for entry in entries.flatten() {
                let path = entry.path();
                let Ok(meta) = entry.metadata() else { continue };
                if meta.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "json") && meta.len() <= MAX_RECORD {
                    match std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok()) {
                        Some(record) => out.add(&record),
                        None => skipped += 1,
                    }
                }
            }
        }
        if skipped > 0 {
            tracing::warn!(skipped, dir = %dir.display(), "OSV records that are not JSON were skipped");
        }
        out
    }

    /// Adds one OSV record.
    pub fn add(&mut self, record: &Value) {
        let Some(id) = record.get("id").and_then(Value::as_str) else { return };
        if record.get("withdrawn").and_then(Value::as_str).is_some() {
            return;
        }
        self.records += 1;
        let top = severity_of(record);
        for affected in record.get("affected").and_then(Value::as_array).into_iter().flatten() {
            let package = affected.get("package");
            let eco = package.and_then(|p| p.get("ecosystem")).and_then(Value::as_str);
            let ecosystem = match eco {
                Some("PyPI") => Ecosystem::Pypi,
                Some("npm") => Ecosystem::Npm,
                Some("crates.io") => Ecosystem::Crates,
                _ => continue,
            };
            let Some(name) = package.and_then(|p| p.get("name")).and_then(Value::as_str) else { continue };
            let versions = affected
                .get("versions")
                .and_then(Value::as_array)
                .map(|v| v.iter().filter_map(Value::as_str).map(str::to_string).collect())
                .unwrap_or_default();
            let mut ranges = Vec::new();
            for range in affected.get("ranges").and_then(Value::as_array).into_iter().flatten() {
                if range.get("type").and_then(Value::as_str) == Some("GIT") {
                    continue;
                }
                let mut introduced: Option<String> = None;
                for event in range.get("events").and_then(Value::as_array).into_iter().flatten() {
                    let text = |k: &str| event.get(k).and_then(Value::as_str).map(str::to_string);
                    if let Some(v) = text("introduced") {
                        introduced = Some(v);
                    } else if let Some(end) = text("fixed") {
                        ranges.push((introduced.take().unwrap_or_else(|| "0".into()), Some(end), false));
                    } else if let Some(end) = text("last_affected") {
                        ranges.push((introduced.take().unwrap_or_else(|| "0".into()), Some(end), true));
                    }
                }
                if let Some(start) = introduced {
                    ranges.push((start, None, false));
                }
            }
            let severity = severity_of(affected).or(top);
            let entry = Affected { id: id.to_string(), malicious: id.starts_with("MAL-"), severity, versions, ranges };
            self.by_package.entry((ecosystem, ecosystem.normalise(name))).or_default().push(entry);
        }
    }

    /// The advisories that name `version` of `name` (normalised).
    pub fn naming(&self, ecosystem: Ecosystem, name: &str, version: &str) -> Vec<Named> {
        let Some(list) = self.by_package.get(&(ecosystem, name.to_string())) else { return Vec::new() };
        list.iter()
            .filter(|a| a.versions.iter().any(|v| v == version) || a.ranges.iter().any(|r| in_range(version, r)))
            .map(|a| Named { id: a.id.clone(), malicious: a.malicious, severity: a.severity })
            .collect()
    }
}

/// How bad `v` (a record, or one of its `affected`) says it is: the worst
/// of its CVSS vectors (`severity[].score`, scored) and of the word in its
/// `database_specific` or `ecosystem_specific` (GitHub's LOW, MODERATE,
/// HIGH, CRITICAL). A deny rule errs on the side of the worse reading.
fn severity_of(v: &Value) -> Option<Severity> {
    let word = ["database_specific", "ecosystem_specific"]
        .iter()
        .find_map(|k| v.get(*k).and_then(|d| d.get("severity")).and_then(Value::as_str))
        .and_then(|text| match text.to_ascii_uppercase().as_str() {
            "LOW" => Some(Severity::Low),
            "MODERATE" | "MEDIUM" => Some(Severity::Medium),
            "HIGH" => Some(Severity::High),
            "CRITICAL" => Some(Severity::Critical),
            _ => None,
        });
    let vectors = v.get("severity").and_then(Value::as_array).into_iter().flatten();
    let scored = vectors.filter_map(|s| s.get("score").and_then(Value::as_str)).filter_map(scored);
    word.into_iter().chain(scored).max()
}

/// The rating of a CVSS vector (`CVSS:3.1/AV:N/...`, `CVSS:4.0/...`, or a
/// v2 vector without a prefix), by its base score; `None` for 0.0 or a
/// vector that does not parse. The records come from outside: a vector the
/// scorer cannot take is skipped, never the gateway's end.
fn scored(vector: &str) -> Option<Severity> {
    let cvss: cvss::Cvss = vector.parse().ok()?;
    let rating = std::panic::catch_unwind(|| cvss.severity()).ok()?;
    match rating {
        cvss::Severity::None => None,
        cvss::Severity::Low => Some(Severity::Low),
        cvss::Severity::Medium => Some(Severity::Medium),
        cvss::Severity::High => Some(Severity::High),
        cvss::Severity::Critical => Some(Severity::Critical),
    }
}

fn in_range(version: &str, (start, end, inclusive): &(String, Option<String>, bool)) -> bool {
    let after_start = start == "0" || compare(version, start) != std::cmp::Ordering::Less;
    let before_end = match end {
        None => true,
        Some(end) if *inclusive => compare(version, end) != std::cmp::Ordering::Greater,
        Some(end) => compare(version, end) == std::cmp::Ordering::Less,
    };
    after_start && before_end
}

/// Versions compared as runs of numbers (`1.10.0` after `1.9`), a
/// pre-release (`1.0.0-rc.1`, `1.0rc1`) before its release.
pub fn compare(a: &str, b: &str) -> std::cmp::Ordering {
    fn split(v: &str) -> (Vec<u64>, bool) {
        let release: String = v.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
        let nums = release.split('.').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap_or(u64::MAX)).collect();
        (nums, release.len() < v.len())
    }
    let ((mut x, xpre), (mut y, ypre)) = (split(a), split(b));
    let len = x.len().max(y.len());
    x.resize(len, 0);
    y.resize(len, 0);
    x.cmp(&y).then(ypre.cmp(&xpre))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn records_name_versions_and_ranges() {
        let mut db = Advisories::default();
        db.add(&serde_json::json!({"id": "MAL-2026-1", "affected": [{"package": {"ecosystem": "PyPI", "name": "Demo_Pkg"}, "versions": ["2.0"]}]}));
        db.add(&serde_json::json!({"id": "GHSA-x", "database_specific": {"severity": "HIGH"}, "affected": [{"package": {"ecosystem": "npm", "name": "lib"},
            "ranges": [{"type": "SEMVER", "events": [{"introduced": "1.2.0"}, {"fixed": "1.4.1"}]}]}]}));
        db.add(&serde_json::json!({"id": "W", "withdrawn": "2026-01-01T00:00:00Z", "affected": [{"package": {"ecosystem": "npm", "name": "lib"}, "versions": ["9.0.0"]}]}));
        assert_eq!(db.records, 2);
        let named = db.naming(Ecosystem::Pypi, "demo-pkg", "2.0");
        assert!(named.len() == 1 && named[0].malicious);
        assert!(db.naming(Ecosystem::Pypi, "demo-pkg", "1.0").is_empty());
        assert_eq!(db.naming(Ecosystem::Npm, "lib", "1.3.9")[0].severity, Some(Severity::High));
        assert!(db.naming(Ecosystem::Npm, "lib", "1.4.1").is_empty());
        assert!(db.naming(Ecosystem::Npm, "lib", "1.1.0").is_empty());
        assert!(db.naming(Ecosystem::Npm, "lib", "9.0.0").is_empty(), "withdrawn");
        assert_eq!(compare("1.10", "1.9"), std::cmp::Ordering::Greater);
        assert_eq!(compare("1.0.0-rc.1", "1.0.0"), std::cmp::Ordering::Less);
    }

    #[test]
    fn cvss_vectors_are_scored_and_the_worse_reading_wins() {
        let record = |severity: Value| {
            let mut db = Advisories::default();
            db.add(&serde_json::json!({"id": "GHSA-v", "severity": severity,
                "affected": [{"package": {"ecosystem": "PyPI", "name": "p"}, "versions": ["1.0"]}]}));
            db.naming(Ecosystem::Pypi, "p", "1.0").first().and_then(|n| n.severity)
        };
        let v31 = |vector: &str| serde_json::json!([{"type": "CVSS_V3", "score": vector}]);
        // Base scores from FIRST's calculator: 9.8, 6.1, 3.1, 0.0.
        assert_eq!(record(v31("CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H")), Some(Severity::Critical));
        assert_eq!(record(v31("CVSS:3.1/AV:N/AC:L/PR:N/UI:R/S:C/C:L/I:L/A:N")), Some(Severity::Medium));
        assert_eq!(record(v31("CVSS:3.0/AV:N/AC:H/PR:N/UI:R/S:U/C:L/I:N/A:N")), Some(Severity::Low));
        assert_eq!(record(v31("CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:N/I:N/A:N")), None);
        // v4.0 (9.3) and v2 (7.5), as OSV records carry them.
        let v4 = serde_json::json!([{"type": "CVSS_V4", "score": "CVSS:4.0/AV:N/AC:L/AT:N/PR:N/UI:N/VC:H/VI:H/VA:H/SC:N/SI:N/SA:N"}]);
        assert_eq!(record(v4), Some(Severity::Critical));
        let v2 = serde_json::json!([{"type": "CVSS_V2", "score": "AV:N/AC:L/Au:N/C:P/I:P/A:P"}]);
        assert_eq!(record(v2), Some(Severity::High));
        // Garbage is skipped; of two readings the worse one counts.
        assert_eq!(record(v31("CVSS:3.1/AV:Q")), None);
        assert_eq!(record(serde_json::json!([{"type": "CVSS_V3", "score": 7}])), None);
        let mut db = Advisories::default();
        db.add(&serde_json::json!({"id": "GHSA-w", "database_specific": {"severity": "LOW"},
            "severity": [{"type": "CVSS_V3", "score": "CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H"}],
            "affected": [{"package": {"ecosystem": "npm", "name": "q"}, "versions": ["2.0.0"]}]}));
        assert_eq!(db.naming(Ecosystem::Npm, "q", "2.0.0")[0].severity, Some(Severity::Critical));
    }
}
