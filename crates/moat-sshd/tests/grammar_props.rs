//! Property tests of the control-command grammar, which reads whatever a
//! client sends as `ssh HOST COMMAND`: any line splits and parses or fails
//! with one line of usage, never a panic; names that get through are valid.

#![allow(missing_docs)]

use moat_core::Name;
use moat_sshd::control::{is_control_command, parse, Command};
use moat_sshd::words::split;
use proptest::prelude::*;

fn check(line: &str) {
    let _ = is_control_command(line);
    let Ok(words) = split(line) else { return };
    match parse(&words) {
        Ok(cmd) => {
            if let Some(name) = cmd.creates() {
                assert!(Name::new(name.as_str()).is_ok());
            }
            if let Command::New { limits, .. } = cmd {
                assert!(limits.validate().is_ok());
            }
        }
        Err(e) => assert!(!e.0.contains('\n'), "{e}"),
    }
}

const VERBS: &[&str] = &["new", "ls", "info", "rm", "dup", "diff", "promote", "set", "usage", "stop", "help"];
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
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn random_lines(line in ".{0,120}") {
        check(&line);
    }

    #[test]
    fn plausible_lines(verb in 0usize..11, pieces in proptest::collection::vec(0usize..31, 0..8)) {
        let mut line = VERBS[verb].to_string();
        for p in pieces {
            line.push(' ');
            line.push_str(PIECES[p]);
        }
        check(&line);
    }
}
