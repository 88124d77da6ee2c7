//! The grammar, verb by verb: what each line asks of the core, and that bad
//! lines are one line of usage.

#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use moat_api::{Op, Reply};
use moat_core::effects::{Effect, EffectKind, Since};

use super::race::Keep;
use moat_core::egress::Answer;
use moat_core::policy::{PolicyChange, Preset, PushRule, Rule};
use moat_core::secrets::SecretValue;
use moat_core::{BackendKind, Limits, Name};

use super::*;

fn plan(line: &str) -> Result<Plan, UsageError> {
    parse(&crate::words::split(line).unwrap())
}

/// The call a line makes (its operation and `--json`).
fn p(line: &str) -> Result<(Op, bool), UsageError> {
    match plan(line)? {
        Plan::Call(call) => Ok((call.op, call.json)),
        other => panic!("{line}: {other:?}"),
    }
}

fn op(line: &str) -> Op {
    p(line).unwrap().0
}

fn n(s: &str) -> Name {
    Name::new(s).unwrap()
}

fn rule(s: &str) -> Rule {
    Rule::parse(&s.split(' ').collect::<Vec<_>>()).unwrap()
}

#[test]
fn parses_commands() {
    assert!(matches!(plan("").unwrap(), Plan::Print(text) if text.contains("commands:")));
    assert!(matches!(plan("help").unwrap(), Plan::Print(_)));
    assert_eq!(p("ls --json").unwrap(), (Op::List, true));
    assert_eq!(op("rm web"), Op::Remove { name: n("web") });
    let Op::Create { name, image, limits, .. } = op("new web --image busybox --cpus 1 --memory=512M --pids 64") else {
        panic!("not new")
    };
    assert_eq!((name.as_str(), image.as_str()), ("web", "busybox"));
    assert_eq!(limits, Limits { cpus: 1, memory: 512 << 20, pids: 64, ..Limits::default() });
    assert_eq!(
        op("new web"),
        Op::Create {
            name: n("web"),
            image: n("debian"),
            limits: Limits::default(),
            idle: None,
            policy: None,
            ask: false,
            backend: None,
            node: None,
            run: false,
        }
    );
    let Op::Create { run, ask, .. } = op("new web --image app --run") else { panic!("not new") };
    assert!(run && !ask, "--run asks for the image's service, nothing else");
    let Op::Create { backend, .. } = op("new web --backend vm") else { panic!("not new") };
    assert_eq!(backend, Some(BackendKind::Vm));
    assert!(p("new web --backend kvm").is_err());
    let Op::Create { node, .. } = op("new web --node N2.example") else { panic!("not new") };
    assert_eq!(node.as_deref(), Some("n2.example"));
    for bad in ["new web --node", "new web --node ../x", "new web --node -n", "new web --node a_b"] {
        assert!(p(bad).is_err(), "{bad}");
    }
    assert_eq!(p("whoami").unwrap(), (Op::Whoami, false));
    assert_eq!(p("whoami --json").unwrap(), (Op::Whoami, true));
    assert!(p("whoami alice").is_err());
}

#[test]
fn parses_egress_commands() {
    assert_eq!(p("policy web").unwrap(), (Op::Policy { name: n("web") }, false));
    assert_eq!(p("policy web --json").unwrap(), (Op::Policy { name: n("web") }, true));
    // The rule travels parsed, not as the words typed.
    assert_eq!(
        op("policy web allow GET,HEAD deb.debian.org/debian/"),
        Op::ChangePolicy { name: n("web"), change: PolicyChange::Allow(rule("GET,HEAD deb.debian.org/debian/")) }
    );
    assert_eq!(
        op("policy web rm *.Example.COM:443"),
        Op::ChangePolicy { name: n("web"), change: PolicyChange::Remove(rule("*.example.com:443")) }
    );
    let push = PushRule::parse(&["github.com/me/app", "refs/heads/agent/*", "--fast-forward"]).unwrap();
    assert_eq!(
        op("policy web allow push github.com/me/app.git refs/heads/agent/* --fast-forward"),
        Op::ChangePolicy { name: n("web"), change: PolicyChange::AllowPush(push.clone()) }
    );
    assert_eq!(
        op("policy web rm push github.com/me/app refs/heads/agent/* --fast-forward"),
        Op::ChangePolicy { name: n("web"), change: PolicyChange::RemovePush(push) }
    );
    assert_eq!(
        op("policy web preset registries"),
        Op::ChangePolicy { name: n("web"), change: PolicyChange::Preset(Preset::Registries) }
    );
    for bad in [
        "policy web allow",
        "policy web allow 1.2.3.4",
        "policy web preset nope",
        "policy web open x.org",
        "policy web allow x.org:0",
        "policy web allow push github.com/me/app",
        "policy web allow push github.com/me/app main",
        "policy web allow push github.com/me/app refs/heads/x --force",
        "log",
        "log web --tail",
        "new web --policy everything",
        "log web --ask",
        "log web --service --follow",
        "log web --service --json",
        "ask 3",
        "ask x once",
        "ask 3 maybe",
        "ask --json 3",
        "set web ask maybe",
    ] {
        assert!(plan(bad).is_err(), "{bad}");
    }
    let Plan::Call(call) = plan("log web -f --json").unwrap() else { panic!("not a call") };
    assert_eq!(call.op, Op::Log { name: n("web"), since_ms: 0, until_ms: None, follow: true, ask: false });
    assert!(call.json && !call.answers);
    let Plan::Call(call) = plan("log web -f --ask").unwrap() else { panic!("not a call") };
    assert_eq!(call.op, Op::Log { name: n("web"), since_ms: 0, until_ms: None, follow: true, ask: true });
    assert!(!call.json && call.answers);
    assert_eq!(op("log web --service"), Op::ServiceLog { name: n("web") });
    let Op::Create { policy, ask, .. } = op("new web --policy github-read --ask") else { panic!("not new") };
    assert_eq!((policy, ask), (Some(Preset::GithubRead), true));
    let Plan::Call(call) = plan("ask").unwrap() else { panic!("not a call") };
    assert_eq!((call.op, call.answers), (Op::Questions { follow: true }, true));
    assert_eq!(op("ask 12 always"), Op::Answer { id: 12, answer: Answer::Always });
    assert_eq!(op("set web ask on"), Op::ChangePolicy { name: n("web"), change: PolicyChange::Ask(true) });
}

#[test]
fn parses_secret_commands() {
    // The value is read from stdin, then completes the operation.
    let Plan::ReadSecret(then) = plan("secret add llm --host API.example --header x-api-key").unwrap() else {
        panic!("not secret add")
    };
    let value = SecretValue::new("sk-REAL-0123456789").unwrap();
    let Op::SecretAdd { spec, value: sent } = then(value.clone()).op else { panic!("not secret add") };
    assert_eq!((spec.host.as_str(), spec.env.as_str(), spec.format.as_str()), ("api.example", "LLM", "{}"));
    assert_eq!(sent, value);
    let limit = op("secret limit llm --box web --requests 10 --per 1m --tokens 500 --per 1d --bytes 1000");
    let Op::SecretLimit { box_name, limits, .. } = limit else { panic!("not a limit") };
    assert_eq!(box_name, Some(n("web")));
    let shown: Vec<String> = limits.iter().map(ToString::to_string).collect();
    assert_eq!(shown, ["10 requests per 60s", "500 tokens per 86400s", "1000 bytes"]);
    assert_eq!(op("secret revoke llm web"), Op::SecretRevoke { name: n("llm"), box_name: n("web") });
    assert_eq!(p("secret ls --json").unwrap(), (Op::SecretList, true));
    for bad in [
        "secret",
        "secret add llm --host api.example",
        "secret add llm --host api.example --header 'x y'",
        "secret add llm --host api.example --header x --format nothing",
        "secret add llm --host 10.0.0.1 --header x",
        "secret add llm --host api.example --header x --env PATH",
        "secret limit llm --requests 10",
        "secret limit llm --bytes 10 --per 1h",
        "secret limit llm --requests 0 --per 1h",
        "secret limit llm",
        "secret grant llm",
        "secret ls --yaml",
    ] {
        assert!(plan(bad).is_err(), "{bad}");
    }
}

#[test]
fn parses_storage_commands() {
    assert_eq!(op("dup web web-try"), Op::Dup { src: n("web"), dst: n("web-try") });
    assert_eq!(p("diff web web-try --json").unwrap(), (Op::Diff { a: n("web"), b: n("web-try") }, true));
    assert_eq!(op("promote web-try"), Op::Promote { child: n("web-try") });
    assert_eq!(op("checkpoint web"), Op::Checkpoint { name: n("web"), label: None });
    assert_eq!(op("checkpoint web pre-pip"), Op::Checkpoint { name: n("web"), label: Some(n("pre-pip")) });
    // A box called rm is checkpointed as any other; three words remove.
    assert_eq!(op("checkpoint rm c1"), Op::Checkpoint { name: n("rm"), label: Some(n("c1")) });
    assert_eq!(op("checkpoint rm web c1"), Op::CheckpointRemove { name: n("web"), label: n("c1") });
    assert_eq!(p("checkpoints web --json").unwrap(), (Op::Checkpoints { name: n("web") }, true));
    assert_eq!(op("restore web c1"), Op::Restore { name: n("web"), label: n("c1") });
    let race = |line: &str| match plan(line) {
        Ok(Plan::Race(spec)) => Ok(spec),
        Ok(other) => panic!("{line}: {other:?}"),
        Err(e) => Err(e.0),
    };
    let spec = race("race web 8 --keep-best -- make test && echo ok").unwrap();
    assert_eq!(
        (spec.copies, spec.command.as_str(), &spec.keep, spec.json),
        (8, "make test && echo ok", &Keep::Best, false)
    );
    assert_eq!(spec.copy_name(8).unwrap(), n("web-r8"));
    assert_eq!(race("race web 2 --pick 'test -f ok' --json -- true").unwrap().keep, Keep::Pick("test -f ok".into()));
    assert_eq!(race("race web 1 -- --json").unwrap().command, "--json");
    for bad in [
        "race web",
        "race web 0 -- true",
        "race web 33 -- true",
        "race web 2",
        "race web 2 --",
        "race web 2 true",
        "race web 2 --keep-best --pick x -- true",
        "race web 2 --pick",
        &format!("race {} 2 -- true", "a".repeat(62)),
    ] {
        assert!(race(bad).is_err(), "{bad}");
    }
    assert_eq!(op("effects web"), Op::Effects { name: n("web"), since: Since::Start });
    assert_eq!(p("effects web --json").unwrap(), (Op::Effects { name: n("web"), since: Since::Start }, true));
    assert_eq!(op("effects web --since c1"), Op::Effects { name: n("web"), since: Since::Checkpoint(n("c1")) });
    assert_eq!(
        op("effects web --since 1700000000"),
        Op::Effects { name: n("web"), since: Since::Time(1_700_000_000_000) }
    );
    assert!(matches!(op("effects web --since 2h"), Op::Effects { since: Since::Time(_), .. }));
    for bad in ["effects", "effects web --since", "effects web --since ../x", "effects web --tail"] {
        assert!(p(bad).is_err(), "{bad}");
    }
    for bad in ["restore web", "restore web c1 c2", "checkpoint", "checkpoint web A_B", "checkpoints web --all"] {
        assert!(plan(bad).is_err(), "{bad}");
    }
    let Op::Create { limits, .. } = op("new x --disk 1G") else { panic!("not new") };
    assert_eq!(limits.disk, 1 << 30);
    for bad in [
        "dup web",
        "dup web Web",
        "dup a b c",
        "diff a",
        "diff a b --long",
        "promote",
        "promote a b",
        "new x --disk 1K",
    ] {
        assert!(plan(bad).is_err(), "{bad}");
    }
}

#[test]
fn rejects_bad_input_with_one_line() {
    for bad in [
        "frobnicate",
        "new",
        "new Web",
        "new web --cpus",
        "new web --cpus x",
        "new web --bogus 1",
        "new web --memory 1Q",
        "new web --cpus 0",
        "rm",
        "rm a b",
        "ls -l",
        "info",
        "new ../etc",
        "whoami --yaml",
    ] {
        let e = plan(bad).unwrap_err();
        assert!(!e.0.contains('\n'), "{bad}: {e}");
    }
}

#[test]
fn the_table_is_the_grammar_and_the_help() {
    for line in ["ls", "new web --cpus 1", "rm", "help", "", "  ", "whoami"] {
        assert!(is_control_command(line), "{line:?}");
    }
    for line in ["make test", "git-upload-pack '/root/repo.git'", "echo 'unterminated", "lsof"] {
        assert!(!is_control_command(line), "{line:?}");
    }
    // A word that is no verb but close to one is told which.
    assert_eq!(plan("lst").unwrap_err().0, "unknown command \"lst\" (did you mean \"ls\"? see 'help')");
    assert_eq!(closest_verb("whoamii"), Some("whoami"));
    assert_eq!(closest_verb("make"), None);
    assert_eq!(plan("frobnicate").unwrap_err().0, "unknown command \"frobnicate\" (see 'help')");
    let text = help();
    let mut seen = Vec::new();
    for verb in VERBS {
        // Every verb's help lines name it, and every name reaches its parse.
        assert!(verb.help.starts_with(&format!("  {} ", verb.names[0])), "{}", verb.help);
        assert!(verb.help.ends_with('\n') && text.contains(verb.help), "{}", verb.names[0]);
        for name in verb.names {
            assert!(!seen.contains(name), "{name} names two verbs");
            seen.push(name);
            let e = plan(name).err().map(|e| e.0).unwrap_or_default();
            assert!(!e.contains("unknown command"), "{name} is in VERBS but parse does not know it");
            // `VERB --help`, `VERB ARGS -h` and `help VERB` print its lines.
            for line in [format!("{name} --help"), format!("{name} web -h"), format!("help {name}")] {
                match plan(&line) {
                    Ok(Plan::Print(shown)) => assert!(shown.contains(verb.help), "{line}: {shown}"),
                    other => panic!("{line}: {other:?}"),
                }
            }
        }
    }
    // After `--` a `--help` is the command's own.
    assert!(matches!(plan("race web 2 -- make --help"), Ok(Plan::Race(_))));
    assert_eq!(plan("help lst").unwrap_err().0, "help: no command \"lst\" (did you mean \"ls\"?)");
    assert!(plan("help ls now").is_err());
}

#[test]
fn answers_render_as_their_verb_says() {
    let Plan::Call(call) = plan("whoami").unwrap() else { panic!("not a call") };
    let me = moat_api::Whoami {
        account: moat_core::AccountId("SHA256:abc".into()),
        fingerprint: "SHA256:abc".into(),
        owner: "0123456789".into(),
        boxes: 2,
        limits: moat_api::AccountLimits::from(&moat_core::ManagerConfig::default()),
    };
    let text = (call.render)(Reply::Whoami(me.clone()), &call.op, false).unwrap();
    assert!(text.starts_with("account:      SHA256:abc\nfingerprint:  SHA256:abc "), "{text}");
    assert!(text.contains("boxes:        2 of at most 32\n"), "{text}");
    assert!(
        text.contains(
            "owner:        0123456789 (names your boxes to those you share them with: NAME.0123456789@HOST)\n"
        ),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&(call.render)(Reply::Whoami(me), &call.op, true).unwrap()).unwrap();
    assert_eq!(json["limits"]["max_boxes"], 32);
    // An answer the verb does not expect is handed back, not shown.
    assert!((call.render)(Reply::Done, &call.op, false).is_err());
    let Plan::Call(diff) = plan("diff a b --json").unwrap() else { panic!("not a call") };
    let none = || Reply::Diffed { a: Vec::new(), b: Vec::new(), a_packages: Vec::new(), b_packages: Vec::new() };
    assert_eq!((diff.render)(none(), &diff.op, true).unwrap(), "[]\n");
    assert_eq!((diff.render)(none(), &diff.op, false).unwrap(), "");
    // Effects since the split, then after a restore, in words.
    let post = Effect {
        at_ms: 1,
        kind: EffectKind::Request,
        host: "api.github.com".into(),
        port: 443,
        method: Some("POST".into()),
        method_override: None,
        path: Some("/repos/o/r/pulls\u{1b}[2J".into()),
        status: Some(201),
        sent: 10,
        received: 20,
    };
    let text = (diff.render)(
        Reply::Diffed { a: Vec::new(), b: vec![post.clone()], a_packages: Vec::new(), b_packages: Vec::new() },
        &diff.op,
        false,
    )
    .unwrap();
    assert_eq!(
        text,
        "b since the split did what a restore does not undo:\n  1 request to api.github.com: POST /repos/o/r/pulls\\u{1b}[2J 201\n"
    );
    let Plan::Call(restore) = plan("restore web c1").unwrap() else { panic!("not a call") };
    let restored = Reply::Restored { kept: n("before-c1"), effects: vec![post.clone()] };
    let text = (restore.render)(restored, &restore.op, false).unwrap();
    assert!(
        text.starts_with("before-c1\nsince checkpoint c1, web did what a restore does not undo:\n  1 request"),
        "{text}"
    );
    let Plan::Call(effects) = plan("effects web --json").unwrap() else { panic!("not a call") };
    let line = (effects.render)(Reply::Effects(vec![post]), &effects.op, true).unwrap();
    let json: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!((json["kind"].as_str(), json["status"].as_u64()), (Some("request"), Some(201)));
    assert_eq!((effects.render)(Reply::Effects(Vec::new()), &effects.op, false).unwrap(), "no effects\n");
}

#[test]
fn times_read_one_way_and_json_adds_strings() {
    let b = moat_api::BoxInfo {
        id: "00ff".into(),
        name: n("web"),
        image: n("debian"),
        limits: Limits::default(),
        state: "running".into(),
        created_at: 1_796_080_000,
        parent: Some(n("base")),
        duplicated: true,
        idle: None,
        keep_running: false,
        state_since: 1_796_080_060,
        backend: BackendKind::Ns,
        node: String::new(),
        durable: None,
        moved: None,
        moving: None,
        shared_with: Vec::new(),
    };
    let Plan::Call(info) = plan("info web").unwrap() else { panic!("not a call") };
    let text = (info.render)(Reply::Box(b.clone()), &info.op, false).unwrap();
    assert!(text.contains("\nstate:    running (since 2026-11-30T23:07:40Z)\n"), "{text}");
    assert!(!text.contains("durable:") && !text.contains("shared:"), "{text}");
    // Its owner sees whom it is shared with.
    let key = moat_core::AccountId("SHA256:abc".into());
    let shared = moat_api::BoxInfo { shared_with: vec![key], ..b.clone() };
    let text = (info.render)(Reply::Box(shared), &info.op, false).unwrap();
    assert!(text.ends_with("\nshared:   SHA256:abc\n"), "{text}");
    // Where boxes are kept in an object store, info says as of when.
    let suspended = moat_api::BoxInfo {
        state: "suspended".into(),
        durable: Some(Box::new(moat_api::DurableInfo {
            as_of_ms: Some(1_796_080_061_000),
            bytes: 3 << 20,
            pending: false,
        })),
        ..b.clone()
    };
    let text = (info.render)(Reply::Box(suspended.clone()), &info.op, false).unwrap();
    assert!(text.contains("\ndurable:  as of 2026-11-30T23:07:41Z (3M in the object store), up to date\n"), "{text}");
    let never = moat_api::BoxInfo {
        durable: Some(Box::new(moat_api::DurableInfo { as_of_ms: None, bytes: 0, pending: true })),
        ..suspended
    };
    let text = (info.render)(Reply::Box(never), &info.op, false).unwrap();
    assert!(text.contains("\ndurable:  not yet, an upload is under way\n"), "{text}");
    // A single host's boxes name no node; a fleet's do, in `info` and `ls`.
    assert!(!text.contains("node:"), "{text}");
    let Plan::Call(ls) = plan("ls").unwrap() else { panic!("not a call") };
    let listed = (ls.render)(Reply::Boxes(vec![b.clone()]), &ls.op, false).unwrap();
    assert!(!listed.contains("NODE"), "{listed}");
    let on_node = moat_api::BoxInfo { node: "n2".into(), ..b.clone() }.on_lost_node();
    let text = (info.render)(Reply::Box(on_node.clone()), &info.op, false).unwrap();
    assert!(text.contains("\nstate:    node-lost (since ") && text.contains("\nnode:     n2\n"), "{text}");
    let listed = (ls.render)(Reply::Boxes(vec![b.clone(), on_node]), &ls.op, false).unwrap();
    let rows: Vec<Vec<&str>> = listed.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows[0][..4], ["NAME", "STATE", "NODE", "IMAGE"], "{listed}");
    assert_eq!(rows[2][..4], ["web", "node-lost", "n2", "debian"], "{listed}");
    assert!(text.contains("\ncreated:  2026-11-30T23:06:40Z\n"), "{text}");
    assert!(text.contains("\nparent:   base (duplicated at 2026-11-30T23:06:40Z)\n"), "{text}");
    let json: serde_json::Value = serde_json::from_str(&(info.render)(Reply::Box(b), &info.op, true).unwrap()).unwrap();
    assert_eq!(
        (json["created_at"].as_u64(), json["created_at_utc"].as_str()),
        (Some(1_796_080_000), Some("2026-11-30T23:06:40.000Z"))
    );
    assert_eq!(json["state_since_utc"], "2026-11-30T23:07:40.000Z");

    let Plan::Call(list) = plan("checkpoints web").unwrap() else { panic!("not a call") };
    let now_ms = moat_core::clock::now() * 1000;
    let saved =
        vec![moat_core::Checkpoint { label: "c1".into(), created_ms: now_ms - 180_000, held_bytes: Some(4096) }];
    let text = (list.render)(Reply::Checkpoints(saved.clone()), &list.op, false).unwrap();
    let row = text.lines().nth(1).unwrap();
    assert!(row.starts_with("c1 ") && row.contains("Z ") && row.contains(" 3m ago "), "{text}");
    let json = (list.render)(Reply::Checkpoints(saved), &list.op, true).unwrap();
    assert!(json.contains("\"created_ms\"") && json.contains("\"created_utc\""), "{json}");
}

#[test]
fn move_names_its_node_and_info_says_where_a_box_came_from() {
    let Plan::Call(call) = plan("move web --node n2").unwrap() else { panic!("not a call") };
    assert!(matches!(&call.op, Op::Move { name, node } if name.as_str() == "web" && node == "n2"), "{:?}", call.op);
    for bad in ["move web", "move web n2", "move web --node", "move web --node n2 extra", "move --node n2"] {
        assert!(plan(bad).is_err(), "{bad}");
    }
    let b = moat_api::BoxInfo {
        id: "00ff".into(),
        name: n("web"),
        image: n("debian"),
        limits: Limits::default(),
        state: "stopped".into(),
        created_at: 1_796_080_000,
        parent: None,
        duplicated: false,
        idle: None,
        keep_running: false,
        state_since: 1_796_080_060,
        backend: BackendKind::Ns,
        node: "n2".into(),
        durable: None,
        moved: Some(moat_core::store::moves::Arrival {
            from: "n1".into(),
            reason: moat_core::store::moves::MoveReason::Lost,
            as_of_ms: 1_796_080_000_000,
            at_ms: 1_796_080_060_000,
        }),
        moving: None,
        shared_with: Vec::new(),
    };
    let Plan::Call(info) = plan("info web").unwrap() else { panic!("not a call") };
    let text = (info.render)(Reply::Box(b.clone()), &info.op, false).unwrap();
    assert!(
        text.contains(
            "moved:    from node n1 at 2026-11-30T23:07:40Z (its node was lost); its files as of 2026-11-30T23:06:40Z"
        ),
        "{text}"
    );
    assert!(!text.contains("moving:"), "{text}");
    // A move under way, one that failed, and a lost node's box whose
    // re-homing failed twice (tried again 20 s after the last failure).
    let now = moat_core::clock::now_ms();
    let mv = moat_core::store::moves::BoxMove {
        box_id: moat_core::BoxId::parse("00ff00ff00ff00ff").unwrap(),
        from: "n2".into(),
        to: "n3".into(),
        epoch: 1,
        reason: moat_core::store::moves::MoveReason::Move,
        ready: false,
        as_of_ms: None,
        asked_at_ms: now,
        error: None,
        failures: 0,
        failed_at_ms: None,
    };
    let said = |mv: &moat_core::store::moves::BoxMove| {
        let b = moat_api::BoxInfo { moving: Some(Box::new(mv.clone())), ..b.clone() };
        let text = (info.render)(Reply::Box(b), &info.op, false).unwrap();
        text.lines().find(|l| l.starts_with("moving:")).unwrap_or_default().to_string()
    };
    assert_eq!(said(&mv), "moving:   to node n3 (asked)");
    let failed = moat_core::store::moves::BoxMove { error: Some("no room".into()), failures: 1, ..mv.clone() };
    assert_eq!(said(&failed), "moving:   to node n3 failed (asked): no room; the box stayed");
    let lost = moat_core::store::moves::BoxMove {
        reason: moat_core::store::moves::MoveReason::Lost,
        error: Some("object k is corrupt".into()),
        failures: 2,
        failed_at_ms: Some(now),
        ..mv
    };
    assert_eq!(said(&lost), "moving:   re-homing failed 2 times (object k is corrupt); tried again in 20s");
}

#[test]
fn parses_web_commands() {
    assert_eq!(op("expose web 3000"), Op::Expose { name: n("web"), port: 3000, public: false });
    assert_eq!(op("expose web 8080 --public"), Op::Expose { name: n("web"), port: 8080, public: true });
    assert_eq!(op("unexpose web 3000"), Op::Unexpose { name: n("web"), port: 3000 });
    assert_eq!(p("urls").unwrap(), (Op::Urls { name: None }, false));
    assert_eq!(p("urls web --json").unwrap(), (Op::Urls { name: Some(n("web")) }, true));
    assert_eq!(op("url web 3000"), Op::Url { name: n("web"), port: 3000, owner: None });
    let Op::Url { owner, .. } = op("url web 3000 --owner 0123456789") else { panic!("not url") };
    assert_eq!(owner.unwrap().as_str(), "0123456789");
    let fp = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";
    let with = moat_core::AccountId(fp.into());
    assert_eq!(op(&format!("share web {fp}")), Op::Share { name: n("web"), with: with.clone() });
    assert_eq!(op(&format!("unshare web {fp}")), Op::Unshare { name: n("web"), with });
    for bad in [
        "expose web",
        "expose web 0",
        "expose web 65536",
        "expose web http",
        "expose web 3000 --private",
        "unexpose web 3000 extra",
        "urls a b",
        "url web",
        "url web 3000 --owner",
        "url web 3000 --owner SHA256:x",
        "share web",
        "share web alice",
        "share web SHA256:short",
        &format!("share web {fp} extra"),
    ] {
        let err = p(bad).unwrap_err();
        assert!(!err.0.contains('\n'), "{bad}: {err}");
    }
}

#[test]
fn image_verbs_parse_and_refuse() {
    let Plan::Call(call) = plan("image save web web-ready").unwrap() else { panic!("not a call") };
    assert!(
        matches!(&call.op, Op::ImageSave { name, image } if name.as_str() == "web" && image.as_str() == "web-ready")
    );
    let Plan::Call(call) = plan("image pull registry.test:5000/moat/tiny:v1 --as tiny --json").unwrap() else {
        panic!("not a call")
    };
    assert!(call.json);
    assert!(
        matches!(&call.op, Op::ImagePull { reference, name: Some(n) } if reference.ends_with(":v1") && n.as_str() == "tiny")
    );
    assert!(matches!(plan("image login registry.test:5000 me").unwrap(), Plan::ReadPassword(_)));
    for bad in [
        "image",
        "image pull",
        "image pull -x",
        "image save web",
        "image login bad/host me",
        "image rm A_B",
        "image frob",
    ] {
        let e = plan(bad).unwrap_err();
        assert!(!e.0.contains('\n'), "{bad}: {e}");
    }
}

#[test]
fn a_flag_given_twice_is_a_usage_error() {
    for line in ["new x --image busybox --image debian", "new x --memory 1G --memory=2G", "ls --json --json"] {
        let e = plan(line).unwrap_err();
        assert!(e.to_string().contains("given twice"), "{line}: {e}");
    }
    // After `--` the words are the command's.
    assert!(plan("race web 2 -- grep --json --json x").is_ok());
}
