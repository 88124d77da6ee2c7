//! The control plane: commands run as `ssh HOST COMMAND`. Each verb is a
//! file in `verbs/` (its help, its parse into an operation of the core, its
//! rendering), listed in one table; `run` asks the privileged side to do it,
//! the same way for every verb.

mod args;
pub mod race;
pub(crate) mod render;
mod run;
mod time;
mod verbs;

pub use args::UsageError;
pub use run::{run, Output};
pub use verbs::{closest_verb, help, is_control_command, parse, Call, Plan, Render, Verb, VERBS};
