//! Package rules: the gateway reads the stand-in PyPI, npm and crates.io as
//! their own protocols, driven by the real pip, uv, npm and cargo in a box. A
//! fresh version is left out of the index (installers pick the older one),
//! a denied name, a version off the lock, a malicious version (the OSV
//! export) and a file whose hash does not match its index are refused with
//! the rule in the client's output; a malformed index is refused, and the
//! gateway serves on; a second box installs from the shared cache (the
//! stand-in sees one download), and a third with the index down;
//! `packages NAME` lists what came in.

use std::process::Stdio;

use crate::egress::sh;
use crate::fixture::unique;
use crate::Env;

/// A wheel of `name` `version` (`import NAME; NAME.VERSION`), carrying
/// `mib` MiB of noise.
fn wheel(env: &Env, name: &str, version: &str, mib: usize) -> String {
    let file = format!("{name}-{version}-py3-none-any.whl");
    let path = env.net.dir.join("data/pypi").join(&file);
    let script = format!(
        "import os, sys, zipfile\nz = zipfile.ZipFile(sys.argv[1], 'w')\n\
         z.writestr('{name}/__init__.py', 'VERSION = \"{version}\"\\n')\n\
         z.writestr('{name}/noise.bin', os.urandom({mib} << 20))\n\
         z.writestr('{name}-{version}.dist-info/METADATA', 'Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n')\n\
         z.writestr('{name}-{version}.dist-info/WHEEL', 'Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
         z.writestr('{name}-{version}.dist-info/RECORD', '')\n"
    );
    let ok = std::process::Command::new("python3").args(["-c", &script]).arg(&path).status().unwrap().success();
    assert!(ok, "wheel {file}");
    file
}

/// An npm tarball of `name` `version`.
fn tarball(env: &Env, name: &str, version: &str) -> String {
    let file = format!("{name}-{version}.tgz");
    let json = format!(r#"{{"name": "{name}", "version": "{version}", "main": "index.js"}}"#);
    let js = format!("module.exports = {{ version: \"{version}\" }};");
    crate::testnet::tar_gz(
        &env.net.dir.join("data/npm").join(&file),
        &[("package/package.json", &json), ("package/index.js", &js)],
    );
    file
}

/// A .crate of `name` `version`.
fn krate(env: &Env, name: &str, version: &str) {
    let file = format!("{name}-{version}.crate");
    let toml = format!("[package]\nname = \"{name}\"\nversion = \"{version}\"\nedition = \"2021\"\n");
    let dir = format!("{name}-{version}");
    crate::testnet::tar_gz(
        &env.net.dir.join("data/crates").join(file),
        &[(&format!("{dir}/Cargo.toml"), &toml), (&format!("{dir}/src/lib.rs"), "pub const V: u32 = 1;\n")],
    );
}

/// Marks a stand-in file published `secs` ago.
fn published_ago(env: &Env, registry: &str, file: &str, secs: u64) {
    let date = std::process::Command::new("date")
        .args(["-u", "-d", &format!("{secs} seconds ago"), "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .unwrap();
    let path = env.net.dir.join("data").join(registry).join(format!("{file}.published"));
    std::fs::write(path, date.stdout).unwrap();
}

/// How often the stand-ins served `path` of `host`.
fn downloads(env: &Env, host: &str, path: &str) -> usize {
    let line = format!("GET {host} {path}\n");
    env.net.received().matches(&line).count()
}

/// A package name of this run (no '-': a wheel's name has none).
fn package_name(prefix: &str) -> String {
    unique(prefix).replace('-', "")
}

fn policy(env: &Env, name: &str, words: &[&str]) {
    let mut all = vec!["policy", name, "packages"];
    all.extend_from_slice(words);
    env.alice(None, &all).ok();
}

/// What a test puts on the stand-in PyPI: a package with an old version
/// (of `old_mib` MiB) and one published an hour ago, a name to deny, and a
/// package whose file is served other than its index promises.
struct Pypi {
    name: String,
    old_wheel: String,
    fresh_wheel: String,
    denied: String,
    tampered: String,
    tampered_wheel: String,
}

fn pypi_packages(env: &Env, prefix: &str, old_mib: usize) -> Pypi {
    let name = package_name(prefix);
    let old_wheel = wheel(env, &name, "1.0", old_mib);
    let fresh_wheel = wheel(env, &name, "2.0", 0);
    published_ago(env, "pypi", &fresh_wheel, 3600);
    let denied = package_name(&format!("{prefix}typo"));
    wheel(env, &denied, "1.0", 0);
    let tampered = package_name(&format!("{prefix}tamper"));
    let tampered_wheel = wheel(env, &tampered, "1.0", 0);
    std::fs::write(env.net.dir.join("data/pypi").join(format!("{tampered_wheel}.served")), b"not the wheel").unwrap();
    Pypi { name, old_wheel, fresh_wheel, denied, tampered, tampered_wheel }
}

pub fn package_rules_decide_what_comes_in(env: &Env) {
    // (3 MiB: an answer larger than TLS and socket buffers must reach the box whole.)
    let Pypi { name: new, old_wheel, fresh_wheel, denied, tampered, tampered_wheel } = pypi_packages(env, "ok", 3);
    let broken = package_name("broken");
    std::fs::write(env.net.dir.join("data/pypi").join(format!("{broken}.broken")), b"{\"files\": 7").unwrap();
    // npm: the same, and a version the OSV export reports malicious.
    tarball(env, &new, "1.0.0");
    let fresh_tgz = tarball(env, &new, "2.0.0");
    published_ago(env, "npm", &fresh_tgz, 3600);
    tarball(env, "evil", "1.0.0");
    std::fs::write(env.net.dir.join("data/npm").join(format!("{broken}.broken")), b"[1, 2").unwrap();
    // crates.io: the same.
    krate(env, &new, "1.0.0");
    krate(env, &new, "2.0.0");
    published_ago(env, "crates", &format!("{new}-2.0.0.crate"), 3600);

    let a = unique("pkg");
    env.new_box(&a, &["--policy", "registries"]);
    policy(env, &a, &["min-age", "1d"]);
    policy(env, &a, &["deny", &format!("pypi:{denied}")]);
    policy(env, &a, &["advisories"]);
    let shown = env.alice(None, &["policy", &a]).ok().stdout;
    for want in
        ["packages min-age 1d --unknown-age allow", &format!("packages deny pypi:{denied}"), "packages advisories"]
    {
        assert!(shown.contains(want), "policy lacks {want:?}:\n{shown}");
    }
    let pip = |name: &str, what: &str| {
        sh(env, name, &format!("rm -rf /tmp/dl; pip download -q --disable-pip-version-check --no-deps --no-cache-dir -d /tmp/dl {what} 2>&1; ls /tmp/dl"))
    };

    // min-age: pip picks the older version (the fresh one is not in the index it sees).
    let (_, out) = pip(&a, &new);
    assert_eq!(out.trim(), old_wheel, "pip under min-age");
    // A version asked by name is refused, the rule in pip's output.
    let (_, out) = pip(&a, &format!("{new}==2.0"));
    assert!(!out.contains(&fresh_wheel), "{out}");
    // A denied name: refused, the rule in pip's output.
    let (_, out) = pip(&a, &denied);
    assert!(out.contains(&format!("packages deny pypi:{denied}")), "pip of a denied name:\n{out}");
    // A file whose hash is not its index's: refused, and not kept.
    let (_, out) = pip(&a, &tampered);
    assert!(out.contains("not the sha256:"), "pip of a tampered file:\n{out}");
    // Nor by a path a lenient server reads as the same file (nginx merges
    // `//`); the gateway's router must not read it as something else.
    for path in [
        format!("//files/{tampered_wheel}"),
        format!("/files;x/{tampered_wheel}"),
        format!("//files/{denied}-1.0-py3-none-any.whl"),
    ] {
        let (_, out) = sh(env, &a, &format!("curl -sS --path-as-is \"https://pypi.org{path}\""));
        assert!(!out.contains("not the wheel") && out.contains("servers read more than one way"), "{path}: {out}");
    }
    // A malformed index: refused (pip shows no index's error; the log says
    // why), and the gateway serves on.
    let (_, out) = pip(&a, &broken);
    assert!(out.contains("No matching distribution"), "pip of a broken index:\n{out}");
    let log = crate::egress::log(env, &a);
    assert!(
        log.contains(&format!("the index of pypi {broken}: no \"files\" list")) || log.contains("not JSON"),
        "{log}"
    );
    let (_, out) = pip(&a, &new);
    assert_eq!(out.trim(), old_wheel, "the gateway serves on after a malformed index");

    // npm: min-age picks 1.0.0; a malicious version is refused by its advisory.
    let (status, out) = sh(
        env,
        &a,
        &format!("mkdir -p /tmp/app && cd /tmp/app && npm install --no-audit {new} 2>&1 && node -e 'console.log(require(\"{new}\").version)'"),
    );
    assert_eq!((status, out.lines().last()), (Some(0), Some("1.0.0")), "npm under min-age:\n{out}");
    let (status, out) = sh(env, &a, "cd /tmp/app && npm install --no-audit evil 2>&1");
    assert_ne!(status, Some(0));
    assert!(out.contains("MAL-2026-7"), "npm of a malicious version:\n{out}");
    let (status, out) = sh(env, &a, &format!("cd /tmp/app && npm install --no-audit {broken} 2>&1"));
    assert!(status != Some(0) && out.contains("moat"), "npm of a broken document:\n{out}");

    // A lock: only its versions and hashes pass.
    let wrong = format!("{new}==1.0 --hash=sha256:{}\n", "0".repeat(64));
    let mut cmd = env.daemon.ssh(&env.alice, None, &["policy", &a, "packages", "lock"]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), wrong.as_bytes()).unwrap();
    drop(child.stdin.take());
    let done = child.wait_with_output().unwrap();
    assert!(done.status.success(), "lock: {}", String::from_utf8_lossy(&done.stderr));
    assert!(String::from_utf8_lossy(&done.stdout).contains("packages lock pypi: 1 versions"));
    let (_, out) = pip(&a, &new);
    assert!(out.contains("packages lock"), "pip of a file off the lock:\n{out}");
    policy(env, &a, &["unlock", "pypi"]);

    // cargo: min-age picks 1.0.0 from the sparse index.
    crate::egress::bring_cargo(env, &a);
    let (status, out) = sh(
        env,
        &a,
        &format!(
            "{}; {} && {} && ls $CARGO_HOME/registry/cache/*/",
            crate::egress::CARGO_ENV,
            crate::egress::cargo_project("/tmp/crate", &format!("{new} = \"*\"")),
            crate::egress::CARGO_FETCH
        ),
    );
    assert_eq!(status, Some(0), "cargo:\n{out}");
    assert!(out.contains(&format!("{new}-1.0.0.crate")) && !out.contains("2.0.0"), "cargo under min-age:\n{out}");

    // What came in, from the host's side.
    let listed = env.alice(None, &["packages", &a, "--json"]).ok().stdout;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&listed).unwrap();
    let row = |eco: &str, version: &str, verdict: &str| {
        rows.iter()
            .any(|r| r["ecosystem"] == eco && r["name"] == new && r["version"] == version && r["verdict"] == verdict)
    };
    assert!(row("pypi", "1.0", "allow") && row("npm", "1.0.0", "allow") && row("crates", "1.0.0", "allow"), "{listed}");
    assert!(rows.iter().any(|r| r["name"] == "evil" && r["verdict"] == "deny"), "{listed}");
    assert!(rows.iter().all(|r| r["source"] == "upstream" || r["source"] == "cache"), "{listed}");
    let log = crate::egress::log(env, &a);
    assert!(log.contains("packages min-age 1d"), "the log names the rule:\n{log}");

    // A copy's packages show in `diff`: what each let in since the split.
    let copy = unique("pkg");
    env.alice(None, &["dup", &a, &copy]).ok();
    let (_, out) = pip(&copy, &new);
    assert_eq!(out.trim(), old_wheel, "the copy keeps the rules");
    let added = format!("{copy} since the split let in these package files:\n  pypi {new} 1.0 ({old_wheel})\n");
    // (The log reaches the store a moment after pip is done.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let diff = loop {
        let diff = env.alice(None, &["diff", &a, &copy]).ok().stdout;
        if diff.contains(&added) || std::time::Instant::now() > deadline {
            break diff;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(diff.contains(&added), "diff lacks the copy's package:\n{diff}");
    assert!(!diff.contains(&format!("{a} since the split let in")), "{diff}");
    env.alice(None, &["rm", &copy]).ok();

    // A second box is served from the cache: the stand-in saw one download.
    let b = unique("pkg");
    env.new_box(&b, &["--policy", "registries"]);
    let (_, out) = pip(&b, &new);
    assert!(out.contains(&fresh_wheel), "without rules the newest comes in: {out}");
    let (_, out) = pip(&b, &format!("{new}==1.0"));
    assert_eq!(out.trim(), old_wheel);
    assert_eq!(
        downloads(env, "pypi.org", &format!("/files/{old_wheel}")),
        1,
        "the second box's wheel came from the registry"
    );
    let listed = env.alice(None, &["packages", &b, "--json"]).ok().stdout;
    assert!(listed.contains("\"source\": \"cache\"") || listed.contains("\"source\":\"cache\""), "{listed}");
    // The tampered file was never kept: every ask goes to the registry, and is refused.
    let (_, out) = pip(&b, &tampered);
    assert!(out.contains("not the sha256:"), "{out}");
    assert_eq!(downloads(env, "pypi.org", &format!("/files/{tampered_wheel}")), 2);

    // The registry down: a new box reinstalls what the cache holds, from the
    // last index read (once it is no longer fresh, a minute on).
    std::fs::write(env.net.dir.join("data/pypi").join(format!("{new}.down")), b"").unwrap();
    std::thread::sleep(std::time::Duration::from_secs(61));
    let c = unique("pkg");
    env.new_box(&c, &["--policy", "registries"]);
    let (_, out) = pip(&c, &format!("{new}==1.0"));
    assert_eq!(out.trim(), old_wheel, "a reinstall with the index down");
    assert!(env.net.received().contains(&format!("GET pypi.org /simple/{new}/")), "the index was not asked");
    assert_eq!(downloads(env, "pypi.org", &format!("/files/{old_wheel}")), 1);
    for name in [&a, &b, &c] {
        env.alice(None, &["rm", name]).ok();
    }
}

/// uv (the binary of its PyPI wheel, as a user brings it) installs under
/// the same rules as pip: its own resolver, HTTP client and TLS stack, which
/// read the index as JSON and trust the gateway's CA from the box's
/// environment alone.
pub fn uv_installs_under_the_same_rules(env: &Env) {
    let Pypi { name, old_wheel, fresh_wheel: _, denied, tampered, tampered_wheel: _ } = pypi_packages(env, "uv", 2);

    let a = unique("pkg");
    env.new_box(&a, &["--policy", "registries"]);
    policy(env, &a, &["min-age", "1d"]);
    policy(env, &a, &["deny", &format!("pypi:{denied}")]);
    crate::egress::bring(env, &a, UV, "/usr/local/bin/uv");
    let uv = |what: &str| {
        sh(env, &a, &format!("rm -rf /tmp/uvt; uv pip install --no-cache --target /tmp/uvt {what} 2>&1; ls /tmp/uvt"))
    };

    // min-age: uv resolves to the older version; asked for the fresh one by
    // name, it finds none.
    let (_, out) = uv(&name);
    assert!(out.contains(&format!("{name}-1.0.dist-info")), "uv under min-age:\n{out}");
    let (_, out) = uv(&format!("{name}==2.0"));
    assert!(out.contains(&format!("there is no version of {name}==2.0")), "uv of a fresh version:\n{out}");
    // A denied name and a tampered file: refused, the rule in uv's output.
    let (_, out) = uv(&denied);
    assert!(out.contains(&format!("packages deny pypi:{denied}")), "uv of a denied name:\n{out}");
    let (_, out) = uv(&tampered);
    assert!(out.contains("not the sha256:"), "uv of a tampered file:\n{out}");
    // uv reads a wheel more than once (its metadata first): the registry
    // saw one download, the rest came from the cache; and the gateway read
    // the index and fetched the wheel on one connection.
    assert_eq!(downloads(env, "pypi.org", &format!("/files/{old_wheel}")), 1);
    let peers: std::collections::HashSet<String> = env
        .net
        .received()
        .split("----\n")
        .filter(|r| {
            r.starts_with(&format!("GET pypi.org /simple/{name}/"))
                || r.starts_with(&format!("GET pypi.org /files/{old_wheel}"))
        })
        .filter_map(|r| r.lines().find_map(|l| l.strip_prefix("peer ")).map(String::from))
        .collect();
    assert_eq!(peers.len(), 1, "the index and the wheel came over {peers:?}");
    let listed = env.alice(None, &["packages", &a, "--json"]).ok().stdout;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&listed).unwrap();
    assert!(
        rows.iter()
            .any(|r| r["ecosystem"] == "pypi" && r["name"] == name && r["version"] == "1.0" && r["verdict"] == "allow"),
        "{listed}"
    );
    env.alice(None, &["rm", &a]).ok();
}

/// Where scripts/deps.sh puts uv's binary.
const UV: &str = "/usr/local/libexec/moat-test/uv";

/// A gateway killed mid-download keeps nothing of the file: the one that
/// replaces it fetches the file whole again, checked. And a gateway that
/// starts while a registry's index is down serves the last index the one
/// before it read, so a box still installs from the cache. (Alone after
/// the rest: it kills the shared daemon's gateway, which would cut the
/// other tests' egress.)
pub fn a_killed_gateway_keeps_no_half_file_and_its_indexes(env: &Env) {
    use crate::egress::{gateway_pid, wait_for_egress};
    let name = package_name("killed");
    let file = wheel(env, &name, "1.0", 8);
    let pypi = env.net.dir.join("data/pypi");
    std::fs::write(pypi.join(format!("{file}.slow")), b"").unwrap();
    let hash = {
        let out = std::process::Command::new("sha256sum").arg(pypi.join(&file)).output().unwrap();
        String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
    };
    let cache = env.daemon.state_dir.join("packages");
    let kept = |prefix: &str| -> Vec<String> {
        let names = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned());
        names.filter(|n| n.starts_with(prefix)).collect()
    };
    let kill_gateway = || {
        let gateway = gateway_pid(&env.daemon);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(gateway as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while gateway_pid(&env.daemon) == gateway {
            assert!(std::time::Instant::now() < deadline, "the gateway was not started again");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    let a = unique("pkg");
    env.new_box(&a, &["--policy", "registries"]);
    let pip = format!(
        "rm -rf /tmp/dl; pip download -q --retries 0 --disable-pip-version-check --no-deps --no-cache-dir -d /tmp/dl {name}==1.0 2>&1; ls /tmp/dl"
    );

    // Killed while the file comes (8 MiB at 1 MiB/s).
    let quoted = format!("bash -c '{}'", pip.replace('\'', "'\\''"));
    let mut slow = env.daemon.ssh(&env.alice, Some(&a), &[&quoted]);
    slow.stdout(Stdio::piped()).stderr(Stdio::piped());
    let slow = slow.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while downloads(env, "pypi.org", &format!("/files/{file}")) == 0 {
        assert!(std::time::Instant::now() < deadline, "pip never asked for the file");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(!kept("tmp-").is_empty(), "no download in flight: {:?}", kept(""));
    kill_gateway();
    let out = slow.wait_with_output().unwrap();
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(!listed.lines().any(|l| l == file), "pip finished through a killed gateway:\n{listed}");
    // The gateway that replaced it swept the half-written file, kept nothing
    // under the file's hash, and fetches it whole.
    assert!(kept("tmp-").is_empty(), "a half-written download survived: {:?}", kept("tmp-"));
    assert!(!kept("sha256-").contains(&format!("sha256-{hash}")), "a killed download was kept");
    std::fs::remove_file(pypi.join(format!("{file}.slow"))).unwrap();
    wait_for_egress(|| sh(env, &a, "curl -s -o /dev/null https://pypi.org/simple/").0 == Some(0));
    let (_, out) = sh(env, &a, &pip);
    assert_eq!(out.trim(), file, "pip after the gateway's restart");
    assert_eq!(downloads(env, "pypi.org", &format!("/files/{file}")), 2, "the file came whole from the registry");
    assert!(kept("sha256-").contains(&format!("sha256-{hash}")), "the checked file is kept");
    let (_, sum) = sh(env, &a, &format!("sha256sum /tmp/dl/{file}"));
    assert!(sum.starts_with(&hash), "the box got other bytes: {sum}");

    // The index down, and a gateway started since: the index it kept serves.
    assert!(!kept("index-").is_empty(), "no index kept in {}", cache.display());
    std::fs::write(pypi.join(format!("{name}.down")), b"").unwrap();
    let asked = env.net.received().matches(&format!("GET pypi.org /simple/{name}/")).count();
    kill_gateway();
    let (_, out) = sh(env, &a, &pip);
    assert_eq!(out.trim(), file, "a reinstall with the index down, by a gateway started since");
    let now = env.net.received().matches(&format!("GET pypi.org /simple/{name}/")).count();
    assert!(now > asked, "the index was not asked: it must be down to test this");
    assert_eq!(downloads(env, "pypi.org", &format!("/files/{file}")), 2, "the file came from the cache");
    env.alice(None, &["rm", &a]).ok();
}
