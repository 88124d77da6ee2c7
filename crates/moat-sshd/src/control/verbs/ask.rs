//! `ask [--json]` shows the boxes' questions (ask mode) as they come and
//! reads answers from stdin; `ask ID once|always|deny` answers one.

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{usage, UsageError};
use crate::control::render::answered;

pub const VERB: Verb = Verb {
    names: &["ask"],
    help: "  \
  ask [--json]        show your boxes' questions (ask mode) as they come; answer each with
                      a line on stdin: 'ID once', 'ID always' (added to the policy) or 'ID deny'
                      (or just the answer, for the newest); unanswered ones are denied in 60 s
  ask ID once|always|deny       answer one question
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let questions = |json| Call::new(Op::Questions { follow: true }, super::nothing).json(json).answers(true);
    let call = match args {
        [] => questions(false),
        [json] if json == "--json" => questions(true),
        [id, answer] => {
            let id = id.parse().map_err(|_| usage(format!("ask: {id:?} is no question number")))?;
            let answer = answer.parse().map_err(|e| usage(format!("ask: {e}")))?;
            Call::new(Op::Answer { id, answer }, render)
        }
        _ => return Err(usage("ask: usage: ask [--json] | ask ID once|always|deny")),
    };
    Ok(Plan::Call(call))
}

/// What answering did.
fn render(reply: Reply, op: &Op, _: bool) -> Result<String, ApiError> {
    match (reply, op) {
        (Reply::Question(q), Op::Answer { answer, .. }) => Ok(answered(&q, *answer)),
        (other, _) => Err(ApiError::unexpected(&other)),
    }
}
