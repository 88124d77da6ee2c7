//! A fleet on this one machine: a private PostgreSQL 15, three nodes (each
//! `moat serve` with its own state dir and pool, answering the fleet on
//! 127.0.0.2-4) and two front doors, driven by the real OpenSSH tools.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::clients::python_client_at;
use crate::fixture::{listening_port, moat_bin, run, spawn_with_lines, ssh_opts, ssh_to, Daemon, Key, Ran};
use crate::forward::{curl, free_port, Tunnel};
use crate::Env;

/// Boxes each node holds at most (small, so that filling the fleet is quick).
pub const NODE_MAX_BOXES: u32 = 12;

/// A running fleet; dropped in field order: front doors, then nodes (purged:
/// they need the store), then PostgreSQL and the object store.
pub struct Fleet {
    pub fronts: Vec<Front>,
    pub nodes: Vec<Daemon>,
    pub admin: PathBuf,
    pub pg: moat_testkit::Postgres,
    /// Where the nodes keep boxes durable (a real SeaweedFS).
    pub _s3: moat_testkit::SeaweedFs,
}

/// How long a node's lease stays lapsed before its boxes are re-homed: past
/// the 15 s in which `a_killed_node_is_lost_and_the_rest_answer` brings its
/// node back.
pub const NODE_GRACE_SECS: u64 = 25;

/// A running `moat front`.
pub struct Front {
    pub port: u16,
    pub dir: PathBuf,
    child: Option<Child>,
}

impl Front {
    fn start(dir: &Path) -> Front {
        let mut front = Front { port: 0, dir: dir.to_path_buf(), child: None };
        front.restart();
        front
    }

    fn restart(&mut self) {
        let log = std::fs::File::create(self.dir.with_extension("log")).expect("front log");
        let mut child = Command::new(moat_bin())
            .args(["front", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(&self.dir)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start moat front");
        self.port = listening_port(&mut child, &self.dir.with_extension("log"), "front door");
        self.child = Some(child);
    }

    /// Kills it with SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `ssh [user@]front ARGS...` as `key`.
    pub fn ssh(&self, key: &Key, user: Option<&str>, args: &[&str]) -> Ran {
        run(&mut ssh_to(self.port, key, user, &[], args))
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.kill();
    }
}

fn moat(args: &[&str]) -> Ran {
    run(Command::new(moat_bin()).args(args))
}

impl Fleet {
    /// Makes a fleet for `env`'s keys: the store, `fleet init`, a token and
    /// a join for each member, then the nodes and the front doors.
    pub fn start(env: &Env) -> Fleet {
        let dir = env.dir.join("fleet");
        std::fs::create_dir_all(&dir).expect("fleet dir");
        let pg = moat_testkit::Postgres::start();
        let dsn = pg.create_db();
        let s3 = moat_testkit::SeaweedFs::start();
        s3.create_bucket("fleet");
        let creds = dir.join("s3.env");
        std::fs::write(&creds, "AWS_ACCESS_KEY_ID=test\nAWS_SECRET_ACCESS_KEY=test\n").unwrap();
        let admin = dir.join("admin");
        let admin_s = admin.display().to_string();
        moat(&["fleet", "init", "--store", &dsn, "--state-dir", &admin_s]).ok();
        let member = |role: &str, name: &str| {
            let token = moat(&["fleet", "token", "--role", role, "--name", name, "--state-dir", &admin_s]).ok();
            let at = dir.join(name);
            moat(&["fleet", "join", token.stdout.trim(), "--state-dir", &at.display().to_string()]).ok();
            at
        };
        for key in [&env.alice, &env.bob] {
            let keys = dir.join(format!("{}.pub", key.path.file_name().unwrap().to_string_lossy()));
            std::fs::write(&keys, &key.public).unwrap();
            moat(&["fleet", "keys", "add", &keys.display().to_string(), "--state-dir", &admin_s]).ok();
        }
        // CPUs and an account's boxes to spare: the nodes' room (and not an
        // account's limit) is what runs out, with few, idle boxes per node.
        let boxes = NODE_MAX_BOXES.to_string();
        let mut flags: Vec<String> =
            ["--warm-boxes", "0", "--node-max-boxes", &boxes, "--node-cpus", "64", "--max-boxes", "100"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        flags.extend(env.net.daemon_flags());
        let grace = NODE_GRACE_SECS.to_string();
        for flag in ["--object-store", "s3://fleet/e2e", "--s3-endpoint", &s3.endpoint(), "--s3-credentials"] {
            flags.push(flag.to_string());
        }
        flags.extend([
            creds.display().to_string(),
            "--node-grace".into(),
            grace,
            "--upload-interval".into(),
            "3600".into(),
        ]);
        let nodes = (1..=3)
            .map(|i| {
                let at = member("node", &format!("n{i}"));
                // A port of its own, kept across restarts: a node's address is stable.
                let host = format!("127.0.0.{}", i + 1);
                let port = std::net::TcpListener::bind((host.as_str(), 0)).unwrap().local_addr().unwrap().port();
                let advertise = format!("{host}:{port}");
                let mut all: Vec<&str> = flags.iter().map(String::as_str).collect();
                all.extend(["--advertise", &advertise]);
                // Its own authorized_keys lists nobody: the fleet's keys are the accounts.
                Daemon::start(at, PathBuf::from("/dev/null"), &all)
            })
            .collect();
        let fronts = (1..=2).map(|i| Front::start(&member("front", &format!("f{i}")))).collect();
        let fleet = Fleet { fronts, nodes, admin, pg, _s3: s3 };
        fleet.wait_for_live_nodes(3);
        fleet
    }

    /// alice's boxes' names, on every node.
    pub fn box_names(&self, env: &Env) -> Vec<String> {
        let out = self.alice(env, 1, None, &["ls", "--json"]);
        let boxes: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
        let names = boxes.as_array().into_iter().flatten().filter_map(|b| b["name"].as_str());
        names.map(String::from).collect()
    }

    /// Puts the fleet back as it was before a test that failed midway, so
    /// that the next test does not fail for it: every node and front door
    /// running, none cordoned, and only the boxes in `kept` left.
    pub fn tidy_after_failure(&mut self, env: &Env, kept: &[String]) {
        for node in &mut self.nodes {
            if !node.alive() {
                node.env.clear();
                node.restart();
            }
        }
        for front in self.fronts.iter_mut().filter(|f| f.child.is_none()) {
            front.restart();
        }
        let admin = self.admin.display().to_string();
        for node in 1..=self.nodes.len() {
            let _ = moat(&["node", "uncordon", &format!("n{node}"), "--state-dir", &admin]);
        }
        self.wait_for_live_nodes(self.nodes.len());
        for name in self.box_names(env).iter().filter(|n| !kept.contains(n)) {
            let _ = self.alice(env, 1, None, &["rm", name]);
        }
    }

    /// Every member's log (nodes, then front doors).
    fn logs(&self) -> Vec<PathBuf> {
        let nodes = self.nodes.iter().map(|n| n.state_dir.with_extension("log"));
        nodes.chain(self.fronts.iter().map(|f| f.dir.with_extension("log"))).collect()
    }

    /// How long each member's log is now (see [`Fleet::print_log_warnings`]).
    pub fn log_marks(&self) -> Vec<u64> {
        self.logs().iter().map(|l| std::fs::metadata(l).map(|m| m.len()).unwrap_or(0)).collect()
    }

    /// Prints the warnings and errors each member logged since `marks`: what
    /// a failed test's daemons said, in CI's output (the logs go with the
    /// scratch dir).
    pub fn print_log_warnings(&self, marks: &[u64]) {
        for (log, mark) in self.logs().iter().zip(marks) {
            let text = std::fs::read(log).unwrap_or_default();
            let since = String::from_utf8_lossy(text.get(*mark as usize..).unwrap_or_default()).into_owned();
            let plain = strip_ansi(&since);
            let said: Vec<&str> = plain.lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).collect();
            if !said.is_empty() {
                eprintln!("--- {} since the test began:\n{}", log.display(), said.join("\n"));
            }
        }
    }

    /// `moat nodes --json`.
    pub fn nodes_json(&self) -> serde_json::Value {
        let out = moat(&["nodes", "--json", "--state-dir", &self.admin.display().to_string()]).ok();
        serde_json::from_str(&out.stdout).expect("nodes json")
    }

    fn wait_for_live_nodes(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let nodes = self.nodes_json();
            let live = nodes.as_array().unwrap().iter().filter(|n| n["state"] == "live").count();
            if live == n {
                return;
            }
            assert!(Instant::now() < deadline, "{live} of {n} nodes live: {nodes}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `ssh [user@]front ARGS` as alice through front door `f`.
    fn alice(&self, env: &Env, f: usize, user: Option<&str>, args: &[&str]) -> Ran {
        self.fronts[f].ssh(&env.alice, user, args)
    }

    /// alice's box `name` on node `node` (1-based), made through front door `f`.
    fn new_box(&self, env: &Env, f: usize, name: &str, node: usize, extra: &[&str]) {
        let node = format!("n{node}");
        let mut args = vec!["new", name, "--node", &node];
        args.extend_from_slice(extra);
        let out = self.alice(env, f, None, &args).ok();
        assert_eq!(out.stdout.trim(), name);
    }

    /// The state `ls` shows for alice's box `name`, and its node.
    fn listed(&self, env: &Env, f: usize, name: &str) -> (String, String) {
        let out = self.alice(env, f, None, &["ls", "--json"]).ok();
        let boxes: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        let b =
            boxes.as_array().unwrap().iter().find(|b| b["name"] == name).unwrap_or_else(|| panic!("{name}: {boxes}"));
        (b["state"].as_str().unwrap().to_string(), b["node"].as_str().unwrap_or_default().to_string())
    }
}

/// `text` without its terminal colour sequences (tracing's log colours).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // ESC [ parameters, up to the final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Gives node `node` (1-based) the debian image the suite's own daemon
/// built, as a node will fetch images: `btrfs send | btrfs receive` of the
/// read-only subvolume (seconds, where debootstrap takes minutes); once.
fn copy_debian_image(env: &Env, fleet: &Fleet, node: usize) {
    let from = env.daemon.state_dir.join("pool/images/debian");
    let to = fleet.nodes[node - 1].state_dir.join("pool/images");
    if to.join("debian").exists() {
        return;
    }
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("btrfs send -q {} | btrfs receive -q {}", from.display(), to.display()))
        .status()
        .unwrap();
    assert!(status.success(), "btrfs send | receive of the debian image");
}

/// A template saved from a box on n1 makes boxes on n2, which fetches it
/// from the object store on first use (once: the next box there is a local
/// snapshot of it).
pub fn an_image_saved_on_one_node_makes_boxes_on_another(env: &Env, fleet: &mut Fleet) {
    fleet.new_box(env, 0, "tsrc", 1, &["--image", "busybox"]);
    fleet.alice(env, 0, Some("tsrc"), &["echo from-template > /root/t; sync"]).ok();
    fleet.alice(env, 0, None, &["image", "save", "tsrc", "tpl"]).ok();
    let n2_images = fleet.nodes[1].state_dir.join("pool/images");
    let templates = |dir: &Path| -> Vec<String> {
        let names = std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()));
        names.into_iter().flatten().filter(|n| n.starts_with("oci-t")).collect()
    };
    assert!(templates(&n2_images).is_empty(), "n2 has no template before");
    let log = fleet.nodes[1].state_dir.with_extension("log");
    let fetched = || strip_ansi(&std::fs::read_to_string(&log).unwrap_or_default()).matches("image fetched").count();
    let before = fetched();
    // Its upload follows the save at once; until it is complete n2 cannot have it.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = fleet.alice(env, 1, None, &["new", "t1", "--image", "tpl", "--node", "n2"]);
        if out.status == Some(0) {
            assert!(out.stderr.contains("fetching it from the object store"), "{}", out.stderr);
            break;
        }
        assert!(out.stderr.contains("image tpl is not on this node, nor in the object store yet"), "{}", out.stderr);
        assert!(Instant::now() < deadline, "n2 never got the template: {}", out.stderr);
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(fleet.alice(env, 1, Some("t1"), &["cat /root/t"]).ok().stdout, "from-template\n");
    assert_eq!(templates(&n2_images).len(), 1, "kept on n2 as an image");
    fleet.new_box(env, 1, "t2", 2, &["--image", "tpl"]);
    assert_eq!(fleet.alice(env, 0, Some("t2"), &["cat /root/t"]).ok().stdout, "from-template\n");
    assert_eq!(fetched(), before + 1, "fetched once, then a local snapshot");
    for name in ["t1", "t2", "tsrc"] {
        fleet.alice(env, 0, None, &["rm", name]).ok();
    }
    fleet.alice(env, 0, None, &["image", "rm", "tpl"]).ok();
}

pub fn boxes_on_every_node_answer_through_either_front_door(env: &Env, fleet: &mut Fleet) {
    for node in 1..=3 {
        fleet.new_box(env, node % 2, &format!("fb{node}"), node, &["--image", "busybox"]);
    }
    for node in 1..=3 {
        let name = format!("fb{node}");
        assert_eq!(fleet.listed(env, 0, &name), ("running".into(), format!("n{node}")));
        for f in 0..2 {
            let out = fleet.alice(env, f, Some(&name), &["hostname; echo $((6*7))"]).ok();
            assert_eq!(out.stdout, format!("{name}\n42\n"), "front door {f}");
        }
    }
    let info = fleet.alice(env, 1, None, &["info", "fb2"]).ok();
    assert!(info.stdout.contains("\nnode:     n2\n"), "{}", info.stdout);
    // Another account sees none of them, on any node.
    let bob = fleet.fronts[0].ssh(&env.bob, None, &["ls", "--json"]).ok();
    assert_eq!(bob.stdout.trim(), "[]");
    assert_ne!(fleet.fronts[0].ssh(&env.bob, Some("fb1"), &["true"]).status, Some(0));

    // Files and forwards to a box on another host than the front door's:
    // scp and sftp to a debian box on n2, -L to a server in a box on n3.
    copy_debian_image(env, fleet, 2);
    fleet.new_box(env, 0, "fd2", 2, &[]);
    let local = env.dir.join("fleet/payload");
    std::fs::write(&local, "across the fleet\n".repeat(1000)).unwrap();
    let port = fleet.fronts[1].port.to_string();
    let mut scp = Command::new("scp");
    scp.args(ssh_opts(&env.alice)).args(["-P", &port]).arg(&local).arg("fd2@127.0.0.1:/root/payload");
    run(&mut scp).ok();
    let sum = fleet.alice(env, 0, Some("fd2"), &["md5sum < /root/payload"]).ok();
    let want = run(Command::new("sh").arg("-c").arg(format!("md5sum < {}", local.display()))).ok();
    assert_eq!(sum.stdout, want.stdout);
    let batch = env.dir.join("fleet/batch");
    std::fs::write(&batch, format!("get /root/payload {}.back\n", local.display())).unwrap();
    let mut sftp = Command::new("sftp");
    sftp.args(ssh_opts(&env.alice)).args(["-P", &port, "-b"]).arg(&batch).arg("fd2@127.0.0.1");
    run(&mut sftp).ok();
    assert_eq!(std::fs::read(local.with_extension("back")).unwrap(), std::fs::read(&local).unwrap());
    // Clients other than OpenSSH, through the other front door: 100 commands
    // and SFTP on one connection each.
    let out = python_client_at(fleet.fronts[0].port, &env.alice, "paramiko_session.py", "fd2").ok();
    assert!(out.stdout.contains("paramiko: 100 commands"), "{}", out.stdout);
    let out = python_client_at(fleet.fronts[1].port, &env.alice, "asyncssh_session.py", "fd2").ok();
    assert!(out.stdout.contains("asyncssh:"), "{}", out.stdout);

    fleet
        .alice(
            env,
            0,
            Some("fb3"),
            &["mkdir -p /www && echo from-n3 > /www/index.html && httpd -p 127.0.0.1:8000 -h /www"],
        )
        .ok();
    let local_port = free_port();
    let spec = format!("{local_port}:localhost:8000");
    let opts = ["-N", "-o", "ExitOnForwardFailure=yes", "-L", &spec];
    let mut cmd = ssh_to(fleet.fronts[0].port, &env.alice, Some("fb3"), &opts, &[]);
    let _tunnel = Tunnel(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    while curl(local_port).stdout != "from-n3\n" {
        assert!(Instant::now() < deadline, "no answer through -L to a box on n3");
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn fifty_news_fill_the_nodes_exactly(env: &Env, fleet: &mut Fleet) {
    let room: u64 = fleet
        .nodes_json()
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["max_boxes"].as_u64().unwrap() - n["boxes"].as_u64().unwrap())
        .sum();
    assert!(room < 50, "the fleet must fill up: room for {room}");
    let fleet = &*fleet;
    let made: Vec<Ran> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..50)
            .map(|i| s.spawn(move || fleet.alice(env, i % 2, None, &["new", &format!("p{i}"), "--image", "busybox"])))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let ok = made.iter().filter(|r| r.status == Some(0)).count();
    let refusals: Vec<&str> = made.iter().filter(|r| r.status != Some(0)).map(|r| r.stderr.as_str()).collect();
    assert_eq!(ok as u64, room, "exactly the room there was; refused: {refusals:?}");
    for refused in made.iter().filter(|r| r.status != Some(0)) {
        assert!(refused.stderr.contains("no node can take a new box"), "{}", refused.stderr);
        assert_eq!(refused.stderr.trim().lines().count(), 1, "{}", refused.stderr);
    }
    for n in fleet.nodes_json().as_array().unwrap() {
        assert_eq!(n["boxes"], n["max_boxes"], "{n}");
    }
    // A dup stays on its source's node, and says so when that node is full.
    let out = fleet.alice(env, 0, None, &["dup", "fb1", "fb1-copy"]);
    assert_ne!(out.status, Some(0));
    assert!(out.stderr.contains("node n1 is full"), "{}", out.stderr);
    // A move to a full node is refused before the box's processes end for it.
    let state = |out: Ran| serde_json::from_str::<serde_json::Value>(&out.ok().stdout).unwrap()["state"].clone();
    let before = state(fleet.alice(env, 0, None, &["info", "fb1", "--json"]));
    let out = fleet.alice(env, 0, None, &["move", "fb1", "--node", "n2"]);
    assert_ne!(out.status, Some(0));
    assert!(out.stderr.contains("node n2 is full"), "{}", out.stderr);
    assert_eq!(state(fleet.alice(env, 0, None, &["info", "fb1", "--json"])), before, "the refused move stopped it");
    for i in 0..50 {
        let _ = fleet.alice(env, i % 2, None, &["rm", &format!("p{i}")]);
    }
}

pub fn cordoned_nodes_take_no_new_boxes(env: &Env, fleet: &mut Fleet) {
    let admin = fleet.admin.display().to_string();
    // `purge` of the fleet's admin directory (its CA) refuses, and makes no
    // pool for it on the way (it made and mounted a 38 GB image, then failed).
    let purged = run(Command::new(moat_bin()).args(["purge", "--state-dir", &admin]));
    assert_ne!(purged.status, Some(0));
    assert!(purged.stderr.contains("not a server's state directory"), "{}", purged.stderr);
    assert!(!fleet.admin.join("pool.img").exists() && fleet.admin.join("fleet.json").exists());
    moat(&["node", "cordon", "n1", "--state-dir", &admin]).ok();
    let state = |name: &str| {
        let nodes = fleet.nodes_json();
        nodes.as_array().unwrap().iter().find(|n| n["name"] == name).unwrap()["state"].as_str().unwrap().to_string()
    };
    assert_eq!(state("n1"), "cordoned");
    for i in 0..3 {
        let name = format!("c{i}");
        fleet.alice(env, i % 2, None, &["new", &name, "--image", "busybox"]).ok();
        assert_ne!(fleet.listed(env, 0, &name).1, "n1", "{name} went to a cordoned node");
    }
    let out = fleet.alice(env, 0, None, &["new", "c9", "--image", "busybox", "--node", "n1"]);
    assert_ne!(out.status, Some(0));
    assert!(out.stderr.contains("n1") && out.stderr.trim().lines().count() == 1, "{}", out.stderr);
    // Its boxes are still served.
    assert_eq!(fleet.alice(env, 1, Some("fb1"), &["hostname"]).ok().stdout, "fb1\n");
    assert_ne!(moat(&["node", "cordon", "nosuch", "--state-dir", &admin]).status, Some(0));
    moat(&["node", "uncordon", "n1", "--state-dir", &admin]).ok();
    assert_eq!(state("n1"), "live");
    fleet.alice(env, 0, None, &["new", "c9", "--image", "busybox", "--node", "n1"]).ok();
    for name in ["c0", "c1", "c2", "c9"] {
        fleet.alice(env, 0, None, &["rm", name]).ok();
    }
}

/// Ask mode across the fleet: questions from boxes on two nodes reach their
/// owner's one `ask` through a front door, under numbers no two nodes share,
/// and each answer, given through either front door, reaches the node that
/// holds its question.
pub fn questions_from_every_node_reach_one_ask(env: &Env, fleet: &mut Fleet) {
    // (curl: busybox's static wget cannot look a name up.)
    copy_debian_image(env, fleet, 1);
    copy_debian_image(env, fleet, 3);
    fleet.new_box(env, 0, "qa1", 1, &["--ask"]);
    fleet.new_box(env, 1, "qa3", 3, &["--ask"]);
    let mut watch = ssh_to(fleet.fronts[0].port, &env.alice, None, &[], &["ask"]);
    let watch_err = env.dir.join("fleet/ask.err");
    let err_file = std::fs::File::create(&watch_err).unwrap();
    let (mut watch, mut answers, lines) = spawn_with_lines(watch.stderr(err_file));
    // A node killed under the follow (its lease still live for a while):
    // the others' questions still come, and answers pass it over.
    std::thread::sleep(Duration::from_millis(500));
    fleet.nodes[1].kill();
    let dial = |name: &str, f: usize| {
        let mut cmd =
            ssh_to(fleet.fronts[f].port, &env.alice, Some(name), &[], &["curl -sS -m 40 http://web.test/asked"]);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let (on_n1, on_n3) = (dial("qa1", 0), dial("qa3", 1));
    // "TIME ? ID  box NAME wants HOST:PORT": both boxes' questions, by number.
    let mut asked = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while asked.len() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left).unwrap_or_else(|_| {
            let err = std::fs::read_to_string(&watch_err).unwrap_or_default();
            panic!("ask showed {asked:?} only; it said: {err}")
        });
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(at) = words.iter().position(|w| *w == "?") {
            let (id, name) = (words[at + 1].to_string(), words[at + 3].to_string());
            assert!(line.contains("wants web.test"), "{line}");
            asked.insert(name, id);
        }
    }
    assert_ne!(asked["qa1"], asked["qa3"], "two nodes numbered their questions alike");
    writeln!(answers, "{} once", asked["qa1"]).unwrap();
    let denied = fleet.alice(env, 1, None, &["ask", &asked["qa3"], "deny"]).ok();
    assert!(denied.stdout.contains("is refused it"), "{}", denied.stdout);
    let again = fleet.alice(env, 1, None, &["ask", &asked["qa3"], "deny"]);
    assert_eq!(again.status, Some(1));
    assert!(again.stderr.contains("no open question"), "{}", again.stderr);
    let body = |child: Child| String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout).into_owned();
    assert_eq!(body(on_n1), "GET /asked host=web.test body=0\n");
    assert_eq!(body(on_n3), "", "the denied box reached the name");
    drop(answers);
    let _ = watch.kill();
    let _ = watch.wait();
    for name in ["qa1", "qa3"] {
        fleet.alice(env, 0, None, &["rm", name]).ok();
    }
    fleet.nodes[1].restart();
    fleet.wait_for_live_nodes(3);
}

pub fn a_killed_front_door_leaves_the_other_serving(env: &Env, fleet: &mut Fleet) {
    fleet.fronts[0].kill();
    let out = fleet.alice(env, 1, Some("fb1"), &["echo", "still"]).ok();
    assert_eq!(out.stdout, "still\n");
    assert_ne!(fleet.alice(env, 0, None, &["ls"]).status, Some(0), "the killed one is gone");
}

pub fn a_killed_node_is_lost_and_the_rest_answer(env: &Env, fleet: &mut Fleet) {
    let started = Instant::now();
    fleet.nodes[2].kill();
    loop {
        if fleet.listed(env, 1, "fb3").0 == "node-lost" {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(15), "fb3 not node-lost within 15 s");
        std::thread::sleep(Duration::from_millis(250));
    }
    let out = fleet.alice(env, 1, Some("fb3"), &["true"]);
    assert_ne!(out.status, Some(0));
    assert!(out.stderr.contains("node n3") && out.stderr.trim().lines().count() == 1, "{}", out.stderr);
    assert_eq!(fleet.alice(env, 1, Some("fb1"), &["hostname"]).ok().stdout, "fb1\n");
    let info = fleet.alice(env, 1, None, &["info", "fb3"]).ok();
    assert!(info.stdout.contains("state:    node-lost"), "{}", info.stdout);
    // Back: it recovers its boxes from the store before it serves them.
    fleet.nodes[2].restart();
    fleet.wait_for_live_nodes(3);
    assert_eq!(fleet.alice(env, 1, Some("fb3"), &["hostname"]).ok().stdout, "fb3\n");
}

pub fn a_store_outage_spares_running_sessions(env: &Env, fleet: &mut Fleet) {
    let mut session = ssh_to(
        fleet.fronts[1].port,
        &env.alice,
        Some("fb1"),
        &[],
        &["for i in 1 2 3 4 5 6 7 8; do echo tick $i; sleep 1; done"],
    );
    let session = session.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    fleet.pg.stop();
    let out = fleet.alice(env, 1, None, &["ls"]);
    assert_ne!(out.status, Some(0));
    assert!(out.stderr.contains("unreachable") && out.stderr.trim().lines().count() == 1, "{}", out.stderr);
    std::thread::sleep(Duration::from_secs(2));
    fleet.pg.start_again();
    let done: Ran = session.wait_with_output().unwrap().into();
    assert_eq!(done.status, Some(0), "{}", done.stderr);
    assert!(done.stdout.ends_with("tick 8\n"), "{}", done.stdout);
    // Working again, no restart: the first request after the store is back.
    assert!(fleet.alice(env, 1, None, &["ls"]).ok().stdout.contains("fb1"));
    assert_eq!(fleet.alice(env, 1, Some("fb2"), &["hostname"]).ok().stdout, "fb2\n");
}
