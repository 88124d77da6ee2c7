//! Which box port a request is for: its `Host` (HTTP/1.1) or `:authority`
//! (HTTP/2), which must be one label right under the edge's domain.

use moat_core::web::WebHost;

/// Why a request's host names no box port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// No host at all.
    #[error("the request names no host")]
    Missing,
    /// `Host` and `:authority` disagree, or there are two `Host`s.
    #[error("the request names two hosts")]
    Conflicting,
    /// Not a name under the domain.
    #[error("{0:?} is not a name under this server's domain")]
    Foreign(String),
    /// Under the domain, but not `PORT-NAME-OWNER`.
    #[error("{0:?} names no box port (PORT-NAME-OWNER)")]
    NotABox(String),
}

/// The longest host the edge reads.
const MAX_HOST: usize = 255;

/// The box port `host` (a `Host` value: a name, maybe a port) names under `domain`.
pub fn parse(host: &str, domain: &str) -> Result<WebHost, HostError> {
    if host.len() > MAX_HOST {
        return Err(HostError::Foreign(host.chars().take(64).collect()));
    }
    let name = strip_port(host).ok_or_else(|| HostError::Foreign(host.to_string()))?;
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let label = name
        .strip_suffix(domain)
        .and_then(|rest| rest.strip_suffix('.'))
        .filter(|label| !label.is_empty() && !label.contains('.'))
        .ok_or_else(|| HostError::Foreign(host.to_string()))?;
    WebHost::parse_label(label).map_err(|_| HostError::NotABox(host.to_string()))
}

/// The name of `host` without a `:PORT` (digits only); `None` for an IPv6
/// literal or a malformed port.
fn strip_port(host: &str) -> Option<&str> {
    if host.starts_with('[') {
        return None;
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit()) => {
            Some(name)
        }
        Some(_) => None,
        None => Some(host),
    }
}

/// The one host a request names: `:authority` and `Host` (at most one
/// each), the same if both are there.
pub fn of_request<B>(req: &http::Request<B>) -> Result<&str, HostError> {
    let mut hosts = req.headers().get_all(http::header::HOST).iter();
    let header = hosts.next();
    if hosts.next().is_some() {
        return Err(HostError::Conflicting);
    }
    let header = match header {
        Some(value) => Some(value.to_str().map_err(|_| HostError::Foreign("(not text)".into()))?),
        None => None,
    };
    match (req.uri().authority().map(|a| a.as_str()), header) {
        (Some(authority), Some(host)) if !authority.eq_ignore_ascii_case(host) => Err(HostError::Conflicting),
        (Some(authority), _) => Ok(authority),
        (None, Some(host)) => Ok(host),
        (None, None) => Err(HostError::Missing),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use moat_core::web::Owner;
    use moat_core::AccountId;

    #[test]
    fn only_one_label_under_the_domain() {
        let owner = Owner::of(&AccountId("SHA256:x".into()));
        let good = format!("3000-web-{owner}.moat.test");
        let host = parse(&good, "moat.test").unwrap();
        assert_eq!((host.port, host.name.as_str()), (3000, "web"));
        assert_eq!(parse(&format!("{good}:8443"), "moat.test").unwrap(), host);
        assert_eq!(parse(&format!("{good}."), "moat.test").unwrap(), host);
        assert_eq!(parse(&good.to_uppercase(), "moat.test").unwrap(), host);
        for foreign in [
            "moat.test".to_string(),
            "example.com".into(),
            format!("3000-web-{owner}.evilmoat.test"),
            format!("a.3000-web-{owner}.moat.test"),
            format!("3000-web-{owner}.moat.test.evil"),
            format!("{good}:x"),
            format!("{good}:123456"),
            "[::1]:443".into(),
            "x".repeat(300),
        ] {
            assert!(matches!(parse(&foreign, "moat.test"), Err(HostError::Foreign(_))), "{foreign}");
        }
        assert!(matches!(parse("web.moat.test", "moat.test"), Err(HostError::NotABox(_))));
    }

    #[test]
    fn a_request_names_one_host() {
        let req = |uri: &str, hosts: &[&str]| {
            let mut b = http::Request::builder().uri(uri);
            for h in hosts {
                b = b.header("host", *h);
            }
            b.body(()).unwrap()
        };
        assert_eq!(of_request(&req("/", &["a.test"])).unwrap(), "a.test");
        assert_eq!(of_request(&req("https://a.test/", &[])).unwrap(), "a.test");
        assert_eq!(of_request(&req("https://a.test/", &["A.test"])).unwrap(), "a.test");
        assert_eq!(of_request(&req("https://a.test/", &["b.test"])), Err(HostError::Conflicting));
        assert_eq!(of_request(&req("/", &["a.test", "b.test"])), Err(HostError::Conflicting));
        assert_eq!(of_request(&req("/", &[])), Err(HostError::Missing));
    }
}
