//! `effects NAME [--since LABEL|TIME] [--json]`: what a box did outside that
//! no checkpoint takes back (see `moat_core::effects`).

use moat_api::{ApiError, Op, Reply};
use moat_core::effects::Since;
use moat_core::Name;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, parse_since, rest, usage, UsageError};
use crate::control::render;

pub const VERB: Verb = Verb {
    names: &["effects"],
    help: "  \
  effects NAME [--since LABEL|TIME] [--json]
                      what NAME did outside that a restore does not undo: every request that was
                      not GET/HEAD/OPTIONS (pushes among them) and every connection the gateway
                      passed through unread; since checkpoint LABEL, or a time (epoch seconds, 2h)
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("effects", args.first())?;
    let (mut since, mut json) = (Since::Start, false);
    let mut rest = rest(args, 1).iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--since" => {
                let value = rest.next().ok_or_else(|| usage("effects: --since needs a checkpoint label or a time"))?;
                // A time if it reads as one, else a checkpoint's label.
                since = match parse_since(value, moat_core::clock::now()) {
                    Ok(seconds) => Since::Time(seconds.saturating_mul(1000)),
                    Err(_) => Since::Checkpoint(
                        Name::new(value).map_err(|e| usage(format!("effects: --since: not a time or a label: {e}")))?,
                    ),
                };
            }
            other => return Err(usage(format!("effects: unexpected argument {other:?}"))),
        }
    }
    Ok(Plan::Call(Call::new(Op::Effects { name, since }, show).json(json)))
}

fn show(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    match reply {
        Reply::Effects(effects) if effects.is_empty() && !json => Ok("no effects\n".into()),
        Reply::Effects(effects) => Ok(render::effects(&effects, json)),
        other => Err(ApiError::unexpected(&other)),
    }
}
