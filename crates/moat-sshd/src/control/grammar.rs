//! The control plane's grammar: what `ssh HOST COMMAND` may say.
//!
//! Parsing is pure and strict: an unknown command or flag, a missing or extra
//! argument, or an invalid name is a one-line usage error (exit 2) and nothing
//! runs. Every listing takes `--json`. A new verb is a `Command` variant, an
//! arm in `parse` (and its name in `VERBS`), and one in `run::run`.

use moat_api::PolicyChange;
use moat_core::limits::parse_size;
use moat_core::policy::{HostName, Rule, PRESETS};
use moat_core::secrets::{Limit, LimitKind, SecretSpec};
use moat_core::{BackendKind, Limits, Name};

/// What `help` prints.
pub const HELP: &str = "\
moat: disposable boxes over SSH

usage: ssh HOST COMMAND [ARGS]

commands:
  new NAME [--image I] [--cpus N] [--memory SIZE] [--pids N] [--disk SIZE] [--idle SECONDS]
         [--policy PRESET] [--ask] [--backend ns|vm]
                      create a box (image 'debian' unless told, built on first use;
                      vm: a kernel of its own, ns: namespaces; the server's default unless told)
  ls [--json]         list your boxes
  info NAME [--json]  show one box
  rm NAME             stop and delete a box and its files
  dup SRC DST         copy box SRC as DST, instantly (SRC keeps running); DST is a new machine
  diff A B [--json]   the files added (A), modified (M) and deleted (D) in B relative to A
  promote CHILD       CHILD takes its parent's name; the parent stays as PARENT-prev
  checkpoint NAME [LABEL]       save NAME's files as they are now, instantly (label: c1, c2, ...)
  checkpoints NAME [--json]     NAME's checkpoints: label, time, and the bytes only each holds
  restore NAME LABEL  put NAME back to checkpoint LABEL: its processes end and it boots again,
                      the same machine; its state before is kept as checkpoint before-LABEL
  checkpoint rm NAME LABEL      delete a checkpoint (rm NAME deletes them all; dup copies none)
  stop NAME           end every process of a box (its files stay); start NAME boots it
  suspend NAME        freeze a box now (billing stops); the next session resumes it
  set NAME idle SECONDS         suspend NAME after SECONDS without a session
  set NAME keep-running on|off  never suspend NAME (it is billed while idle)
  set NAME ask on|off           ask mode: a name NAME's policy does not allow is put to you
                                (ssh HOST ask) instead of refused at once
  usage [NAME] [--since T] [--json]
                      CPU, memory, running and suspended time, disk, per box and in
                      total; T is seconds since the epoch, or an age like 90s, 30m, 2h, 7d
  policy NAME [--json]           what NAME may reach on the network (nothing unless allowed)
  policy NAME allow|deny|rm [METHODS] HOST[:PORTS][/PATH]
                      add or remove a rule; e.g. 'allow pypi.org', 'allow *.example.com:443',
                      'allow GET,HEAD deb.debian.org/debian/', 'deny github.com/*git-receive-pack';
                      PORTS default to 80,443 ('*': any); a deny wins; applies to new connections
  policy NAME preset none|registries|github-read
                      replace the policy with a preset
  log NAME [--follow [--ask]] [--since T] [--json]
                      every DNS query, connection and HTTP request NAME made, and the verdict;
                      with --ask, NAME's questions too, answered as with 'ask'
  ask [--json]        show your boxes' questions (ask mode) as they come; answer each with
                      a line on stdin: 'ID once', 'ID always' (added to the policy) or 'ID deny'
                      (or just the answer, for the newest); unanswered ones are denied in 60 s
  ask ID once|always|deny       answer one question
  secret add NAME --host H --header X [--format 'Bearer {}'] [--env VAR]   (value on stdin)
                      keep a secret outside every box: a box it is granted to holds a
                      placeholder in $VAR (default: NAME in upper case), and the gateway writes
                      the value into header X of that box's HTTPS requests to H, and nowhere else
  secret ls [--json]  your secrets: hosts, headers, boxes, limits, use (never values)
  secret grant|revoke NAME BOX  give or take BOX's use of NAME (grant also allows H:443)
  secret limit NAME [--box B] [--requests N --per D] [--tokens N --per D] [--bytes N]
                      at most N per period D (like 60s, 1h, 1d); by B, or by all boxes together
  secret kill NAME    stop every use of NAME now, open connections included
  secret rm NAME      revoke NAME everywhere and forget its value
  help                this text

then: ssh NAME@HOST for a shell in box NAME, ssh NAME@HOST CMD to run CMD;
scp, sftp, rsync -e ssh and ssh -L reach the box the same way.

The SSH user name picks what you talk to: one of your boxes by that name, or
else the control plane. `ssh moat@HOST COMMAND` always reaches the control
plane; through any other user name that is not a box, only the commands above
run (anything else is taken for a box that does not exist).
";

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
        /// Idle grace, if not the daemon's default.
        idle: Option<u32>,
        /// The policy preset, if not the daemon's default.
        policy: Option<String>,
        /// Ask mode from the start.
        ask: bool,
        /// What isolates it, if not the server's default.
        backend: Option<BackendKind>,
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
    /// `dup SRC DST`
    Dup {
        /// The box to copy.
        src: Name,
        /// The copy's name.
        dst: Name,
    },
    /// `diff A B [--json]`
    Diff {
        /// The reference box.
        a: Name,
        /// The box whose changes are listed.
        b: Name,
        /// Machine-readable output.
        json: bool,
    },
    /// `promote CHILD`
    Promote {
        /// The duplicate that takes its parent's place.
        child: Name,
    },
    /// `stop NAME`
    Stop {
        /// Box name.
        name: Name,
    },
    /// `start NAME`
    Start {
        /// Box name.
        name: Name,
    },
    /// `suspend NAME`
    Suspend {
        /// Box name.
        name: Name,
    },
    /// `set NAME idle SECONDS`
    SetIdle {
        /// Box name.
        name: Name,
        /// Seconds without a session before suspending.
        seconds: u32,
    },
    /// `set NAME keep-running on|off`
    SetKeepRunning {
        /// Box name.
        name: Name,
        /// Whether the box is exempt from suspension.
        on: bool,
    },
    /// `policy NAME [--json]`
    Policy {
        /// Box name.
        name: Name,
        /// Machine-readable output.
        json: bool,
    },
    /// `policy NAME allow|deny|rm RULE`, `policy NAME preset P`
    ChangePolicy {
        /// Box name.
        name: Name,
        /// The change.
        change: PolicyChange,
    },
    /// `log NAME [--follow] [--since T] [--json]`
    Log {
        /// Box name.
        name: Name,
        /// Keep printing new entries.
        follow: bool,
        /// With `follow`, the box's questions too (answers from stdin).
        ask: bool,
        /// Start, seconds since the epoch.
        since: Option<u64>,
        /// JSON lines.
        json: bool,
    },
    /// `ask [--json]`: questions as they come, answers from stdin
    Ask {
        /// JSON lines.
        json: bool,
    },
    /// `secret add NAME --host H --header X [--format F] [--env VAR]`
    SecretAdd {
        /// What it is (the value comes on stdin).
        spec: SecretSpec,
    },
    /// `secret ls [--json]`
    SecretLs {
        /// Machine-readable output.
        json: bool,
    },
    /// `secret rm NAME`
    SecretRm {
        /// The secret.
        name: Name,
    },
    /// `secret grant NAME BOX`, `secret revoke NAME BOX`
    SecretGrant {
        /// The secret.
        name: Name,
        /// The box.
        box_name: Name,
        /// Grant (or revoke).
        grant: bool,
    },
    /// `secret limit NAME [--box B] LIMITS`
    SecretLimit {
        /// The secret.
        name: Name,
        /// One box's use, or all together.
        box_name: Option<Name>,
        /// The limits.
        limits: Vec<Limit>,
    },
    /// `secret kill NAME`
    SecretKill {
        /// The secret.
        name: Name,
    },
    /// `ask ID once|always|deny`
    Answer {
        /// The question.
        id: u64,
        /// The answer.
        answer: moat_core::egress::Answer,
    },
    /// `checkpoint NAME [LABEL]`
    Checkpoint {
        /// Box name.
        name: Name,
        /// The label, if not the next `cN`.
        label: Option<Name>,
    },
    /// `checkpoints NAME [--json]`
    Checkpoints {
        /// Box name.
        name: Name,
        /// Machine-readable output.
        json: bool,
    },
    /// `restore NAME LABEL`
    Restore {
        /// Box name.
        name: Name,
        /// The checkpoint.
        label: Name,
    },
    /// `checkpoint rm NAME LABEL`
    CheckpointRm {
        /// Box name.
        name: Name,
        /// The checkpoint.
        label: Name,
    },
    /// `usage [NAME] [--since T] [--json]`
    Usage {
        /// One box, or all.
        name: Option<Name>,
        /// Start of the period, seconds since the epoch.
        since: Option<u64>,
        /// Machine-readable output.
        json: bool,
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

/// Every verb `parse` knows.
const VERBS: &[&str] = &[
    "help",
    "--help",
    "-h",
    "ls",
    "list",
    "info",
    "rm",
    "new",
    "dup",
    "diff",
    "stop",
    "start",
    "suspend",
    "set",
    "usage",
    "promote",
    "policy",
    "log",
    "ask",
    "secret",
    "checkpoint",
    "checkpoints",
    "restore",
];

/// Whether `line` is meant for the control plane (its first word is a verb;
/// an empty line means `help`), whether or not its arguments are right.
pub fn is_control_command(line: &str) -> bool {
    match crate::words::split(line) {
        Ok(words) => words.first().is_none_or(|verb| VERBS.contains(&verb.as_str())),
        Err(_) => false,
    }
}

impl Command {
    /// The name of the box this command would create, if it creates one.
    pub fn creates(&self) -> Option<&Name> {
        match self {
            Command::New { name, .. } => Some(name),
            Command::Dup { dst, .. } => Some(dst),
            _ => None,
        }
    }
}

/// Parses the words of a control command.
pub fn parse(words: &[String]) -> Result<Command, UsageError> {
    let Some((verb, args)) = words.split_first() else {
        return Ok(Command::Help);
    };
    match verb.as_str() {
        // Keep VERBS in step with these arms.
        "help" | "--help" | "-h" => no_more("help", args).map(|()| Command::Help),
        "ls" | "list" => {
            let json = flags_only("ls", args)?;
            Ok(Command::Ls { json })
        }
        "info" | "checkpoints" => {
            let name = name_arg(verb, args.first())?;
            let json = flags_only(verb, args.get(1..).unwrap_or_default())?;
            Ok(match verb.as_str() {
                "info" => Command::Info { name, json },
                _ => Command::Checkpoints { name, json },
            })
        }
        "rm" => {
            let name = name_arg("rm", args.first())?;
            no_more("rm", args.get(1..).unwrap_or_default())?;
            Ok(Command::Rm { name })
        }
        "new" => parse_new(args),
        "dup" => {
            let src = name_arg("dup", args.first())?;
            let dst = name_arg("dup", args.get(1))?;
            no_more("dup", args.get(2..).unwrap_or_default())?;
            Ok(Command::Dup { src, dst })
        }
        "diff" => {
            let a = name_arg("diff", args.first())?;
            let b = name_arg("diff", args.get(1))?;
            let json = flags_only("diff", args.get(2..).unwrap_or_default())?;
            Ok(Command::Diff { a, b, json })
        }
        "stop" | "start" | "suspend" => {
            let name = name_arg(verb, args.first())?;
            no_more(verb, args.get(1..).unwrap_or_default())?;
            Ok(match verb.as_str() {
                "stop" => Command::Stop { name },
                "start" => Command::Start { name },
                _ => Command::Suspend { name },
            })
        }
        "set" => parse_set(args),
        "usage" => parse_usage(args),
        "policy" => parse_policy(args),
        "log" => parse_log(args),
        "ask" => parse_ask(args),
        "secret" => parse_secret(args),
        "checkpoint" => parse_checkpoint(args),
        "restore" => {
            let name = name_arg("restore", args.first())?;
            let label = label_arg("restore", args.get(1))?;
            no_more("restore", args.get(2..).unwrap_or_default())?;
            Ok(Command::Restore { name, label })
        }
        "promote" => {
            let child = name_arg("promote", args.first())?;
            no_more("promote", args.get(1..).unwrap_or_default())?;
            Ok(Command::Promote { child })
        }
        other => Err(usage(format!("unknown command {other:?} (see 'help')"))),
    }
}

/// `checkpoint NAME [LABEL]`, or `checkpoint rm NAME LABEL` (three words:
/// a box called `rm` is still checkpointed with `checkpoint rm [LABEL]`).
fn parse_checkpoint(args: &[String]) -> Result<Command, UsageError> {
    if let [rm, name, label] = args {
        if rm == "rm" {
            let name = name_arg("checkpoint rm", Some(name))?;
            let label = label_arg("checkpoint rm", Some(label))?;
            return Ok(Command::CheckpointRm { name, label });
        }
    }
    let name = name_arg("checkpoint", args.first())?;
    let label = args.get(1).map(|l| label_arg("checkpoint", Some(l))).transpose()?;
    no_more("checkpoint", args.get(2..).unwrap_or_default())?;
    Ok(Command::Checkpoint { name, label })
}

fn label_arg(what: &str, value: Option<&String>) -> Result<Name, UsageError> {
    let value = value.ok_or_else(|| usage(format!("{what}: missing LABEL (see 'help')")))?;
    Name::new(value).map_err(|e| usage(format!("{what}: label: {e}")))
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
    let mut image = Name::new(moat_core::images::DEFAULT).map_err(|e| usage(e.to_string()))?;
    let mut limits = Limits::default();
    let mut idle = None;
    let mut policy = None;
    let mut ask = false;
    let mut backend = None;
    let mut rest = args.get(1..).unwrap_or_default().iter();
    while let Some(flag) = rest.next() {
        if flag == "--ask" {
            ask = true;
            continue;
        }
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (flag.as_str(), None),
        };
        let mut value = || {
            inline.clone().or_else(|| rest.next().cloned()).ok_or_else(|| usage(format!("new: {flag} needs a value")))
        };
        match flag {
            "--image" => image = Name::new(&value()?).map_err(|e| usage(format!("new: --image: {e}")))?,
            "--cpus" => limits.cpus = number(flag, &value()?)?,
            "--pids" => limits.pids = number(flag, &value()?)?,
            "--idle" => idle = Some(seconds("new: --idle", &value()?)?),
            "--policy" => policy = Some(preset_arg("new: --policy", &value()?)?),
            "--disk" => limits.disk = parse_size(&value()?).map_err(|e| usage(format!("new: --disk: {e}")))?,
            "--memory" => limits.memory = parse_size(&value()?).map_err(|e| usage(format!("new: --memory: {e}")))?,
            "--backend" => {
                let v = value()?;
                let kind =
                    BackendKind::parse(&v).ok_or_else(|| usage(format!("new: --backend: {v:?} is not ns or vm")))?;
                backend = Some(kind);
            }
            other => return Err(usage(format!("new: unknown flag {other:?}"))),
        }
    }
    limits.validate().map_err(|e| usage(format!("new: {e}")))?;
    Ok(Command::New { name, image, limits, idle, policy, ask, backend })
}

fn preset_arg(what: &str, value: &str) -> Result<String, UsageError> {
    if PRESETS.contains(&value) {
        Ok(value.to_string())
    } else {
        Err(usage(format!("{what}: no preset {value:?} (presets: {})", PRESETS.join(", "))))
    }
}

fn parse_policy(args: &[String]) -> Result<Command, UsageError> {
    let name = name_arg("policy", args.first())?;
    let rest = args.get(1..).unwrap_or_default();
    let Some((op, words)) = rest.split_first() else { return Ok(Command::Policy { name, json: false }) };
    let rule = |words: &[String]| {
        // Checked here for a usage error; the privileged side parses it again.
        let refs: Vec<&str> = words.iter().map(String::as_str).collect();
        Rule::parse(&refs).map(|_| words.to_vec()).map_err(|e| usage(format!("policy: {e}")))
    };
    let change = match op.as_str() {
        "--json" => {
            no_more("policy", words)?;
            return Ok(Command::Policy { name, json: true });
        }
        "allow" => PolicyChange::Allow(rule(words)?),
        "deny" => PolicyChange::Deny(rule(words)?),
        "rm" => PolicyChange::Remove(rule(words)?),
        "preset" => match words {
            [preset] => PolicyChange::Preset(preset_arg("policy: preset", preset)?),
            _ => return Err(usage("policy: usage: policy NAME preset none|registries|github-read")),
        },
        other => {
            return Err(usage(format!("policy: unknown action {other:?} (allow, deny, rm, preset, or --json)")));
        }
    };
    Ok(Command::ChangePolicy { name, change })
}

fn parse_log(args: &[String]) -> Result<Command, UsageError> {
    let name = name_arg("log", args.first())?;
    let (mut follow, mut ask, mut since, mut json) = (false, false, None, false);
    let mut rest = args.get(1..).unwrap_or_default().iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--follow" | "-f" => follow = true,
            "--ask" => ask = true,
            "--json" => json = true,
            "--since" => {
                let value = rest.next().ok_or_else(|| usage("log: --since needs a value"))?;
                since = Some(parse_since(value, moat_core::clock::now())?);
            }
            other => return Err(usage(format!("log: unexpected argument {other:?}"))),
        }
    }
    if ask && !follow {
        return Err(usage("log: --ask needs --follow"));
    }
    Ok(Command::Log { name, follow, ask, since, json })
}

fn parse_ask(args: &[String]) -> Result<Command, UsageError> {
    match args {
        [] => Ok(Command::Ask { json: false }),
        [json] if json == "--json" => Ok(Command::Ask { json: true }),
        [id, answer] => {
            let id = id.parse().map_err(|_| usage(format!("ask: {id:?} is no question number")))?;
            let answer = answer.parse().map_err(|e| usage(format!("ask: {e}")))?;
            Ok(Command::Answer { id, answer })
        }
        _ => Err(usage("ask: usage: ask [--json] | ask ID once|always|deny")),
    }
}

fn parse_secret(args: &[String]) -> Result<Command, UsageError> {
    let name = |what: &str, v: Option<&String>| name_arg(&format!("secret {what}"), v);
    let (Some(verb), rest) = (args.first(), args.get(1..).unwrap_or_default()) else {
        return Err(usage("secret: add, ls, rm, grant, revoke, limit or kill (see 'help')"));
    };
    match (verb.as_str(), rest) {
        ("ls", []) => Ok(Command::SecretLs { json: false }),
        ("ls", [json]) if json == "--json" => Ok(Command::SecretLs { json: true }),
        ("rm", [n]) => Ok(Command::SecretRm { name: name("rm", Some(n))? }),
        ("kill", [n]) => Ok(Command::SecretKill { name: name("kill", Some(n))? }),
        ("grant" | "revoke", [n, b]) => Ok(Command::SecretGrant {
            name: name(verb, Some(n))?,
            box_name: name(verb, Some(b))?,
            grant: verb == "grant",
        }),
        ("add", [n, flags @ ..]) => parse_secret_add(name("add", Some(n))?, flags),
        ("limit", [n, flags @ ..]) => parse_secret_limit(name("limit", Some(n))?, flags),
        _ => Err(usage(format!("secret {verb}: bad arguments (see 'help')"))),
    }
}

fn parse_secret_add(name: Name, flags: &[String]) -> Result<Command, UsageError> {
    let (mut host, mut header, mut format, mut env) = (None, None, "{}".to_string(), None);
    let mut rest = flags.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or_else(|| usage(format!("secret add: {flag} needs a value")))?;
        match flag.as_str() {
            "--host" => host = Some(HostName::from_user(value).map_err(|e| usage(format!("secret add: --host: {e}")))?),
            "--header" => header = Some(value.clone()),
            "--format" => format = value.clone(),
            "--env" => env = Some(value.clone()),
            other => return Err(usage(format!("secret add: unknown flag {other:?}"))),
        }
    }
    let (Some(host), Some(header)) = (host, header) else {
        return Err(usage("secret add: --host and --header are required"));
    };
    let env = env.unwrap_or_else(|| SecretSpec::default_env(&name));
    let spec = SecretSpec { name, host, header, format, env };
    spec.validate().map_err(|e| usage(format!("secret add: {e}")))?;
    Ok(Command::SecretAdd { spec })
}

fn parse_secret_limit(name: Name, flags: &[String]) -> Result<Command, UsageError> {
    let mut box_name = None;
    let mut limits: Vec<Limit> = Vec::new();
    let mut rest = flags.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or_else(|| usage(format!("secret limit: {flag} needs a value")))?;
        let amount =
            || value.parse::<u64>().map_err(|_| usage(format!("secret limit: {flag} {value:?}: not a number")));
        let kind = match flag.as_str() {
            "--box" => {
                box_name = Some(name_arg("secret limit: --box", Some(value))?);
                continue;
            }
            "--per" => {
                let per = parse_duration(value)
                    .ok_or_else(|| usage(format!("secret limit: --per {value:?}: a period like 60s, 1h, 1d")))?;
                match limits.last_mut() {
                    Some(l) if l.kind != LimitKind::Bytes && l.per_secs.is_none() => l.per_secs = Some(per),
                    _ => return Err(usage("secret limit: --per follows --requests N or --tokens N")),
                }
                continue;
            }
            "--requests" => LimitKind::Requests,
            "--tokens" => LimitKind::Tokens,
            "--bytes" => LimitKind::Bytes,
            other => return Err(usage(format!("secret limit: unknown flag {other:?}"))),
        };
        limits.push(Limit::new(kind, amount()?, None).map_err(|e| usage(format!("secret limit: {e}")))?);
    }
    if limits.is_empty() {
        return Err(usage("secret limit: give --requests N --per D, --tokens N --per D or --bytes N"));
    }
    if let Some(l) = limits.iter().find(|l| l.kind != LimitKind::Bytes && l.per_secs.is_none()) {
        return Err(usage(format!("secret limit: --{} needs --per D after it", l.kind.as_str())));
    }
    Ok(Command::SecretLimit { name, box_name, limits })
}

fn parse_set(args: &[String]) -> Result<Command, UsageError> {
    let name = name_arg("set", args.first())?;
    let (Some(key), Some(value), None) = (args.get(1), args.get(2), args.get(3)) else {
        return Err(usage("set: usage: set NAME idle SECONDS | set NAME keep-running|ask on|off"));
    };
    let on = |what: &str| match value.as_str() {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(usage(format!("set: {what} takes on or off, not {other:?}"))),
    };
    match key.as_str() {
        "idle" => Ok(Command::SetIdle { name, seconds: seconds("set: idle", value)? }),
        "keep-running" => Ok(Command::SetKeepRunning { name, on: on("keep-running")? }),
        "ask" => Ok(Command::ChangePolicy { name, change: PolicyChange::Ask(on("ask")?) }),
        other => Err(usage(format!("set: unknown setting {other:?} (idle, keep-running, ask)"))),
    }
}

fn seconds(what: &str, value: &str) -> Result<u32, UsageError> {
    match value.parse::<u32>() {
        Ok(n) if (1..=30 * 86_400).contains(&n) => Ok(n),
        _ => Err(usage(format!("{what}: {value:?} is not a number of seconds from 1 to 2592000"))),
    }
}

fn parse_usage(args: &[String]) -> Result<Command, UsageError> {
    let (mut name, mut since, mut json) = (None, None, false);
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--since" => {
                let value = rest.next().ok_or_else(|| usage("usage: --since needs a value"))?;
                since = Some(parse_since(value, moat_core::clock::now())?);
            }
            flag if flag.starts_with('-') => return Err(usage(format!("usage: unknown flag {flag:?}"))),
            box_name if name.is_none() => name = Some(Name::new(box_name).map_err(|e| usage(format!("usage: {e}")))?),
            extra => return Err(usage(format!("usage: unexpected argument {extra:?}"))),
        }
    }
    Ok(Command::Usage { name, since, json })
}

/// `1700000000` (seconds since the epoch) or an age: `90s`, `30m`, `2h`, `7d`.
fn parse_since(value: &str, now: u64) -> Result<u64, UsageError> {
    let bad = || usage(format!("usage: --since {value:?}: give seconds since the epoch or an age like 30m, 2h, 7d"));
    if let Ok(epoch) = value.parse::<u64>() {
        return Ok(epoch);
    }
    let age = parse_duration(value).filter(|_| value.ends_with(|c: char| c.is_ascii_alphabetic())).ok_or_else(bad)?;
    Ok(now.saturating_sub(age))
}

/// A period in seconds: `90s`, `30m`, `2h`, `7d`, or a bare number of seconds.
fn parse_duration(value: &str) -> Option<u64> {
    if let Ok(n) = value.parse::<u64>() {
        return Some(n).filter(|n| *n > 0);
    }
    let split = value.len().checked_sub(1)?;
    let (n, unit) = (value.get(..split)?, value.get(split..)?);
    let n: u64 = n.parse().ok()?;
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    Some(n.saturating_mul(scale)).filter(|n| *n > 0)
}

fn number(flag: &str, value: &str) -> Result<u32, UsageError> {
    value.parse().map_err(|_| usage(format!("new: {flag}: {value:?} is not a whole number")))
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
        assert_eq!(p("rm web").unwrap(), Command::Rm { name: Name::new("web").unwrap() });
        let Command::New { name, image, limits, .. } =
            p("new web --image busybox --cpus 1 --memory=512M --pids 64").unwrap()
        else {
            panic!("not new")
        };
        assert_eq!((name.as_str(), image.as_str()), ("web", "busybox"));
        assert_eq!(limits, Limits { cpus: 1, memory: 512 << 20, pids: 64, ..Limits::default() });
        assert_eq!(
            p("new web").unwrap(),
            Command::New {
                name: Name::new("web").unwrap(),
                image: Name::new("debian").unwrap(),
                limits: Limits::default(),
                idle: None,
                policy: None,
                ask: false,
                backend: None,
            }
        );
        let Command::New { backend, .. } = p("new web --backend vm").unwrap() else { panic!("not new") };
        assert_eq!(backend, Some(BackendKind::Vm));
        assert!(p("new web --backend kvm").is_err());
    }

    #[test]
    fn parses_egress_commands() {
        let n = |s: &str| Name::new(s).unwrap();
        let words = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(p("policy web").unwrap(), Command::Policy { name: n("web"), json: false });
        assert_eq!(p("policy web --json").unwrap(), Command::Policy { name: n("web"), json: true });
        assert_eq!(
            p("policy web allow GET,HEAD deb.debian.org/debian/").unwrap(),
            Command::ChangePolicy {
                name: n("web"),
                change: PolicyChange::Allow(words("GET,HEAD deb.debian.org/debian/"))
            }
        );
        assert_eq!(
            p("policy web preset registries").unwrap(),
            Command::ChangePolicy { name: n("web"), change: PolicyChange::Preset("registries".into()) }
        );
        for bad in [
            "policy web allow",
            "policy web allow 1.2.3.4",
            "policy web preset nope",
            "policy web open x.org",
            "policy web allow x.org:0",
            "log",
            "log web --tail",
            "new web --policy everything",
            "log web --ask",
            "ask 3",
            "ask x once",
            "ask 3 maybe",
            "ask --json 3",
            "set web ask maybe",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
        assert_eq!(
            p("log web -f --json").unwrap(),
            Command::Log { name: n("web"), follow: true, ask: false, since: None, json: true }
        );
        assert_eq!(
            p("log web -f --ask").unwrap(),
            Command::Log { name: n("web"), follow: true, ask: true, since: None, json: false }
        );
        let Command::New { policy, ask, .. } = p("new web --policy github-read --ask").unwrap() else {
            panic!("not new")
        };
        assert_eq!((policy.as_deref(), ask), (Some("github-read"), true));
        assert_eq!(p("ask").unwrap(), Command::Ask { json: false });
        assert_eq!(p("ask 12 always").unwrap(), Command::Answer { id: 12, answer: moat_core::egress::Answer::Always });
        let Command::SecretAdd { spec } = p("secret add llm --host API.example --header x-api-key").unwrap() else {
            panic!("not secret add")
        };
        assert_eq!((spec.host.as_str(), spec.env.as_str(), spec.format.as_str()), ("api.example", "LLM", "{}"));
        let limit = p("secret limit llm --box web --requests 10 --per 1m --tokens 500 --per 1d --bytes 1000").unwrap();
        let Command::SecretLimit { box_name, limits, .. } = limit else { panic!("not a limit") };
        assert_eq!(box_name, Some(n("web")));
        let shown: Vec<String> = limits.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["10 requests per 60s", "500 tokens per 86400s", "1000 bytes"]);
        for bad in [
            "secret",
            "secret add llm --host api.example",
            "secret add llm --host api.example --header 'x y'",
            "secret add llm --host api.example --header x --format nothing",
            "secret add llm --host 10.0.0.1 --header x",
            "secret add llm --host api.example --header x --env PATH",
            "secret limit llm --requests 10",
            "secret limit llm --bytes 10 --per 1h",
            "secret limit llm --requests 0 --per 1h",
            "secret limit llm",
            "secret grant llm",
            "secret ls --yaml",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
        assert_eq!(
            p("set web ask on").unwrap(),
            Command::ChangePolicy { name: n("web"), change: PolicyChange::Ask(true) }
        );
    }

    #[test]
    fn parses_storage_commands() {
        let n = |s: &str| Name::new(s).unwrap();
        assert_eq!(p("dup web web-try").unwrap(), Command::Dup { src: n("web"), dst: n("web-try") });
        assert_eq!(p("diff web web-try --json").unwrap(), Command::Diff { a: n("web"), b: n("web-try"), json: true });
        assert_eq!(p("promote web-try").unwrap(), Command::Promote { child: n("web-try") });
        assert_eq!(p("checkpoint web").unwrap(), Command::Checkpoint { name: n("web"), label: None });
        assert_eq!(
            p("checkpoint web pre-pip").unwrap(),
            Command::Checkpoint { name: n("web"), label: Some(n("pre-pip")) }
        );
        // A box called rm is checkpointed as any other; three words remove.
        assert_eq!(p("checkpoint rm c1").unwrap(), Command::Checkpoint { name: n("rm"), label: Some(n("c1")) });
        assert_eq!(p("checkpoint rm web c1").unwrap(), Command::CheckpointRm { name: n("web"), label: n("c1") });
        assert_eq!(p("checkpoints web --json").unwrap(), Command::Checkpoints { name: n("web"), json: true });
        assert_eq!(p("restore web c1").unwrap(), Command::Restore { name: n("web"), label: n("c1") });
        for bad in ["restore web", "restore web c1 c2", "checkpoint", "checkpoint web A_B", "checkpoints web --all"] {
            assert!(p(bad).is_err(), "{bad}");
        }
        let Command::New { limits, .. } = p("new x --disk 1G").unwrap() else { panic!("not new") };
        assert_eq!(limits.disk, 1 << 30);
        for bad in [
            "dup web",
            "dup web Web",
            "dup a b c",
            "diff a",
            "diff a b --long",
            "promote",
            "promote a b",
            "new x --disk 1K",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
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
    fn control_commands_are_told_from_box_commands() {
        for line in ["ls", "new web --cpus 1", "rm", "help", "", "  "] {
            assert!(is_control_command(line), "{line:?}");
        }
        for line in ["make test", "git-upload-pack '/root/repo.git'", "echo 'unterminated", "lsof"] {
            assert!(!is_control_command(line), "{line:?}");
        }
        let mut all: Vec<&str> = VERBS.to_vec();
        all.retain(|v| !v.starts_with('-'));
        for verb in all {
            let e = p(verb).err().map(|e| e.0).unwrap_or_default();
            assert!(!e.contains("unknown command"), "{verb} is in VERBS but parse does not know it");
        }
    }
}
