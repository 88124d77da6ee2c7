//! `move NAME --node N`: move a box to another node of the fleet.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, usage, UsageError};

pub const VERB: Verb = Verb {
    names: &["move"],
    help: "  move NAME --node N  move a box to fleet node N (through the object store; its processes end)\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("move", args.first())?;
    let node = match args.get(1..) {
        Some([flag, node]) if flag == "--node" && !node.is_empty() => node.clone(),
        _ => return Err(usage("usage: move NAME --node NODE")),
    };
    Ok(Plan::Call(Call::new(Op::Move { name, node }, super::nothing)))
}
