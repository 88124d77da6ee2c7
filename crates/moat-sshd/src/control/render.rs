//! What the user reads, shared by verbs: what streams before an answer
//! (a diff's changes, log entries, questions) and how times and JSON print.
//! Each verb's own answer reads as its file in `verbs/` says.

use std::fmt::Write as _;

use moat_core::effects::{Effect, EffectKind};
use moat_core::egress::{method_in_words, Answer, LogEntry, LogKind, LogVerdict, Question};
use moat_core::limits::format_measured;
use moat_core::{Change, ChangeKind};
use serde::Serialize;

use super::time::{add_times, utc_ms};

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
                let _ = writeln!(out, "{mark} {}", printable(&c.path));
            }
            self.started = true;
        }
        out
    }

    /// Whether any change has been shown.
    pub fn started(&self) -> bool {
        self.started
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

/// A question of ask mode, as it arrives (a JSON object with `--json`).
pub fn question(q: &Question, json: bool) -> String {
    if json {
        return to_json(&serde_json::json!({ "question": q }));
    }
    let port = q.port.map_or_else(|| " (a DNS lookup)".to_string(), |p| format!(":{p}"));
    let mut out = format!("{} ? {}  box {} wants {}{port}\n", utc_ms(q.asked_ms), q.id, q.box_name, printable(&q.name));
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
            out.push_str(&json_value(e).map(|v| v.to_string()).unwrap_or_default());
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
            LogKind::Web => "web ",
        };
        let _ = write!(out, "{} {verdict} {kind} {}", utc_ms(e.at_ms), printable(&e.name));
        if e.port != 0 {
            let _ = write!(out, ":{}", e.port);
        }
        let method = method_in_words(e.method.as_deref(), e.method_override.as_deref());
        for part in [&method, &e.target].into_iter().flatten() {
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

/// Effects of `effects`: one line each (a JSON object per line with `--json`).
pub fn effects(effects: &[Effect], json: bool) -> String {
    let mut out = String::new();
    for e in effects {
        if json {
            out.push_str(&json_value(e).map(|v| v.to_string()).unwrap_or_default());
            out.push('\n');
            continue;
        }
        let kind = match e.kind {
            EffectKind::Request => "request",
            EffectKind::Push => "push   ",
            EffectKind::Opaque => "opaque ",
        };
        let _ = write!(out, "{} {kind} {}:{}", utc_ms(e.at_ms), printable(&e.host), e.port);
        let method = method_in_words(e.method.as_deref(), e.method_override.as_deref());
        for part in [&method, &e.path].into_iter().flatten() {
            let _ = write!(out, " {}", printable(part));
        }
        match e.status {
            Some(status) => {
                let _ = write!(out, " {status}");
            }
            None if e.kind != EffectKind::Opaque => out.push_str(" -"),
            None => {}
        }
        let _ = writeln!(out, " sent {} received {}", format_measured(e.sent), format_measured(e.received));
    }
    out
}

/// Effects in a sentence a line, under `heading` (nothing if there are none).
pub fn effects_summary(heading: &str, effects: &[Effect]) -> String {
    if effects.is_empty() {
        return String::new();
    }
    let mut out = format!("{heading}\n");
    for line in moat_core::effects::summary(effects, 5) {
        let _ = writeln!(out, "  {}", printable(&line));
    }
    out
}

/// What a box sent, safe for a terminal: control and invisible characters
/// escaped.
pub fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() || invisible(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A message of moat's (an error, a progress line) for a terminal: its lines
/// kept, and every other control and invisible character escaped, since
/// such a message can quote what a box or a registry named (a path in a
/// failed `diff`, a layer in a pull), and an escape sequence in it would
/// reach the user's terminal.
pub fn terminal_safe(s: &str) -> String {
    s.split('\n').map(printable).collect::<Vec<_>>().join("\n")
}

/// Characters that change how text around them shows without showing
/// themselves: the bidirectional controls (a name that reads backwards),
/// zero-width ones, and the byte-order mark.
fn invisible(c: char) -> bool {
    matches!(c, '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2069}' | '\u{FEFF}')
}

/// Pretty JSON and a newline: what `--json` prints (times also as strings).
pub fn to_json<T: Serialize + ?Sized>(value: &T) -> String {
    let mut s =
        json_value(value).map_or_else(|| "null".into(), |v| serde_json::to_string_pretty(&v).unwrap_or_default());
    s.push('\n');
    s
}

/// `value` as JSON, each time in it also as an RFC 3339 string.
fn json_value<T: Serialize + ?Sized>(value: &T) -> Option<serde_json::Value> {
    let mut value = serde_json::to_value(value).ok()?;
    add_times(&mut value);
    Some(value)
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

    /// A failed `diff` names the path it stopped at, which the box chose.
    #[test]
    fn a_message_keeps_its_lines_and_nothing_else_of_control() {
        let msg = "compare a and b: /\u{1b}]0;PWNED\u{7}\u{1b}[2JRED\rFAKE: too deep\nsee 'help'";
        let shown = terminal_safe(msg);
        assert_eq!(shown.lines().count(), 2, "{shown}");
        assert!(!shown.chars().any(|c| c.is_control() && c != '\n'), "{shown:?}");
        assert!(shown.contains("\\u{1b}]0;PWNED\\u{7}") && shown.ends_with("\nsee 'help'"), "{shown}");
    }

    #[test]
    fn a_box_cannot_write_to_its_owners_terminal() {
        let path = "/root/evil\nD fakepath\u{1b}[31mRED\u{1b}]0;pwned\u{7}RED\u{202E}gnp.exe";
        let change = Change { path: path.into(), change: ChangeKind::Added };
        let shown = ChangeStream::new(false).next(&[change]);
        assert_eq!(shown.lines().count(), 1, "{shown}");
        assert!(!shown.chars().any(|c| c.is_control() && c != '\n' || invisible(c)), "{shown:?}");
        assert!(shown.starts_with("A /root/evil\\nD fakepath\\u{1b}[31m"), "{shown}");
    }
}
