//! `suspend NAME`: freeze a box now.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{only_name, UsageError};

pub const VERB: Verb = Verb {
    names: &["suspend"],
    help: "  suspend NAME        freeze a box now (billing stops); the next session resumes it\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    Ok(Plan::Call(Call::new(Op::Suspend { name: only_name("suspend", args)? }, super::nothing)))
}
