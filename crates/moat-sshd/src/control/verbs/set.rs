//! `set NAME idle|keep-running|ask VALUE`: a box's settings.

use moat_api::Op;
use moat_core::policy::PolicyChange;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, seconds, usage, UsageError};

pub const VERB: Verb = Verb {
    names: &["set"],
    help: "  \
  set NAME idle SECONDS         suspend NAME after SECONDS without a session
  set NAME keep-running on|off  never suspend NAME (it is billed while idle)
  set NAME ask on|off           ask mode: a name NAME's policy does not allow is put to you
                                (ssh HOST ask) instead of refused at once
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("set", args.first())?;
    let (Some(key), Some(value), None) = (args.get(1), args.get(2), args.get(3)) else {
        return Err(usage("set: usage: set NAME idle SECONDS | set NAME keep-running|ask on|off"));
    };
    let on = |what: &str| match value.as_str() {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(usage(format!("set: {what} takes on or off, not {other:?}"))),
    };
    let call = match key.as_str() {
        "idle" => Call::new(Op::SetIdle { name, seconds: seconds("set: idle", value)? }, super::nothing),
        "keep-running" => Call::new(Op::SetKeepRunning { name, on: on("keep-running")? }, super::nothing),
        // Ask mode is part of the box's policy, which the answer shows.
        "ask" => Call::new(Op::ChangePolicy { name, change: PolicyChange::Ask(on("ask")?) }, super::policy::render),
        other => return Err(usage(format!("set: unknown setting {other:?} (idle, keep-running, ask)"))),
    };
    Ok(Plan::Call(call))
}
