//! `policy NAME [--json]` shows what a box may reach; `policy NAME
//! allow|deny|rm RULE` and `policy NAME preset P` change it. A rule is
//! parsed here, once: the core receives it typed and checks it on decode.
//! `policy NAME allow|rm push HOST/REPO REFS [--fast-forward] [--delete]`
//! adds or removes a git push rule.

use std::fmt::Write as _;

use moat_api::{ApiError, Op, Reply};
use moat_core::policy::{PolicyChange, PushRule, Rule};

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, no_more, rest, usage, UsageError};
use crate::control::render::to_json;

pub const VERB: Verb = Verb {
    names: &["policy"],
    help: "  \
  policy NAME [--json]           what NAME may reach on the network (nothing unless allowed)
  policy NAME allow|deny|rm [METHODS] HOST[:PORTS][/PATH]
                      add or remove a rule; e.g. 'allow pypi.org', 'allow *.example.com:443',
                      'allow GET,HEAD deb.debian.org/debian/', 'deny github.com/*git-receive-pack';
                      PORTS default to 80,443 ('*': any); a deny wins; applies to new connections
  policy NAME allow|rm push HOST/ORG/REPO REF-PATTERN [--fast-forward] [--delete]
                      let git push to matching refs of that repository over HTTPS, e.g.
                      'allow push github.com/me/app refs/heads/agent/*'; once a host has push
                      rules they alone decide pushes there; tags only by a refs/tags/ pattern,
                      deletes only with --delete; --fast-forward: the pack must show the new
                      commit descends from the old one
  policy NAME preset none|registries|github-read
                      replace the policy with a preset
  policy NAME packages min-age AGE [--unknown-age allow|deny] | min-age off
                      refuse PyPI, npm and crates.io versions published less than AGE ago
                      (e.g. 7d); index pages drop them, so installers pick the newest older
                      one; versions whose index gives no time are let in unless 'deny'
  policy NAME packages deny|allow-only|rm ECOSYSTEM:PATTERN
                      refuse names ('deny pypi:reqeusts'), or let in only matching names of
                      that ecosystem ('allow-only npm:@acme/*'); ecosystems: pypi, npm, crates
  policy NAME packages lock < FILE     only the exact versions (and hashes) of a
                      requirements.txt, package-lock.json or Cargo.lock; 'unlock ECOSYSTEM'
  policy NAME packages advisories [--severity low|medium|high|critical|malicious] | off
                      refuse versions the operator's OSV database names (malicious ones always)
  policy NAME packages clear           drop every package rule
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("policy", args.first())?;
    let Some((action, words)) = rest(args, 1).split_first() else {
        return Ok(Plan::Call(Call::new(Op::Policy { name }, render)));
    };
    let rule = |words: &[String]| {
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        Rule::parse(&words).map_err(|e| usage(format!("policy: {e}")))
    };
    let push = |words: &[String]| {
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        PushRule::parse(&words).map_err(|e| usage(format!("policy: {e}")))
    };
    if action == "packages" {
        return super::policy_packages::parse(name, words, render);
    }
    let pushing = words.first().is_some_and(|w| w == "push");
    let change = match action.as_str() {
        "--json" => {
            no_more("policy", words)?;
            return Ok(Plan::Call(Call::new(Op::Policy { name }, render).json(true)));
        }
        "allow" if pushing => PolicyChange::AllowPush(push(rest(words, 1))?),
        "rm" if pushing => PolicyChange::RemovePush(push(rest(words, 1))?),
        "allow" => PolicyChange::Allow(rule(words)?),
        "deny" => PolicyChange::Deny(rule(words)?),
        "rm" => PolicyChange::Remove(rule(words)?),
        "preset" => match words {
            [preset] => PolicyChange::Preset(super::new::preset("policy: preset", preset)?),
            _ => return Err(usage("policy: usage: policy NAME preset none|registries|github-read")),
        },
        other => {
            return Err(usage(format!(
                "policy: unknown action {other:?} (allow, deny, rm, preset, packages, or --json)"
            )));
        }
    };
    Ok(Plan::Call(Call::new(Op::ChangePolicy { name, change }, render)))
}

/// A box's policy, as it is now (also the answer to a change).
pub fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Policy(policy) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&policy));
    }
    let mut out = String::new();
    if policy.allow.is_empty() && policy.push.is_empty() {
        out.push_str("no allow rules: this box reaches nothing\n");
    }
    for rule in &policy.allow {
        let _ = writeln!(out, "allow {rule}");
    }
    for rule in &policy.deny {
        let _ = writeln!(out, "deny  {rule}");
    }
    for rule in &policy.push {
        let _ = writeln!(out, "allow {rule}");
    }
    for line in policy.packages.lines() {
        let _ = writeln!(out, "{line}");
    }
    if policy.ask {
        out.push_str("ask mode: names no rule allows or denies are put to you first (ssh HOST ask)\n");
    }
    Ok(out)
}
