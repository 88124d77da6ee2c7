//! Egress policy: which hosts a box may reach, as data.
//!
//! Deny by default: a box reaches a host only when an `allow` rule matches it
//! and no `deny` rule does. Host names are normalised once, here ([`HostName`]),
//! and that one value drives the decision, the DNS answer, the SNI and Host
//! checks and the dial, so no two parts of the gateway can read a name two ways.

use std::fmt;

use serde::{Deserialize, Serialize};

mod lockfile;
pub mod packages;
mod preset;
mod push;

pub use lockfile::{integrity, read_lock, MAX_LOCK_FILE};
pub use packages::{Ecosystem, PackageRules, PackagesChange};
pub use preset::{preset, Preset, DEFAULT_REGISTRIES};
pub use push::{glob_whole, PushRule, RefChange, PUSH_PORT};

/// Ports a rule that names none allows: HTTP and HTTPS.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// A host name in the one form the gateway compares: ASCII lower case, no
/// trailing dot, 1-63 byte labels of `a-z`, `0-9`, `-` and `_`, at most 253
/// bytes, and not an IP address. Internationalised names are held in their
/// `xn--` form (that is what resolvers send on the wire); a rule may be
/// written either way ([`HostName::from_user`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct HostName(String);

/// Why text is not a host name or a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// Not a host name.
    #[error("{0:?} is not a host name (letters, digits, '-', '_' and dots; non-ASCII names in their xn-- form)")]
    BadHost(String),
    /// An IP address where a name belongs.
    #[error("{0:?} is an address; rules name hosts (the gateway resolves them itself)")]
    Address(String),
    /// A bad port list.
    #[error("{0:?} is not a port list (e.g. 443 or 80,443 or *)")]
    BadPorts(String),
    /// A bad method list.
    #[error("{0:?} is not a method list (e.g. GET,HEAD)")]
    BadMethods(String),
    /// A bad path prefix.
    #[error("{0:?} is not a path pattern (it starts with '/', holds printable ASCII, '*' for any run)")]
    BadPath(String),
    /// A push rule that is not `HOST/REPO REF-PATTERN [--fast-forward] [--delete]`.
    #[error("{0:?} is not a push rule (HOST/ORG/REPO REF-PATTERN [--fast-forward] [--delete])")]
    BadPush(String),
    /// A bad repository path.
    #[error("{0:?} is not a repository path (segments of letters, digits, '-', '_', '.', '*')")]
    BadRepo(String),
    /// A bad ref pattern.
    #[error("{0:?} is not a ref pattern (refs/..., '*' for any run, no '..')")]
    BadRefs(String),
    /// A bad package rule or lock.
    #[error("{0}")]
    BadPackages(String),
    /// No such preset.
    #[error("no preset named {0:?} (presets: {presets})", presets = Preset::names())]
    NoPreset(String),
}

impl HostName {
    /// Normalises `s`: one trailing dot dropped, upper case folded; anything
    /// else that is not a plain host name is refused.
    pub fn parse(s: &str) -> Result<Self, PolicyError> {
        let bad = || PolicyError::BadHost(s.to_string());
        let trimmed = s.strip_suffix('.').unwrap_or(s);
        if trimmed.is_empty() || trimmed.len() > 253 {
            return Err(bad());
        }
        let lower = trimmed.to_ascii_lowercase();
        for label in lower.split('.') {
            let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_';
            if label.is_empty() || label.len() > 63 || !label.bytes().all(ok) {
                return Err(bad());
            }
        }
        // A name whose last label is all digits is an IPv4 address in some
        // spelling (inet_aton reads "1.2.3.4", "16909060", "0x1.2").
        let last = lower.rsplit('.').next().unwrap_or_default();
        if last.bytes().all(|b| b.is_ascii_digit()) || (last.starts_with("0x") && lower.split('.').count() <= 4) {
            return Err(PolicyError::Address(s.to_string()));
        }
        Ok(Self(lower))
    }

    /// Normalises a name a person wrote: as [`parse`](Self::parse), after
    /// mapping an internationalised name to its `xn--` form (UTS #46).
    pub fn from_user(s: &str) -> Result<Self, PolicyError> {
        if s.is_ascii() {
            return Self::parse(s);
        }
        let ascii = idna::domain_to_ascii_strict(s).map_err(|_| PolicyError::BadHost(s.to_string()))?;
        Self::parse(&ascii)
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is `suffix` or a name below it.
    fn is_below(&self, suffix: &HostName) -> bool {
        self.0.len() > suffix.0.len()
            && self.0.ends_with(&suffix.0)
            && self.0.as_bytes()[self.0.len() - suffix.0.len() - 1] == b'.'
    }
}

impl TryFrom<String> for HostName {
    type Error = PolicyError;
    fn try_from(s: String) -> Result<Self, PolicyError> {
        Self::parse(&s)
    }
}

impl From<HostName> for String {
    fn from(n: HostName) -> String {
        n.0
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// Which hosts a rule names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostPattern {
    /// Exactly this name.
    Exact(HostName),
    /// Any name below this one (`*.example.com`: `a.example.com`, not `example.com`).
    Below(HostName),
}

impl HostPattern {
    fn matches(&self, host: &HostName) -> bool {
        match self {
            Self::Exact(name) => name == host,
            Self::Below(suffix) => host.is_below(suffix),
        }
    }
}

/// One rule: `[METHODS ]HOST[:PORTS][/PATH]`, e.g. `pypi.org`,
/// `*.githubusercontent.com:443`, `GET,HEAD deb.debian.org/debian/`.
///
/// A rule is parsed once, where a person typed it; what decodes from JSON
/// (the front door's requests, the store) is checked as strictly as
/// [`Rule::parse`] checks text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RuleFields")]
pub struct Rule {
    /// The hosts.
    pub host: HostPattern,
    /// Ports; `None` is any port, and a rule that names none means [`DEFAULT_PORTS`].
    pub ports: Option<Vec<u16>>,
    /// HTTP methods (upper case); empty is any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// What HTTP request targets (path and query) must start with; `*` stands
    /// for any run of characters. `None` is any target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// A rule's fields as they decode, before they are checked (a field this
/// version does not know, as in a policy a later one stored, is ignored).
#[derive(Deserialize)]
struct RuleFields {
    host: HostPattern,
    ports: Option<Vec<u16>>,
    #[serde(default)]
    methods: Vec<String>,
    #[serde(default)]
    path: Option<String>,
}

impl TryFrom<RuleFields> for Rule {
    type Error = PolicyError;
    fn try_from(f: RuleFields) -> Result<Self, PolicyError> {
        if !f.methods.iter().all(|m| is_method(m)) {
            return Err(PolicyError::BadMethods(f.methods.join(",")));
        }
        if let Some(ports) = &f.ports {
            if ports.is_empty() || ports.contains(&0) {
                let shown: Vec<String> = ports.iter().map(u16::to_string).collect();
                return Err(PolicyError::BadPorts(shown.join(",")));
            }
        }
        if let Some(path) = &f.path {
            if !path.starts_with('/') {
                return Err(PolicyError::BadPath(path.clone()));
            }
            parse_path(path)?;
        }
        Ok(Self { host: f.host, ports: f.ports, methods: f.methods, path: f.path })
    }
}

impl Rule {
    /// Parses a rule from its words: an optional method list, then the host
    /// with optional ports and path.
    pub fn parse(words: &[&str]) -> Result<Self, PolicyError> {
        let (methods, spec) = match words {
            [spec] => (Vec::new(), *spec),
            [methods, spec] => (parse_methods(methods)?, *spec),
            _ => return Err(PolicyError::BadHost(words.join(" "))),
        };
        let (hostport, path) = match spec.find('/') {
            Some(i) => (&spec[..i], Some(parse_path(&spec[i..])?)),
            None => (spec, None),
        };
        let (host, ports) = match hostport.rsplit_once(':') {
            Some((host, ports)) => (host, parse_ports(ports)?),
            None => (hostport, Some(DEFAULT_PORTS.to_vec())),
        };
        let host = match host.strip_prefix("*.") {
            Some(suffix) => HostPattern::Below(HostName::from_user(suffix)?),
            None => HostPattern::Exact(HostName::from_user(host)?),
        };
        Ok(Self { host, ports, methods, path })
    }

    /// A rule for `host` on `port` alone.
    pub fn exact(host: HostName, port: u16) -> Self {
        Self { host: HostPattern::Exact(host), ports: Some(vec![port]), methods: Vec::new(), path: None }
    }

    /// Whether the rule covers a connection to `host:port`.
    pub fn covers(&self, host: &HostName, port: u16) -> bool {
        self.host.matches(host) && self.ports.as_ref().is_none_or(|p| p.contains(&port))
    }

    /// Whether the rule says anything about HTTP requests (so that applying it
    /// needs each request seen).
    pub fn is_per_request(&self) -> bool {
        !self.methods.is_empty() || self.path.is_some()
    }

    /// Whether the rule covers an HTTP request (method and origin-form target)
    /// on a connection it covers.
    pub fn covers_request(&self, method: &str, target: &str) -> bool {
        (self.methods.is_empty() || self.methods.iter().any(|m| m == method))
            && self.path.as_ref().is_none_or(|p| glob_prefix(p.as_bytes(), target.as_bytes()))
    }

    /// [`Rule::covers_request`] of a target's [`lenient_reading`], the rule's
    /// path read the same way.
    fn covers_request_leniently(&self, method: &str, lenient: &str) -> bool {
        (self.methods.is_empty() || self.methods.iter().any(|m| m == method))
            && self.path.as_ref().is_none_or(|p| glob_prefix(lenient_reading(p).as_bytes(), lenient.as_bytes()))
    }
}

/// A request target as the most lenient servers read its path: `%2F` as
/// `/`, runs of `/` as one, each segment's `;parameters` dropped, all in
/// lower case (the query is kept, lower-cased).
pub fn lenient_reading(target: &str) -> String {
    let (path, query) = match target.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (target, None),
    };
    let path = path.replace("%2F", "/").replace("%2f", "/");
    let segments: Vec<&str> =
        path.split('/').map(|seg| seg.split(';').next().unwrap_or_default()).filter(|seg| !seg.is_empty()).collect();
    let mut out = format!("/{}", segments.join("/"));
    if path.ends_with('/') && !segments.is_empty() {
        out.push('/');
    }
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out.to_ascii_lowercase()
}

/// Whether `text` starts with something `pattern` matches, `*` matching any
/// run of bytes. (Backtracking only to the last `*`: linear in practice, and
/// patterns and targets are bounded.)
fn glob_prefix(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while p < pattern.len() {
        if pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if t < text.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star.filter(|&(_, st)| st < text.len()) {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    true
}

/// An HTTP method as rules name it: 1-16 upper-case letters.
fn is_method(m: &str) -> bool {
    !m.is_empty() && m.len() <= 16 && m.bytes().all(|b| b.is_ascii_uppercase())
}

fn parse_methods(s: &str) -> Result<Vec<String>, PolicyError> {
    let methods: Vec<String> = s.split(',').map(str::to_string).collect();
    if methods.iter().all(|m| is_method(m)) {
        Ok(methods)
    } else {
        Err(PolicyError::BadMethods(s.to_string()))
    }
}

fn parse_ports(s: &str) -> Result<Option<Vec<u16>>, PolicyError> {
    if s == "*" {
        return Ok(None);
    }
    let ports: Result<Vec<u16>, _> = s.split(',').map(str::parse::<u16>).collect();
    match ports {
        Ok(ports) if !ports.contains(&0) && !ports.is_empty() => Ok(Some(ports)),
        _ => Err(PolicyError::BadPorts(s.to_string())),
    }
}

fn parse_path(s: &str) -> Result<String, PolicyError> {
    // Printable ASCII without the characters that make a pattern mean two
    // things (percent escapes, fragments, backslashes, dot segments).
    let plain = s.bytes().all(|b| b.is_ascii_graphic() && !b"%#\\".contains(&b));
    if s.len() > 1024 || !plain || s.split('/').any(|seg| seg == "." || seg == "..") {
        return Err(PolicyError::BadPath(s.to_string()));
    }
    Ok(s.to_string())
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.methods.is_empty() {
            write!(f, "{} ", self.methods.join(","))?;
        }
        match &self.host {
            HostPattern::Exact(name) => write!(f, "{name}")?,
            HostPattern::Below(name) => write!(f, "*.{name}")?,
        }
        match &self.ports {
            None => write!(f, ":*")?,
            Some(ports) if ports[..] == DEFAULT_PORTS => {}
            Some(ports) => {
                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                write!(f, ":{}", ports.join(","))?;
            }
        }
        if let Some(path) = &self.path {
            write!(f, "{path}")?;
        }
        Ok(())
    }
}

/// A box's policy: what it may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Rules that allow.
    pub allow: Vec<Rule>,
    /// Rules that refuse; a match here wins over any allow.
    pub deny: Vec<Rule>,
    /// Ask mode: a name no rule allows (and none denies) is put to the box's
    /// owner instead of refused at once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ask: bool,
    /// Git push rules (see [`PushRule`]): once a host has one, they alone
    /// decide pushes to it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub push: Vec<PushRule>,
    /// Package rules (see [`PackageRules`]): once there are any, the
    /// registries the gateway knows are looked inside on every connection.
    #[serde(default, skip_serializing_if = "PackageRules::is_empty")]
    pub packages: PackageRules,
}

/// What the policy says about a connection, before any request on it is seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed whatever is sent on it.
    Allow(Rule),
    /// Allowed, but each HTTP request must be checked by [`Policy::decide_request`].
    PerRequest,
    /// Refused, by this rule or by default.
    Deny(Option<Rule>),
}

impl Policy {
    /// Whether a name may be resolved at all: some allow rule names it (on any
    /// port) and no deny rule refuses it outright.
    pub fn allows_name(&self, host: &HostName) -> bool {
        !self.denies_name(host) && (self.allow.iter().any(|r| r.host.matches(host)) || self.has_push_rules(host))
    }

    /// Whether push rules name `host` (then they alone decide pushes there,
    /// and its connections are looked inside).
    pub fn has_push_rules(&self, host: &HostName) -> bool {
        self.push.iter().any(|r| r.host == *host)
    }

    /// Whether the gateway reads `host`'s traffic as a package registry's
    /// because package rules are set (see [`Ecosystem::of_host`]).
    pub fn has_package_rules(&self, host: &HostName) -> bool {
        !self.packages.is_empty() && Ecosystem::of_host(host).is_some()
    }

    /// Whether a deny rule refuses the name on some port, for every request
    /// (such a name is never put to the owner in ask mode).
    pub fn denies_connections_to(&self, host: &HostName) -> bool {
        self.deny.iter().any(|r| r.host.matches(host) && !r.is_per_request())
    }

    /// Whether a deny rule refuses the name outright (on every port, for
    /// every request).
    pub fn denies_name(&self, host: &HostName) -> bool {
        self.deny.iter().any(|r| r.host.matches(host) && r.ports.is_none() && !r.is_per_request())
    }

    /// The verdict on a connection to `host:port`.
    pub fn decide(&self, host: &HostName, port: u16) -> Verdict {
        let denying = self.deny.iter().filter(|r| r.covers(host, port));
        let mut per_request_deny = false;
        for rule in denying {
            if !rule.is_per_request() {
                return Verdict::Deny(Some(rule.clone()));
            }
            per_request_deny = true;
        }
        // Pushes are read inside the request body: a host with push rules
        // is looked inside on every port, whatever else allows it (raw TCP
        // to it, git over SSH among it, is refused).
        let pushed = self.has_push_rules(host);
        // Package rules are read inside what the host answers, likewise.
        let packaged = self.has_package_rules(host);
        let mut allowing = self.allow.iter().filter(|r| r.covers(host, port)).peekable();
        if allowing.peek().is_none() {
            return if pushed { Verdict::PerRequest } else { Verdict::Deny(None) };
        }
        match allowing.find(|r| !r.is_per_request()) {
            Some(rule) if !per_request_deny && !pushed && !packaged => Verdict::Allow(rule.clone()),
            _ => Verdict::PerRequest,
        }
    }

    /// The verdict on one HTTP request on a connection to `host:port`:
    /// the deciding rule, or `Err` with the refusing rule (or none: default).
    ///
    /// A deny rule also refuses the path as lenient servers read it (see
    /// [`lenient_reading`]): nginx merges `//` and decodes `%2F`, Tomcat
    /// drops `;parameters`, IIS ignores case, so `deny host/secret*` must
    /// refuse `//secret`, `/%2Fsecret`, `/;x/secret` and `/SECRET` too. An
    /// allow rule matches the path as given only.
    pub fn decide_request(&self, host: &HostName, port: u16, method: &str, path: &str) -> Result<Rule, Option<Rule>> {
        let on = |r: &&Rule| r.covers(host, port) && r.covers_request(method, path);
        // Read leniently only if a deny rule on the host gets that far.
        let lenient = std::cell::OnceCell::new();
        let refuses = |r: &&Rule| {
            on(r)
                || (r.covers(host, port)
                    && r.covers_request_leniently(method, lenient.get_or_init(|| lenient_reading(path))))
        };
        if let Some(rule) = self.deny.iter().find(refuses) {
            return Err(Some(rule.clone()));
        }
        self.allow.iter().find(on).cloned().ok_or(None)
    }

    /// Adds an allow rule (a rule already there is not added twice).
    pub fn allow(&mut self, rule: Rule) {
        if !self.allow.contains(&rule) {
            self.allow.push(rule);
        }
    }

    /// Adds a deny rule, and drops allow rules it makes identical to it.
    pub fn deny(&mut self, rule: Rule) {
        self.allow.retain(|r| r != &rule);
        if !self.deny.contains(&rule) {
            self.deny.push(rule);
        }
    }

    /// Removes a rule equal to `rule`, allow or deny.
    pub fn remove(&mut self, rule: &Rule) {
        self.allow.retain(|r| r != rule);
        self.deny.retain(|r| r != rule);
    }

    /// Applies an owner's change: a preset replaces the rules (ask mode stays
    /// as it was); the registry hosts are those of the `registries` preset.
    pub fn apply(&mut self, change: PolicyChange, registries: &[HostName]) -> Result<(), PolicyError> {
        match change {
            PolicyChange::Allow(rule) => self.allow(rule),
            PolicyChange::Deny(rule) => self.deny(rule),
            PolicyChange::Remove(rule) => self.remove(&rule),
            PolicyChange::Preset(preset) => {
                let ask = self.ask;
                *self = preset.policy(registries)?;
                self.ask = ask;
            }
            PolicyChange::Ask(on) => self.ask = on,
            PolicyChange::AllowPush(rule) => {
                if !self.push.contains(&rule) {
                    self.push.push(rule);
                }
            }
            PolicyChange::RemovePush(rule) => self.push.retain(|r| r != &rule),
            PolicyChange::Packages(change) => self.packages.apply(change)?,
        }
        Ok(())
    }
}

/// A change to a box's policy, as its owner asks for it (rules already
/// parsed: the front door parses the words, the core applies the rule).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyChange {
    /// Add an allow rule.
    Allow(Rule),
    /// Add a deny rule.
    Deny(Rule),
    /// Remove a rule (allow or deny) equal to this one.
    Remove(Rule),
    /// Replace the policy's rules with a preset's (ask mode stays as it was).
    Preset(Preset),
    /// Turn ask mode on or off.
    Ask(bool),
    /// Add a push rule.
    AllowPush(PushRule),
    /// Remove a push rule equal to this one.
    RemovePush(PushRule),
    /// Change the package rules.
    Packages(PackagesChange),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn host(s: &str) -> HostName {
        HostName::parse(s).unwrap()
    }

    fn rule(s: &str) -> Rule {
        Rule::parse(&s.split(' ').collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn names_normalise_once() {
        assert_eq!(host("PyPI.org.").as_str(), "pypi.org");
        assert_eq!(host("_acme.x-y.example").as_str(), "_acme.x-y.example");
        for bad in ["", ".", "a..b", "a.b..", "a b", "a\0b", "bücher.de", "a/b", &"a".repeat(64)] {
            assert!(HostName::parse(bad).is_err(), "{bad:?}");
        }
        for addr in ["1.2.3.4", "16909060", "0x7f.1", "127.1"] {
            assert!(matches!(HostName::parse(addr), Err(PolicyError::Address(_))), "{addr}");
        }
        let long = format!("{}.com", ["a"; 125].join("."));
        assert!(long.len() <= 253 && HostName::parse(&long).is_ok());
        assert!(HostName::parse(&format!("aa.{long}")).is_err());
        // A person may write a name in Unicode; it is held (and matched, and
        // dialled) in the form the wire carries. The wire itself is ASCII only.
        assert_eq!(HostName::from_user("Bücher.DE").unwrap().as_str(), "xn--bcher-kva.de");
        assert_eq!(rule("*.bücher.de").to_string(), "*.xn--bcher-kva.de");
        for bad in ["a\u{200b}b\u{0}.de", "ü..de", "\u{202e}evil.com/"] {
            assert!(HostName::from_user(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rules_round_trip() {
        for text in ["pypi.org", "*.example.com:443", "x.org:*", "GET,HEAD deb.debian.org/debian/", "a.b:22,2222"] {
            assert_eq!(rule(text).to_string(), text);
        }
        assert_eq!(rule("A.Example.:80,443").to_string(), "a.example");
        for bad in ["x.org:0", "x.org:", "x.org:99999", "get x.org", "x.org/a/../b", "x.org/%2e", "*.", "*"] {
            assert!(Rule::parse(&bad.split(' ').collect::<Vec<_>>()).is_err(), "{bad}");
        }
    }

    #[test]
    fn deny_by_default_and_deny_wins() {
        let mut p = Policy::default();
        assert_eq!(p.decide(&host("pypi.org"), 443), Verdict::Deny(None));
        assert!(!p.allows_name(&host("pypi.org")));
        p.allow(rule("*.example.com"));
        p.allow(rule("pypi.org:443"));
        assert!(matches!(p.decide(&host("a.example.com"), 80), Verdict::Allow(_)));
        assert_eq!(p.decide(&host("example.com"), 80), Verdict::Deny(None));
        assert_eq!(p.decide(&host("badexample.com"), 80), Verdict::Deny(None));
        assert_eq!(p.decide(&host("pypi.org"), 80), Verdict::Deny(None));
        assert_eq!(p.decide(&host("a.example.com"), 22), Verdict::Deny(None));
        p.deny(rule("evil.example.com:*"));
        assert_eq!(p.decide(&host("evil.example.com"), 443), Verdict::Deny(Some(rule("evil.example.com:*"))));
        assert!(!p.allows_name(&host("evil.example.com")));
        assert!(p.allows_name(&host("good.example.com")));
    }

    #[test]
    fn deny_rules_refuse_what_lenient_servers_read_as_theirs() {
        let mut p = Policy::default();
        p.allow(Rule::parse(&["b.example"]).unwrap());
        p.deny(Rule::parse(&["b.example/secret*"]).unwrap());
        p.deny(Rule::parse(&["b.example/*admin"]).unwrap());
        let host = HostName::parse("b.example").unwrap();
        let verdict = |path: &str| p.decide_request(&host, 443, "GET", path).is_ok();
        for refused in
            ["/secret", "//secret", "/%2Fsecret", "/%2fsecret", "/;x/secret", "/SECRET", "/x/ADMIN", "/Secret/"]
        {
            assert!(!verdict(refused), "{refused} let through");
        }
        for allowed in ["/", "/public/secrets-page", "/x/y?q=secret"] {
            assert!(verdict(allowed), "{allowed} refused");
        }
        assert_eq!(lenient_reading("//A;v=1//b%2Fc/?Q=1"), "/a/b/c/?q=1");
        assert_eq!(lenient_reading("/"), "/");
    }

    #[test]
    fn globs_match_prefixes() {
        assert!(glob_prefix(b"/a/", b"/a/b"));
        assert!(!glob_prefix(b"/a/", b"/ab"));
        assert!(glob_prefix(b"/*/x", b"/o/r/x"));
        assert!(glob_prefix(b"/*x", b"/abc?s=x"));
        assert!(!glob_prefix(b"/*/x", b"/o/r/y"));
        assert!(glob_prefix(b"*", b""));
        assert!(!glob_prefix(b"/a*b*c", b"/aXbY"));
    }

    #[test]
    fn per_request_rules() {
        let mut p = Policy::default();
        p.allow(rule("GET,HEAD deb.debian.org"));
        let h = host("deb.debian.org");
        assert_eq!(p.decide(&h, 80), Verdict::PerRequest);
        assert!(p.decide_request(&h, 80, "GET", "/debian/x").is_ok());
        assert_eq!(p.decide_request(&h, 80, "POST", "/debian/x"), Err(None));
        let g = preset("github-read", &[]).unwrap();
        let gh = host("github.com");
        assert_eq!(g.decide(&gh, 443), Verdict::PerRequest);
        assert!(g.decide_request(&gh, 443, "GET", "/o/r.git/info/refs?service=git-upload-pack").is_ok());
        assert!(g.decide_request(&gh, 443, "POST", "/o/r.git/git-upload-pack").is_ok());
        assert!(g.decide_request(&gh, 443, "POST", "/o/r.git/git-receive-pack").is_err());
        assert!(g.decide_request(&gh, 443, "GET", "/o/r.git/info/refs?service=git-receive-pack").is_err());
        assert!(g.decide_request(&gh, 443, "POST", "/o/r.git/info/lfs").is_err());
        assert!(g.decide_request(&host("api.github.com"), 443, "POST", "/repos").is_err());
    }

    #[test]
    fn push_rules_make_their_host_reachable_and_looked_inside() {
        let mut p = Policy::default();
        let gh = host("github.com");
        p.apply(PolicyChange::AllowPush(PushRule::parse(&["github.com/a/b", "refs/heads/x"]).unwrap()), &[]).unwrap();
        assert!(p.allows_name(&gh) && p.has_push_rules(&gh));
        assert_eq!(p.decide(&gh, 443), Verdict::PerRequest);
        assert_eq!(p.decide(&gh, 22), Verdict::PerRequest);
        p.allow(rule("github.com:*"));
        assert_eq!(p.decide(&gh, 22), Verdict::PerRequest);
        assert!(matches!(p.decide(&host("other.test"), 443), Verdict::Deny(None)));
        // A deny of the whole host still wins.
        p.deny(rule("github.com:*"));
        assert!(!p.allows_name(&gh));
        assert!(matches!(p.decide(&gh, 443), Verdict::Deny(Some(_))));
        let rm = PolicyChange::RemovePush(PushRule::parse(&["github.com/a/b", "refs/heads/x"]).unwrap());
        p.apply(rm, &[]).unwrap();
        assert!(p.push.is_empty());
    }

    #[test]
    fn decoded_rules_are_checked_as_parsed_ones() {
        for text in ["pypi.org", "*.example.com:443", "x.org:*", "GET,HEAD deb.debian.org/debian/", "a.b:22,2222"] {
            let json = serde_json::to_string(&rule(text)).unwrap();
            assert_eq!(serde_json::from_str::<Rule>(&json).unwrap(), rule(text));
        }
        for bad in [
            r#"{"host":{"exact":"x.org"},"ports":[]}"#,
            r#"{"host":{"exact":"x.org"},"ports":[0]}"#,
            r#"{"host":{"exact":"x.org"},"ports":null,"methods":["get"]}"#,
            r#"{"host":{"exact":"x.org"},"ports":null,"methods":[""]}"#,
            r#"{"host":{"exact":"x.org"},"ports":null,"path":"a/b"}"#,
            r#"{"host":{"exact":"x.org"},"ports":null,"path":"/a/../b"}"#,
            r#"{"host":{"exact":"x.org"},"ports":null,"path":"/a b"}"#,
            r#"{"host":{"exact":"1.2.3.4"},"ports":null}"#,
        ] {
            assert!(serde_json::from_str::<Rule>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn changes_apply_the_policys_own_rules() {
        let mut p = Policy { ask: true, ..Policy::default() };
        p.apply(PolicyChange::Allow(rule("x.org")), &[]).unwrap();
        p.apply(PolicyChange::Allow(rule("x.org")), &[]).unwrap();
        assert_eq!(p.allow, [rule("x.org")]);
        // A deny drops the allow rule it equals.
        p.apply(PolicyChange::Deny(rule("x.org")), &[]).unwrap();
        assert_eq!((p.allow.len(), p.deny.len()), (0, 1));
        p.apply(PolicyChange::Remove(rule("x.org")), &[]).unwrap();
        assert_eq!(p, Policy { ask: true, ..Policy::default() });
        // A preset replaces the rules and keeps ask mode.
        p.apply(PolicyChange::Allow(rule("y.org")), &[]).unwrap();
        p.apply(PolicyChange::Preset(Preset::Registries), &[host("pypi.org")]).unwrap();
        assert_eq!(p.allow, [rule("GET,HEAD pypi.org")]);
        assert!(p.ask);
        p.apply(PolicyChange::Ask(false), &[]).unwrap();
        assert!(!p.ask);
        for preset in Preset::ALL {
            assert_eq!(Preset::parse(preset.name()), Ok(preset));
            assert_eq!(serde_json::to_string(&preset).unwrap(), format!("{:?}", preset.name()));
            assert!(preset.policy(&[host("pypi.org")]).is_ok());
        }
        assert_eq!(Preset::parse("all"), Err(PolicyError::NoPreset("all".into())));
    }
}
