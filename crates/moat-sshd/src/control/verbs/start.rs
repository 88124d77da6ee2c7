//! `start NAME`: boot a stopped box.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{only_name, UsageError};

pub const VERB: Verb =
    Verb { names: &["start"], help: "  start NAME          boot a stopped box (with the files it had)\n", parse };

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    Ok(Plan::Call(Call::new(Op::Start { name: only_name("start", args)? }, super::nothing)))
}
