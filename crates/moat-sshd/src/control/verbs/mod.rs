//! The control verbs, one file each (as mini-redis keeps `cmd/get.rs`): a
//! verb's file holds its lines of `help`, how its words become an operation
//! of the core ([`moat_api::Op`], checked again there), and how the answer
//! reads. [`VERBS`] lists them; the verb list and `help` come from it.
//!
//! A new verb is a file here and a line in [`VERBS`] (and, when the core
//! needs a new operation, an `Op` variant and its arm in moat-api's server).

use moat_api::{ApiError, Op, Reply};
use moat_core::secrets::SecretValue;
use moat_core::Name;

use super::args::{usage, UsageError};
pub use help::text as help;

mod ask;
mod checkpoint;
mod checkpoints;
mod diff;
mod dup;
mod effects;
mod expose;
mod help;
mod image;
mod info;
mod log;
mod ls;
mod mv;
mod new;
mod packages;
mod policy;
mod policy_packages;
mod promote;
pub mod race;
mod restore;
mod rm;
mod secret;
mod set;
mod share;
mod start;
mod stop;
mod suspend;
mod unexpose;
mod url;
mod urls;
mod usage;
mod whoami;

#[cfg(test)]
mod tests;

/// Every verb, in the order `help` shows them.
pub const VERBS: &[Verb] = &[
    new::VERB,
    ls::VERB,
    info::VERB,
    rm::VERB,
    dup::VERB,
    diff::VERB,
    promote::VERB,
    race::VERB,
    checkpoint::VERB,
    checkpoints::VERB,
    restore::VERB,
    stop::VERB,
    start::VERB,
    suspend::VERB,
    mv::VERB,
    set::VERB,
    usage::VERB,
    policy::VERB,
    packages::VERB,
    log::VERB,
    effects::VERB,
    ask::VERB,
    secret::VERB,
    expose::VERB,
    unexpose::VERB,
    urls::VERB,
    url::VERB,
    share::VERB,
    share::UNSHARE,
    image::VERB,
    whoami::VERB,
    help::VERB,
];

/// One control verb.
pub struct Verb {
    /// The words that name it.
    pub names: &'static [&'static str],
    /// Its lines in `help`, each ending in a newline.
    pub help: &'static str,
    /// What its arguments (the words after it) ask for.
    pub parse: fn(&[String]) -> Result<Plan, UsageError>,
}

/// What a command line asks for.
pub enum Plan {
    /// Print this; the core is asked nothing (`help`).
    Print(String),
    /// Ask the core one operation and show the answer.
    Call(Call),
    /// Read a secret's value from stdin, to its end, and then make the call
    /// this makes of it (`secret add`: the value is never on the command line).
    ReadSecret(Box<dyn FnOnce(SecretValue) -> Call + Send>),
    /// Read a registry password from stdin, to its end, then make the call
    /// this makes of it (`image login`).
    ReadPassword(Box<dyn FnOnce(moat_api::Password) -> Call + Send>),
    /// Read text from stdin, to its end or `max` bytes, and then make the
    /// call this makes of it (`policy NAME packages lock`).
    ReadText(usize, TextCall),
    /// Several calls and box sessions (`race`).
    Race(race::RaceSpec),
}

/// What makes a call of text read from stdin (or refuses the text).
pub type TextCall = Box<dyn FnOnce(String) -> Result<Call, ApiError> + Send>;

/// How a verb shows the core's answer to its operation, for people or (with
/// `--json`) for scripts; an answer it does not expect is an error.
pub type Render = fn(Reply, &Op, bool) -> Result<String, ApiError>;

/// An operation for the core and how to show what comes back.
#[derive(Debug)]
pub struct Call {
    /// The operation.
    pub op: Op,
    /// `--json`: for scripts.
    pub json: bool,
    /// Whether the client's stdin answers questions as they come (`ask`,
    /// `log --follow --ask`); other calls leave it unread.
    pub answers: bool,
    /// How the outcome reads.
    pub render: Render,
}

impl Call {
    /// A call of `op` whose outcome `render` shows, for people.
    pub fn new(op: Op, render: Render) -> Self {
        Self { op, json: false, answers: false, render }
    }

    /// With `--json` or not.
    pub fn json(self, json: bool) -> Self {
        Self { json, ..self }
    }

    /// Reading answers to questions from stdin, or not.
    pub fn answers(self, answers: bool) -> Self {
        Self { answers, ..self }
    }
}

impl Plan {
    /// The name of the box this would create, if it creates one.
    pub fn creates(&self) -> Option<&Name> {
        match self {
            Plan::Call(call) => call.op.creates(),
            Plan::Print(_) | Plan::ReadSecret(_) | Plan::ReadPassword(_) | Plan::ReadText(..) | Plan::Race(_) => None,
        }
    }
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Plan::Print(text) => f.debug_tuple("Print").field(text).finish(),
            Plan::Call(call) => f.debug_tuple("Call").field(call).finish(),
            Plan::ReadSecret(_) => f.write_str("ReadSecret(..)"),
            Plan::ReadPassword(_) => f.write_str("ReadPassword(..)"),
            Plan::ReadText(max, _) => write!(f, "ReadText({max}, ..)"),
            Plan::Race(spec) => f.debug_tuple("Race").field(spec).finish(),
        }
    }
}

/// What `Done` shows: nothing.
pub fn nothing(reply: Reply, _: &Op, _: bool) -> Result<String, ApiError> {
    match reply {
        Reply::Done => Ok(String::new()),
        other => Err(ApiError::unexpected(&other)),
    }
}

/// What an answer naming a box or checkpoint shows: the name, for scripts.
pub fn name(reply: Reply, _: &Op, _: bool) -> Result<String, ApiError> {
    match reply {
        Reply::Box(b) => Ok(format!("{}\n", b.name)),
        Reply::Name(name) => Ok(format!("{name}\n")),
        other => Err(ApiError::unexpected(&other)),
    }
}

/// The verb a word names.
fn verb(word: &str) -> Option<&'static Verb> {
    VERBS.iter().find(|v| v.names.contains(&word))
}

/// Whether `line` is meant for the control plane (its first word is a verb;
/// an empty line means `help`), whether or not its arguments are right.
pub fn is_control_command(line: &str) -> bool {
    match crate::words::split(line) {
        Ok(words) => words.first().is_none_or(|word| verb(word).is_some()),
        Err(_) => false,
    }
}

/// Parses the words of a control command.
pub fn parse(words: &[String]) -> Result<Plan, UsageError> {
    let Some((word, args)) = words.split_first() else {
        return Ok(Plan::Print(help()));
    };
    if let Some(verb) = verb(word).filter(|_| asks_help(args)) {
        return Ok(Plan::Print(help::of(verb)));
    }
    if let Some(flag) = repeated_flag(args) {
        return Err(usage(format!("{word}: {flag} given twice")));
    }
    match (verb(word), closest_verb(word)) {
        (Some(verb), _) => (verb.parse)(args),
        (None, Some(meant)) => Err(usage(format!("unknown command {word:?} (did you mean {meant:?}? see 'help')"))),
        (None, None) => Err(usage(format!("unknown command {word:?} (see 'help')"))),
    }
}

/// Whether a verb's words ask for its help (`new --help`), before any `--`
/// (what follows is a command: `race web 2 -- make --help`).
fn asks_help(args: &[String]) -> bool {
    args.iter().take_while(|a| *a != "--").any(|a| a == "--help" || a == "-h")
}

/// Flags that add up when given again: `secret limit`'s windows
/// (`--requests 10 --per 1m --requests 500 --per 1d`).
const ADD_UP: &[&str] = &["--requests", "--tokens", "--per"];

/// A flag given twice before any `--`, of those that do not add up (the
/// second would silently win: `new x --image busybox --image debian`).
fn repeated_flag(args: &[String]) -> Option<&str> {
    let mut seen = std::collections::HashSet::new();
    let flags = args.iter().take_while(|a| *a != "--").filter(|a| a.starts_with("--") && a.len() > 2);
    let mut flags = flags.map(|a| a.split('=').next().unwrap_or(a)).filter(|flag| !ADD_UP.contains(flag));
    flags.find(|flag| !seen.insert(*flag))
}

/// The verb a word that is none is most likely a typo of (`lst`: `ls`).
pub fn closest_verb(word: &str) -> Option<&'static str> {
    // `make`, the commonest command a box is sent, is two letters from `move`
    // and from `race`: neither is offered as what a mistyped word meant.
    let names = VERBS
        .iter()
        .flat_map(|v| v.names.iter().copied())
        .filter(|n| !n.starts_with('-') && *n != "move" && *n != "race");
    moat_core::near::closest(word, names)
}
