//! The decision on a push, apart from any socket: each command of the list
//! against the push rules that name the repository (pure), then, for the
//! updates only a `--fast-forward` rule allows, the commits of the pack.
//! A push goes whole or not at all: one refused ref refuses it, and nothing
//! of it reaches the server.

use moat_core::policy::{HostName, PushRule, RefChange};

use super::commands::CommandList;
use super::pack::{self, Descent, Hash};

/// An update that needs its fast-forward shown by the pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeedsDescent {
    /// Index of the command.
    pub command: usize,
    /// The rule that allows it if it is one.
    pub rule: PushRule,
}

/// The commands judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judged {
    /// Each command's refusal, if it was refused (by index).
    pub refused: Vec<Option<String>>,
    /// Updates still to be shown fast-forwards.
    pub descent: Vec<NeedsDescent>,
}

impl Judged {
    /// Whether any command was refused.
    pub fn any_refused(&self) -> bool {
        self.refused.iter().any(Option::is_some)
    }

    /// For git's report: each ref with its reason, refs allowed on their own
    /// said to go down with the rest.
    pub fn report(&self, list: &CommandList) -> Vec<(String, String)> {
        list.commands
            .iter()
            .zip(&self.refused)
            .map(|(c, why)| {
                let why = why.clone().unwrap_or_else(|| "moat: another ref of this push was refused".into());
                (c.refname.clone(), why)
            })
            .collect()
    }
}

/// Each command of `list` against `rules` for `repo` on `host`.
pub fn judge(rules: &[PushRule], host: &HostName, repo: &str, list: &CommandList) -> Judged {
    let naming: Vec<&PushRule> = rules.iter().filter(|r| r.names_repo(host, repo)).collect();
    let mut judged = Judged { refused: Vec::new(), descent: Vec::new() };
    for (i, command) in list.commands.iter().enumerate() {
        let change = command.change();
        let allowing: Vec<&&PushRule> = naming.iter().filter(|r| r.allows(&command.refname, change)).collect();
        let why = if allowing.is_empty() {
            Some(refusal(&naming, &command.refname, change))
        } else if change != RefChange::Update || allowing.iter().any(|r| !r.fast_forward) {
            None
        } else {
            let rule = allowing.first().map(|r| (**r).clone());
            judged.descent.extend(rule.map(|rule| NeedsDescent { command: i, rule }));
            None
        };
        judged.refused.push(why);
    }
    judged
}

/// Why no rule allows `change` to `refname`, naming the rules that came closest.
fn refusal(naming: &[&PushRule], refname: &str, change: RefChange) -> String {
    let covering: Vec<&&PushRule> =
        naming.iter().filter(|r| moat_core::policy::glob_whole(r.refs.as_bytes(), refname.as_bytes())).collect();
    match (covering.first(), change) {
        (None, _) if naming.is_empty() => "moat: no push rule names this repository".into(),
        (None, _) => {
            let rules: Vec<String> = naming.iter().map(|r| r.refs.clone()).collect();
            format!("moat: no push rule covers this ref (allowed: {})", rules.join(", "))
        }
        (Some(rule), RefChange::Delete) if !rule.delete => format!("moat: deleting needs --delete ({rule})"),
        (Some(rule), _) => format!("moat: tags need a refs/tags/ pattern ({rule})"),
    }
}

/// Decides the updates still open from the pack's commits; `pack` is the
/// body after the command list, `None` where it was too large to hold.
pub fn decide_descent(judged: &mut Judged, list: &CommandList, pack_bytes: Option<&[u8]>) {
    if judged.descent.is_empty() {
        return;
    }
    let hash = if list.sha256() { Hash::Sha256 } else { Hash::Sha1 };
    let commits = match pack_bytes.map(|p| pack::commits(p, hash)) {
        Some(Ok(commits)) => Ok(commits),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("the pack is larger than the gateway holds".into()),
    };
    for need in &judged.descent {
        let Some(command) = list.commands.get(need.command) else { continue };
        let ids = pack::unhex(&command.new).zip(pack::unhex(&command.old));
        let why = match (&commits, ids) {
            (Ok(commits), Some((new, old))) => match commits.descends(&new, &old) {
                Descent::Yes => None,
                Descent::No => Some(format!("moat: not a fast-forward ({})", need.rule)),
                Descent::Unknown(at) => Some(format!(
                    "moat: cannot verify fast-forward (commit {} is not in the pack; {})",
                    at.get(..12).unwrap_or(&at),
                    need.rule
                )),
            },
            (Err(e), _) => Some(format!("moat: cannot verify fast-forward ({e}; {})", need.rule)),
            (_, None) => Some("moat: cannot verify fast-forward (a malformed id)".into()),
        };
        if let Some(slot) = judged.refused.get_mut(need.command) {
            if slot.is_none() {
                *slot = why;
            }
        }
    }
}
