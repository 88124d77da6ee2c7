//! `stop NAME`: end every process of a box; its files stay.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{only_name, UsageError};

pub const VERB: Verb =
    Verb { names: &["stop"], help: "  stop NAME           end every process of a box (its files stay)\n", parse };

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    Ok(Plan::Call(Call::new(Op::Stop { name: only_name("stop", args)? }, super::nothing)))
}
