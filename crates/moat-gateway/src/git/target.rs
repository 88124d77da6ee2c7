//! Which HTTP requests are pushes: smart HTTP's `GET
//! /REPO/info/refs?service=git-receive-pack` (the refs a push starts from)
//! and `POST /REPO/git-receive-pack` (the commands and the pack). The
//! repository is the path before them, `.git` dropped, so that a rule for
//! `moat/repo` covers both spellings.

/// A request that is part of a push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushRequest {
    /// The ref advertisement for a push.
    Advertise {
        /// The repository's path, without leading `/` or trailing `.git`.
        repo: String,
    },
    /// The push itself.
    Push {
        /// The repository's path.
        repo: String,
    },
}

impl PushRequest {
    /// The repository's path.
    pub fn repo(&self) -> &str {
        match self {
            Self::Advertise { repo } | Self::Push { repo } => repo,
        }
    }
}

/// Whether a request (method, normalised target) is part of a push, and to
/// which repository. A target that names receive-pack in any other way (a
/// second `service`, another method) is taken as a push too, with no
/// repository, so that path rules never decide it on a host with push rules.
pub fn push_request(method: &str, target: &str) -> Option<PushRequest> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if let Some(repo) = path.strip_suffix("/git-receive-pack") {
        let repo = repo_of(repo);
        return Some(PushRequest::Push { repo: if method == "POST" { repo } else { String::new() } });
    }
    if !query.contains("git-receive-pack") && !path.contains("git-receive-pack") {
        return None;
    }
    let advertise = method == "GET" || method == "HEAD";
    match path.strip_suffix("/info/refs") {
        Some(repo) if advertise && query == "service=git-receive-pack" => {
            Some(PushRequest::Advertise { repo: repo_of(repo) })
        }
        _ => Some(PushRequest::Advertise { repo: String::new() }),
    }
}

fn repo_of(path: &str) -> String {
    let path = path.trim_start_matches('/');
    path.strip_suffix(".git").unwrap_or(path).to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn pushes_are_told_from_fetches() {
        let adv = |r: &str| Some(PushRequest::Advertise { repo: r.into() });
        let push = |r: &str| Some(PushRequest::Push { repo: r.into() });
        assert_eq!(push_request("GET", "/moat/repo.git/info/refs?service=git-receive-pack"), adv("moat/repo"));
        assert_eq!(push_request("GET", "/moat/repo/info/refs?service=git-receive-pack"), adv("moat/repo"));
        assert_eq!(push_request("POST", "/moat/repo.git/git-receive-pack"), push("moat/repo"));
        assert_eq!(push_request("GET", "/moat/repo.git/info/refs?service=git-upload-pack"), None);
        assert_eq!(push_request("POST", "/moat/repo.git/git-upload-pack"), None);
        assert_eq!(push_request("GET", "/moat/repo.git/HEAD"), None);
        // Odd spellings are pushes to no repository (refused by push rules).
        assert_eq!(push_request("PUT", "/moat/repo.git/git-receive-pack"), push(""));
        assert_eq!(push_request("GET", "/moat/repo.git/info/refs?service=git-receive-pack&x=1"), adv(""));
        assert_eq!(push_request("GET", "/x/git-receive-pack/info/refs"), adv(""));
    }
}
