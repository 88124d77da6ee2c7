//! `race`: N copies of a box run one command at once, each line prefixed by
//! its copy; the table says how each did; what is kept is what was asked;
//! a dropped connection ends the runs and removes the copies.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::fixture::unique;
use crate::Env;

fn names(env: &Env) -> Vec<String> {
    let out = env.alice(None, &["ls", "--json"]).ok().stdout;
    let list: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    list.iter().filter_map(|b| b["name"].as_str().map(String::from)).collect()
}

/// Waits until `pred` holds of the box names (copies go a moment after the race).
fn until(env: &Env, what: &str, pred: impl Fn(&[String]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = names(env);
        if pred(&now) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {now:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

pub fn race_runs_copies_at_once_and_keeps_what_was_asked(env: &Env) {
    let name = unique("race");
    env.new_box(&name, &["--image", "busybox"]);
    let copy = |i: usize| format!("{name}-r{i}");

    // Every copy stays; lines are prefixed; all start before any ends.
    let script =
        "echo start $(hostname); sleep 2; touch /root/x; echo end; case $(hostname) in *-r2) exit 0;; esac; exit 3";
    let out = env.alice(None, &["race", &name, "3", "--", script]).ok().stdout;
    for i in 1..=3 {
        assert!(out.contains(&format!("[{}] start {}\n", copy(i), copy(i))), "{out}");
    }
    let last_start = out.rfind("] start ").unwrap();
    let first_end = out.find("] end").unwrap();
    assert!(last_start < first_end, "the copies ran one after another:\n{out}");
    let row = |i: usize| -> Vec<String> {
        let line = out.lines().find(|l| l.starts_with(&format!("{} ", copy(i)))).unwrap_or_default();
        line.split_whitespace().map(String::from).collect()
    };
    assert_eq!(row(2).get(1).map(String::as_str), Some("0"), "{out}");
    assert_eq!(row(1).get(1).map(String::as_str), Some("3"), "{out}");
    // Files changed (the new file among them) and effects (none) are counted.
    assert!(row(3).get(3).and_then(|f| f.parse::<usize>().ok()).is_some_and(|f| f >= 1), "{out}");
    assert_eq!(row(3).get(4).map(String::as_str), Some("0"), "{out}");
    assert!(names(env).contains(&copy(3)));
    for i in 1..=3 {
        env.alice(None, &["rm", &copy(i)]).ok();
    }
    let json = env.alice(None, &["race", &name, "1", "--json", "--", "echo", "x"]);
    let json = json.ok().stdout;
    let last: serde_json::Value = serde_json::from_str(json.lines().last().unwrap()).unwrap();
    assert!(json.contains(r#""line":"x""#) && last["exit"] == 0, "{json}");
    env.alice(None, &["rm", &copy(1)]).ok();
    // The command reaches each copy's shell as written: its quotes too.
    let json = env.alice(None, &["race", &name, "1", "--json", "--", "printf '%s|' \"a   b\" c"]).ok().stdout;
    assert!(json.contains(r#""line":"a   b|c|""#), "{json}");
    env.alice(None, &["rm", &copy(1)]).ok();

    // --keep-best: the first to exit 0 takes the name; the others go.
    let script = "case $(hostname) in *-r3) touch /root/won; exit 0;; esac; exit 1";
    let out = env.alice(None, &["race", &name, "3", "--keep-best", "--", script]).ok().stdout;
    assert!(out.contains(&format!("{} won and was promoted", copy(3))), "{out}");
    // Gone by the time the race answers, not a moment after.
    let now = names(env);
    assert!(!now.contains(&copy(1)) && !now.contains(&copy(2)) && !now.contains(&copy(3)), "{now:?}");
    assert_eq!(env.alice(Some(&name), &["test -f /root/won"]).status, Some(0), "the winner is not NAME now");
    env.alice(None, &["rm", &format!("{name}-prev")]).ok();

    // No copy won: the race fails (a script can tell), and its copies'
    // names are free as it answers.
    let lost = env.alice(None, &["race", &name, "2", "--keep-best", "--", "exit 3"]);
    assert_ne!(lost.status, Some(0), "{}", lost.stdout);
    assert!(lost.stderr.contains("no copy won"), "{}", lost.stderr);
    env.alice(None, &["dup", &name, &copy(1)]).ok();
    env.alice(None, &["rm", &copy(1)]).ok();

    // A name taken: refused whole, nothing made.
    env.alice(None, &["dup", &name, &copy(2)]).ok();
    let refused = env.alice(None, &["race", &name, "2", "--", "true"]);
    assert_ne!(refused.status, Some(0));
    assert!(refused.stderr.contains("is there already"), "{}", refused.stderr);
    assert!(!names(env).contains(&copy(1)));
    env.alice(None, &["rm", &copy(2)]).ok();

    // The client gone mid-race: every run ends and the copies go.
    let mut child = env
        .daemon
        .ssh(&env.alice, None, &["race", &name, "2", "--", "sleep", "120"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    until(env, "copies made", |now| now.contains(&copy(1)) && now.contains(&copy(2)));
    std::thread::sleep(Duration::from_millis(500));
    // (`timeout` runs ssh: TERM reaches ssh through it, as Ctrl-C would.)
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    child.wait().unwrap();
    until(env, "copies removed after the client went", |now| !now.contains(&copy(1)) && !now.contains(&copy(2)));
    env.alice(None, &["rm", &name]).ok();
}
