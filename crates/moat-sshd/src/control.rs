//! The control plane: commands run as `ssh HOST COMMAND`.
//!
//! Parsing is pure and strict: an unknown command or flag, a missing or extra
//! argument, or an invalid name is a one-line usage error (exit 2) and nothing
//! runs. Every listing takes `--json`.

use std::fmt::Write as _;
use std::sync::Arc;

use moat_core::limits::parse_size;
use moat_core::{AccountId, BoxManager, BoxSpec, Limits, ManagerError, Name, ProgressSink};
use serde::Serialize;

/// What `help` prints.
pub const HELP: &str = "\
moat: disposable boxes over SSH

usage: ssh HOST COMMAND [ARGS]

commands:
  new NAME [--image I] [--cpus N] [--memory SIZE] [--pids N]
                      create a box (image 'debian' unless told, built on first use)
  ls [--json]         list your boxes
  info NAME [--json]  show one box
  rm NAME             stop and delete a box and its files
  help                this text

then: ssh NAME@HOST for a shell in box NAME, ssh NAME@HOST CMD to run CMD;
scp, sftp, rsync -e ssh and ssh -L reach the box the same way.
";

/// The default image for `new`.
pub const DEFAULT_IMAGE: &str = "debian";

/// A parsed control command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `help`
    Help,
    /// `new NAME [flags]`
    New {
        /// Box name.
        name: Name,
        /// Image name.
        image: Name,
        /// Limits.
        limits: Limits,
    },
    /// `ls [--json]`
    Ls {
        /// Machine-readable output.
        json: bool,
    },
    /// `info NAME [--json]`
    Info {
        /// Box name.
        name: Name,
        /// Machine-readable output.
        json: bool,
    },
    /// `rm NAME`
    Rm {
        /// Box name.
        name: Name,
    },
}

/// A command line that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

fn usage(msg: impl Into<String>) -> UsageError {
    UsageError(msg.into())
}

fn name_arg(what: &str, value: Option<&String>) -> Result<Name, UsageError> {
    let value = value.ok_or_else(|| usage(format!("{what}: missing NAME (see 'help')")))?;
    Name::new(value).map_err(|e| usage(format!("{what}: {e}")))
}

/// Parses the words of a control command.
pub fn parse(words: &[String]) -> Result<Command, UsageError> {
    let Some((verb, args)) = words.split_first() else {
        return Ok(Command::Help);
    };
    match verb.as_str() {
        "help" | "--help" | "-h" => no_more("help", args).map(|()| Command::Help),
        "ls" | "list" => {
            let json = flags_only("ls", args)?;
            Ok(Command::Ls { json })
        }
        "info" => {
            let name = name_arg("info", args.first())?;
            let json = flags_only("info", args.get(1..).unwrap_or_default())?;
            Ok(Command::Info { name, json })
        }
        "rm" => {
            let name = name_arg("rm", args.first())?;
            no_more("rm", args.get(1..).unwrap_or_default())?;
            Ok(Command::Rm { name })
        }
        "new" => parse_new(args),
        other => Err(usage(format!("unknown command {other:?} (see 'help')"))),
    }
}

fn no_more(verb: &str, args: &[String]) -> Result<(), UsageError> {
    match args.first() {
        None => Ok(()),
        Some(extra) => Err(usage(format!("{verb}: unexpected argument {extra:?}"))),
    }
}

/// Accepts only `--json`; returns whether it was given.
fn flags_only(verb: &str, args: &[String]) -> Result<bool, UsageError> {
    let mut json = false;
    for arg in args {
        match arg.as_str() {
            "--json" => json = true,
            other => return Err(usage(format!("{verb}: unexpected argument {other:?}"))),
        }
    }
    Ok(json)
}

fn parse_new(args: &[String]) -> Result<Command, UsageError> {
    let name = name_arg("new", args.first())?;
    let mut image = Name::new(DEFAULT_IMAGE).map_err(|e| usage(e.to_string()))?;
    let mut limits = Limits::default();
    let mut rest = args.get(1..).unwrap_or_default().iter();
    while let Some(flag) = rest.next() {
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (flag.as_str(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| rest.next().cloned())
                .ok_or_else(|| usage(format!("new: {flag} needs a value")))
        };
        match flag {
            "--image" => {
                image = Name::new(&value()?).map_err(|e| usage(format!("new: --image: {e}")))?
            }
            "--cpus" => limits.cpus = number(flag, &value()?)?,
            "--pids" => limits.pids = number(flag, &value()?)?,
            "--memory" => {
                limits.memory =
                    parse_size(&value()?).map_err(|e| usage(format!("new: --memory: {e}")))?
            }
            other => return Err(usage(format!("new: unknown flag {other:?}"))),
        }
    }
    limits.validate().map_err(|e| usage(format!("new: {e}")))?;
    Ok(Command::New {
        name,
        image,
        limits,
    })
}

fn number(flag: &str, value: &str) -> Result<u32, UsageError> {
    value
        .parse()
        .map_err(|_| usage(format!("new: {flag}: {value:?} is not a whole number")))
}

/// Runs a command for `account`; returns what goes to stdout.
pub async fn run(
    cmd: Command,
    account: &AccountId,
    manager: &Arc<BoxManager>,
    progress: ProgressSink,
) -> Result<String, ManagerError> {
    match cmd {
        Command::Help => Ok(HELP.to_string()),
        Command::New {
            name,
            image,
            limits,
        } => {
            let rec = manager
                .create(
                    account,
                    BoxSpec {
                        name,
                        image,
                        limits,
                    },
                    progress,
                )
                .await?;
            Ok(format!("{}\n", rec.name))
        }
        Command::Ls { json } => {
            let boxes = manager.list(account)?;
            if json {
                return Ok(to_json(&boxes));
            }
            let mut out = format!(
                "{:<24} {:<9} {:<10} {:>4} {:>8} {:>6}\n",
                "NAME", "STATE", "IMAGE", "CPUS", "MEMORY", "PIDS"
            );
            for b in &boxes {
                let _ = writeln!(
                    out,
                    "{:<24} {:<9} {:<10} {:>4} {:>8} {:>6}",
                    b.name,
                    b.state,
                    b.image,
                    b.limits.cpus,
                    human_size(b.limits.memory),
                    b.limits.pids
                );
            }
            Ok(out)
        }
        Command::Info { name, json } => {
            let b = manager.get(account, &name)?;
            if json {
                return Ok(to_json(&b));
            }
            Ok(format!(
                "name:     {}\nid:       {}\nstate:    {}\nimage:    {}\ncpus:     {}\nmemory:   {}\npids:     {}\ncreated:  {}\n",
                b.name, b.id, b.state, b.image, b.limits.cpus, human_size(b.limits.memory), b.limits.pids, b.created_at
            ))
        }
        Command::Rm { name } => {
            manager.remove(account, &name).await?;
            Ok(String::new())
        }
    }
}

fn to_json<T: Serialize>(value: &T) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| "null".into());
    s.push('\n');
    s
}

/// `2147483648` → `2G`.
fn human_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    fn p(line: &str) -> Result<Command, UsageError> {
        parse(&crate::words::split(line).unwrap())
    }

    #[test]
    fn parses_commands() {
        assert_eq!(p("").unwrap(), Command::Help);
        assert_eq!(p("ls --json").unwrap(), Command::Ls { json: true });
        assert_eq!(
            p("rm web").unwrap(),
            Command::Rm {
                name: Name::new("web").unwrap()
            }
        );
        let Command::New {
            name,
            image,
            limits,
        } = p("new web --image busybox --cpus 1 --memory=512M --pids 64").unwrap()
        else {
            panic!("not new")
        };
        assert_eq!((name.as_str(), image.as_str()), ("web", "busybox"));
        assert_eq!(
            limits,
            Limits {
                cpus: 1,
                memory: 512 << 20,
                pids: 64
            }
        );
        assert_eq!(
            p("new web").unwrap(),
            Command::New {
                name: Name::new("web").unwrap(),
                image: Name::new("debian").unwrap(),
                limits: Limits::default()
            }
        );
    }

    #[test]
    fn rejects_bad_input_with_one_line() {
        for bad in [
            "frobnicate",
            "new",
            "new Web",
            "new web --cpus",
            "new web --cpus x",
            "new web --bogus 1",
            "new web --memory 1Q",
            "new web --cpus 0",
            "rm",
            "rm a b",
            "ls -l",
            "info",
            "new ../etc",
        ] {
            let e = p(bad).unwrap_err();
            assert!(!e.0.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn sizes_print_short() {
        assert_eq!(human_size(2 << 30), "2G");
        assert_eq!(human_size(512 << 20), "512M");
        assert_eq!(human_size(1000), "1000");
    }
}
