//! `ls [--json]`: the account's boxes.

use std::fmt::Write as _;

use moat_api::{ApiError, Op, Reply};
use moat_core::limits::format_size;

use super::{Call, Plan, Verb};
use crate::control::args::{flags_only, UsageError};
use crate::control::render::to_json;

pub const VERB: Verb = Verb { names: &["ls", "list"], help: "  ls [--json]         list your boxes\n", parse };

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    Ok(Plan::Call(Call::new(Op::List, render).json(flags_only("ls", args)?)))
}

fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Boxes(boxes) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&boxes));
    }
    // A fleet's boxes say which node holds each; a single host's need not.
    let nodes = boxes.iter().any(|b| !b.node.is_empty());
    let node = |n: &str| if nodes { format!("{n:<12} ") } else { String::new() };
    let mut out = format!(
        "{:<24} {:<9} {}{:<10} {:<7} {:>4} {:>8} {:>6}  {}\n",
        "NAME",
        "STATE",
        node("NODE"),
        "IMAGE",
        "BACKEND",
        "CPUS",
        "MEMORY",
        "PIDS",
        "PARENT"
    );
    for b in &boxes {
        let _ = writeln!(
            out,
            "{:<24} {:<9} {}{:<10} {:<7} {:>4} {:>8} {:>6}  {}",
            b.name,
            b.state,
            node(&b.node),
            b.image,
            b.backend,
            b.limits.cpus,
            format_size(b.limits.memory),
            b.limits.pids,
            b.parent.as_ref().map_or("-", |p| p.as_str())
        );
    }
    Ok(out)
}
