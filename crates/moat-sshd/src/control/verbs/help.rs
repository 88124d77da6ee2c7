//! `help`: every verb's lines, from the table, between a head and a tail.

use super::{Plan, Verb, VERBS};
use crate::control::args::{no_more, usage, UsageError};

pub const VERB: Verb = Verb {
    names: &["help", "--help", "-h"],
    help: "  help [COMMAND]      this text, or COMMAND's lines of it (as COMMAND --help)\n",
    parse,
};

const HEAD: &str = "\
moat: disposable boxes over SSH

usage: ssh HOST COMMAND [ARGS]

commands:
";

const TAIL: &str = "
then: ssh NAME@HOST for a shell in box NAME, ssh NAME@HOST CMD to run CMD;
scp, sftp, rsync -e ssh and ssh -L reach the box the same way.

The SSH user name picks what you talk to: one of your boxes by that name, or
else the control plane. `ssh moat@HOST COMMAND` always reaches the control
plane; through any other user name that is not a box, only the commands above
run (anything else is taken for a box that does not exist).
";

/// What `help` prints (and a shell on the control plane).
pub fn text() -> String {
    let mut text = HEAD.to_string();
    for verb in VERBS {
        text.push_str(verb.help);
    }
    text.push_str(TAIL);
    text
}

/// What `COMMAND --help` and `help COMMAND` print: the verb's lines.
pub fn of(verb: &Verb) -> String {
    format!("usage: ssh HOST COMMAND [ARGS]\n\n{}\n'ssh HOST help' lists every command.\n", verb.help)
}

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let Some((word, rest)) = args.split_first() else { return Ok(Plan::Print(text())) };
    no_more("help", rest)?;
    match (super::verb(word), super::closest_verb(word)) {
        (Some(verb), _) => Ok(Plan::Print(of(verb))),
        (None, Some(meant)) => Err(usage(format!("help: no command {word:?} (did you mean {meant:?}?)"))),
        (None, None) => Err(usage(format!("help: no command {word:?}"))),
    }
}
