//! `promote CHILD`: a duplicate takes its parent's name.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{only_name, UsageError};

pub const VERB: Verb = Verb {
    names: &["promote"],
    help: "  promote CHILD       CHILD takes its parent's name; the parent stays as PARENT-prev\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    Ok(Plan::Call(Call::new(Op::Promote { child: only_name("promote", args)? }, super::name)))
}
