//! `secret add|ls|grant|revoke|limit|kill|rm`: values a box may use but
//! never holds. The value of `secret add` comes on stdin, never on the line.

use std::fmt::Write as _;

use moat_api::{ApiError, Op, Reply};
use moat_core::limits::format_measured;
use moat_core::policy::HostName;
use moat_core::secrets::{Limit, LimitKind, SecretSpec};
use moat_core::Name;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, parse_duration, rest, usage, UsageError};
use crate::control::render::to_json;

pub const VERB: Verb = Verb {
    names: &["secret"],
    help: "  \
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
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = |what: &str, v: &String| name_arg(&format!("secret {what}"), Some(v));
    let Some(verb) = args.first() else {
        return Err(usage("secret: add, ls, rm, grant, revoke, limit or kill (see 'help')"));
    };
    let call = |op| Ok(Plan::Call(Call::new(op, super::nothing)));
    match (verb.as_str(), rest(args, 1)) {
        ("ls", []) => Ok(Plan::Call(Call::new(Op::SecretList, render))),
        ("ls", [json]) if json == "--json" => Ok(Plan::Call(Call::new(Op::SecretList, render).json(true))),
        ("rm", [n]) => call(Op::SecretRemove { name: name("rm", n)? }),
        ("kill", [n]) => call(Op::SecretKill { name: name("kill", n)? }),
        ("grant", [n, b]) => call(Op::SecretGrant { name: name(verb, n)?, box_name: name(verb, b)? }),
        ("revoke", [n, b]) => call(Op::SecretRevoke { name: name(verb, n)?, box_name: name(verb, b)? }),
        ("add", [n, flags @ ..]) => {
            let spec = parse_add(name("add", n)?, flags)?;
            Ok(Plan::ReadSecret(Box::new(move |value| Call::new(Op::SecretAdd { spec, value }, super::nothing))))
        }
        ("limit", [n, flags @ ..]) => parse_limit(name("limit", n)?, flags),
        _ => Err(usage(format!("secret {verb}: bad arguments (see 'help')"))),
    }
}

fn parse_add(name: Name, flags: &[String]) -> Result<SecretSpec, UsageError> {
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
    Ok(spec)
}

fn parse_limit(name: Name, flags: &[String]) -> Result<Plan, UsageError> {
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
    Ok(Plan::Call(Call::new(Op::SecretLimit { name, box_name, limits }, super::nothing)))
}

/// `secret ls`: what each secret is for, where it is granted, its limits
/// and use; never a value.
fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Secrets(secrets) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&secrets));
    }
    if secrets.is_empty() {
        return Ok("no secrets (secret add NAME --host H --header X < value)\n".into());
    }
    let mut out = String::new();
    for s in &secrets {
        let spec = &s.spec;
        let state = if s.killed { "  KILLED" } else { "" };
        let _ = writeln!(out, "{}: {} {}: {} in ${}{state}", spec.name, spec.host, spec.header, spec.format, spec.env);
        let boxes: Vec<&str> = s.boxes.iter().map(|b| b.as_str()).collect();
        let _ = writeln!(out, "  granted to: {}", if boxes.is_empty() { "-".into() } else { boxes.join(", ") });
        for l in &s.limits {
            let whose = l.box_name.as_ref().map_or("all boxes".to_string(), |b| format!("box {b}"));
            let _ = writeln!(out, "  limit: {} ({whose})", l.limit);
        }
        for (name, used) in &s.used {
            let _ = writeln!(
                out,
                "  used by {name}: {} requests, {} tokens, {}",
                used.requests,
                used.tokens,
                format_measured(used.bytes)
            );
        }
    }
    Ok(out)
}
