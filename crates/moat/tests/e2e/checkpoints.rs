//! Checkpoints: save a box by label, damage it, restore it in place, undo
//! the restore; what checkpoints hold counts against the disk limit; a crash
//! in the middle leaves the box as it was or fully restored.

use crate::fixture::{run_briefly, unique, Daemon};
use crate::Env;

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn labels(env: &Env, name: &str) -> Vec<String> {
    let listed = json(&env.alice(None, &["checkpoints", name, "--json"]).ok().stdout);
    listed.as_array().unwrap().iter().map(|c| c["label"].as_str().unwrap().to_string()).collect()
}

pub fn restore_puts_a_damaged_box_back(env: &Env) {
    let name = unique("ck");
    env.new_box(&name, &[]);
    let box_sh = |script: &str| env.alice(Some(&name), &[script]);
    box_sh("echo precious > /root/data; head -c 5000000 /dev/urandom > /root/blob; sync").ok();
    let identity = box_sh("cat /etc/machine-id /etc/hostname").ok().stdout;
    assert_eq!(env.alice(None, &["checkpoint", &name]).ok().stdout, "c1\n");
    let listed = json(&env.alice(None, &["checkpoints", &name, "--json"]).ok().stdout);
    assert_eq!(listed[0]["label"], "c1", "{listed}");
    assert!(listed[0]["created_ms"].as_u64().unwrap() > 0, "{listed}");

    // Some damage, then back; then forward again through `before-c1`.
    box_sh("rm /root/data; echo later > /root/later").ok();
    assert_eq!(env.alice(None, &["restore", &name, "c1"]).ok().stdout, "before-c1\n");
    assert_eq!(box_sh("cat /root/data; ls /root/later 2>&1 | grep -c 'No such'").ok().stdout, "precious\n1\n");
    assert_eq!(box_sh("cat /etc/machine-id /etc/hostname").ok().stdout, identity, "not the same machine");
    assert_eq!(labels(env, &name), ["c1", "before-c1"]);
    env.alice(None, &["restore", &name, "before-c1"]).ok();
    assert_eq!(box_sh("cat /root/later; test -e /root/data || echo gone").ok().stdout, "later\ngone\n");

    // Worse damage: no programs at all. The restored box has a working shell.
    let broken = box_sh("rm -rf /usr/bin /usr/sbin 2>/dev/null; echo done");
    assert!(broken.stdout.contains("done"), "{}", broken.stderr);
    assert_ne!(box_sh("ls /").status, Some(0), "the damage did not take");
    env.alice(None, &["restore", &name, "c1"]).ok();
    assert_eq!(
        box_sh("ls /usr/bin | wc -l | awk '$1 > 50 {print \"ok\"}'; cat /root/data").ok().stdout,
        "ok\nprecious\n"
    );

    // Checkpoints held only by a restore's kept state show what only they hold.
    let listed = json(&env.alice(None, &["checkpoints", &name, "--json"]).ok().stdout);
    assert!(listed.as_array().unwrap().iter().all(|c| c["held_bytes"].is_u64()), "{listed}");
    let text = env.alice(None, &["checkpoints", &name]).ok().stdout;
    assert!(text.starts_with("LABEL") && text.contains("before-c1-2"), "{text}");

    // Bad input: one line, nothing changed.
    for (args, says) in [
        (vec!["restore", &name, "nope"], "has no checkpoint nope"),
        (vec!["checkpoint", &name, "c1"], "has a checkpoint c1 already"),
        (vec!["checkpoint", "rm", &name, "nope"], "has no checkpoint nope"),
        (vec!["checkpoint", &name, "Bad_Label"], "label"),
        (vec!["restore", "no-such-box", "c1"], "no box named no-such-box"),
    ] {
        let out = env.alice(None, &args);
        assert_ne!(out.status, Some(0), "{args:?}");
        assert!(out.stderr.contains(says) && out.stderr.lines().count() == 1, "{args:?}: {}", out.stderr);
    }
    assert_eq!(labels(env, &name), ["c1", "before-c1", "before-c1-2", "before-c1-3"]);
    env.alice(None, &["checkpoint", "rm", &name, "before-c1"]).ok();
    assert_eq!(labels(env, &name), ["c1", "before-c1-2", "before-c1-3"]);

    // A copy has none; rm takes them with the box.
    let copy = unique("ck");
    env.alice(None, &["dup", &name, &copy]).ok();
    assert!(labels(env, &copy).is_empty());
    let id = json(&env.alice(None, &["info", &name, "--json"]).ok().stdout)["id"].as_str().unwrap().to_string();
    let dir = env.daemon.state_dir.join("pool/checkpoints").join(&id);
    assert!(dir.exists());
    env.alice(None, &["rm", &name]).ok();
    assert!(!dir.exists(), "rm left checkpoints behind");
    env.alice(None, &["rm", &copy]).ok();
}

/// A box that made its /etc a link out of itself (which writes in its root
/// never follow) is restored all the same: the restore put its files back,
/// then failed writing its host name, and said so.
pub fn a_box_whose_etc_leads_out_still_restores(env: &Env) {
    let name = unique("ckl");
    env.new_box(&name, &["--image", "busybox"]);
    env.alice(Some(&name), &["echo kept > /root/mark; mv /etc /etc.real; ln -s /nonexistent-moat-test /etc"]).ok();
    assert_eq!(env.alice(None, &["checkpoint", &name]).ok().stdout, "c1\n");
    env.alice(Some(&name), &["rm /root/mark"]).ok();
    let restored = env.alice(None, &["restore", &name, "c1"]);
    assert_eq!((restored.status, restored.stdout.as_str()), (Some(0), "before-c1\n"), "{}", restored.stderr);
    assert_eq!(env.alice(Some(&name), &["cat /root/mark"]).ok().stdout, "kept\n");
    env.alice(None, &["rm", &name]).ok();
}

/// Data only a checkpoint still holds counts against the box's disk limit
/// (and shows in `usage`), before and after a restore.
pub fn count_against_the_disk_limit(env: &Env) {
    let name = unique("ckq");
    env.new_box(&name, &["--image", "busybox", "--disk", "64M"]);
    let box_sh = |script: &str| env.alice(Some(&name), &[script]);
    box_sh("dd if=/dev/urandom of=/root/a bs=1M count=40 2>/dev/null; sync").ok();
    env.alice(None, &["checkpoint", &name, "kept"]).ok();
    box_sh("rm /root/a; sync").ok();
    let out = box_sh("dd if=/dev/urandom of=/root/b bs=1M count=40 2>&1; sync; echo rc=$?").ok().stdout;
    assert!(out.contains("Disk quota exceeded"), "a checkpoint let the box past its limit: {out}");
    let usage = json(&env.alice(None, &["usage", &name, "--json"]).ok().stdout);
    let billed = usage["boxes"][0]["disk_bytes"].as_u64().unwrap() >> 20;
    assert!(billed >= 40, "usage bills {billed} MiB with 40 MiB in a checkpoint: {usage}");

    // A restore is a new root, and still counts what the old ones hold.
    box_sh("rm -f /root/b; sync").ok();
    env.alice(None, &["restore", &name, "kept"]).ok();
    let out = box_sh("dd if=/dev/urandom of=/root/c bs=1M count=40 2>&1; echo rc=$?").ok().stdout;
    assert!(out.contains("Disk quota exceeded"), "a restore let the box past its limit: {out}");
    // Removing what holds the data frees it.
    box_sh("rm -f /root/a /root/c; sync").ok();
    env.alice(None, &["checkpoint", "rm", &name, "kept"]).ok();
    env.alice(None, &["checkpoint", "rm", &name, "before-kept"]).ok();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let out = box_sh("dd if=/dev/urandom of=/root/d bs=1M count=40 2>&1; echo rc=$?").ok().stdout;
        if out.contains("rc=0") {
            break;
        }
        box_sh("rm -f /root/d; sync").ok();
        assert!(std::time::Instant::now() < deadline, "space never came back: {out}");
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    // A box that filled its disk restores (the commonest reason to): the
    // state it leaves is made read-only whatever quota it reached (the
    // second restore failed on EDQUOT and left the box stopped).
    box_sh("rm -f /root/d; sync").ok();
    env.alice(None, &["checkpoint", &name, "clean"]).ok();
    box_sh("dd if=/dev/zero of=/root/fill bs=1M count=100 2>/dev/null; sync").ok();
    env.alice(None, &["restore", &name, "clean"]).ok();
    env.alice(None, &["checkpoint", &name, "again"]).ok();
    box_sh("dd if=/dev/zero of=/root/fill bs=1M count=100 2>/dev/null; sync").ok();
    env.alice(None, &["restore", &name, "again"]).ok();
    assert_eq!(box_sh("test -e /root/fill || echo clean").ok().stdout, "clean\n");
    let out = box_sh("dd if=/dev/zero of=/root/big bs=1M count=100 2>&1; echo rc=$?").ok().stdout;
    assert!(out.contains("Disk quota exceeded"), "the limit was not put back: {out}");
    env.alice(None, &["rm", &name]).ok();
}

/// Kills the daemon at each point of `checkpoint` and `restore`; the next
/// start leaves the box as it was or fully restored, never between, and
/// running.
pub fn interrupted_checkpoints_and_restores_finish_or_undo(env: &Env) {
    let points = [
        "checkpoint-while-frozen",
        "restore-after-intent",
        "restore-after-snapshot",
        "restore-after-move",
        "restore-after-swap",
    ];
    for point in points {
        let state = env.dir.join(format!("crash-{point}{}", if crate::in_vm_pass() { "-vm" } else { "" }));
        let mut daemon = Daemon::start(state, env.daemon.keys_file.clone(), &[]);
        let ssh = |d: &Daemon, user: Option<&str>, args: &[&str]| run_briefly(&d.ssh(&env.alice, user, args));
        let mut new = vec!["new", "b", "--image", "busybox"];
        new.extend_from_slice(crate::pass_backend());
        ssh(&daemon, None, &new).ok();
        ssh(&daemon, Some("b"), &["echo before > /root/f"]).ok();
        ssh(&daemon, None, &["checkpoint", "b", "c1"]).ok();
        ssh(
            &daemon,
            Some("b"),
            &["echo after > /root/f; (while true; do echo . >> /root/tick; sleep 0.05; done) >/dev/null 2>&1 &"],
        )
        .ok();
        daemon.env = vec![("MOAT_FAULT".into(), point.into())];
        daemon.restart();
        let op: &[&str] =
            if point.starts_with("checkpoint") { &["checkpoint", "b", "c2"] } else { &["restore", "b", "c1"] };
        assert_ne!(ssh(&daemon, None, op).status, Some(0), "{point}: survived its crash");
        daemon.env.clear();
        daemon.restart();
        let listed = json(&ssh(&daemon, None, &["checkpoints", "b", "--json"]).ok().stdout);
        let labels: Vec<&str> = listed.as_array().unwrap().iter().map(|c| c["label"].as_str().unwrap()).collect();
        let f = ssh(&daemon, Some("b"), &["cat /root/f"]).ok().stdout;
        match (point, f.as_str()) {
            ("checkpoint-while-frozen", "after\n") => assert_eq!(labels, ["c1"], "{point}"),
            ("restore-after-intent" | "restore-after-snapshot", "after\n") => assert_eq!(labels, ["c1"], "{point}"),
            (_, "before\n") => assert_eq!(labels, ["c1", "before-c1"], "{point}: restored, but not whole"),
            _ => panic!("{point}: the box is neither as it was nor restored: {f:?}, {labels:?}"),
        }
        let leftovers: Vec<String> = std::fs::read_dir(daemon.state_dir.join("pool/boxes"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("restoring-"))
            .collect();
        assert!(leftovers.is_empty(), "{point}: {leftovers:?}");
        // It runs (not frozen, not paused: its loop ticks on, waited for),
        // and both commands work again.
        if point.starts_with("checkpoint") {
            let tick = |d: &Daemon| ssh(d, Some("b"), &["wc -l < /root/tick"]).ok().stdout;
            let t1 = tick(&daemon);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while tick(&daemon) == t1 {
                assert!(std::time::Instant::now() < deadline, "{point}: the box is still frozen");
            }
        }
        ssh(&daemon, None, op).ok();
        daemon.purge();
    }
}
