//! `restore NAME LABEL`: put a box back to a checkpoint.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{label_arg, name_arg, no_more, rest, UsageError};

pub const VERB: Verb = Verb {
    names: &["restore"],
    help: "  \
  restore NAME LABEL  put NAME back to checkpoint LABEL: its processes end and it boots again,
                      the same machine; its state before is kept as checkpoint before-LABEL
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("restore", args.first())?;
    let label = label_arg("restore", args.get(1))?;
    no_more("restore", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Restore { name, label }, super::name)))
}
