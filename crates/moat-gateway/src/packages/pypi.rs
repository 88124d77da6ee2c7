//! PyPI's simple index: PEP 691's JSON (`files`, each with `hashes` and
//! `upload-time`) and PEP 503's HTML (a link a file, its hash in the
//! fragment, no time). A file's version is read from its name.

use moat_core::policy::packages::FileHash;
use serde_json::Value;

use super::index::{epoch, Entry};
use super::route::{route_python_file, Wanted};

/// The files of a JSON page.
pub fn parse_json(body: &[u8]) -> Result<Vec<Entry>, String> {
    let page: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let files = page.get("files").and_then(Value::as_array).ok_or("no \"files\" list")?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let file = f.get("filename").and_then(Value::as_str).ok_or("a file with no \"filename\"")?;
        // Files of kinds the gateway cannot name a version of (.egg, .exe) are listed on, never fetched.
        let Some(version) = version_of(file) else { continue };
        let hashes = f.get("hashes").and_then(Value::as_object);
        let hash = hashes.and_then(|h| {
            ["sha256", "sha512"]
                .iter()
                .find_map(|a| h.get(*a).and_then(Value::as_str).and_then(|hex| FileHash::new(a, hex)))
        });
        let published = f.get("upload-time").and_then(Value::as_str).and_then(epoch);
        out.push(Entry { version, file: file.to_string(), hash, published });
    }
    Ok(out)
}

/// The page without the files `keep` refuses (and versions left with none).
pub fn rewrite_json(body: &[u8], keep: &dyn Fn(&str) -> bool) -> Result<Vec<u8>, String> {
    let mut page: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let files = page.get_mut("files").and_then(Value::as_array_mut).ok_or("no \"files\" list")?;
    files.retain(|f| f.get("filename").and_then(Value::as_str).is_none_or(keep));
    let left: Vec<String> =
        files.iter().filter_map(|f| f.get("filename").and_then(Value::as_str).and_then(version_of)).collect();
    if let Some(versions) = page.get_mut("versions").and_then(Value::as_array_mut) {
        versions.retain(|v| v.as_str().is_some_and(|v| left.iter().any(|l| l == v)));
    }
    serde_json::to_vec(&page).map_err(|e| e.to_string())
}

/// The links of an HTML page.
pub fn parse_html(body: &[u8]) -> Result<Vec<Entry>, String> {
    let text = std::str::from_utf8(body).map_err(|_| "not UTF-8")?;
    let mut out = Vec::new();
    for (_, href) in anchors(text)? {
        let Some((file, hash)) = link(&href) else { continue };
        let Some(version) = version_of(&file) else { continue };
        out.push(Entry { version, file, hash, published: None });
    }
    Ok(out)
}

/// The page without the links to files `keep` refuses.
pub fn rewrite_html(body: &[u8], keep: &dyn Fn(&str) -> bool) -> Result<Vec<u8>, String> {
    let text = std::str::from_utf8(body).map_err(|_| "not UTF-8")?;
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for (range, href) in anchors(text)? {
        if link(&href).is_some_and(|(file, _)| !keep(&file)) {
            out.push_str(text.get(at..range.start).unwrap_or_default());
            at = range.end;
        }
    }
    out.push_str(text.get(at..).unwrap_or_default());
    Ok(out.into_bytes())
}

/// Each `<a ...>...</a>` of `text`: where it is, and its `href`.
fn anchors(text: &str) -> Result<Vec<(std::ops::Range<usize>, String)>, String> {
    let lower = text.to_ascii_lowercase();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(start) = lower.get(from..).and_then(|s| s.find("<a ")).map(|i| i + from) {
        let end = lower.get(start..).and_then(|s| s.find("</a>")).map(|i| start + i + 4).ok_or("an unclosed link")?;
        let tag = lower.get(start..end).unwrap_or_default();
        let href = tag.find("href=\"").and_then(|i| {
            let value = text.get(start + i + 6..end)?;
            value.split('"').next()
        });
        if let Some(href) = href {
            out.push((start..end, href.replace("&amp;", "&")));
        }
        from = end;
    }
    Ok(out)
}

/// A link's file name and the hash in its fragment.
fn link(href: &str) -> Option<(String, Option<FileHash>)> {
    let (url, fragment) = href.split_once('#').unwrap_or((href, ""));
    let file = url.split('?').next()?.rsplit('/').next()?.to_string();
    Some((file, FileHash::parse(fragment)))
}

/// The version in a wheel's or an sdist's name.
pub fn version_of(file: &str) -> Option<String> {
    match route_python_file(file)? {
        Wanted::File { version, .. } => Some(version),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn json_pages_give_hashes_and_times_and_lose_refused_files() {
        let page = format!(
            r#"{{"meta":{{"api-version":"1.1"}},"name":"demo","versions":["1.0","2.0"],"files":[
            {{"filename":"demo-1.0-py3-none-any.whl","url":"https://files.pythonhosted.org/packages/a/demo-1.0-py3-none-any.whl","hashes":{{"sha256":"{}"}},"upload-time":"2020-01-01T00:00:00.000000Z"}},
            {{"filename":"demo-2.0.tar.gz","url":"u","hashes":{{}},"upload-time":"bad"}},
            {{"filename":"demo-0.1.egg","url":"u","hashes":{{}}}}]}}"#,
            "ab".repeat(32)
        );
        let entries = parse_json(page.as_bytes()).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!((entries[0].version.as_str(), entries[0].published), ("1.0", Some(1_577_836_800)));
        assert!(entries[0].hash.is_some() && entries[1].hash.is_none() && entries[1].published.is_none());
        let out = rewrite_json(page.as_bytes(), &|f| !f.starts_with("demo-2.0")).unwrap();
        let out: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(out["files"].as_array().unwrap().len(), 2);
        assert_eq!(out["versions"], serde_json::json!(["1.0"]));
        for bad in ["{", "[]", r#"{"files":[{"url":"x"}]}"#, r#"{"files":7}"#] {
            assert!(parse_json(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn html_pages_give_hashes_and_lose_refused_links() {
        let page = format!(
            "<html><body>\n<a href=\"/files/demo-1.0-py3-none-any.whl#sha256={}\">demo-1.0-py3-none-any.whl</a>\n<A HREF=\"/files/demo-2.0.tar.gz\">demo-2.0.tar.gz</A>\n</body></html>",
            "cd".repeat(32)
        );
        let entries = parse_html(page.as_bytes()).unwrap();
        assert_eq!(entries.len(), 2);
        assert!(entries[0].hash.is_some());
        let out = String::from_utf8(rewrite_html(page.as_bytes(), &|f| !f.contains("2.0")).unwrap()).unwrap();
        assert!(out.contains("demo-1.0") && !out.contains("demo-2.0"), "{out}");
        assert!(parse_html(b"<a href=\"x\">never closed").is_err());
        assert!(parse_html(&[0xff, 0xfe]).is_err());
    }
}
