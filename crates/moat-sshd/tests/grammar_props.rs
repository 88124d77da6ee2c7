//! Property tests of the control-command grammar, which reads whatever a
//! client sends as `ssh HOST COMMAND`: any line splits and parses or fails
//! with one line of usage, never a panic; what gets through is what the core
//! accepts (valid names and limits, rules as the parser makes them).

#![allow(missing_docs)]

use moat_api::Op;
use moat_core::policy::{PolicyChange, Rule};
use moat_core::Name;
use moat_sshd::control::{is_control_command, parse, Plan, VERBS};
use moat_sshd::words::split;
use proptest::prelude::*;

fn check(line: &str) {
    let _ = is_control_command(line);
    let Ok(words) = split(line) else { return };
    match parse(&words) {
        Ok(plan) => {
            if let Some(name) = plan.creates() {
                assert!(Name::new(name.as_str()).is_ok());
            }
            let Plan::Call(call) = plan else { return };
            match call.op {
                Op::Create { limits, .. } => assert!(limits.validate().is_ok()),
                Op::ChangePolicy {
                    change: PolicyChange::Allow(r) | PolicyChange::Deny(r) | PolicyChange::Remove(r),
                    ..
                } => {
                    // What the core decodes is what the parser made.
                    let json = serde_json::to_string(&r).unwrap();
                    assert_eq!(serde_json::from_str::<Rule>(&json).unwrap(), r);
                }
                _ => {}
            }
        }
        Err(e) => assert!(!e.0.contains('\n'), "{e}"),
    }
}

const PIECES: &[&str] = &[
    "web",
    "--json",
    "--cpus",
    "--memory",
    "--disk",
    "--pids",
    "--idle",
    "--image",
    "--since",
    "0",
    "1",
    "-1",
    "99999999999999999999",
    "1G",
    "512M",
    "1K",
    "idle",
    "keep-running",
    "on",
    "off",
    "'",
    "\"",
    "\\",
    "=",
    "x=",
    "--memory=",
    "Web",
    "a-",
    "7d",
    "",
    " ",
    "allow",
    "deny",
    "rm",
    "preset",
    "GET,HEAD",
    "x.org:443/a/*b",
    "*.x.org:*",
    "x.org/../a",
    "add",
    "--host",
    "limit",
    "--requests",
    "--per",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn random_lines(line in ".{0,120}") {
        check(&line);
    }

    /// Every verb of the table, with plausible pieces after it.
    #[test]
    fn plausible_lines(verb in 0usize..64, pieces in proptest::collection::vec(0usize..PIECES.len(), 0..8)) {
        let mut line = VERBS[verb % VERBS.len()].names[0].to_string();
        for p in pieces {
            line.push(' ');
            line.push_str(PIECES[p]);
        }
        check(&line);
    }
}
