//! `checkpoint NAME [LABEL]` saves a box's files as they are;
//! `checkpoint rm NAME LABEL` deletes a checkpoint.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{label_arg, name_arg, no_more, rest, UsageError};

pub const VERB: Verb = Verb {
    names: &["checkpoint"],
    help: "  \
  checkpoint NAME [LABEL]       save NAME's files as they are now, instantly (label: c1, c2, ...)
  checkpoint rm NAME LABEL      delete a checkpoint (rm NAME deletes them all; dup copies none)
",
    parse,
};

/// Three words remove: a box called `rm` is still checkpointed with
/// `checkpoint rm [LABEL]`.
fn parse(args: &[String]) -> Result<Plan, UsageError> {
    if let [rm, name, label] = args {
        if rm == "rm" {
            let name = name_arg("checkpoint rm", Some(name))?;
            let label = label_arg("checkpoint rm", Some(label))?;
            return Ok(Plan::Call(Call::new(Op::CheckpointRemove { name, label }, super::nothing)));
        }
    }
    let name = name_arg("checkpoint", args.first())?;
    let label = args.get(1).map(|l| label_arg("checkpoint", Some(l))).transpose()?;
    no_more("checkpoint", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Checkpoint { name, label }, super::name)))
}
