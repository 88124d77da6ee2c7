//! The decision on one HTTP request, apart from any socket: a request the
//! gateway has read, the name and port the box dialled, and the policy's
//! verdict on the connection in, the rule that lets it go or the refusal out.
//! Pure, so that it is tested here without a box or a network.

use moat_core::policy::{HostName, Policy, Rule, Verdict};

use crate::http::request::Request;
use crate::refusal::Refusal;

/// Whether `request`, read on a connection to `name:port` whose verdict under
/// `policy` was `verdict`, may go to the host: by which rule, or why not.
/// The request must name the dialled host (and port, if it names one), must
/// not switch protocols, and, where the verdict leaves it to each request,
/// must be allowed by a rule that names its method or target.
pub fn judge(
    request: &Request,
    name: &HostName,
    port: u16,
    policy: &Policy,
    verdict: &Verdict,
) -> Result<Rule, Refusal> {
    // A protocol switch would hand every later byte through unread (and a
    // server that does not switch reads them as requests): refused.
    if request.upgrade {
        return Err(Refusal::Upgrade);
    }
    if request.host != *name || request.port.is_some_and(|p| p != port) {
        return Err(Refusal::HostDiffers(request.host.clone()));
    }
    match verdict {
        Verdict::Allow(rule) => Ok(rule.clone()),
        _ => policy.decide_request(name, port, &request.method, &request.target).map_err(|rule| match rule {
            Some(rule) => Refusal::ByRule(rule),
            None => Refusal::NoRule,
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use crate::http::request::{read_head, Head};

    fn host(s: &str) -> HostName {
        HostName::parse(s).unwrap()
    }

    fn rule(text: &str) -> Rule {
        Rule::parse(&text.split(' ').collect::<Vec<_>>()).unwrap()
    }

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        Policy {
            allow: allow.iter().map(|r| rule(r)).collect(),
            deny: deny.iter().map(|r| rule(r)).collect(),
            ask: false,
        }
    }

    fn request(head: &str) -> Request {
        match read_head(head.as_bytes()) {
            Head::Request(r) => r,
            other => panic!("{head:?}: {other:?}"),
        }
    }

    /// The verdict on `request` at `name:port` under `policy`, decided as the
    /// proxy decides it (connection first, then request).
    fn judged(policy: &Policy, name: &str, port: u16, head: &str) -> Result<Rule, Refusal> {
        let name = host(name);
        let verdict = policy.decide(&name, port);
        judge(&request(head), &name, port, policy, &verdict)
    }

    #[test]
    fn per_request_rules_decide_each_request() {
        let p = policy(&["GET,HEAD deb.debian.org/debian/"], &["POST pypi.org/x"]);
        let get = "GET /debian/dists HTTP/1.1\r\nHost: deb.debian.org\r\n\r\n";
        assert_eq!(judged(&p, "deb.debian.org", 80, get), Ok(rule("GET,HEAD deb.debian.org/debian/")));
        let post = "POST /debian/x HTTP/1.1\r\nHost: deb.debian.org\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(judged(&p, "deb.debian.org", 80, post), Err(Refusal::NoRule));
        let elsewhere = "GET /etc HTTP/1.1\r\nHost: deb.debian.org\r\n\r\n";
        assert_eq!(judged(&p, "deb.debian.org", 443, elsewhere), Err(Refusal::NoRule));
        // A deny rule that names requests refuses them by name.
        let p = policy(&["pypi.org"], &["POST pypi.org/x"]);
        let refused = judged(&p, "pypi.org", 443, "POST /x/y HTTP/1.1\r\nHost: pypi.org\r\n\r\n").unwrap_err();
        assert_eq!(refused, Refusal::ByRule(rule("POST pypi.org/x")));
        assert_eq!(refused.rule(), Some(&rule("POST pypi.org/x")));
        assert_eq!(judged(&p, "pypi.org", 443, "GET /x HTTP/1.1\r\nHost: pypi.org\r\n\r\n"), Ok(rule("pypi.org")));
    }

    #[test]
    fn a_connection_allowed_whole_lets_every_request_go() {
        let p = policy(&["pypi.org"], &[]);
        let put = "PUT /anything HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(judged(&p, "pypi.org", 443, put), Ok(rule("pypi.org")));
        // Allowed once by the owner: no rule of the policy's, the verdict's own.
        let (name, once) = (host("once.example"), Rule::exact(host("once.example"), 8080));
        let verdict = Verdict::Allow(once.clone());
        let r = request("GET / HTTP/1.1\r\nHost: once.example:8080\r\n\r\n");
        assert_eq!(judge(&r, &name, 8080, &policy(&[], &[]), &verdict), Ok(once));
    }

    #[test]
    fn another_host_or_port_or_a_protocol_switch_is_refused() {
        let p = policy(&["pypi.org", "other.test"], &[]);
        let other = "GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
        assert_eq!(judged(&p, "pypi.org", 443, other), Err(Refusal::HostDiffers(host("other.test"))));
        let port = "GET / HTTP/1.1\r\nHost: pypi.org:8443\r\n\r\n";
        assert_eq!(judged(&p, "pypi.org", 443, port), Err(Refusal::HostDiffers(host("pypi.org"))));
        let same_port = "GET / HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n";
        assert!(judged(&p, "pypi.org", 443, same_port).is_ok());
        let upgrade = "GET / HTTP/1.1\r\nHost: pypi.org\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
        assert_eq!(judged(&p, "pypi.org", 443, upgrade), Err(Refusal::Upgrade));
        // Checked before the rules: a refusal by rule never hides them.
        let p = policy(&["GET pypi.org"], &[]);
        let both = "POST / HTTP/1.1\r\nHost: other.test\r\nUpgrade: h2c\r\n\r\n";
        assert_eq!(judged(&p, "pypi.org", 443, both), Err(Refusal::Upgrade));
    }
}
