//! `share NAME KEY-FINGERPRINT` and `unshare NAME KEY-FINGERPRINT`: let
//! another account's key reach a box (its web URLs, and its ssh as
//! `NAME.OWNER@HOST`, OWNER the slug in the box's URLs), or no longer.

use moat_api::Op;

use super::{Call, Plan, Verb};
use crate::control::args::{fingerprint_arg, name_arg, no_more, rest, UsageError};

pub const VERB: Verb = Verb {
    names: &["share"],
    help: "  \
  share NAME KEY-FINGERPRINT
                      let that key (SHA256:..., as its 'whoami' shows it) reach NAME: sign in to
                      its URLs ('url NAME PORT --owner OWNER'), ssh NAME.OWNER@HOST
",
    parse,
};

pub const UNSHARE: Verb = Verb {
    names: &["unshare"],
    help: "  unshare NAME KEY-FINGERPRINT  take it back (its sign-ins end at once)\n",
    parse: parse_unshare,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("share", args.first())?;
    let with = fingerprint_arg("share", args.get(1))?;
    no_more("share", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Share { name, with }, super::nothing)))
}

fn parse_unshare(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("unshare", args.first())?;
    let with = fingerprint_arg("unshare", args.get(1))?;
    no_more("unshare", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Unshare { name, with }, super::nothing)))
}
