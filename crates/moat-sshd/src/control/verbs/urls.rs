//! `urls [NAME] [--json]`: the web URLs of your boxes (or of one), and of
//! the boxes shared with you.

use std::fmt::Write as _;

use moat_api::{ApiError, Op, Reply};
use moat_core::Name;

use super::{Call, Plan, Verb};
use crate::control::args::{usage, UsageError};
use crate::control::render::to_json;

pub const VERB: Verb = Verb {
    names: &["urls"],
    help: "  urls [NAME] [--json]  the web URLs of your boxes, and of boxes shared with you\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let (mut name, mut json) = (None, false);
    for arg in args {
        match arg.as_str() {
            "--json" => json = true,
            word if name.is_none() && !word.starts_with('-') => {
                name = Some(Name::new(word).map_err(|e| usage(format!("urls: {e}")))?);
            }
            other => return Err(usage(format!("urls: unexpected argument {other:?}"))),
        }
    }
    Ok(Plan::Call(Call::new(Op::Urls { name }, render).json(json)))
}

fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Exposures(exposed) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&exposed));
    }
    let mut out = format!("{:<24} {:>5}  {:<8} {}\n", "NAME", "PORT", "ACCESS", "URL");
    for e in &exposed {
        let access = match (e.public, e.shared) {
            (true, _) => "public",
            (false, true) => "shared",
            (false, false) => "private",
        };
        let _ = writeln!(out, "{:<24} {:>5}  {access:<8} {}", e.name, e.port, e.url.as_deref().unwrap_or("-"));
    }
    Ok(out)
}
