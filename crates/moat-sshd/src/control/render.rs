//! What the user reads: tables for people, `--json` for scripts.

use std::fmt::Write as _;

use moat_api::BoxInfo;
use moat_core::limits::{format_measured, format_size};
use moat_core::{Change, ChangeKind, UsageReport};
use serde::Serialize;

/// `ls`.
pub fn boxes(boxes: &[BoxInfo], json: bool) -> String {
    if json {
        return to_json(&boxes);
    }
    let mut out = format!(
        "{:<24} {:<9} {:<10} {:>4} {:>8} {:>6}  {}\n",
        "NAME", "STATE", "IMAGE", "CPUS", "MEMORY", "PIDS", "PARENT"
    );
    for b in boxes {
        let _ = writeln!(
            out,
            "{:<24} {:<9} {:<10} {:>4} {:>8} {:>6}  {}",
            b.name,
            b.state,
            b.image,
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
        "name:     {}\nid:       {}\nstate:    {} (since {})\nidle:     {}\nimage:    {}\ncpus:     {}\nmemory:   {}\npids:     {}\ndisk:     {}\ncreated:  {}\nparent:   {}\n",
        b.name,
        b.id,
        b.state,
        b.state_since,
        idle_rule(b),
        b.image,
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
    let mut out =
        format!("{:<24} {:>10} {:>12} {:>10} {:>10} {:>8}\n", "NAME", "CPU-S", "MEM-GIB-S", "RUN-S", "SUSP-S", "DISK");
    let line = |out: &mut String, u: &moat_core::ledger::Usage, disk: String| {
        let _ = writeln!(
            out,
            "{:<24} {:>10.2} {:>12.2} {:>10.0} {:>10.0} {:>8}",
            u.name, u.cpu_seconds, u.memory_gib_seconds, u.running_seconds, u.suspended_seconds, disk
        );
    };
    for b in &report.boxes {
        line(&mut out, &b.usage, b.disk_bytes.map_or("-".into(), format_measured));
    }
    line(&mut out, &report.total, report.disk_bytes.map_or(String::new(), format_measured));
    out
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
}
