//! Copy-on-write storage: dup, diff, promote, lineage, identity, disk limits,
//! and a dup interrupted by a crash.

use crate::fixture::{run, run_briefly, unique, Daemon};
use crate::Env;

/// What makes a machine itself, read from inside a box.
const IDENTITY: &str = "cat /etc/machine-id; hostname; cat /etc/hostname; \
    sha256sum /var/lib/systemd/random-seed | cut -c1-16; ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub | cut -d' ' -f2; \
    sha256sum /etc/moat/ca.pem | cut -c1-16";

fn json(env: &Env, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&env.alice(None, args).ok().stdout).expect("json")
}

pub fn dup_copies_and_makes_a_new_machine(env: &Env) {
    let (src, dst) = (unique("orig"), unique("copy"));
    env.new_box(&src, &[]);
    // Give the source everything an identity has: host keys and a random seed.
    env.alice(
        Some(&src),
        &["ssh-keygen -A >/dev/null && mkdir -p /var/lib/systemd && head -c 512 /dev/urandom > /var/lib/systemd/random-seed \
           && echo data > /root/file && (sleep 1000 >/dev/null 2>&1 &)"],
    )
    .ok();
    let out = env.alice(None, &["dup", &src, &dst]).ok();
    assert_eq!(out.stdout, format!("{dst}\n"));

    // The copy has the source's files, and its own identity in every respect
    // (a VM box's copy too, though the guest made its keys and seed itself:
    // the host never reads a guest's disk).
    assert_eq!(env.alice(Some(&dst), &["cat /root/file"]).ok().stdout, "data\n");
    assert_new_machine(env, &src, &dst);

    // Each box's CA key stays on the host: it is in no file of the box (the
    // CA's certificate is, which shows the search works).
    for name in [&src, &dst] {
        let id = json(env, &["info", name, "--json"])["id"].as_str().unwrap().to_string();
        let key = std::fs::read_to_string(env.daemon.state_dir.join("pool/keys").join(format!("{id}.ca.pem"))).unwrap();
        let mut lines = key.lines().skip_while(|l| !l.contains("PRIVATE KEY"));
        let body = lines.nth(1).unwrap_or_else(|| panic!("no private key in the host's file of {name}"));
        let search =
            format!("grep -rlF -- '{body}' /etc /root /tmp /var /usr/local /home 2>/dev/null; ls /etc/moat/ca.pem");
        let found = env.alice(Some(name), &[&search]).stdout;
        assert_eq!(found, "/etc/moat/ca.pem\n", "{name}'s CA key is in its files");
    }

    // The source kept running (its process survived the freeze). A namespace
    // box's copy has a fresh process tree; a VM box's copy is the very
    // machine, its processes with it (and a new identity all the same).
    let ps = |name: &str| env.alice(Some(name), &["ps -e -o comm= | grep -c '^sleep$' || true"]).ok().stdout;
    assert_eq!(ps(&src), "1\n");
    assert_eq!(ps(&dst), if crate::in_vm_pass() { "1\n" } else { "0\n" });

    // Writes on either side stay on that side.
    env.alice(Some(&dst), &["echo child > /root/file; touch /root/only-child"]).ok();
    env.alice(Some(&src), &["touch /root/only-parent"]).ok();
    assert_eq!(env.alice(Some(&src), &["cat /root/file; ls /root"]).ok().stdout, "data\nfile\nonly-parent\n");
    assert_eq!(env.alice(Some(&dst), &["cat /root/file; ls /root"]).ok().stdout, "child\nfile\nonly-child\n");

    // Lineage shows in ls and info.
    let boxes = json(env, &["ls", "--json"]);
    let me = boxes.as_array().unwrap().iter().find(|b| b["name"] == dst.as_str()).unwrap();
    assert_eq!(me["parent"], src.as_str());
    assert!(env.alice(None, &["info", &dst]).ok().stdout.contains(&format!("parent:   {src} (duplicated at")));
    let table = env.alice(None, &["ls"]).ok().stdout;
    let row = table.lines().find(|l| l.starts_with(&format!("{dst} "))).unwrap();
    assert!(row.ends_with(&format!("  {src}")), "{row}");

    // A copy of a stopped box (booted afresh, not resumed) is a new machine too.
    env.alice(None, &["stop", &src]).ok();
    let cold = unique("cold");
    env.alice(None, &["dup", &src, &cold]).ok();
    assert_new_machine(env, &src, &cold);
    for name in [&cold, &dst, &src] {
        env.alice(None, &["rm", name]).ok();
    }
}

/// `dst` is a machine of its own, not `src` again: every part of
/// [`IDENTITY`] differs, and it goes by its own name.
fn assert_new_machine(env: &Env, src: &str, dst: &str) {
    let a = env.alice(Some(src), &[IDENTITY]).ok().stdout;
    let b = env.alice(Some(dst), &[IDENTITY]).ok().stdout;
    let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    assert_eq!(a.len(), 6, "{a:?}");
    assert_eq!(b.len(), 6, "{b:?}");
    let parts = ["machine-id", "hostname", "/etc/hostname", "random seed", "ssh host key", "TLS CA"];
    let copied: Vec<&str> = parts.iter().zip(a.iter().zip(&b)).filter(|(_, (a, b))| a == b).map(|(p, _)| *p).collect();
    assert!(copied.is_empty(), "{dst}: copied, not re-minted: {copied:?}");
    assert_eq!(b[1], dst);
}

pub fn dup_of_a_box_whose_processes_died(env: &Env) {
    let (src, dst) = (unique("dead"), unique("revived"));
    env.new_box(&src, &["--image", "busybox"]);
    env.alice(Some(&src), &["echo kept > /root/f"]).ok();
    let id = json(env, &["info", &src, "--json"])["id"].as_str().unwrap().to_string();
    crate::restart::kill_box_processes(&id);
    env.alice(None, &["dup", &src, &dst]).ok();
    assert_eq!(env.alice(Some(&dst), &["cat /root/f"]).ok().stdout, "kept\n");
    // The source boots again on its next session.
    assert_eq!(env.alice(Some(&src), &["cat /root/f"]).ok().stdout, "kept\n");
}

pub fn diff_lists_changes(env: &Env) {
    let (a, b) = (unique("diffa"), unique("diffb"));
    env.new_box(&a, &["--image", "busybox"]);
    // npm unpacks every file with a 1985 mtime: an upgrade in place can
    // keep a file's size and mtime, and is still a change.
    let npm = |version: &str| format!("echo 1.2.{version} > /srv/pkg && touch -d '1985-10-26 08:15:00' /srv/pkg");
    env.alice(
        Some(&a),
        &[&format!(
            "mkdir -p /srv && echo 1 > /srv/edit && echo x > /srv/gone && echo same > /srv/same && {}",
            npm("3")
        )],
    )
    .ok();
    env.alice(None, &["dup", &a, &b]).ok();
    env.alice(
        Some(&b),
        &[&format!("echo 22 > /srv/edit && rm /srv/gone && mkdir /srv/new && echo n > /srv/new/file && {}", npm("4"))],
    )
    .ok();
    let out = env.alice(None, &["diff", &a, &b]).ok().stdout;
    let srv: Vec<&str> = out.lines().filter(|l| l.contains(" /srv/")).collect();
    assert_eq!(srv, ["M /srv/edit", "D /srv/gone", "A /srv/new", "A /srv/new/file", "M /srv/pkg"], "{out}");
    // The copy's identity files differ too (in a VM box, with the guest's
    // record of what the host wrote), and nothing else.
    let other: Vec<&str> = out.lines().filter(|l| !l.contains(" /srv/") && !l.starts_with("M /etc/")).collect();
    let identity = |l: &&str| l.starts_with("M /root") || *l == "M /srv" || *l == "M /var/lib/moat/host-files";
    assert!(other.iter().all(identity), "{other:?}");
    let changes = json(env, &["diff", &a, &b, "--json"]);
    let edit = changes.as_array().unwrap().iter().find(|c| c["path"] == "/srv/edit").unwrap();
    assert_eq!(edit["change"], "modified");
    // Reversed, additions become deletions.
    let back = env.alice(None, &["diff", &b, &a]).ok().stdout;
    assert!(back.lines().any(|l| l == "D /srv/new/file") && back.lines().any(|l| l == "A /srv/gone"), "{back}");
    // Two unrelated boxes of one image compare too.
    let c = unique("diffc");
    env.new_box(&c, &["--image", "busybox"]);
    let out = env.alice(None, &["diff", &a, &c]).ok().stdout;
    assert!(out.lines().any(|l| l == "D /srv/edit"), "{out}");
    // A name the box chose cannot forge a line or reach the owner's terminal.
    env.alice(Some(&b), &["touch \"/srv/$(printf 'evil\\nD forged\\033]0;title\\007')\""]).ok();
    let out = env.alice(None, &["diff", &a, &b]).ok().stdout;
    assert!(!out.lines().any(|l| l.starts_with("D forged")), "{out}");
    assert!(out.lines().any(|l| l == "A /srv/evil\\nD forged\\u{1b}]0;title\\u{7}"), "{out}");
    assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out}");
}

/// A file whose only change is an extended attribute (as `setcap` makes:
/// an image pushed from the box carries it) is a change.
pub fn diff_sees_attributes(env: &Env) {
    let (a, b) = (unique("xattra"), unique("xattrb"));
    env.new_box(&a, &[]);
    env.alice(Some(&a), &["mkdir -p /srv && echo same > /srv/tagged && echo same > /srv/plain"]).ok();
    env.alice(None, &["dup", &a, &b]).ok();
    let set = "python3 -c \"import os; os.setxattr('/srv/tagged', 'user.moat', b'1')\"";
    env.alice(Some(&b), &[set]).ok();
    let out = env.alice(None, &["diff", &a, &b]).ok().stdout;
    let srv: Vec<&str> = out.lines().filter(|l| l.contains(" /srv/")).collect();
    assert_eq!(srv, ["M /srv/tagged"], "{out}");
    env.alice(None, &["rm", &a]).ok();
    env.alice(None, &["rm", &b]).ok();
}

/// A diff streams what it finds, and what a box holds cannot make it cost the
/// daemon memory: paths past PATH_MAX end it with a clear error.
pub fn diff_streams_and_is_bounded(env: &Env) {
    let (a, b) = (unique("bnda"), unique("bndb"));
    env.new_box(&a, &[]);
    env.alice(None, &["dup", &a, &b]).ok();
    let many = "import os\nos.mkdir('/many')\nfor i in range(30000): open(f'/many/f{i}', 'w').close()";
    env.alice(Some(&b), &[&format!("python3 -c \"{many}\"")]).ok();
    let out = env.alice(None, &["diff", &a, &b]).ok().stdout;
    assert_eq!(out.lines().filter(|l| l.starts_with("A /many/f")).count(), 30000);
    let listed = json(env, &["diff", &a, &b, "--json"]);
    assert_eq!(listed.as_array().unwrap().len(), out.lines().count());
    // 40 branches of 40 levels of 200-byte names: 8 KB paths, ~3 MB of names
    // (dash's cd goes a level at a time: the kernel takes no such path whole).
    let deep = "name=$(printf '%0200d' 0); for b in $(seq 40); do mkdir -p /deep/$b && cd /deep/$b && \
                for l in $(seq 40); do mkdir $name && cd $name; done; done";
    env.alice(Some(&b), &[deep]).ok();
    // The daemon's peak memory, in MiB, from its size now: writing 5 to
    // clear_refs resets the peak to the present size (else earlier work's
    // peak would hide the diff's).
    let pid = env.daemon.pid();
    let field = |name: &str| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with(name)).unwrap().to_string();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() >> 10
    };
    let peak = || field("VmHWM:");
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    let before = peak();
    let out = env.alice(None, &["diff", &a, &b]);
    assert_eq!(out.status, Some(1));
    assert!(out.stderr.contains("a path is longer than 4096 bytes"), "{}", out.stderr);
    assert!(out.stdout.lines().any(|l| l == "A /deep/1"), "printed before the limit: {:.300}", out.stdout);
    let grew = peak().saturating_sub(before);
    assert!(grew < 100, "the daemon's peak memory grew by {grew} MiB during a diff");
    // As JSON, what was printed before the limit is still a whole array.
    let cut = env.alice(None, &["diff", &a, &b, "--json"]);
    assert_eq!(cut.status, Some(1));
    let printed: serde_json::Value = serde_json::from_str(&cut.stdout).expect("a whole JSON array");
    assert!(printed.as_array().is_some_and(|changes| !changes.is_empty()), "{:.300}", cut.stdout);
    env.alice(None, &["rm", &a]).ok();
    env.alice(None, &["rm", &b]).ok();
}

pub fn promote_swaps_parent_and_child(env: &Env) {
    let (web, child) = (unique("web"), unique("try"));
    env.new_box(&web, &["--image", "busybox"]);
    env.alice(Some(&web), &["echo v1 > /root/app"]).ok();
    env.alice(None, &["dup", &web, &child]).ok();
    env.alice(Some(&child), &["echo v2 > /root/app"]).ok();
    let out = env.alice(None, &["promote", &child]).ok();
    let prev = format!("{web}-prev");
    assert_eq!(out.stdout, format!("{prev}\n"));
    // The parent's name now means the child's filesystem; the old one is kept.
    // Its running processes see the new host name too, not only its files.
    let names = "cat /root/app /etc/hostname; hostname";
    assert_eq!(env.alice(Some(&web), &[names]).ok().stdout, format!("v2\n{web}\n{web}\n"));
    assert_eq!(env.alice(Some(&prev), &[names]).ok().stdout, format!("v1\n{prev}\n{prev}\n"));
    let info = json(env, &["info", &web, "--json"]);
    assert_eq!(info["parent"], prev.as_str());
    assert_ne!(env.alice(None, &["info", &child]).status, Some(0));
    // A box that is not a duplicate cannot be promoted; a second promote finds
    // the -prev name taken.
    let orphan = unique("orphan");
    env.new_box(&orphan, &["--image", "busybox"]);
    let out = env.alice(None, &["promote", &orphan]);
    assert_eq!(out.stderr, format!("moat: box {orphan} was not duplicated from another box\n"));
    let again = unique("again");
    env.alice(None, &["dup", &web, &again]).ok();
    let out = env.alice(None, &["promote", &again]);
    assert_eq!(out.stderr, format!("moat: a box named {prev} already exists\n"));
    assert_eq!(env.alice(Some(&web), &["cat /root/app"]).ok().stdout, "v2\n");
}

pub fn bad_dups_create_nothing(env: &Env) {
    let (src, taken) = (unique("bsrc"), unique("btaken"));
    env.new_box(&src, &["--image", "busybox"]);
    env.new_box(&taken, &["--image", "busybox"]);
    // Other tests add boxes meanwhile: look for what these dups would have made.
    let names = || -> Vec<String> {
        json(env, &["ls", "--json"])
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["name"].as_str().unwrap().to_string())
            .collect()
    };
    let out = env.alice(None, &["dup", &src, &taken]);
    assert_eq!(
        (out.status, out.stderr.as_str()),
        (Some(1), format!("moat: a box named {taken} already exists\n").as_str())
    );
    let out = env.alice(None, &["dup", "no-such-box", "newname"]);
    assert_eq!(out.stderr, "moat: no box named no-such-box\n");
    // Across accounts: bob cannot see alice's box, so cannot copy it.
    let out = run(&mut env.daemon.ssh(&env.bob, None, &["dup", &src, "stolen"]));
    assert_eq!(out.stderr, format!("moat: no box named {src}\n"));
    assert!(!run(&mut env.daemon.ssh(&env.bob, None, &["ls"])).stdout.contains("stolen"));
    let after = names();
    assert_eq!(after.iter().filter(|n| **n == taken).count(), 1);
    assert!(!after.iter().any(|n| n == "newname" || n == "stolen"), "{after:?}");
}

pub fn disk_limit_is_enforced_and_rm_frees(env: &Env) {
    let name = unique("disk");
    env.new_box(&name, &["--image", "busybox", "--disk", "64M"]);
    let out = env
        .alice(Some(&name), &["dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1; echo rc=$?; du -m /root/fill"])
        .ok();
    let pool = env.daemon.state_dir.join("pool");
    let qgroups = || run(std::process::Command::new("btrfs").args(["qgroup", "show", "-re"]).arg(&pool)).stdout;
    let inconsistent = || {
        let show = run(std::process::Command::new("btrfs").args(["filesystem", "show"]).arg(&pool)).stdout;
        let uuid = show.split("uuid: ").nth(1).unwrap_or("").split_whitespace().next().unwrap_or("").to_string();
        std::fs::read_to_string(format!("/sys/fs/btrfs/{uuid}/qgroups/inconsistent")).unwrap_or_default()
    };
    assert!(
        out.stdout.contains("Disk quota exceeded"),
        "{}\ninconsistent: {}\n{}",
        out.stdout,
        inconsistent(),
        qgroups()
    );
    let used: u64 = out.stdout.lines().last().unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!(used <= 64, "wrote {used} MiB under a 64M limit");
    // The box still works, and freeing space inside it lets it write again.
    env.alice(Some(&name), &["rm /root/fill && sync && echo ok > /root/small"]).ok();
    let id = json(env, &["info", &name, "--json"])["id"].as_str().unwrap().to_string();
    let root = env.daemon.state_dir.join("pool/boxes").join(&id);
    assert!(root.exists());
    env.alice(None, &["rm", &name]).ok();
    assert!(!root.exists(), "rm left the box's filesystem behind");
}

/// `dup` then `rm` of the parent, repeated, cannot shed a box's disk limit:
/// what removed boxes left shared stays charged to the account, whose boxes
/// share one budget (and one memory budget). Files count against the limit
/// (metadata), and space freed goes back to the host's disk.
pub fn account_budgets_hold_across_dup_and_rm(env: &Env) {
    let state = env.dir.join("budget-state");
    let extra = ["--max-disk-per-account", "160M", "--max-memory-per-account", "1G"];
    let mut daemon = Daemon::start(state.clone(), env.daemon.keys_file.clone(), &extra);
    let ssh = |user: Option<&str>, args: &[&str]| run(&mut daemon.ssh(&env.alice, user, args));
    // Its own limit above the budget: the budget is what binds here.
    ssh(None, &["new", "b0", "--image", "busybox", "--disk", "200M", "--memory", "512M"]).ok();
    ssh(None, &["new", "other", "--image", "busybox", "--memory", "512M"]).ok();
    let out = ssh(None, &["new", "third", "--image", "busybox", "--memory", "256M"]);
    assert_eq!(
        out.stderr,
        "moat: with this box your boxes' memory limits add up to 1280M; this server allows 1G per account\n"
    );
    ssh(None, &["rm", "other"]).ok();
    // Each round writes 40 MiB, copies the box and removes the original.
    // A dup may be refused once the budget is spent, but only for that, and
    // not before the rounds have written more than the budget (else the
    // bound below would hold whatever dup does).
    let mut current = "b0".to_string();
    let mut refused = String::new();
    for round in 1..=5 {
        ssh(Some(&current), &[&format!("dd if=/dev/urandom of=/f{round} bs=1M count=40 2>/dev/null; sync")]);
        let next = format!("b{round}");
        let out = ssh(None, &["dup", &current, &next]);
        if out.status != Some(0) {
            refused = out.stderr;
            break;
        }
        ssh(None, &["rm", &current]).ok();
        current = next;
    }
    let copies: usize = current[1..].parse().unwrap();
    assert!(copies >= 3, "{copies} copies made, the last refused: {refused}");
    assert!(refused.is_empty() || refused.contains("per account"), "dup failed for another reason: {refused}");
    let held: u64 = ssh(Some(&current), &["du -sm / 2>/dev/null | tail -1"])
        .ok()
        .stdout
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(held <= 165, "one box holds {held} MiB under a 160M account budget");
    let usage: serde_json::Value = serde_json::from_str(&ssh(None, &["usage", "--json"]).ok().stdout).unwrap();
    let billed = usage["disk_bytes"].as_u64().unwrap() >> 20;
    assert!(billed + 8 >= held, "usage bills {billed} MiB for {held} MiB held");
    let out = ssh(None, &["new", "more", "--image", "busybox", "--memory", "256M"]);
    assert!(out.stderr.contains("all this server allows per account (160M)"), "{}", out.stderr);

    // Files are metadata, and metadata is charged: a 64M box cannot make
    // 300,000, and what it makes costs the pool at most 1.25 times its limit
    // (the bytes the pool holds, every copy of its metadata counted; before
    // pools kept one copy of metadata, empty files cost it twice the limit).
    ssh(None, &["rm", &current]).ok();
    wait_for("the removed boxes' space", || {
        ssh(None, &["new", "files", "--image", "busybox", "--disk", "64M", "--memory", "256M"]).status == Some(0)
    });
    let pool_used = || -> u64 {
        let usage =
            run(std::process::Command::new("btrfs").args(["filesystem", "usage", "-b"]).arg(state.join("pool")));
        let line = usage.stdout.lines().find(|l| l.trim_start().starts_with("Used:")).unwrap_or_default().to_string();
        line.split_whitespace().nth(1).unwrap_or_default().parse().unwrap_or_else(|_| panic!("{}", usage.stdout))
    };
    // The removed boxes' subvolumes cleaned first: their space going back
    // meanwhile would hide what the files take.
    run(std::process::Command::new("btrfs").args(["subvolume", "sync"]).arg(state.join("pool")));
    let used_before = pool_used();
    let made: u64 = ssh(
        Some("files"),
        &["mkdir /m; i=0; while [ $i -lt 300000 ] && true > /m/$i 2>/dev/null; do i=$((i+1)); done; echo $i"],
    )
    .ok()
    .stdout
    .trim()
    .parse()
    .unwrap();
    assert!(made < 300_000, "a 64M box made {made} empty files");
    run(std::process::Command::new("btrfs").args(["filesystem", "sync"]).arg(state.join("pool")));
    let grew = pool_used().saturating_sub(used_before) >> 20;
    assert!(grew <= 80, "{made} empty files under a 64M limit take {grew} MiB of the pool");

    // Space a box frees is given back to the host's disk (the loop image shrinks).
    let allocated = || {
        use std::os::unix::fs::MetadataExt;
        (std::fs::metadata(state.join("pool.img")).unwrap().blocks() * 512) >> 20
    };
    ssh(None, &["new", "big", "--image", "busybox", "--memory", "256M"]).ok();
    ssh(Some("big"), &["dd if=/dev/urandom of=/big bs=1M count=120 2>/dev/null; sync"]).ok();
    let before = allocated();
    ssh(Some("big"), &["rm /big; sync"]).ok();
    wait_for(&format!("the pool image to shrink from {before} MiB"), || allocated() + 100 <= before);
    daemon.purge();
}

/// `dup` then `rm` of the parent, repeated, cannot shed a box's own disk
/// limit: what a copy keeps alive of removed parents counts against it, and
/// stops counting once the copy frees it.
pub fn copies_are_charged_for_what_removed_parents_left(env: &Env) {
    let mut current = unique("line");
    env.new_box(&current, &["--image", "busybox", "--disk", "64M"]);
    for round in 1..=3 {
        env.alice(Some(&current), &[&format!("dd if=/dev/urandom of=/f{round} bs=1M count=40 2>/dev/null; sync")]);
        let next = unique("line");
        env.alice(None, &["dup", &current, &next]).ok();
        env.alice(None, &["rm", &current]).ok();
        current = next;
    }
    let held = |name: &str| -> u64 {
        let out = env.alice(Some(name), &["du -sm / 2>/dev/null | tail -1"]).ok().stdout;
        out.split_whitespace().next().unwrap().parse().unwrap()
    };
    let kept = held(&current);
    assert!(kept <= 64 + 8, "a --disk 64M box holds {kept} MiB after three rounds of dup, rm and 40 MiB written");
    // What it frees of its parents' data stops counting: it writes again.
    env.alice(Some(&current), &["rm -f /f1 /f2 /f3; sync"]).ok();
    wait_for("the freed space to count", || {
        env.alice(Some(&current), &["dd if=/dev/urandom of=/again bs=1M count=40 2>/dev/null && sync"]).status
            == Some(0)
    });
    env.alice(None, &["rm", &current]).ok();
}

/// Polls `done` for up to 60 s.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

/// Kills the daemon in the middle of a dup, at each point a crash could hit;
/// the next start leaves no copy and a source that runs (and answers: a VM
/// source's link to its agent was held for the save).
pub fn dup_interrupted_leaves_nothing(env: &Env) {
    for point in ["dup-while-frozen", "dup-after-snapshot"] {
        let state = env.dir.join(format!("crash-{point}{}", if crate::in_vm_pass() { "-vm" } else { "" }));
        let mut daemon = Daemon::start(state, env.daemon.keys_file.clone(), &[]);
        let ssh = |d: &Daemon, user: Option<&str>, args: &[&str]| run_briefly(&d.ssh(&env.alice, user, args));
        let mut new = vec!["new", "src", "--image", "busybox"];
        new.extend_from_slice(crate::pass_backend());
        ssh(&daemon, None, &new).ok();
        ssh(
            &daemon,
            Some("src"),
            &["echo before > /root/f; (while true; do echo . >> /root/tick; sleep 0.05; done) >/dev/null 2>&1 &"],
        )
        .ok();
        daemon.env = vec![("MOAT_FAULT".into(), point.into())];
        daemon.restart();
        let out = ssh(&daemon, None, &["dup", "src", "dst"]);
        assert_ne!(out.status, Some(0), "{point}: dup survived its crash");
        daemon.env.clear();
        daemon.restart();
        let boxes = ssh(&daemon, None, &["ls", "--json"]).ok().stdout;
        let names: Vec<serde_json::Value> = serde_json::from_str(&boxes).unwrap();
        assert_eq!(names.len(), 1, "{point}: {boxes}");
        assert_eq!(names[0]["name"], "src");
        let subvolumes = std::fs::read_dir(daemon.state_dir.join("pool/boxes")).unwrap().count();
        assert_eq!(subvolumes, 1, "{point}: a half-made copy's filesystem is left");
        // A running VM source's memory is its own file there; nothing else is.
        let src_memory = format!("{}.mem", names[0]["id"].as_str().unwrap());
        let saved: Vec<String> = std::fs::read_dir(daemon.state_dir.join("pool/vm-states"))
            .into_iter()
            .flatten()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| *name != src_memory)
            .collect();
        assert_eq!(saved, Vec::<String>::new(), "{point}: a half-made copy's saved machine is left");
        // The source is untouched and running: its loop ticks on (waited for).
        let tick = |d: &Daemon| ssh(d, Some("src"), &["wc -l < /root/tick"]).ok().stdout;
        let t1 = tick(&daemon);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while tick(&daemon) == t1 {
            assert!(std::time::Instant::now() < deadline, "{point}: the source is still frozen");
        }
        assert_eq!(ssh(&daemon, Some("src"), &["cat /root/f"]).ok().stdout, "before\n");
        // And the same dup now works.
        ssh(&daemon, None, &["dup", "src", "dst"]).ok();
        daemon.purge();
    }
}
