//! `restore NAME LABEL`: put a box back to a checkpoint.

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{label_arg, name_arg, no_more, rest, UsageError};
use crate::control::render;

pub const VERB: Verb = Verb {
    names: &["restore"],
    help: "  \
  restore NAME LABEL  put NAME back to checkpoint LABEL: its processes end and it boots again,
                      the same machine; its state before is kept as checkpoint before-LABEL;
                      then what NAME did since LABEL that the restore does not undo (effects)
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("restore", args.first())?;
    let label = label_arg("restore", args.get(1))?;
    no_more("restore", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Restore { name, label }, show)))
}

/// The label the state before is kept under, then the effects since the
/// checkpoint (on stderr's side of things: a note, not the answer).
fn show(reply: Reply, op: &Op, _: bool) -> Result<String, ApiError> {
    let (Reply::Restored { kept, effects }, Op::Restore { name, label }) = (&reply, op) else {
        return Err(ApiError::unexpected(&reply));
    };
    let heading = format!("since checkpoint {label}, {name} did what a restore does not undo:");
    Ok(format!("{kept}\n{}", render::effects_summary(&heading, effects)))
}
