//! `checkpoints NAME [--json]`: a box's checkpoints, when each was made and
//! the bytes only it holds.

use std::fmt::Write as _;

use moat_api::{ApiError, Op, Reply};
use moat_core::limits::format_measured;

use super::{Call, Plan, Verb};
use crate::control::args::{name_and_json, UsageError};
use crate::control::render::to_json;
use crate::control::time::{age, utc_ms};

pub const VERB: Verb = Verb {
    names: &["checkpoints"],
    help: "  checkpoints NAME [--json]     NAME's checkpoints: label, time, and the bytes only each holds\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let (name, json) = name_and_json("checkpoints", args)?;
    Ok(Plan::Call(Call::new(Op::Checkpoints { name }, render).json(json)))
}

fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Checkpoints(saved) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&saved));
    }
    if saved.is_empty() {
        return Ok("no checkpoints (checkpoint NAME [LABEL] saves one)\n".into());
    }
    let now = moat_core::clock::now();
    let mut out = format!("{:<24} {:<20} {:<9} {:>10}\n", "LABEL", "CREATED", "AGE", "HELD");
    for c in &saved {
        let held = c.held_bytes.map_or("-".to_string(), format_measured);
        let created = utc_ms(c.created_ms);
        let _ = writeln!(out, "{:<24} {created:<20} {:<9} {held:>10}", c.label, age(c.created_ms / 1000, now));
    }
    Ok(out)
}
