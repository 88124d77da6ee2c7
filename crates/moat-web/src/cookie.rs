//! The edge's session cookie: set for the one host it signs in to (no
//! `Domain`, so never sent to another box's URL), `HttpOnly`, `Secure`,
//! `SameSite=Lax`; read from what the browser sends, and taken out of it
//! before the request reaches the box (the box never sees its visitors'
//! sessions).

use http::header::{HeaderMap, HeaderValue, COOKIE, SET_COOKIE};
use moat_core::web::WebSecret;

/// The cookie's name. `__Host-` makes browsers refuse it unless it is
/// Secure, host-only and for `/`.
pub const NAME: &str = "__Host-moat";

/// The `Set-Cookie` value that signs a browser in with `session`.
pub fn set(session: &WebSecret, max_age_secs: u64) -> String {
    format!("{NAME}={}; Path=/; Max-Age={max_age_secs}; HttpOnly; Secure; SameSite=Lax", session.0)
}

/// Takes the session cookie out of `headers` (every `Cookie` field), leaving
/// the others as one `Cookie` field; returns its value if it looks like one.
pub fn take(headers: &mut HeaderMap) -> Option<WebSecret> {
    let mut ours = None;
    let mut rest: Vec<String> = Vec::new();
    let mut any = false;
    for value in headers.get_all(COOKIE) {
        any = true;
        // A field that is not text goes to the box as it came (it is not ours).
        let Ok(text) = value.to_str() else {
            rest.push(String::from_utf8_lossy(value.as_bytes()).into_owned());
            continue;
        };
        for pair in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some((name, value)) if name.trim() == NAME => {
                    let value = value.trim();
                    if WebSecret::plausible(value) {
                        ours = Some(WebSecret(value.to_string()));
                    }
                }
                _ => rest.push(pair.to_string()),
            }
        }
    }
    if any {
        headers.remove(COOKIE);
        if let Ok(value) = HeaderValue::from_str(&rest.join("; ")) {
            if !rest.is_empty() {
                headers.insert(COOKIE, value);
            }
        }
    }
    ours
}

/// A box's `Set-Cookie` fields as its visitor gets them: for the box's own
/// URL only (a `Domain` attribute is taken out: with it, one box's page set
/// cookies every other box's URL received, and could fill them until every
/// request was too large), and never the edge's own cookie (with it, a box
/// signed its visitors out, or in as someone else). `Clear-Site-Data` loses
/// `"cookies"` and `"*"`: browsers clear the cookies of the whole site (the
/// domain every box's URL is under), so a box's page signed its visitor out
/// of every box.
pub fn confine(headers: &mut HeaderMap) {
    confine_clearing(headers);
    let fields: Vec<HeaderValue> = headers.get_all(SET_COOKIE).iter().cloned().collect();
    if fields.is_empty() {
        return;
    }
    headers.remove(SET_COOKIE);
    for field in fields {
        // One that is not text is dropped: its attributes cannot be read.
        let Ok(text) = field.to_str() else { continue };
        let mut parts = text.split(';');
        let pair = parts.next().unwrap_or_default();
        if pair.split('=').next().unwrap_or_default().trim().eq_ignore_ascii_case(NAME) {
            continue;
        }
        let domain = |attr: &&str| attr.split('=').next().unwrap_or_default().trim().eq_ignore_ascii_case("domain");
        let kept: Vec<&str> = std::iter::once(pair).chain(parts.filter(|a| !domain(a))).collect();
        if let Ok(value) = HeaderValue::from_str(&kept.join(";")) {
            headers.append(SET_COOKIE, value);
        }
    }
}

/// `Clear-Site-Data` without the directives that reach past the box's URL.
fn confine_clearing(headers: &mut HeaderMap) {
    let name = http::header::HeaderName::from_static("clear-site-data");
    let fields: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
    if fields.is_empty() {
        return;
    }
    headers.remove(&name);
    let text: Vec<&str> = fields.iter().filter_map(|f| f.to_str().ok()).collect();
    let sitewide = |d: &&str| matches!(d.trim().trim_matches('"'), "cookies" | "*");
    let kept: Vec<&str> = text.iter().flat_map(|t| t.split(',')).map(str::trim).filter(|d| !sitewide(d)).collect();
    if let (false, Ok(value)) = (kept.is_empty(), HeaderValue::from_str(&kept.join(", "))) {
        headers.insert(name, value);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ours_is_taken_out_and_the_rest_stay() {
        let session = WebSecret::random();
        let mut headers = HeaderMap::new();
        headers.append(COOKIE, HeaderValue::from_str(&format!("a=1; {NAME}={}", session.0)).unwrap());
        headers.append(COOKIE, HeaderValue::from_static("b=2"));
        assert_eq!(take(&mut headers), Some(session));
        assert_eq!(headers.get_all(COOKIE).iter().collect::<Vec<_>>(), ["a=1; b=2"]);
        let mut only = HeaderMap::new();
        only.insert(COOKIE, HeaderValue::from_str(&format!("{NAME}=nothex")).unwrap());
        assert_eq!(take(&mut only), None);
        assert!(only.get(COOKIE).is_none(), "not passed on either");
    }

    #[test]
    fn a_box_sets_cookies_for_its_own_url_only() {
        let mut headers = HeaderMap::new();
        for field in [
            "tossed=from-evil; Domain=h4.test; Path=/",
            "app=1; Path=/; domain =.h4.test; HttpOnly",
            "__Host-moat=000; Path=/; Secure",
            "__HOST-MOAT=000; Path=/; Secure",
            "plain=2",
        ] {
            headers.append(SET_COOKIE, HeaderValue::from_static(field));
        }
        confine(&mut headers);
        let kept: Vec<_> = headers.get_all(SET_COOKIE).iter().map(|v| v.to_str().unwrap()).collect();
        assert_eq!(kept, ["tossed=from-evil; Path=/", "app=1; Path=/; HttpOnly", "plain=2"]);
    }

    #[test]
    fn a_box_clears_its_own_url_only() {
        let mut headers = HeaderMap::new();
        headers.append("clear-site-data", HeaderValue::from_static("\"cache\", \"cookies\""));
        headers.append("clear-site-data", HeaderValue::from_static("\"*\",\"storage\""));
        confine(&mut headers);
        assert_eq!(headers.get_all("clear-site-data").iter().collect::<Vec<_>>(), ["\"cache\", \"storage\""]);
        let mut all = HeaderMap::new();
        all.insert("clear-site-data", HeaderValue::from_static("\"cookies\""));
        confine(&mut all);
        assert!(all.get("clear-site-data").is_none());
    }

    #[test]
    fn set_is_host_only_and_strict() {
        let value = set(&WebSecret::random(), 60);
        for part in ["Path=/", "HttpOnly", "Secure", "SameSite=Lax"] {
            assert!(value.contains(part), "{value}");
        }
        assert!(!value.to_ascii_lowercase().contains("domain"));
    }
}
