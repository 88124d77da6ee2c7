//! `moat bench --packages`: installs in a box through the gateway's package
//! path, next to the same installs straight from the same stand-in registry:
//!
//! - `pip install` of 25 wheels of 2 MiB each (50 MiB);
//! - `npm install` of a tree of 300 small packages (each depends on two
//!   more: 300 package documents and 300 tarballs).
//!
//! Each runs in three boxes of moat's debian image under one `moat serve`:
//! the first with package rules on (`registries` and `min-age 1d`: every
//! index read, every file checked and kept), a second one after it (its
//! files from the shared cache), and a box whose policy allows the two hosts
//! plainly (TLS passed through untouched: the registry as the client sees
//! it without moat's package path). The registry answers from memory on the
//! bench's test internet (see [`crate::bench_egress::Registry`]).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use sha2::Digest as _;

use crate::bench::ms;
use crate::bench_egress::{BenchNet, Registry, SERVER};
use crate::bench_fleet_rig::{moat, path, serve, Server};

/// Wheels, and MiB each.
const WHEELS: usize = 25;
const WHEEL_MIB: usize = 2;
/// npm packages in the tree.
const NPM_PACKAGES: usize = 300;
/// A publish time long past (every rule lets it in).
const LONG_AGO: &str = "2020-01-01T00:00:00Z";

/// The names of each round's packages (a round of its own starts with an
/// empty cache): wheels `PREFIX0..`, npm packages `PREFIX0..` (the tree's root).
const ROUNDS: [(&str, &str); 2] = [("benchw", "bench-p"), ("benchx", "bench-q")];

/// Writes the wheels and tarballs under `dir` (Python's zipfile and
/// tarfile make them as the real tools do) and returns the registry.
fn make_registry(dir: &Path) -> Result<Registry> {
    let mut registry = Registry::default();
    for (wheel, package) in ROUNDS {
        add_round(dir, wheel, package, &mut registry)?;
    }
    Ok(registry)
}

fn add_round(dir: &Path, wheel_prefix: &str, npm_prefix: &str, registry: &mut Registry) -> Result<()> {
    let script = r#"
import io, json, os, sys, tarfile, zipfile
out, wheels, mib, packages, w, p = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
os.makedirs(out, exist_ok=True)
for i in range(wheels):
    name = f"{w}{i}"
    with zipfile.ZipFile(f"{out}/{name}-1.0-py3-none-any.whl", "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{name}/data.bin", os.urandom(mib << 20))
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{name}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}-1.0.dist-info/RECORD", "")
for i in range(packages):
    deps = {f"{p}{c}": "1.0.0" for c in (2 * i + 1, 2 * i + 2) if c < packages}
    pkg = json.dumps({"name": f"{p}{i}", "version": "1.0.0", "main": "index.js", "dependencies": deps})
    with tarfile.open(f"{out}/{p}{i}-1.0.0.tgz", "w:gz") as t:
        for name, text in (("package/package.json", pkg), ("package/index.js", f"module.exports = {i};")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            t.addfile(info, io.BytesIO(data))
    with open(f"{out}/{p}{i}.deps", "w") as f:
        json.dump(deps, f)
"#;
    let ok = Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .args([WHEELS.to_string(), WHEEL_MIB.to_string(), NPM_PACKAGES.to_string()])
        .args([wheel_prefix, npm_prefix])
        .status()
        .context("python3 (apt-get install python3)")?
        .success();
    if !ok {
        bail!("making the registry's files failed");
    }
    let mut put = |host: &str, path: String, content_type: &str, body: Vec<u8>| {
        registry.files.insert((host.to_string(), path), (content_type.to_string(), body));
    };
    for i in 0..WHEELS {
        let (name, file) = (format!("{wheel_prefix}{i}"), format!("{wheel_prefix}{i}-1.0-py3-none-any.whl"));
        let body = std::fs::read(dir.join(&file))?;
        let page = serde_json::json!({
            "meta": {"api-version": "1.1"}, "name": name, "versions": ["1.0"],
            "files": [{"filename": file, "url": format!("https://pypi.org/files/{file}"),
                       "hashes": {"sha256": hex::encode(sha2::Sha256::digest(&body))}, "upload-time": LONG_AGO}],
        });
        put(
            "pypi.org",
            format!("/simple/{name}/"),
            "application/vnd.pypi.simple.v1+json",
            page.to_string().into_bytes(),
        );
        put("pypi.org", format!("/files/{file}"), "application/octet-stream", body);
    }
    for i in 0..NPM_PACKAGES {
        let (name, file) = (format!("{npm_prefix}{i}"), format!("{npm_prefix}{i}-1.0.0.tgz"));
        let body = std::fs::read(dir.join(&file))?;
        let deps: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.deps")))?)?;
        let integrity =
            format!("sha512-{}", base64::engine::general_purpose::STANDARD.encode(sha2::Sha512::digest(&body)));
        let doc = serde_json::json!({
            "name": name, "dist-tags": {"latest": "1.0.0"},
            "versions": {"1.0.0": {"name": name, "version": "1.0.0", "dependencies": deps,
                "dist": {"tarball": format!("https://registry.npmjs.org/{name}/-/{file}"), "integrity": integrity}}},
            "time": {"created": LONG_AGO, "modified": LONG_AGO, "1.0.0": LONG_AGO},
        });
        put("registry.npmjs.org", format!("/{name}"), "application/json", doc.to_string().into_bytes());
        put("registry.npmjs.org", format!("/{name}/-/{file}"), "application/octet-stream", body);
    }
    Ok(())
}

/// The pip and npm commands, trusting `ca` (a path in the box; `None`:
/// the TLS is not verified, for the direct box, whose client sees the
/// stand-in's own certificate), in a directory of their own (`run`).
fn installs(ca: Option<&str>, round: usize, run: usize) -> (String, String) {
    let (wheel, package) = ROUNDS.get(round).copied().unwrap_or(ROUNDS[0]);
    let wheels: Vec<String> = (0..WHEELS).map(|i| format!("{wheel}{i}")).collect();
    let (pip_trust, npm_trust) = match ca {
        Some(ca) => (format!("--cert {ca}"), format!("--cafile {ca}")),
        None => ("--trusted-host pypi.org".to_string(), "--strict-ssl=false".to_string()),
    };
    let pip = format!(
        "pip install -q --no-deps --no-cache-dir --disable-pip-version-check --target /tmp/pip{run} \
         --index-url https://pypi.org/simple/ {pip_trust} {}",
        wheels.join(" ")
    );
    let npm = format!(
        "mkdir -p /tmp/npm{run} && cd /tmp/npm{run} && npm install --no-audit --no-fund --no-package-lock \
         --cache /tmp/npm-cache{run} --registry https://registry.npmjs.org/ {npm_trust} {package}0@1.0.0 >/dev/null"
    );
    (pip, npm)
}

/// Loads pip's and npm's install code without reaching any registry, so
/// that no column pays for reading it from disk: a box's first run of an
/// installer reads its code into the box's own page cache (a snapshot
/// shares its image's blocks, not their cache), and the host's first run
/// reads it from the disk below; the rules box, run first, paid both
/// (+0.4 to +1.3 s).
const WARM: &str = "pip install -q --no-index --target /tmp/warm moat-warm-up >/dev/null 2>&1; \
    mkdir -p /tmp/warm && cd /tmp/warm && npm install --offline --no-audit --no-fund --no-package-lock \
    --cache /tmp/warm-cache moat-warm-up@1.0.0 >/dev/null 2>&1; true";

/// Runs the packages benchmark under `state_dir`.
pub fn run(state_dir: &Path) -> Result<()> {
    crate::bench_fleet_rig::fresh_state_dir(state_dir)?;
    let result = measure(state_dir);
    let single = state_dir.join("single");
    if single.exists() {
        if let Err(e) = crate::purge::run(&single) {
            eprintln!("bench: cannot purge {}: {e:#}", single.display());
        }
    }
    let _ = std::fs::remove_dir_all(state_dir);
    result
}

fn measure(state_dir: &Path) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    eprintln!("bench: the registry's files ({WHEELS} wheels of {WHEEL_MIB} MiB, {NPM_PACKAGES} npm packages)");
    let registry = Arc::new(make_registry(&state_dir.join("files"))?);
    let net = BenchNet::start_with(Some(Arc::clone(&registry)))?;
    std::fs::write(state_dir.join("upstream-ca.pem"), &net.ca)?;
    let single = state_dir.join("single");
    eprintln!("bench: moat's debian image (built on first use)");
    moat(&["image", "build", "debian", "--state-dir", &path(&single)])?;
    let key = state_dir.join("client_key");
    crate::bench::keygen(&key)?;
    let flags = [
        "--listen",
        "127.0.0.1:0",
        "--authorized-keys",
        &path(&key.with_extension("pub")),
        "--warm-boxes",
        "0",
        "--upstream-netns",
        &path(&net.path()),
        "--upstream-dns",
        &format!("{SERVER}:53"),
        "--upstream-allow",
        &format!("{SERVER}/32"),
        "--upstream-ca",
        &path(&state_dir.join("upstream-ca.pem")),
    ];
    let mut server: Server = serve(single.clone(), &flags)?;
    let result = boxes(&key, &server, &registry);
    server.kill();
    result
}

fn boxes(key: &Path, server: &Server, registry: &Registry) -> Result<()> {
    let port = server.addr.port().to_string();
    let ssh = |user: &str, command: &str| -> Command {
        let mut cmd = Command::new("ssh");
        cmd.args(["-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no"])
            .args(["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-i"])
            .arg(key)
            .args(["-p", &port, &format!("{user}@127.0.0.1"), command]);
        cmd
    };
    let control = |command: &str| -> Result<()> {
        let out = ssh("moat", command).stdin(Stdio::null()).output()?;
        if !out.status.success() {
            bail!("{command}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    };
    let timed = |user: &str, command: &str| -> Result<Duration> {
        let started = Instant::now();
        let out = ssh(user, command).stdin(Stdio::null()).output()?;
        if !out.status.success() {
            // The box's egress log says what the gateway made of it.
            let log = ssh("moat", &format!("log {user}")).stdin(Stdio::null()).output()?;
            let log = String::from_utf8_lossy(&log.stdout).into_owned();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines.get(lines.len().saturating_sub(15)..).unwrap_or_default().join("\n");
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            let errs: Vec<&str> = err.lines().collect();
            let last = errs.get(errs.len().saturating_sub(3)..).unwrap_or_default().join(" / ");
            bail!("{command} in {user} failed: {last}\n{user}'s log, newest last:\n{tail}");
        }
        Ok(started.elapsed())
    };
    let mut rows = Vec::new();
    // Two rounds: the registry on this host (answering at once, as fast as
    // loopback goes), and across the internet: 30 ms before each answer and
    // a 100 Mbit/s link all answers share (the test internet has neither of
    // its own). Each round's boxes and packages are new: its first install
    // finds nothing in the cache.
    for (round, delay, mbit) in [(0, 0u64, 0u64), (1, 30, 100)] {
        registry.delay_ms.store(delay, std::sync::atomic::Ordering::Relaxed);
        registry.link_rate.store(mbit * 1_000_000 / 8, std::sync::atomic::Ordering::Relaxed);
        let link = if mbit == 0 { format!("+{delay} ms") } else { format!("+{delay} ms, {mbit} Mbit/s") };
        // The rules box and the one after it share the cache; the direct box
        // reaches the hosts with TLS passed through.
        for name in ["rules", "cached", "direct"] {
            control(&format!("rm {name}")).ok();
        }
        for name in ["rules", "cached"] {
            control(&format!("new {name} --policy registries"))?;
            control(&format!("policy {name} packages min-age 1d"))?;
        }
        control("new direct")?;
        control("policy direct allow pypi.org")?;
        control("policy direct allow registry.npmjs.org")?;
        for name in ["rules", "cached", "direct"] {
            timed(name, WARM)?;
        }
        for (label, tool) in [("pip install, 25 wheels (50 MiB)", 0), ("npm install, 300 packages", 1)] {
            eprintln!("bench: {label}, registry {link}: with rules, from the cache, direct");
            let pick = |(pip, npm): (String, String)| if tool == 0 { pip } else { npm };
            let run = round * 2 + tool;
            let rules = timed("rules", &pick(installs(Some("/etc/moat/ca.pem"), round, run)))?;
            let cached = timed("cached", &pick(installs(Some("/etc/moat/ca.pem"), round, run)))?;
            let direct = timed("direct", &pick(installs(None, round, run)))?;
            rows.push((format!("{label}, {link}"), rules, cached, direct));
        }
    }
    println!();
    println!(
        "{:<50} {:>12} {:>12} {:>12} {:>14} {:>14}",
        "install", "rules", "cached", "direct", "rules/direct", "direct/cached"
    );
    for (label, rules, cached, direct) in rows {
        println!(
            "{label:<50} {:>12} {:>12} {:>12} {:>13.2}x {:>13.2}x",
            ms(rules),
            ms(cached),
            ms(direct),
            rules.as_secs_f64() / direct.as_secs_f64(),
            direct.as_secs_f64() / cached.as_secs_f64()
        );
    }
    println!("targets: rules/direct under 1.10x; direct/cached at least 3x");
    Ok(())
}
