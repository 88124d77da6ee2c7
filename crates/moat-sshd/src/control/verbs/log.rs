//! `log NAME [--follow [--ask]] [--since T] [--until T] [--json]`: a box's egress log
//! (its entries stream; see `render::log`); `log NAME --service`: its
//! service's recent output instead.

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, parse_time_ms, rest, usage, UsageError};

pub const VERB: Verb = Verb {
    names: &["log"],
    help: "  \
  log NAME [--follow [--ask]] [--since T] [--until T] [--json]
                      every DNS query, connection and HTTP request NAME made, and the verdict
                      (the newest 10,000 from T on, and before --until T: older ones are said
                      to be left out); with --ask, NAME's questions too, answered as with 'ask'
  log NAME --service  the recent output of NAME's service (new --run), with a line at each start
                      and exit
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("log", args.first())?;
    let (mut follow, mut ask, mut since, mut json, mut service) = (false, false, None, false, false);
    let mut until = None;
    let mut rest = rest(args, 1).iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--follow" | "-f" => follow = true,
            "--ask" => ask = true,
            "--json" => json = true,
            "--service" => service = true,
            "--since" => {
                let value = rest.next().ok_or_else(|| usage("log: --since needs a value"))?;
                since = Some(parse_time_ms(value, moat_core::clock::now())?);
            }
            "--until" => {
                let value = rest.next().ok_or_else(|| usage("log: --until needs a value"))?;
                until = Some(parse_time_ms(value, moat_core::clock::now())?);
            }
            other => return Err(usage(format!("log: unexpected argument {other:?}"))),
        }
    }
    if service {
        if follow || ask || since.is_some() || until.is_some() || json {
            return Err(usage("log: --service takes no other flag"));
        }
        return Ok(Plan::Call(Call::new(Op::ServiceLog { name }, output)));
    }
    if ask && !follow {
        return Err(usage("log: --ask needs --follow"));
    }
    if follow && until.is_some() {
        return Err(usage("log: --follow shows what comes next, --until what came before: not both"));
    }
    let op = Op::Log { name, since_ms: since.unwrap_or(0), until_ms: until, follow, ask };
    Ok(Plan::Call(Call::new(op, super::nothing).json(json).answers(ask)))
}

fn output(reply: Reply, _: &Op, _: bool) -> Result<String, ApiError> {
    match reply {
        Reply::Text(text) if text.is_empty() => Ok("no output yet\n".into()),
        Reply::Text(text) if !text.ends_with('\n') => Ok(text + "\n"),
        Reply::Text(text) => Ok(text),
        other => Err(ApiError::unexpected(&other)),
    }
}
