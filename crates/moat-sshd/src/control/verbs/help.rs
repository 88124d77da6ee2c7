//! `help`: every verb's lines, from the table, between a head and a tail.

use super::{Plan, Verb, VERBS};
use crate::control::args::{no_more, UsageError};

pub const VERB: Verb = Verb { names: &["help", "--help", "-h"], help: "  help                this text\n", parse };

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

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    no_more("help", args)?;
    Ok(Plan::Print(text()))
}
