//! The control plane: commands run as `ssh HOST COMMAND`. The grammar says
//! what a line means, `run` asks the privileged side to do it, and `render`
//! turns the answer into what the user reads.

mod grammar;
mod render;
mod run;

pub use grammar::{is_control_command, parse, Command, UsageError, HELP};
pub use run::{run, Output};
