//! Git push rules: which refs of which repositories a box may push to over
//! git's smart HTTP, as data (`policy NAME allow push HOST/ORG/REPO
//! REF-PATTERN [--fast-forward] [--delete]`).
//!
//! Method and path rules cannot tell a push to `agent/fix-123` from a force
//! push to `main`: the refs are in the request body. A push rule names the
//! repository and a pattern of refs; the gateway reads the command list of
//! each `git-receive-pack` request and lets it go only when every command
//! is covered. Once a host has push rules, they alone decide pushes to it
//! (the path rules decide everything else there). Deleting a ref needs a rule
//! with `--delete`; a tag needs a rule whose pattern names `refs/tags/`.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{HostName, PolicyError};

/// The port pushes go over: HTTPS only (a token bound to the host must never
/// travel in clear text, and the body is read inside TLS).
pub const PUSH_PORT: u16 = 443;

/// Longest repository path or ref pattern a rule may hold.
const MAX_PATTERN: usize = 256;

/// One push rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "PushRuleFields")]
pub struct PushRule {
    /// The git server.
    pub host: HostName,
    /// The repository's path on it, without `.git` (`moat/repo`); `*` stands
    /// for any run of characters.
    pub repo: String,
    /// The refs it allows (`refs/heads/agent/*`); `*` stands for any run.
    pub refs: String,
    /// An update must descend from what the ref held (decided from the pack).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fast_forward: bool,
    /// The ref may also be deleted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delete: bool,
}

#[derive(Deserialize)]
struct PushRuleFields {
    host: HostName,
    repo: String,
    refs: String,
    #[serde(default)]
    fast_forward: bool,
    #[serde(default)]
    delete: bool,
}

impl TryFrom<PushRuleFields> for PushRule {
    type Error = PolicyError;
    fn try_from(f: PushRuleFields) -> Result<Self, PolicyError> {
        let repo = parse_repo(&f.repo)?;
        let refs = parse_refs(&f.refs)?;
        Ok(Self { host: f.host, repo, refs, fast_forward: f.fast_forward, delete: f.delete })
    }
}

/// What one command of a push does to its ref.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefChange {
    /// The ref is made (its old id is all zeros).
    Create,
    /// The ref moves from one commit to another.
    Update,
    /// The ref is removed (its new id is all zeros).
    Delete,
}

impl PushRule {
    /// Parses `HOST/ORG/REPO REF-PATTERN [--fast-forward] [--delete]`.
    pub fn parse(words: &[&str]) -> Result<Self, PolicyError> {
        let (place, refs, flags) = match words {
            [place, refs, flags @ ..] => (*place, *refs, flags),
            _ => return Err(PolicyError::BadPush(words.join(" "))),
        };
        let (host, repo) = place.split_once('/').ok_or_else(|| PolicyError::BadPush(words.join(" ")))?;
        let (mut fast_forward, mut delete) = (false, false);
        for flag in flags {
            match *flag {
                "--fast-forward" if !fast_forward => fast_forward = true,
                "--delete" if !delete => delete = true,
                _ => return Err(PolicyError::BadPush(words.join(" "))),
            }
        }
        Ok(Self {
            host: HostName::from_user(host)?,
            repo: parse_repo(repo)?,
            refs: parse_refs(refs)?,
            fast_forward,
            delete,
        })
    }

    /// Whether the rule names `repo` (a request path's repository, `.git`
    /// dropped) on `host`.
    pub fn names_repo(&self, host: &HostName, repo: &str) -> bool {
        self.host == *host && glob_whole(self.repo.as_bytes(), repo.as_bytes())
    }

    /// Whether the rule allows `change` to `refname` (its repository already
    /// matched): the pattern covers the ref, a tag only by a pattern that
    /// names tags, a delete only with `--delete`.
    pub fn allows(&self, refname: &str, change: RefChange) -> bool {
        let tag = refname.starts_with("refs/tags/");
        glob_whole(self.refs.as_bytes(), refname.as_bytes())
            && (!tag || self.refs.starts_with("refs/tags/"))
            && (change != RefChange::Delete || self.delete)
    }
}

impl fmt::Display for PushRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "push {}/{} {}", self.host, self.repo, self.refs)?;
        if self.fast_forward {
            f.write_str(" --fast-forward")?;
        }
        if self.delete {
            f.write_str(" --delete")?;
        }
        Ok(())
    }
}

/// A repository path: segments of letters, digits, `-`, `_`, `.` and `*`,
/// no dot segments; a trailing `.git` is dropped (requests are matched
/// without it too).
fn parse_repo(s: &str) -> Result<String, PolicyError> {
    let repo = s.trim_end_matches('/');
    let repo = repo.strip_suffix(".git").unwrap_or(repo);
    let ok = |b: u8| b.is_ascii_alphanumeric() || b"-_.*".contains(&b);
    let good = !repo.is_empty()
        && repo.len() <= MAX_PATTERN
        && repo.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != ".." && seg.bytes().all(ok));
    if good {
        Ok(repo.to_string())
    } else {
        Err(PolicyError::BadRepo(s.to_string()))
    }
}

/// A ref pattern: `refs/...`, the characters git allows in ref names (and
/// `*`), no `..`.
fn parse_refs(s: &str) -> Result<String, PolicyError> {
    let ok = |b: u8| b.is_ascii_graphic() && !b"~^:?[\\".contains(&b);
    let good = s.starts_with("refs/") && s.len() <= MAX_PATTERN && s.bytes().all(ok) && !s.contains("..");
    if good {
        Ok(s.to_string())
    } else {
        Err(PolicyError::BadRefs(s.to_string()))
    }
}

/// Whether `pattern` matches all of `text`, `*` matching any run of bytes
/// (slashes too: `refs/heads/agent/*` covers `refs/heads/agent/a/b`).
/// Backtracks only to the last `*`, so linear in practice; both are bounded.
pub fn glob_whole(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    loop {
        match (pattern.get(p), text.get(t)) {
            (Some(b'*'), _) => {
                star = Some((p, t));
                p += 1;
            }
            (Some(a), Some(b)) if a == b => {
                p += 1;
                t += 1;
            }
            (None, None) => return true,
            _ => match star {
                Some((sp, st)) if st < text.len() => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                _ => return false,
            },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn rule(s: &str) -> PushRule {
        PushRule::parse(&s.split(' ').collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn rules_parse_and_round_trip() {
        for text in [
            "github.com/moat/repo refs/heads/agent/*",
            "github.com/moat/* refs/tags/v* --fast-forward",
            "git.example/a/b/c refs/heads/x --fast-forward --delete",
        ] {
            assert_eq!(format!("push {text}"), rule(text).to_string());
            let json = serde_json::to_string(&rule(text)).unwrap();
            assert_eq!(serde_json::from_str::<PushRule>(&json).unwrap(), rule(text));
        }
        assert_eq!(rule("GitHub.com/moat/repo.git refs/heads/a").repo, "moat/repo");
        for bad in [
            "github.com refs/heads/a",
            "github.com/moat/repo",
            "github.com/moat/../x refs/heads/a",
            "github.com//x refs/heads/a",
            "github.com/moat/repo heads/a",
            "github.com/moat/repo refs/heads/a..b",
            "github.com/moat/repo refs/heads/a --force",
            "github.com/moat/repo refs/heads/a --delete --delete",
            "1.2.3.4/moat/repo refs/heads/a",
            "github.com/mo%61t/repo refs/heads/a",
        ] {
            assert!(PushRule::parse(&bad.split(' ').collect::<Vec<_>>()).is_err(), "{bad}");
        }
        let bad = r#"{"host":"github.com","repo":"a/../b","refs":"refs/heads/x"}"#;
        assert!(serde_json::from_str::<PushRule>(bad).is_err());
    }

    #[test]
    fn refs_tags_and_deletes() {
        let r = rule("github.com/moat/repo refs/heads/agent/*");
        let host = HostName::parse("github.com").unwrap();
        assert!(r.names_repo(&host, "moat/repo"));
        assert!(!r.names_repo(&host, "moat/other"));
        assert!(!r.names_repo(&HostName::parse("gitlab.com").unwrap(), "moat/repo"));
        assert!(r.allows("refs/heads/agent/fix-1", RefChange::Update));
        assert!(r.allows("refs/heads/agent/a/b", RefChange::Create));
        assert!(!r.allows("refs/heads/main", RefChange::Update));
        assert!(!r.allows("refs/heads/agent/fix-1", RefChange::Delete));
        // A pattern that covers tags by its star does not allow them.
        assert!(!rule("github.com/moat/repo refs/*").allows("refs/tags/v1", RefChange::Create));
        assert!(rule("github.com/moat/repo refs/tags/*").allows("refs/tags/v1", RefChange::Create));
        assert!(rule("github.com/moat/repo refs/heads/x --delete").allows("refs/heads/x", RefChange::Delete));
    }

    #[test]
    fn globs_match_whole() {
        assert!(glob_whole(b"refs/heads/*", b"refs/heads/a"));
        assert!(!glob_whole(b"refs/heads/a", b"refs/heads/ab"));
        assert!(glob_whole(b"*a*b", b"xxaxxb"));
        assert!(!glob_whole(b"*a*b", b"xxaxxbc"));
        assert!(glob_whole(b"a", b"a"));
    }
}
