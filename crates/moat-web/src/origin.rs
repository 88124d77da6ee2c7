//! Requests a page of one box makes to another box's URL. Every box URL is
//! a name under one domain, so to a browser they are one site: the edge's
//! `SameSite` cookie goes along with what another box's page asks, and a
//! public page of one account could open a WebSocket to, or POST to,
//! another account's private URL as its signed-in owner (a box cannot tell:
//! it is told `Host: localhost:PORT`). A request that can change something
//! (a method other than GET, HEAD or OPTIONS, or a protocol switch) from a
//! page of another box, or from an opaque origin, is refused. Other sites
//! are kept out by the cookie's `SameSite`; pages of the same box (another
//! port: a dev server and its API) are let through.

use http::{header, Method, Request};
use moat_core::web::WebHost;

use crate::host;

/// The `Origin` of `req` (for box `target`, under `domain`) if it is one to
/// refuse.
pub fn foreign<B>(req: &Request<B>, target: &WebHost, domain: &str, upgrade: bool) -> Option<String> {
    let reads = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if reads && !upgrade {
        return None;
    }
    // No Origin: not a browser's request (browsers send one with every
    // unsafe method and every WebSocket).
    let origin = req.headers().get(header::ORIGIN)?;
    let shown = String::from_utf8_lossy(origin.as_bytes()).chars().take(128).collect::<String>();
    let Some(authority) = origin.to_str().ok().and_then(|o| o.strip_prefix("https://").or(o.strip_prefix("http://")))
    else {
        // `null` (a sandboxed frame, a redirect across origins) or nonsense.
        return Some(shown);
    };
    let name = authority.rsplit_once(':').map_or(authority, |(name, _)| name).trim_end_matches('.');
    let name = name.to_ascii_lowercase();
    if name != domain && !name.ends_with(&format!(".{domain}")) {
        // Another site: the cookie's SameSite keeps it out.
        return None;
    }
    match host::parse(authority, domain) {
        Ok(from) if from.name == target.name && from.owner == target.owner => None,
        _ => Some(shown),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn req(method: &str, origin: Option<&str>) -> Request<()> {
        let mut b = Request::builder().method(method).uri("/");
        if let Some(o) = origin {
            b = b.header(header::ORIGIN, o);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn another_boxs_pages_may_only_read() {
        let domain = "h.test";
        let target = host::parse("8000-w1-1e970e6082.h.test", domain).unwrap();
        let own_port = "https://3000-w1-1e970e6082.h.test:8443";
        let other_box = "https://8000-evil-bbebd62ba6.h.test";
        let other_owner = "https://8000-w1-bbebd62ba6.h.test";
        // Reads pass whatever their origin.
        assert_eq!(foreign(&req("GET", Some(other_box)), &target, domain, false), None);
        // Writes and WebSockets from another box (or another owner's box of
        // the same name, or an opaque origin) do not.
        for origin in [other_box, other_owner, "null", "https://h.test", "https://x.h.test"] {
            assert!(foreign(&req("POST", Some(origin)), &target, domain, false).is_some(), "{origin}");
            assert!(foreign(&req("GET", Some(origin)), &target, domain, true).is_some(), "{origin}");
        }
        // The same box (any port), other sites and clients without Origin pass.
        for origin in [Some(own_port), Some("https://8000-W1-1E970E6082.H.TEST."), Some("https://example.org"), None] {
            assert_eq!(foreign(&req("DELETE", origin), &target, domain, true), None, "{origin:?}");
        }
    }
}
