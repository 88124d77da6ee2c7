//! The control plane through `ssh HOST COMMAND`.

use crate::fixture::{run, unique};
use crate::Env;

/// `new` without `--image` builds `debian` on first use, showing progress.
pub fn first_new_builds_default_image(env: &Env) {
    let out = env.alice(None, &["new", "first"]).ok();
    assert_eq!(out.stdout, "first\n");
    assert!(out.stderr.contains("image debian: "), "no progress shown: {}", out.stderr);
    assert!(out.stderr.contains("image debian: ready"), "{}", out.stderr);
    let release = env.alice(Some("first"), &["cat /etc/debian_version"]).ok();
    assert!(release.stdout.starts_with("12."), "{}", release.stdout);
}

fn ls_json(env: &Env) -> Vec<serde_json::Value> {
    let out = env.alice(None, &["ls", "--json"]).ok();
    serde_json::from_str::<Vec<serde_json::Value>>(&out.stdout).expect("ls --json is a JSON array")
}

fn names(boxes: &[serde_json::Value]) -> Vec<String> {
    boxes.iter().map(|b| b["name"].as_str().unwrap_or_default().to_string()).collect()
}

pub fn new_ls_info_rm(env: &Env) {
    let name = unique("ctl");
    env.new_box(&name, &["--image", "busybox", "--cpus", "1", "--memory", "256M", "--pids", "100"]);

    let table = env.alice(None, &["ls"]).ok().stdout;
    let row = table.lines().find(|l| l.starts_with(&format!("{name} "))).expect("box in ls");
    assert!(row.contains("running") && row.contains("busybox") && row.contains("256M"), "{row}");

    let listed = ls_json(env);
    let me = listed.iter().find(|b| b["name"] == name.as_str()).expect("box in ls --json");
    assert_eq!(me["state"], "running");
    assert_eq!(me["limits"]["cpus"], 1);
    assert_eq!(me["limits"]["memory"], 256u64 << 20);
    assert_eq!(me["limits"]["pids"], 100);

    let info: serde_json::Value =
        serde_json::from_str(&env.alice(None, &["info", &name, "--json"]).ok().stdout).expect("info --json");
    assert_eq!(info["name"], name.as_str());
    assert_eq!(info["image"], "busybox");
    let plain = env.alice(None, &["info", &name]).ok().stdout;
    assert!(plain.contains(&format!("name:     {name}")), "{plain}");
    // Times for people are ISO 8601 UTC; JSON keeps the number and adds RFC 3339.
    let created = plain.lines().find_map(|l| l.strip_prefix("created:  ")).expect("a created line");
    assert!(is_iso_utc(created), "{plain}");
    assert!(plain.contains("state:    running (since 20"), "{plain}");
    let stamp = info["created_at_utc"].as_str().expect("created_at_utc");
    assert_eq!(stamp.get(..19), created.get(..19), "{info}");
    assert!(info["created_at"].is_u64(), "{info}");

    env.alice(None, &["rm", &name]).ok();
    assert!(!names(&ls_json(env)).contains(&name));
    let gone = env.alice(None, &["info", &name]);
    assert_eq!(gone.status, Some(1));
    assert_eq!(gone.stderr, format!("moat: no box named {name}\n"));
}

pub fn bad_input_is_one_line_and_leaves_nothing(env: &Env) {
    let taken = unique("taken");
    env.new_box(&taken, &["--image", "busybox"]);
    let info = |name: &str| env.alice(None, &["info", name, "--json"]).ok().stdout;
    let before = info(&taken);
    let fresh = unique("fresh");
    let cases: Vec<Vec<String>> = vec![
        vec!["frobnicate".into()],
        vec!["new".into()],
        vec!["new".into(), "Bad_Name".into()],
        vec!["new".into(), "-x".into()],
        vec!["new".into(), format!("{fresh}"), "--bogus".into(), "1".into()],
        vec!["new".into(), format!("{fresh}"), "--cpus".into()],
        vec!["new".into(), format!("{fresh}"), "--cpus".into(), "many".into()],
        vec!["new".into(), format!("{fresh}"), "--memory".into(), "lots".into()],
        vec!["new".into(), format!("{fresh}"), "--memory".into(), "1K".into()],
        vec!["new".into(), format!("{fresh}"), "--image".into(), "no-such-image".into()],
        vec!["new".into(), taken.clone(), "--image".into(), "busybox".into()],
        vec!["rm".into(), "no-such-box".into()],
        vec!["info".into(), "no-such-box".into()],
        vec!["ls".into(), "--long".into()],
        vec!["new".into(), "'unterminated".into()],
    ];
    for case in cases {
        let args: Vec<&str> = case.iter().map(String::as_str).collect();
        // Through moat@, the control plane itself (a plain user name that is
        // no box takes an unknown verb for a mistyped box: clients.rs).
        let out = env.alice(Some("moat"), &args);
        assert!(matches!(out.status, Some(1) | Some(2)), "{case:?}: status {:?}", out.status);
        assert_eq!(out.stdout, "", "{case:?}");
        assert_eq!(out.stderr.lines().count(), 1, "{case:?}: {}", out.stderr);
        assert!(out.stderr.starts_with("moat: "), "{case:?}: {}", out.stderr);
    }
    let after = names(&ls_json(env));
    assert!(!after.contains(&fresh), "a failed new left {fresh} behind");
    assert_eq!(after.iter().filter(|n| **n == taken).count(), 1);
    // (Other tests add and remove boxes meanwhile: compare only our own.)
    assert_eq!(info(&taken), before, "a failed command changed {taken}");
    let dup = env.alice(None, &["new", &taken, "--image", "busybox"]);
    assert_eq!(dup.stderr, format!("moat: a box named {taken} already exists\n"));
}

pub fn help_and_control_shell(env: &Env) {
    let help = env.alice(None, &["help"]).ok();
    assert!(help.stdout.contains("usage: ssh HOST COMMAND"));
    // One command's lines: `COMMAND --help` (or -h, or `help COMMAND`), status 0.
    for words in [&["new", "--help"][..], &["diff", "a", "-h"], &["help", "diff"]] {
        let one = env.alice(None, words).ok().stdout;
        let verb = words.iter().find(|w| **w != "help").unwrap();
        assert!(one.contains(&format!("\n  {verb} ")) && !one.contains("\n  promote "), "{words:?}: {one}");
    }
    // A shell request on the control plane (no command) prints the help too.
    let mut cmd = env.daemon.ssh_with(&env.alice, Some("moat"), &["-T"], &[]);
    let shell = crate::fixture::run(&mut cmd).ok();
    assert!(shell.stdout.contains("commands:"), "{}", shell.stdout);
}

/// `whoami`: the account, its key's fingerprint as `ssh-keygen -l` shows it,
/// and the operator's caps (the suite's daemon runs with `--max-boxes 1000`).
pub fn whoami_shows_the_key_and_its_limits(env: &Env) {
    for key in [&env.alice, &env.bob] {
        let listed = std::process::Command::new("ssh-keygen")
            .arg("-lf")
            .arg(key.path.with_extension("pub"))
            .output()
            .expect("run ssh-keygen -lf");
        let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
        let fingerprint = listed.split_whitespace().nth(1).expect("ssh-keygen -l prints a fingerprint");
        assert!(fingerprint.starts_with("SHA256:"), "{listed}");

        let text = run(&mut env.daemon.ssh(key, None, &["whoami"])).ok().stdout;
        assert!(text.starts_with(&format!("account:      {fingerprint}\n")), "{text}");
        assert!(text.contains(&format!("\nfingerprint:  {fingerprint} ")), "{text}");
        assert!(text.contains(" of at most 1000\n"), "{text}");
        assert!(text.contains(", 256G disk, 32 checkpoints\n"), "{text}");
        assert!(
            text.contains("\nall boxes:    at most ") && text.contains(" memory and 256G disk together\n"),
            "{text}"
        );
        assert!(text.contains("\nimages:       at most 32 (pulled and saved)\n"), "{text}");

        let json = run(&mut env.daemon.ssh(key, Some("moat"), &["whoami", "--json"])).ok().stdout;
        let me: serde_json::Value = serde_json::from_str(&json).expect("whoami --json is JSON");
        assert_eq!(me["account"], fingerprint);
        assert_eq!(me["fingerprint"], fingerprint);
        assert!(me["boxes"].is_u64(), "{json}");
        assert_eq!(me["limits"]["max_boxes"], 1000);
        assert_eq!(me["limits"]["per_box"]["disk"], 256u64 << 30);
        assert_eq!(me["limits"]["max_disk"], 256u64 << 30);
        assert_eq!(me["limits"]["max_checkpoints"], 32);
        assert!(me["limits"]["per_box"]["cpus"].as_u64().is_some_and(|n| n >= 1), "{json}");
    }
    let bad = env.alice(Some("moat"), &["whoami", "--yaml"]);
    assert_eq!(bad.status, Some(2));
    assert_eq!(bad.stderr, "moat: whoami: unexpected argument \"--yaml\"\n");
    let help = env.alice(None, &["help"]).ok().stdout;
    assert!(help.contains("\n  whoami [--json]  "), "{help}");
}

/// A user name close to one of the account's boxes is a mistyped box, for
/// control words too (`ssh b11@HOST ls` must not list boxes as if they were
/// files); a mistyped command names the command it is closest to.
pub fn mistyped_boxes_and_commands_are_told_as_such(env: &Env) {
    let name = unique("typo");
    env.new_box(&name, &["--image", "busybox"]);
    // Names no box can have count as the box they come closest to spelling.
    for typed in [
        format!("{name}1"),
        name.replacen("typo", "tpyo", 1),
        name.replacen("typo", "typ", 1),
        name.to_uppercase(),
        format!("{name}."),
    ] {
        for command in [&["ls"][..], &["make", "test"]] {
            let out = env.alice(Some(&typed), command);
            assert_eq!(out.status, Some(255), "{typed} {command:?}: {}", out.stderr);
            assert_eq!(out.stdout, "", "{typed} {command:?}");
            assert_eq!(out.stderr, format!("moat: no box named \"{typed}\" (did you mean \"{name}\"?)\n"));
        }
    }
    // `ssh WEB@HOST rm x` meant a file in box web: box x stays.
    let victim = unique("victim");
    env.new_box(&victim, &["--image", "busybox"]);
    let out = env.alice(Some(&name.to_uppercase()), &["rm", &victim]);
    assert_eq!(out.status, Some(255), "{}", out.stderr);
    assert!(env.alice(None, &["ls"]).ok().stdout.contains(&victim), "a mistyped box's rm removed a box");
    env.alice(None, &["rm", &victim]).ok();
    // A name near no box still reaches the control plane, and a box whose
    // name is a letter or two of the user's (`ssh HOST ls` as root) is no
    // typo of it.
    assert!(env.alice(Some("nosuchbox"), &["ls"]).ok().stdout.contains(&name));
    env.new_box("ro", &["--image", "busybox"]);
    assert!(env.alice(Some("root"), &["ls"]).ok().stdout.contains(&name));
    env.alice(None, &["rm", "ro"]).ok();
    // A mistyped command: not a box, and not a command either.
    let out = env.alice(Some("nosuchbox"), &["lst", "--json"]);
    assert_eq!(out.status, Some(255), "{}", out.stderr);
    assert_eq!(
        out.stderr,
        "moat: no box named \"nosuchbox\", and \"lst\" is not a moat command (did you mean \"ls\"?)\n"
    );
    let out = env.alice(Some("moat"), &["chekpoint", &name]);
    assert_eq!(out.status, Some(2), "{}", out.stderr);
    assert_eq!(out.stderr, "moat: unknown command \"chekpoint\" (did you mean \"checkpoint\"? see 'help')\n");
    // A name `promote` took away is told with the name it has now.
    let child = format!("{name}-try");
    env.alice(None, &["dup", &name, &child]).ok();
    env.alice(None, &["promote", &child]).ok();
    let out = env.alice(Some(&child), &["ls"]);
    assert_eq!(out.status, Some(255), "{}", out.stderr);
    assert_eq!(out.stderr, format!("moat: no box named \"{child}\" (did you mean \"{name}\"?)\n"));
    env.alice(None, &["rm", &name]).ok();
    env.alice(None, &["rm", &format!("{name}-prev")]).ok();
}

/// Whether `s` is `YYYY-MM-DDTHH:MM:SSZ`.
fn is_iso_utc(s: &str) -> bool {
    let shape = "dddd-dd-ddTdd:dd:ddZ";
    s.len() == shape.len()
        && s.bytes().zip(shape.bytes()).all(|(c, want)| if want == b'd' { c.is_ascii_digit() } else { c == want })
}
