//! `diff A B [--json]`: the files added, modified and deleted in B relative
//! to A. They stream as the comparison finds them (see `render::ChangeStream`).

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{flags_only, name_arg, rest, UsageError};

pub const VERB: Verb = Verb {
    names: &["diff"],
    help: "  diff A B [--json]   the files added (A), modified (M) and deleted (D) in B relative to A\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let a = name_arg("diff", args.first())?;
    let b = name_arg("diff", args.get(1))?;
    let json = flags_only("diff", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Diff { a, b }, render).json(json)))
}

/// The end of a diff that found nothing (one that found something ends
/// where its stream does).
fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    match reply {
        Reply::Done if json => Ok("[]\n".into()),
        Reply::Done => Ok(String::new()),
        other => Err(ApiError::unexpected(&other)),
    }
}
