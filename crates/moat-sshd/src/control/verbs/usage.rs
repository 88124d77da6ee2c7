//! `usage [NAME] [--since T] [--json]`: what the account's boxes used.

use std::fmt::Write as _;

use moat_api::{ApiError, Op, Reply};
use moat_core::limits::format_measured;
use moat_core::Name;

use super::{Call, Plan, Verb};
use crate::control::args::{parse_since, usage, UsageError};
use crate::control::render::to_json;

pub const VERB: Verb = Verb {
    names: &["usage"],
    help: "  \
  usage [NAME] [--since T] [--json]
                      CPU, memory, running and suspended time, disk, egress, bytes kept
                      in the object store (GiB-s), per box and in total; T is seconds
                      since the epoch, or an age like 90s, 30m, 2h, 7d
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
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
    Ok(Plan::Call(Call::new(Op::Usage { since: since.unwrap_or(0), name }, render).json(json)))
}

fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Usage(report) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&report));
    }
    let mut out = format!(
        "{:<24} {:>10} {:>12} {:>10} {:>10} {:>8} {:>9} {:>9} {:>13}\n",
        "NAME", "CPU-S", "MEM-GIB-S", "RUN-S", "SUSP-S", "DISK", "NET-OUT", "NET-IN", "STORED-GIB-S"
    );
    let line = |out: &mut String, u: &moat_core::store::ledger::Usage, disk: String| {
        let _ = writeln!(
            out,
            "{:<24} {:>10.2} {:>12.2} {:>10.0} {:>10.0} {:>8} {:>9} {:>9} {:>13.2}",
            u.name,
            u.cpu_seconds,
            u.memory_gib_seconds,
            u.running_seconds,
            u.suspended_seconds,
            disk,
            format_measured(u.egress_sent_bytes),
            format_measured(u.egress_received_bytes),
            u.stored_gib_seconds
        );
    };
    for b in &report.boxes {
        line(&mut out, &b.usage, b.disk_bytes.map_or("-".into(), format_measured));
    }
    line(&mut out, &report.total, report.disk_bytes.map_or(String::new(), format_measured));
    if !report.secrets.is_empty() {
        let _ = writeln!(out, "\n{:<24} {:<24} {:>10} {:>10} {:>9}", "SECRET", "BOX", "REQUESTS", "TOKENS", "BYTES");
        for s in &report.secrets {
            let _ = writeln!(
                out,
                "{:<24} {:<24} {:>10} {:>10} {:>9}",
                s.secret,
                s.box_name,
                s.used.requests,
                s.used.tokens,
                format_measured(s.used.bytes)
            );
        }
    }
    Ok(out)
}
