//! `race NAME N [--keep-best | --pick TEST] [--json] -- CMD`: N copies of a
//! box run one command at once; the table says how each did. Carried out by
//! [`crate::control::race`] (it is several calls: dup, sessions, diff,
//! effects, promote, rm).

use moat_core::Name;

use super::{Plan, Verb};
use crate::control::args::{name_arg, usage, UsageError};

/// Most copies one race makes.
pub const MAX_COPIES: usize = 32;

pub const VERB: Verb = Verb {
    names: &["race"],
    help: "  \
  race NAME N [--keep-best | --pick 'TEST'] [--json] -- CMD
                      dup NAME N times and run CMD in every copy at once (output prefixed by
                      copy, or --json lines), then a table: copy, exit, wall time, files
                      changed, effects; --keep-best promotes the first copy to exit 0, --pick
                      the first whose TEST exits 0, and the other copies are removed; without
                      either every copy stays; Ctrl-C ends every run and removes unkept copies
",
    parse,
};

/// Which copy stays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keep {
    /// Every copy, for the user to `diff` and `promote`.
    All,
    /// The first to exit 0, promoted; the others removed.
    Best,
    /// The first finished copy in which this command exits 0, promoted.
    Pick(String),
}

/// A race, as asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaceSpec {
    /// The box raced.
    pub name: Name,
    /// How many copies.
    pub copies: usize,
    /// The command each runs (a shell command line).
    pub command: String,
    /// Which copy stays.
    pub keep: Keep,
    /// JSON lines, for scripts.
    pub json: bool,
}

impl RaceSpec {
    /// The name of copy `i` (from 1).
    pub fn copy_name(&self, i: usize) -> Result<Name, String> {
        Name::new(&format!("{}-r{i}", self.name)).map_err(|e| format!("race: copy {i} of {}: {e}", self.name))
    }
}

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("race", args.first())?;
    let copies = match args.get(1).map(|n| n.parse::<usize>()) {
        Some(Ok(n)) if (1..=MAX_COPIES).contains(&n) => n,
        _ => return Err(usage(format!("race: N must be a number of copies from 1 to {MAX_COPIES}"))),
    };
    let (mut keep, mut json) = (Keep::All, false);
    let mut rest = args.iter().skip(2);
    let mut command = Vec::new();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--" => {
                command.extend(rest.by_ref().cloned());
                break;
            }
            "--json" => json = true,
            "--keep-best" if keep == Keep::All => keep = Keep::Best,
            "--pick" if keep == Keep::All => {
                let test = rest.next().ok_or_else(|| usage("race: --pick needs a test command"))?;
                keep = Keep::Pick(test.clone());
            }
            "--keep-best" | "--pick" => return Err(usage("race: --keep-best and --pick pick one way")),
            other => return Err(usage(format!("race: unexpected argument {other:?} (the command goes after --)"))),
        }
    }
    if command.is_empty() {
        return Err(usage("race: usage: race NAME N [--keep-best | --pick 'TEST'] [--json] -- CMD"));
    }
    let spec = RaceSpec { name, copies, command: command.join(" "), keep, json };
    // Every copy's name must be one (checked before anything is made).
    for i in 1..=copies {
        spec.copy_name(i).map_err(usage)?;
    }
    Ok(Plan::Race(spec))
}
