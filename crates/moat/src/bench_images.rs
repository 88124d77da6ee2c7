//! `moat bench --images`: pulled images against the Debian tools a user
//! would script, from the same registry on the same host:
//!
//! - the first pull of a ~200 MB image (moat's debian image's tree as one
//!   layer), next to `skopeo copy` into an OCI layout and `umoci unpack` of
//!   it;
//! - the pull of a second image on the same base (one more small layer),
//!   next to that second image's own first pull on a host that has neither;
//! - `new` and the first command of a box of the pulled image, next to the
//!   same of a box of moat's debian image.
//!
//! The registry is Debian's docker-registry in a test internet's namespace
//! (TLS from the bench's CA, names from the bench's DNS server or, for
//! skopeo, that namespace's own /etc/hosts); `moat serve` reaches it through
//! its upstream settings, as a pull reaches any registry. Everything is
//! removed after.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::bench::{ms, Samples};
use crate::bench_egress::{BenchNet, NAME, SERVER};
use crate::bench_fleet_rig::{moat, path, serve, Server};

/// The registry's port on the test internet.
const PORT: u16 = 5000;
/// The registry's name (the bench's DNS server answers every name below [`NAME`]).
const REGISTRY: &str = "registry.bench.test";
/// Runs of `new` + first command each.
const NEW_RUNS: usize = 5;

/// What the bench started; stopped and removed when dropped.
struct ImagesRig {
    dir: PathBuf,
    registry: Option<Child>,
    server: Option<Server>,
    hosts: Option<PathBuf>,
}

impl Drop for ImagesRig {
    fn drop(&mut self) {
        if let Some(mut registry) = self.registry.take() {
            let _ = registry.kill();
            let _ = registry.wait();
        }
        if let Some(mut server) = self.server.take() {
            server.kill();
        }
        // The pool is mounted from the image build on, server or not.
        let single = self.dir.join("single");
        if let Err(e) = crate::purge::run(&single) {
            eprintln!("bench: cannot purge {}: {e:#}", single.display());
        }
        if let Some(hosts) = self.hosts.take() {
            let _ = std::fs::remove_dir_all(hosts);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run_ok(cmd: &mut Command) -> Result<String> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn timed(cmd: &mut Command) -> Result<Duration> {
    let started = Instant::now();
    run_ok(cmd)?;
    Ok(started.elapsed())
}

/// Runs the images benchmark under `state_dir`.
pub fn run(state_dir: &Path) -> Result<()> {
    for tool in ["docker-registry", "skopeo", "umoci", "ip"] {
        if Command::new("sh").arg("-c").arg(format!("command -v {tool}")).stdout(Stdio::null()).status()?.code()
            != Some(0)
        {
            bail!("{tool} is not installed (scripts/deps.sh installs docker-registry, skopeo and umoci)");
        }
    }
    crate::bench_fleet_rig::fresh_state_dir(state_dir)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    let net = BenchNet::start()?;
    let mut rig = ImagesRig { dir: state_dir.to_path_buf(), registry: None, server: None, hosts: None };
    let single = state_dir.join("single");
    eprintln!("bench: moat's debian image (built on first use)");
    moat(&["image", "build", "debian", "--state-dir", &path(&single)])?;
    let debian = single.join("pool/images/debian");

    // The registry, its certificate from the test internet's CA; skopeo in
    // the namespace finds it by that namespace's own /etc/hosts.
    let reg_dir = state_dir.join("registry");
    std::fs::create_dir_all(reg_dir.join("storage"))?;
    let (ca, ca_key) = moat_web::site::mint_ca()?;
    let (chain, key) = moat_web::site::issue(NAME, &ca, &ca_key)?;
    std::fs::write(reg_dir.join("cert.pem"), chain)?;
    std::fs::write(reg_dir.join("key.pem"), key)?;
    let certs = reg_dir.join("certs").join(format!("{REGISTRY}:{PORT}"));
    std::fs::create_dir_all(&certs)?;
    std::fs::write(certs.join("ca.crt"), &ca)?;
    std::fs::write(state_dir.join("upstream-ca.pem"), &ca)?;
    let hosts = PathBuf::from("/etc/netns").join(net.name());
    std::fs::create_dir_all(&hosts)?;
    rig.hosts = Some(hosts.clone());
    std::fs::write(hosts.join("hosts"), format!("127.0.0.1 localhost\n{SERVER} {REGISTRY}\n"))?;
    std::fs::write(hosts.join("resolv.conf"), format!("nameserver {SERVER}\n"))?;
    let config = format!(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {SERVER}:{PORT}\n  tls:\n    certificate: {}\n    key: {}\n",
        path(&reg_dir.join("storage")),
        path(&reg_dir.join("cert.pem")),
        path(&reg_dir.join("key.pem")),
    );
    std::fs::write(reg_dir.join("config.yml"), config)?;
    let in_net = |program: &str| {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", net.name(), program]);
        cmd
    };
    let log = std::fs::File::create(reg_dir.join("registry.log"))?;
    rig.registry = Some(
        in_net("docker-registry")
            .arg("serve")
            .arg(reg_dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?,
    );
    let url = format!("https://{REGISTRY}:{PORT}/v2/");
    let deadline = Instant::now() + Duration::from_secs(30);
    while in_net("curl")
        .args(["-sf", "-o", "/dev/null", "--cacert"])
        .arg(certs.join("ca.crt"))
        .arg(&url)
        .status()?
        .code()
        != Some(0)
    {
        if Instant::now() > deadline {
            bail!("the registry did not answer: {}", std::fs::read_to_string(reg_dir.join("registry.log"))?);
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    // moat serve (its pool mounted: the debian tree is read from it),
    // reaching the registry through its upstream settings.
    let key = state_dir.join("client_key");
    crate::bench::keygen(&key)?;
    let upstream_ca = path(&state_dir.join("upstream-ca.pem"));
    let netns = path(&net.path());
    let flags = [
        "--listen",
        "127.0.0.1:0",
        "--authorized-keys",
        &path(&key.with_extension("pub")),
        "--idle-grace",
        "60",
        "--warm-boxes",
        "0",
        "--upstream-netns",
        &netns,
        "--upstream-dns",
        &format!("{SERVER}:53"),
        "--upstream-allow",
        &format!("{SERVER}/32"),
        "--upstream-ca",
        &upstream_ca,
    ];
    let server = rig.server.insert(serve(single.clone(), &flags)?);
    let port = server.addr.port().to_string();
    let ssh = |user: &str, command: &str| -> Command {
        let mut cmd = Command::new("ssh");
        cmd.args(["-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no"])
            .args(["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-i"])
            .arg(&key)
            .args(["-p", &port, &format!("{user}@127.0.0.1"), command]);
        cmd
    };
    // The images: debian's tree as one layer, and one more small layer on it.
    eprintln!("bench: making the images (umoci) and pushing them (skopeo)");
    let layout = state_dir.join("layout");
    let (base, second) = (format!("{}:base", path(&layout)), format!("{}:second", path(&layout)));
    run_ok(Command::new("umoci").args(["init", "--layout", &path(&layout)]))?;
    run_ok(Command::new("umoci").args(["new", "--image", &base]))?;
    let bundle = state_dir.join("bundle");
    run_ok(Command::new("umoci").args(["unpack", "--image", &base, &path(&bundle)]))?;
    run_ok(Command::new("cp").arg("-a").arg(format!("{}/.", path(&debian))).arg(bundle.join("rootfs")))?;
    run_ok(Command::new("umoci").args(["repack", "--image", &base, &path(&bundle)]))?;
    std::fs::remove_dir_all(&bundle)?;
    run_ok(Command::new("umoci").args(["unpack", "--image", &base, &path(&bundle)]))?;
    run_ok(
        Command::new("head")
            .args(["-c", "20M", "/dev/urandom"])
            .stdout(std::fs::File::create(bundle.join("rootfs/opt/added"))?),
    )?;
    run_ok(Command::new("umoci").args(["repack", "--image", &second, &path(&bundle)]))?;
    std::fs::remove_dir_all(&bundle)?;
    for tag in ["base", "second"] {
        run_ok(
            in_net("skopeo")
                .args(["copy", "-q", "--dest-cert-dir", &path(&certs)])
                .arg(format!("oci:{}:{tag}", path(&layout)))
                .arg(format!("docker://{REGISTRY}:{PORT}/bench/{tag}:1")),
        )?;
    }
    let bytes = dir_bytes(&layout.join("blobs"))?;

    let pull = |tag: &str| ssh("moat", &format!("image pull {REGISTRY}:{PORT}/bench/{tag}:1 --as {tag}"));
    let rm = |tag: &str| ssh("moat", &format!("image rm {tag}"));

    eprintln!("bench: first pulls ({} MiB of blobs in the layout)", bytes >> 20);
    let first = timed(&mut pull("base"))?;
    let peer_dir = state_dir.join("peer");
    std::fs::create_dir_all(&peer_dir)?;
    let peer = {
        let started = Instant::now();
        run_ok(
            in_net("skopeo")
                .args(["copy", "-q", "--src-cert-dir", &path(&certs)])
                .arg(format!("docker://{REGISTRY}:{PORT}/bench/base:1"))
                .arg(format!("oci:{}:base", path(&peer_dir.join("layout")))),
        )?;
        let image = format!("{}:base", path(&peer_dir.join("layout")));
        run_ok(Command::new("umoci").args(["unpack", "--image", &image, &path(&peer_dir.join("bundle"))]))?;
        started.elapsed()
    };
    let shared = timed(&mut pull("second"))?;
    timed(&mut rm("second"))?;
    timed(&mut rm("base"))?;
    let cold = timed(&mut pull("second"))?;

    eprintln!("bench: new + first command, {NEW_RUNS} times each");
    let new_from = |image: &str| -> Result<Samples> {
        let mut took = Vec::new();
        for i in 0..NEW_RUNS {
            let name = format!("{image}{i}");
            let started = Instant::now();
            run_ok(&mut ssh("moat", &format!("new {name} --image {image}")))?;
            run_ok(&mut ssh(&name, "true"))?;
            took.push(started.elapsed());
            run_ok(&mut ssh("moat", &format!("rm {name}")))?;
        }
        Ok(Samples::sorted(took))
    };
    let pulled = new_from("second")?;
    let built = new_from("debian")?;

    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    let secs = |d: Duration| format!("{:.2} s", d.as_secs_f64());
    println!("\n## moat bench --images ({} MiB image, debug or release as built)\n", bytes >> 20);
    println!("| measurement | moat | peer | peer's | ratio | target |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| first pull of the image | {} | skopeo copy + umoci unpack | {} | {:.2}x | at most 1x |",
        secs(first),
        secs(peer),
        ratio(first, peer)
    );
    println!(
        "| pull of a second image on the same base | {} | its first pull, base not held | {} | {:.1}x faster | at least 5x |",
        secs(shared),
        secs(cold),
        ratio(cold, shared)
    );
    println!(
        "| new + first command, pulled image (p50) | {} | same, debian image | {} | {:.2}x | within 1.1x |",
        ms(pulled.pct(50)),
        ms(built.pct(50)),
        ratio(pulled.pct(50), built.pct(50))
    );
    drop(rig);
    drop(net);
    Ok(())
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { dir_bytes(&entry.path())? } else { meta.len() };
    }
    Ok(total)
}
