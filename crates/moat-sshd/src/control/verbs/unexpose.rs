//! `unexpose NAME PORT`: take a port's URL away (visitors signed in to it
//! are signed out).

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, no_more, port_arg, rest, UsageError};

pub const VERB: Verb =
    Verb { names: &["unexpose"], help: "  unexpose NAME PORT  take PORT of NAME's web URL away\n", parse };

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("unexpose", args.first())?;
    let port = port_arg("unexpose", args.get(1))?;
    no_more("unexpose", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Unexpose { name, port }, super::nothing)))
}
