//! `diff A B [--json]`: the files added, modified and deleted in B relative
//! to A. They stream as the comparison finds them (see `render::ChangeStream`);
//! then, as text, what each box did outside since they split (effects).

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{flags_only, name_arg, rest, UsageError};
use crate::control::render;

pub const VERB: Verb = Verb {
    names: &["diff"],
    help: "  \
  diff A B [--json]   the files added (A), modified (M) and deleted (D) in B relative to A, then
                      what each did outside since they split (see effects)
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let a = name_arg("diff", args.first())?;
    let b = name_arg("diff", args.get(1))?;
    let json = flags_only("diff", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Diff { a, b }, render).json(json)))
}

/// What follows the changes: `[]` for JSON that found none (the stream
/// closes JSON that found some); as text, each box's effects since the split.
pub fn render(reply: Reply, op: &Op, json: bool) -> Result<String, ApiError> {
    let (Reply::Diffed { a, b }, Op::Diff { a: an, b: bn }) = (&reply, op) else {
        return Err(ApiError::unexpected(&reply));
    };
    if json {
        return Ok("[]\n".into());
    }
    let mut out = render::effects_summary(&format!("{an} since the split did what a restore does not undo:"), a);
    out.push_str(&render::effects_summary(&format!("{bn} since the split did what a restore does not undo:"), b));
    Ok(out)
}
