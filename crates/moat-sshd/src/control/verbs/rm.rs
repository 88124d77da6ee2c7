//! `rm NAME`: stop and delete a box.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{only_name, UsageError};

pub const VERB: Verb =
    Verb { names: &["rm"], help: "  rm NAME             stop and delete a box and its files\n", parse };

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    Ok(Plan::Call(Call::new(Op::Remove { name: only_name("rm", args)? }, super::nothing)))
}
