//! `dup SRC DST`: copy a box, instantly.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, no_more, rest, UsageError};

pub const VERB: Verb = Verb {
    names: &["dup"],
    help: "  dup SRC DST         copy box SRC as DST, instantly (SRC keeps running); DST is a new machine\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let src = name_arg("dup", args.first())?;
    let dst = name_arg("dup", args.get(1))?;
    no_more("dup", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Dup { src, dst }, super::name)))
}
