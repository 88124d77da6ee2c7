//! Boxes that change node, on the fleet of `fleet.rs` (its nodes keep boxes
//! durable in a real SeaweedFS): `move` through a front door, `moat node
//! drain`, and a killed node's boxes re-homed from the object store after
//! the grace, with the node that comes back serving none of its old copies.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::fixture::{moat_bin, run, Ran};
use crate::fleet::{strip_ansi, Fleet, NODE_GRACE_SECS};
use crate::Env;

fn alice(fleet: &Fleet, env: &Env, user: Option<&str>, args: &[&str]) -> Ran {
    fleet.fronts[1].ssh(&env.alice, user, args)
}

fn info(fleet: &Fleet, env: &Env, name: &str) -> serde_json::Value {
    let out = alice(fleet, env, None, &["info", name, "--json"]).ok().stdout;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Where node `node` (1-based) keeps box `name`'s root.
fn root_on(fleet: &Fleet, env: &Env, node: usize, name: &str) -> PathBuf {
    pool_dir_on(fleet, env, node, "boxes", name)
}

/// Box `name`'s entry in directory `dir` of node `node`'s pool (its root in
/// `boxes`, its upload snapshots in `durable`).
fn pool_dir_on(fleet: &Fleet, env: &Env, node: usize, dir: &str, name: &str) -> PathBuf {
    let id = info(fleet, env, name)["id"].as_str().unwrap().to_string();
    fleet.nodes[node - 1].state_dir.join("pool").join(dir).join(id)
}

/// A busybox box `name` on node `node` holding `/root/f` = `text`.
fn box_with_file(fleet: &Fleet, env: &Env, name: &str, node: usize, text: &str) {
    let node = format!("n{node}");
    alice(fleet, env, None, &["new", name, "--image", "busybox", "--node", &node]).ok();
    alice(fleet, env, Some(name), &[&format!("echo {text} > /root/f; sync")]).ok();
}

/// Waits until box `name` is kept in the object store as of after `after_ms`
/// with no upload pending.
fn durable_after(fleet: &Fleet, env: &Env, name: &str, after_ms: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let d = info(fleet, env, name)["durable"].clone();
        if d["as_of_ms"].as_u64().is_some_and(|t| t > after_ms) && d["pending"] == false {
            return;
        }
        assert!(Instant::now() < deadline, "{name} not made durable: {d}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn node_of(fleet: &Fleet, env: &Env, name: &str) -> String {
    info(fleet, env, name)["node"].as_str().unwrap_or_default().to_string()
}

fn wait_gone(path: &std::path::Path, within: Duration) {
    let deadline = Instant::now() + within;
    while path.exists() {
        assert!(Instant::now() < deadline, "{} is still there", path.display());
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn a_box_moves_to_another_node_with_its_files(env: &Env, fleet: &mut Fleet) {
    box_with_file(fleet, env, "mv1", 1, "moved-data");
    alice(fleet, env, None, &["checkpoint", "mv1", "before-edit"]).ok();
    alice(fleet, env, Some("mv1"), &["echo edited > /root/f; sync"]).ok();
    let on_n1 = root_on(fleet, env, 1, "mv1");
    let uploads_on_n1 = pool_dir_on(fleet, env, 1, "durable", "mv1");
    assert!(on_n1.is_dir());
    let out = alice(fleet, env, None, &["move", "mv1", "--node", "n2"]).ok();
    let said = format!("{}{}", out.stdout, out.stderr);
    assert!(said.contains("mv1 answers on node n2 now"), "{said}");
    assert!(said.contains("its processes end"), "the move says what a namespace box loses: {said}");
    assert_eq!(node_of(fleet, env, "mv1"), "n2");
    assert_eq!(alice(fleet, env, Some("mv1"), &["cat /root/f"]).ok().stdout, "edited\n");
    // Both nodes up: streamed from n1 to n2, not through the object store.
    let n1_log = std::fs::read_to_string(fleet.nodes[0].state_dir.with_extension("log")).unwrap_or_default();
    assert!(n1_log.contains("box streamed to the node it moves to"), "n1 streamed nothing");
    // Its checkpoint came with it.
    alice(fleet, env, None, &["restore", "mv1", "before-edit"]).ok();
    assert_eq!(alice(fleet, env, Some("mv1"), &["cat /root/f"]).ok().stdout, "moved-data\n");
    let text = alice(fleet, env, None, &["info", "mv1"]).ok().stdout;
    assert!(text.contains("moved:    from node n1 at "), "{text}");
    // The source's copy goes (in the mover's next round), and so do its
    // upload snapshots of the box.
    wait_gone(&on_n1, Duration::from_secs(15));
    wait_gone(&uploads_on_n1, Duration::from_secs(15));
    assert!(root_on(fleet, env, 2, "mv1").is_dir());
    // The received box's disk is charged and limited as a box made there.
    let usage = alice(fleet, env, Some("mv1"), &["head -c 30000000 /dev/zero > /root/big; sync; du -sk /root/big"]);
    assert_eq!(usage.status, Some(0), "{}", usage.stderr);
    // Its next upload, from n2, is an incremental against what n2 received,
    // not the whole box again.
    let written = now_ms();
    alice(fleet, env, None, &["suspend", "mv1"]).ok();
    durable_after(fleet, env, "mv1", written);
    let n2_log =
        strip_ansi(&std::fs::read_to_string(fleet.nodes[1].state_dir.with_extension("log")).unwrap_or_default());
    let uploads: Vec<&str> =
        n2_log.lines().filter(|l| l.contains("box made durable") && l.contains("name=mv1")).collect();
    assert!(!uploads.is_empty() && uploads.iter().all(|l| l.contains("full=false")), "n2's uploads: {uploads:?}");

    // Refusals, one line each; the box stays where it is.
    for (to, says) in [("n2", "already"), ("nope", "no node named nope")] {
        let out = alice(fleet, env, None, &["move", "mv1", "--node", to]);
        assert_ne!(out.status, Some(0));
        assert!(out.stderr.contains(says) && out.stderr.trim().lines().count() == 1, "{}", out.stderr);
    }
    let out = alice(fleet, env, None, &["move", "mv1"]);
    assert!(out.stderr.contains("usage: move NAME --node NODE"), "{}", out.stderr);
    assert_eq!(node_of(fleet, env, "mv1"), "n2");
    alice(fleet, env, None, &["rm", "mv1"]).ok();
}

pub fn a_drained_node_is_left_empty_and_every_box_answers(env: &Env, fleet: &mut Fleet) {
    // Ten boxes: nine namespace boxes and a VM box.
    let names: Vec<String> = (0..9).map(|i| format!("dr{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        box_with_file(fleet, env, name, 3, &format!("drained-{i}"));
    }
    // Some suspended, some running: both move.
    alice(fleet, env, None, &["suspend", "dr0"]).ok();
    alice(fleet, env, None, &["suspend", "dr1"]).ok();
    // A VM box running a process: its saved machine moves with it.
    alice(fleet, env, None, &["new", "drvm", "--image", "busybox", "--node", "n3", "--backend", "vm"]).ok();
    alice(fleet, env, Some("drvm"), &["echo vm-data > /root/f; sync; setsid sleep 1000 >/dev/null 2>&1 < /dev/null &"])
        .ok();
    let sleeping = alice(fleet, env, Some("drvm"), &["busybox pidof sleep"]).ok().stdout;
    assert!(!sleeping.trim().is_empty(), "the VM box's sleep runs before the drain");
    let admin = fleet.admin.display().to_string();
    let out = run(Command::new(moat_bin()).args(["node", "drain", "n3", "--state-dir", &admin]));
    assert_eq!(out.status, Some(0), "{}{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("node n3 is empty"), "{}", out.stdout);
    assert!(out.stdout.contains("its processes ended"), "{}", out.stdout);
    for (i, name) in names.iter().enumerate() {
        let node = node_of(fleet, env, name);
        assert!(node == "n1" || node == "n2", "{name} on {node}");
        assert_eq!(alice(fleet, env, Some(name), &["cat /root/f"]).ok().stdout, format!("drained-{i}\n"));
    }
    assert!(out.stdout.contains("drvm: moved to") && out.stdout.contains("processes go on there"), "{}", out.stdout);
    let vm = node_of(fleet, env, "drvm");
    assert!(vm == "n1" || vm == "n2", "drvm on {vm}");
    let after = alice(fleet, env, Some("drvm"), &["cat /root/f; busybox pidof sleep"]).ok().stdout;
    assert_eq!(after, format!("vm-data\n{sleeping}"), "the same sleep, still running, on {vm}");
    let nodes = fleet.nodes_json();
    let n3 = nodes.as_array().unwrap().iter().find(|n| n["name"] == "n3").unwrap().clone();
    assert_eq!((n3["boxes"].as_u64(), n3["state"].as_str()), (Some(0), Some("cordoned")), "{n3}");
    run(Command::new(moat_bin()).args(["node", "uncordon", "n3", "--state-dir", &admin])).ok();
    for name in names.iter().map(String::as_str).chain(["drvm"]) {
        alice(fleet, env, None, &["rm", name]).ok();
    }
}

pub fn a_lost_nodes_boxes_are_re_homed_and_it_serves_none_on_return(env: &Env, fleet: &mut Fleet) {
    // Suspended (and so uploaded) with its file; running, with a file
    // written after its last upload.
    box_with_file(fleet, env, "lost1", 1, "kept");
    alice(fleet, env, None, &["checkpoint", "lost1", "c-kept"]).ok();
    alice(fleet, env, Some("lost1"), &["echo after > /root/g; sync"]).ok();
    let t0 = now_ms();
    alice(fleet, env, None, &["suspend", "lost1"]).ok();
    durable_after(fleet, env, "lost1", t0);
    box_with_file(fleet, env, "lost2", 1, "uploaded");
    let t1 = now_ms();
    alice(fleet, env, None, &["checkpoint", "lost2"]).ok();
    durable_after(fleet, env, "lost2", t1);
    alice(fleet, env, Some("lost2"), &["echo late > /root/late; sync"]).ok();
    let (lost_disk, old_root) = (root_on(fleet, env, 1, "lost1"), root_on(fleet, env, 1, "lost2"));

    let killed = Instant::now();
    fleet.nodes[0].kill();
    // lost1's disk on n1 is gone outright (its root, its checkpoint and the
    // snapshot kept for its next upload): it comes back from the object
    // store alone.
    let lost1_id = lost_disk.file_name().unwrap().to_string_lossy().into_owned();
    let pool = fleet.nodes[0].state_dir.join("pool");
    let (durable, checkpoints) = (pool.join("durable").join(&lost1_id), pool.join("checkpoints").join(&lost1_id));
    assert!(checkpoints.join("c-kept").is_dir());
    for gone in [&lost_disk, &durable, &checkpoints] {
        let deleted = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "for s in {0}/*/ {0}; do btrfs -q subvolume delete \"$s\" 2>/dev/null; done; rm -rf {0}",
                gone.display()
            ))
            .status()
            .unwrap();
        assert!(deleted.success() && !gone.exists(), "{} still there", gone.display());
    }
    for name in ["lost1", "lost2"] {
        loop {
            // While n1's lease is live its boxes' requests go to it and fail.
            let out = alice(fleet, env, None, &["info", name, "--json"]);
            let info: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
            if out.status == Some(0) && info["node"] != "n1" && info["state"] != "node-lost" {
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(NODE_GRACE_SECS + 40),
                "{name} not re-homed {:?} after its node was killed",
                killed.elapsed()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    assert_eq!(alice(fleet, env, Some("lost1"), &["cat /root/f /root/g"]).ok().stdout, "kept\nafter\n");
    // Its checkpoint too, as it was saved.
    let listed = alice(fleet, env, None, &["checkpoints", "lost1"]).ok().stdout;
    assert!(listed.contains("c-kept"), "{listed}");
    alice(fleet, env, None, &["restore", "lost1", "c-kept"]).ok();
    assert_eq!(alice(fleet, env, Some("lost1"), &["cat /root/f; ls /root"]).ok().stdout, "kept\nf\n");
    let lost2 = alice(fleet, env, Some("lost2"), &["cat /root/f; ls /root"]).ok().stdout;
    assert!(lost2.starts_with("uploaded\n") && !lost2.contains("late"), "as of its last upload: {lost2}");
    let text = alice(fleet, env, None, &["info", "lost2"]).ok().stdout;
    assert!(text.contains("moved:    from node n1") && text.contains("its node was lost"), "{text}");
    eprintln!("    re-homed: first answer {:?} after the kill (grace {NODE_GRACE_SECS} s)", killed.elapsed());

    // n1 comes back: its copy of lost2 goes before it serves, and the boxes
    // answer from their new nodes.
    assert!(old_root.is_dir(), "n1's old copy of lost2 is there while n1 is down");
    fleet.nodes[0].restart();
    wait_gone(&old_root, Duration::from_secs(10));
    // lost1's processes, frozen on n1 since its suspend, go too, though its
    // files there were gone: a node finds its boxes by their cgroups as well.
    for cgroup in [format!("/sys/fs/cgroup/pids/moat-n1/{lost1_id}"), format!("/sys/fs/cgroup/moat-n1/{lost1_id}")] {
        wait_gone(std::path::Path::new(&cgroup), Duration::from_secs(10));
    }
    assert_eq!(alice(fleet, env, Some("lost1"), &["cat /root/f"]).ok().stdout, "kept\n");
    assert_ne!(node_of(fleet, env, "lost1"), "n1");
    for name in ["lost1", "lost2"] {
        alice(fleet, env, None, &["rm", name]).ok();
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Waits until `daemon`'s process has ended (a fault point aborted it).
fn wait_dead(daemon: &crate::fixture::Daemon, within: Duration) {
    let stat = format!("/proc/{}/stat", daemon.pid());
    let deadline = Instant::now() + within;
    loop {
        let state = std::fs::read_to_string(&stat).unwrap_or_default();
        // The field after the command's parenthesis: Z once it is gone.
        if state.rsplit_once(") ").is_none_or(|(_, rest)| rest.starts_with('Z')) {
            return;
        }
        assert!(Instant::now() < deadline, "{stat} is still running");
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn a_move_killed_at_each_step_lands_once_with_every_file(env: &Env, fleet: &mut Fleet) {
    // (fault point, the node that crashes there: 1 sends, 2 receives)
    // (receive-mid-part: n2 stops with the box's root half received where
    // its uploader keeps its snapshots, a subvolume btrfs began and never
    // finished.)
    let points = [
        ("upload-before-record", 1),
        ("move-before-ready", 1),
        ("move-after-ready", 1),
        ("receive-before-take", 2),
        ("receive-mid-part", 2),
    ];
    for (i, (point, crashes)) in points.into_iter().enumerate() {
        let name = format!("crash{i}");
        box_with_file(fleet, env, &name, 1, point);
        // 8 MiB of noise: the box's stream is many frames, so a receive
        // stopped after the first is half done.
        let big = "head -c 8M /dev/urandom > /root/big; sync; sha256sum /root/big";
        let sum = alice(fleet, env, Some(&name), &[big]).ok().stdout;
        let on_n1 = root_on(fleet, env, 1, &name);
        let uploads_on_n1 = pool_dir_on(fleet, env, 1, "durable", &name);
        let node = &mut fleet.nodes[crashes - 1];
        node.env = vec![("MOAT_FAULT".into(), point.into())];
        node.restart();
        let front = fleet.fronts[1].port;
        let mut mv = crate::fixture::ssh_to(front, &env.alice, None, &[], &["move", &name, "--node", "n2"]);
        let mv = mv.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
        wait_dead(&fleet.nodes[crashes - 1], Duration::from_secs(60));
        let node = &mut fleet.nodes[crashes - 1];
        node.env.clear();
        node.restart();
        // The move finishes on its own once the node is back.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = alice(fleet, env, None, &["info", &name, "--json"]);
            let info: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
            if info["node"] == "n2" {
                break;
            }
            assert!(Instant::now() < deadline, "{point}: {name} did not reach n2: {}{}", out.stdout, out.stderr);
            std::thread::sleep(Duration::from_millis(300));
        }
        let _ = { mv }.wait();
        let said = alice(fleet, env, Some(&name), &["cat /root/f; sha256sum /root/big"]).ok().stdout;
        assert_eq!(said, format!("{point}\n{sum}"), "{point}: the box's files");
        // What n2 keeps of the box's uploads is whole: every snapshot there
        // read-only (btrfs makes a received one so only at its end).
        let kept = pool_dir_on(fleet, env, 2, "durable", &name);
        for snapshot in std::fs::read_dir(&kept).into_iter().flatten().flatten() {
            let ro = run(Command::new("btrfs").args(["property", "get", "-ts"]).arg(snapshot.path()).arg("ro")).ok();
            assert_eq!(ro.stdout.trim(), "ro=true", "{point}: {} is half received", snapshot.path().display());
        }
        wait_gone(&on_n1, Duration::from_secs(15));
        wait_gone(&uploads_on_n1, Duration::from_secs(15));
        let listed = alice(fleet, env, None, &["ls", "--json"]).ok().stdout;
        let boxes: serde_json::Value = serde_json::from_str(&listed).unwrap();
        let count = boxes.as_array().unwrap().iter().filter(|b| b["name"] == name.as_str()).count();
        assert_eq!(count, 1, "{point}: one box, not two");
        let incoming = fleet.nodes[1].state_dir.join("pool/incoming");
        let left = std::fs::read_dir(&incoming).map(|d| d.count()).unwrap_or(0);
        assert_eq!(left, 0, "{point}: nothing left staged on n2");
        alice(fleet, env, None, &["rm", &name]).ok();
    }
}
