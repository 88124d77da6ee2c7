//! What the user reads: tables for people, `--json` for scripts.

use std::fmt::Write as _;

use moat_api::BoxInfo;
use moat_core::egress::{Answer, LogEntry, LogKind, LogVerdict, Question};
use moat_core::limits::{format_measured, format_size};
use moat_core::policy::Policy;
use moat_core::secrets::SecretInfo;
use moat_core::{Change, ChangeKind, Checkpoint, UsageReport};
use serde::Serialize;

/// `ls`.
pub fn boxes(boxes: &[BoxInfo], json: bool) -> String {
    if json {
        return to_json(&boxes);
    }
    let mut out = format!(
        "{:<24} {:<9} {:<10} {:<7} {:>4} {:>8} {:>6}  {}\n",
        "NAME", "STATE", "IMAGE", "BACKEND", "CPUS", "MEMORY", "PIDS", "PARENT"
    );
    for b in boxes {
        let _ = writeln!(
            out,
            "{:<24} {:<9} {:<10} {:<7} {:>4} {:>8} {:>6}  {}",
            b.name,
            b.state,
            b.image,
            b.backend,
            b.limits.cpus,
            format_size(b.limits.memory),
            b.limits.pids,
            b.parent.as_ref().map_or("-", |p| p.as_str())
        );
    }
    out
}

/// `info`.
pub fn info(b: &BoxInfo, json: bool) -> String {
    if json {
        return to_json(b);
    }
    let parent = match (&b.parent, b.duplicated) {
        (Some(name), _) => format!("{name} (duplicated at {})", b.created_at),
        (None, true) => format!("a removed box (duplicated at {})", b.created_at),
        (None, false) => "-".to_string(),
    };
    format!(
        "name:     {}\nid:       {}\nstate:    {} (since {})\nidle:     {}\nimage:    {}\nbackend:  {}\ncpus:     {}\nmemory:   {}\npids:     {}\ndisk:     {}\ncreated:  {}\nparent:   {}\n",
        b.name,
        b.id,
        b.state,
        b.state_since,
        idle_rule(b),
        b.image,
        b.backend,
        b.limits.cpus,
        format_size(b.limits.memory),
        b.limits.pids,
        format_size(b.limits.disk),
        b.created_at,
        parent
    )
}

/// `diff`, batch by batch as the comparison finds them: lines for people, or
/// one JSON array for scripts.
pub struct ChangeStream {
    json: bool,
    started: bool,
}

impl ChangeStream {
    /// Before the first batch.
    pub fn new(json: bool) -> Self {
        Self { json, started: false }
    }

    /// The text of one batch.
    pub fn next(&mut self, changes: &[Change]) -> String {
        let mut out = String::new();
        for c in changes {
            if self.json {
                out.push_str(if self.started { ",\n  " } else { "[\n  " });
                out.push_str(&serde_json::to_string(c).unwrap_or_else(|_| "null".into()));
            } else {
                let mark = match c.change {
                    ChangeKind::Added => 'A',
                    ChangeKind::Modified => 'M',
                    ChangeKind::Deleted => 'D',
                };
                let _ = writeln!(out, "{mark} {}", c.path);
            }
            self.started = true;
        }
        out
    }

    /// What closes the output once every batch has come.
    pub fn end(&self) -> String {
        match (self.json, self.started) {
            (false, _) => String::new(),
            (true, false) => "[]\n".into(),
            (true, true) => "\n]\n".into(),
        }
    }
}

/// `usage`.
pub fn usage(report: &UsageReport, json: bool) -> String {
    if json {
        return to_json(report);
    }
    let mut out = format!(
        "{:<24} {:>10} {:>12} {:>10} {:>10} {:>8} {:>9} {:>9}\n",
        "NAME", "CPU-S", "MEM-GIB-S", "RUN-S", "SUSP-S", "DISK", "NET-OUT", "NET-IN"
    );
    let line = |out: &mut String, u: &moat_core::ledger::Usage, disk: String| {
        let _ = writeln!(
            out,
            "{:<24} {:>10.2} {:>12.2} {:>10.0} {:>10.0} {:>8} {:>9} {:>9}",
            u.name,
            u.cpu_seconds,
            u.memory_gib_seconds,
            u.running_seconds,
            u.suspended_seconds,
            disk,
            format_measured(u.egress_sent_bytes),
            format_measured(u.egress_received_bytes)
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
    out
}

/// `policy NAME`.
pub fn policy(policy: &Policy, json: bool) -> String {
    if json {
        return to_json(policy);
    }
    let mut out = String::new();
    if policy.allow.is_empty() {
        out.push_str("no allow rules: this box reaches nothing\n");
    }
    for rule in &policy.allow {
        let _ = writeln!(out, "allow {rule}");
    }
    for rule in &policy.deny {
        let _ = writeln!(out, "deny  {rule}");
    }
    if policy.ask {
        out.push_str("ask mode: names no rule allows or denies are put to you first (ssh HOST ask)\n");
    }
    out
}

/// `checkpoints`: label, when, and the bytes only that checkpoint holds.
pub fn checkpoints(saved: &[Checkpoint], json: bool) -> String {
    if json {
        return to_json(&saved);
    }
    if saved.is_empty() {
        return "no checkpoints (checkpoint NAME [LABEL] saves one)\n".into();
    }
    let mut out = format!("{:<24} {:<24} {:>10}\n", "LABEL", "CREATED", "HELD");
    for c in saved {
        let held = c.held_bytes.map_or("-".to_string(), format_measured);
        let _ = writeln!(out, "{:<24} {:<24} {:>10}", c.label, utc(c.created_ms), held);
    }
    out
}

/// `secret ls`: what each secret is for, where it is granted, its limits
/// and use; never a value.
pub fn secrets(secrets: &[SecretInfo], json: bool) -> String {
    if json {
        return to_json(&secrets);
    }
    if secrets.is_empty() {
        return "no secrets (secret add NAME --host H --header X < value)\n".into();
    }
    let mut out = String::new();
    for s in secrets {
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
    out
}

/// A question of ask mode, as it arrives (a JSON object with `--json`).
pub fn question(q: &Question, json: bool) -> String {
    if json {
        return to_json(&serde_json::json!({ "question": q }));
    }
    let port = q.port.map_or_else(|| " (a DNS lookup)".to_string(), |p| format!(":{p}"));
    let mut out = format!("{} ? {}  box {} wants {}{port}\n", utc(q.asked_ms), q.id, q.box_name, printable(&q.name));
    for command in &q.running {
        let _ = writeln!(out, "      running: {}", printable(command));
    }
    let _ = writeln!(out, "      answer: {0} once | {0} always | {0} deny", q.id);
    out
}

/// What answering a question did.
pub fn answered(q: &Question, answer: Answer) -> String {
    let what = match answer {
        Answer::Once => "may reach it for a minute",
        Answer::Always => "may reach it from now on (added to its policy)",
        Answer::Deny => "is refused it",
    };
    format!("{}: box {} {what}: {}\n", q.id, q.box_name, printable(&q.name))
}

/// Entries of `log`: one line each (a JSON object per line with `--json`).
pub fn log(entries: &[LogEntry], json: bool) -> String {
    let mut out = String::new();
    for e in entries {
        if json {
            out.push_str(&serde_json::to_string(e).unwrap_or_default());
            out.push('\n');
            continue;
        }
        let verdict = match e.verdict {
            LogVerdict::Allow => "allow",
            LogVerdict::Deny => "DENY ",
            LogVerdict::Error => "error",
        };
        let kind = match e.kind {
            LogKind::Dns => "dns ",
            LogKind::Tcp => "tcp ",
            LogKind::Http => "http",
            LogKind::Udp => "udp ",
            LogKind::Icmp => "icmp",
        };
        let _ = write!(out, "{} {verdict} {kind} {}", utc(e.at_ms), printable(&e.name));
        if e.port != 0 {
            let _ = write!(out, ":{}", e.port);
        }
        for part in [&e.method, &e.target].into_iter().flatten() {
            let _ = write!(out, " {}", printable(part));
        }
        if e.sent + e.received > 0 {
            let _ = write!(out, " sent {} received {}", format_measured(e.sent), format_measured(e.received));
        }
        if let Some(rule) = &e.rule {
            let _ = write!(out, " [rule: {}]", printable(rule));
        }
        if let Some(reason) = &e.reason {
            let _ = write!(out, " ({})", printable(reason));
        }
        out.push('\n');
    }
    out
}

/// What a box sent, safe for a terminal: control bytes escaped.
fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Milliseconds since the epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
fn utc(ms: u64) -> String {
    let (secs, ms) = (ms / 1000, ms % 1000);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// How the idle rule applies to a box, for `info`.
fn idle_rule(b: &BoxInfo) -> String {
    match (b.keep_running, b.idle) {
        (true, _) => "keep-running (billed while idle)".into(),
        (false, Some(s)) => format!("suspend after {s}s without a session"),
        (false, None) => "suspend after the default grace without a session".into(),
    }
}

fn to_json<T: Serialize + ?Sized>(value: &T) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| "null".into());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_short() {
        assert_eq!(format_measured(10_788_864), "10.3M");
        assert_eq!(format_measured(3 << 30), "3.0G");
        assert_eq!(format_measured(512), "512");
    }

    #[test]
    fn times_print_in_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(1_796_080_000_123), "2026-11-30T23:06:40.123Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
