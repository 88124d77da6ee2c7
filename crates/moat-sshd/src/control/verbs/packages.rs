//! `packages NAME [--json]`: every package file NAME asked PyPI, npm or
//! crates.io for, from the host's log (a bill of materials the box cannot
//! edit): ecosystem, name, version, hash, time, from the registry or the
//! shared cache, and the verdict with its rule.

use std::fmt::Write as _;

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, no_more, rest, usage, UsageError};
use crate::control::render::{printable, to_json};

pub const VERB: Verb = Verb {
    names: &["packages"],
    help: "  \
  packages NAME [--json]         every package file NAME downloaded or was refused (PyPI, npm,
                      crates.io): version, hash, from the registry or the host's cache, verdict
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("packages", args.first())?;
    let json = match rest(args, 1) {
        [] => false,
        [flag] if flag == "--json" => true,
        other => {
            no_more("packages", other).map_err(|_| usage("packages: usage: packages NAME [--json]"))?;
            false
        }
    };
    Ok(Plan::Call(Call::new(Op::Packages { name }, render).json(json)))
}

fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Packages(entries) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        let rows: Vec<serde_json::Value> = entries
            .iter()
            .filter_map(|e| {
                let p = e.package.as_ref()?;
                Some(serde_json::json!({
                    "ecosystem": p.ecosystem, "name": p.name, "version": p.version, "file": p.file,
                    "hash": p.hash, "at_ms": e.at_ms, "source": if p.cached { "cache" } else { "upstream" },
                    "verdict": e.verdict, "rule": e.rule, "reason": e.reason,
                }))
            })
            .collect();
        return Ok(to_json(&rows));
    }
    if entries.is_empty() {
        return Ok("no package files yet\n".into());
    }
    let mut out = String::new();
    for e in &entries {
        let Some(p) = &e.package else { continue };
        let source = if p.cached { "cache" } else { "upstream" };
        let verdict = format!("{:?}", e.verdict).to_ascii_lowercase();
        let hash = p.hash.as_deref().unwrap_or("-");
        let (name, version, file) = (printable(&p.name), printable(&p.version), printable(&p.file));
        let _ = write!(out, "{:<6} {name} {version} {file} {source} {hash} {verdict}", p.ecosystem);
        if verdict != "allow" {
            if let Some(reason) = &e.reason {
                let _ = write!(out, ": {}", printable(reason));
            }
        }
        out.push('\n');
    }
    Ok(out)
}
