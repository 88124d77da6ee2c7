//! The decision on one HTTP request, apart from any socket: a request the
//! gateway has read, the name and port the box dialled, and the policy's
//! verdict on the connection in, the rule that lets it go or the refusal out.
//! Pure, so that it is tested here without a box or a network.

use std::fmt;

use moat_core::policy::{HostName, Policy, PushRule, Rule, Verdict, PUSH_PORT};

use crate::git::target::{push_request, PushRequest};
use crate::http::request::{Body, Request};
use crate::refusal::Refusal;

/// What lets a request go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allowed {
    /// A method and path rule (or the connection's own verdict).
    Rule(Rule),
    /// Push rules for the repository: the ref advertisement goes as it is,
    /// a push only once its commands (and pack, for `--fast-forward`) are
    /// read and covered.
    Push {
        /// The repository's path.
        repo: String,
        /// The rules that name it.
        rules: Vec<PushRule>,
        /// It is the push itself (its body must be read first).
        body: bool,
    },
}

impl fmt::Display for Allowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rule(rule) => write!(f, "{rule}"),
            Self::Push { rules, .. } => {
                let rules: Vec<String> = rules.iter().map(PushRule::to_string).collect();
                f.write_str(&rules.join("; "))
            }
        }
    }
}

/// Whether `request`, read on a connection to `name:port` whose verdict under
/// `policy` was `verdict`, may go to the host: by which rule, or why not.
/// The request must name the dialled host (and port, if it names one), must
/// not switch protocols, and, where the verdict leaves it to each request,
/// must be allowed by a rule that names its method or target. On a host
/// with push rules, they alone decide pushes (refused on git's own channel).
pub fn judge(
    request: &Request,
    name: &HostName,
    port: u16,
    policy: &Policy,
    verdict: &Verdict,
) -> Result<Allowed, Refusal> {
    // A protocol switch would hand every later byte through unread (and a
    // server that does not switch reads them as requests): refused.
    if request.upgrade {
        return Err(Refusal::Upgrade);
    }
    if request.host != *name || request.port.is_some_and(|p| p != port) {
        return Err(Refusal::HostDiffers(request.host.clone()));
    }
    if policy.has_push_rules(name) {
        if let Some(push) = push_request(&request.method, &request.target) {
            return judge_push(&push, name, port, policy);
        }
    }
    if let Verdict::Allow(rule) = verdict {
        return Ok(Allowed::Rule(rule.clone()));
    }
    // A server that reads no body of a GET reads one as the requests that
    // follow, which no rule judged (a `DELETE` in a `GET`'s body).
    if request.body != Body::Length(0) && request.methods().any(moat_core::effects::is_safe_method) {
        return Err(Refusal::BadRequest("a GET, HEAD or OPTIONS with a body, where rules read each request"));
    }
    // Under each method the server may read it as: the rule last found is
    // the one for the method it acts on.
    let mut allowed = Err(None);
    for method in request.methods() {
        allowed = policy.decide_request(name, port, method, &request.target);
        if allowed.is_err() {
            break;
        }
    }
    allowed.map(Allowed::Rule).map_err(|rule| match rule {
        Some(rule) => Refusal::ByRule(rule),
        None => Refusal::NoRule,
    })
}

/// A part of a push on a host with push rules: allowed to a repository a
/// rule names, over HTTPS; else refused as git reads refusals.
fn judge_push(push: &PushRequest, name: &HostName, port: u16, policy: &Policy) -> Result<Allowed, Refusal> {
    let repo = push.repo();
    let rules: Vec<PushRule> =
        policy.push.iter().filter(|r| !repo.is_empty() && r.names_repo(name, repo)).cloned().collect();
    let why = if port != PUSH_PORT {
        "moat: pushes go over HTTPS only".to_string()
    } else if rules.is_empty() {
        format!("moat: no push rule names {name}/{repo}")
    } else {
        let body = matches!(push, PushRequest::Push { .. });
        return Ok(Allowed::Push { repo: repo.to_string(), rules, body });
    };
    Err(Refusal::git_error(matches!(push, PushRequest::Advertise { .. }), why))
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
            push: Vec::new(),
            packages: Default::default(),
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
        match judged_any(policy, name, port, head)? {
            Allowed::Rule(rule) => Ok(rule),
            other => panic!("{other:?}"),
        }
    }

    fn judged_any(policy: &Policy, name: &str, port: u16, head: &str) -> Result<Allowed, Refusal> {
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
    fn a_method_override_is_judged_as_the_method_it_names() {
        let hidden = |method: &str, path: &str, host: &str| {
            format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nX-HTTP-Method-Override: {method}\r\n\r\n")
        };
        let p = policy(&["GET,HEAD web.test"], &[]);
        assert_eq!(judged(&p, "web.test", 80, &hidden("DELETE", "/o", "web.test")), Err(Refusal::NoRule));
        assert_eq!(judged(&p, "web.test", 80, &hidden("HEAD", "/o", "web.test")), Ok(rule("GET,HEAD web.test")));
        // A deny rule for the method it names refuses it on an open host.
        let p = policy(&["pypi.org"], &["POST pypi.org/x"]);
        let refused = judged(&p, "pypi.org", 443, &hidden("POST", "/x", "pypi.org"));
        assert_eq!(refused, Err(Refusal::ByRule(rule("POST pypi.org/x"))));
        // A GET with a body, whose body a server may read as a request of its own.
        let smuggled = "GET /x HTTP/1.1\r\nHost: web.test\r\nContent-Length: 40\r\n\r\n";
        let p = policy(&["GET,HEAD web.test"], &[]);
        assert!(matches!(judged(&p, "web.test", 80, smuggled), Err(Refusal::BadRequest(_))));
        // Allowed where a rule allows both methods: by the rule for the one it names.
        let p = policy(&["GET web.test", "DELETE web.test/o"], &[]);
        assert_eq!(judged(&p, "web.test", 80, &hidden("DELETE", "/o", "web.test")), Ok(rule("DELETE web.test/o")));
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
        assert_eq!(judge(&r, &name, 8080, &policy(&[], &[]), &verdict), Ok(Allowed::Rule(once)));
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

    #[test]
    fn push_rules_alone_decide_pushes_on_their_host() {
        let mut p = moat_core::policy::preset("github-read", &[]).unwrap();
        let push = PushRule::parse(&["github.com/moat/repo", "refs/heads/agent/*"]).unwrap();
        let adv = "GET /moat/repo.git/info/refs?service=git-receive-pack HTTP/1.1\r\nHost: github.com\r\n\r\n";
        let post = "POST /moat/repo.git/git-receive-pack HTTP/1.1\r\nHost: github.com\r\nContent-Length: 4\r\n\r\n";
        // Without push rules the preset's deny refuses, as before.
        assert!(matches!(judged_any(&p, "github.com", 443, adv), Err(Refusal::ByRule(_))));
        p.push.push(push.clone());
        let allowed = |body| Allowed::Push { repo: "moat/repo".into(), rules: vec![push.clone()], body };
        assert_eq!(judged_any(&p, "github.com", 443, adv), Ok(allowed(false)));
        assert_eq!(judged_any(&p, "github.com", 443, post), Ok(allowed(true)));
        assert_eq!(
            judged_any(&p, "github.com", 443, post).unwrap().to_string(),
            "push github.com/moat/repo refs/heads/agent/*"
        );
        // Another repository, another port, an odd spelling: git's own refusal.
        let other = adv.replace("moat/repo", "moat/other");
        let refused = judged_any(&p, "github.com", 443, &other).unwrap_err();
        assert_eq!(refused.to_string(), "moat: no push rule names github.com/moat/other");
        assert!(matches!(refused, Refusal::Git { .. }));
        assert!(matches!(judged_any(&p, "github.com", 80, post), Err(Refusal::Git { .. })));
        let odd = "PUT /moat/repo.git/git-receive-pack HTTP/1.1\r\nHost: github.com\r\nContent-Length: 0\r\n\r\n";
        assert!(matches!(judged_any(&p, "github.com", 443, odd), Err(Refusal::Git { .. })));
        // Fetches are the path rules' still.
        let fetch = "POST /moat/repo.git/git-upload-pack HTTP/1.1\r\nHost: github.com\r\nContent-Length: 0\r\n\r\n";
        assert!(judged(&p, "github.com", 443, fetch).is_ok());
        // A whole-host allow lets no push go unchecked, on any port.
        let mut open = policy(&["github.com:*"], &[]);
        open.push.push(push);
        assert_eq!(open.decide(&host("github.com"), 8443), Verdict::PerRequest);
        assert!(matches!(judged_any(&open, "github.com", 443, &other), Err(Refusal::Git { .. })));
    }
}
