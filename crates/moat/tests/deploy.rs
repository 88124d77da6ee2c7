//! The packaging in `deploy/` is checked by parsing (no Kubernetes API server
//! runs here): every manifest is well-formed YAML of a known kind, and every
//! `moat` command line in it and in the systemd units names a subcommand and
//! flags this binary has.

use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// `moat SUB --help`.
fn help(sub: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_moat")).args([sub, "--help"]).output().expect("run moat");
    assert!(out.status.success(), "moat {sub} --help: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts that `moat SUB ARGS...` names flags `moat SUB` has.
fn check_command_line(words: &[String], whence: &str) {
    let sub = words.first().unwrap_or_else(|| panic!("{whence}: `moat` with no subcommand"));
    let help = help(sub);
    for word in &words[1..] {
        let Some(flag) = word.strip_prefix("--") else { continue };
        let flag = flag.split('=').next().unwrap_or_default();
        assert!(has_flag(&help, flag), "{whence}: `moat {sub}` has no --{flag}");
    }
}

/// Whether `help` lists `--flag` itself (not only a longer flag it begins).
fn has_flag(help: &str, flag: &str) -> bool {
    let needle = format!("--{flag}");
    help.match_indices(&needle).any(|(at, _)| {
        let next = help[at + needle.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn flags_are_matched_whole() {
    let help = "  --node-max-boxes <N>\n  --state-dir <DIR>\n";
    assert!(!has_flag(help, "node") && has_flag(help, "node-max-boxes") && has_flag(help, "state-dir"));
}

#[test]
fn kubernetes_manifests_parse_and_run_real_flags() {
    let dir = deploy_dir().join("kubernetes");
    let mut commands = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let doc = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for field in ["apiVersion", "kind", "metadata"] {
                assert!(doc.get(field).is_some(), "{}: no {field}", path.display());
            }
            let pod = &doc["spec"]["template"]["spec"];
            for list in ["containers", "initContainers"] {
                for container in pod[list].as_sequence().into_iter().flatten() {
                    let command: Vec<String> = strings(&container["command"]);
                    if command.first().map(String::as_str) != Some("moat") {
                        continue;
                    }
                    let mut words = command[1..].to_vec();
                    words.extend(strings(&container["args"]));
                    check_command_line(&words, &path.display().to_string());
                    commands += 1;
                }
            }
        }
    }
    assert!(commands >= 2, "a node and a front door: found {commands} moat commands");
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_owned)).collect()
}

#[test]
fn systemd_units_run_real_flags() {
    let dir = deploy_dir().join("systemd");
    let mut units = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let exec = text.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("an ExecStart");
        let mut words = exec.split_whitespace().map(str::to_owned);
        assert_eq!(words.next().as_deref(), Some("/usr/local/bin/moat"), "{}", path.display());
        check_command_line(&words.collect::<Vec<_>>(), &path.display().to_string());
        units += 1;
    }
    assert_eq!(units, 2, "a unit for each role");
}

use serde::Deserialize as _;
