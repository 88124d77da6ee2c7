//! What `moat bench --fleet` measures on, all on loopback: a private
//! PostgreSQL, a fleet made with `moat fleet init|token|join`, two nodes
//! (`moat serve` on 127.0.0.2 and 127.0.0.3, each with its own state dir and
//! pool), one front door, a single host (`moat serve` on its own SQLite) and
//! OpenSSH's sshd as a bastion. Every process is this binary or a system
//! program, started as an operator would start it.
//!
//! Dropping the rig tears everything down in the order it depends on (front
//! door, nodes and host killed, their boxes and pools purged while the store
//! is still up, then the store), whether the bench finished, failed or was
//! interrupted.

use std::io::BufRead as _;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::bench::{self, BenchUser};
use crate::bench_pg::BenchPostgres;

/// A process of the rig that printed `listening on ADDR`.
pub struct Server {
    /// Its state dir.
    pub dir: PathBuf,
    /// Its SSH address.
    pub addr: SocketAddr,
    /// What it printed before that line (its HTTP edge's address and CA).
    pub printed: Vec<String>,
    child: Child,
}

impl Server {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Ends the process (its boxes stay, for `moat purge`).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Everything running for the bench; torn down when dropped.
pub struct Rig {
    /// The bench's scratch dir (state dirs, keys, logs).
    pub dir: PathBuf,
    /// The fleet's store.
    pub dsn: String,
    /// The store's cluster (also holds the placement bench's databases).
    pub pg: Option<BenchPostgres>,
    /// The front door.
    pub front: Option<Server>,
    /// Nodes n1 and n2.
    pub nodes: Vec<Server>,
    /// A single host: `moat serve` with SQLite, no fleet.
    pub single: Option<Server>,
    /// The bastion: OpenSSH's sshd on 127.0.0.1, serving [`bench::BENCH_USER`].
    pub bastion: Option<(Child, u16)>,
    bastion_user: Option<BenchUser>,
    /// The client's OpenSSH config (key, options), the same for every path.
    pub ssh_config: PathBuf,
    /// Set when the bench is asked to stop (SIGINT, SIGTERM, SIGHUP).
    pub stop: Arc<AtomicBool>,
}

/// The bench's client: `ssh -F CONFIG` with one key and the options
/// `moat bench` uses (curve25519, chacha20-poly1305, no known hosts).
fn client_config(key: &Path) -> String {
    format!(
        "Host *\n  IdentityFile {}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  \
         UserKnownHostsFile /dev/null\n  KexAlgorithms curve25519-sha256\n  \
         Ciphers chacha20-poly1305@openssh.com\n  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 20\n",
        key.display()
    )
}

impl Rig {
    /// Starts it all in `dir` (which must not exist) and its store's cluster
    /// in `pg_dir`.
    pub fn start(dir: &Path, pg_dir: &Path, stop: Arc<AtomicBool>) -> Result<Rig> {
        Self::start_with(dir, pg_dir, stop, &[])
    }

    /// [`Rig::start`], each node's `moat serve` also given `node_flags`.
    pub fn start_with(dir: &Path, pg_dir: &Path, stop: Arc<AtomicBool>, node_flags: &[&str]) -> Result<Rig> {
        // Not private: sshd reads the bastion's authorized_keys as its user.
        // (Each state dir in it is, and the fleet CA's key is 0600.)
        std::fs::create_dir(dir).with_context(|| format!("create {}", dir.display()))?;
        let mut rig = Rig {
            dir: dir.to_path_buf(),
            dsn: String::new(),
            pg: None,
            front: None,
            nodes: Vec::new(),
            single: None,
            bastion: None,
            bastion_user: None,
            ssh_config: dir.join("ssh_config"),
            stop,
        };
        let key = dir.join("client_key");
        bench::keygen(&key)?;
        let keys_file = key.with_extension("pub");
        std::fs::write(&rig.ssh_config, client_config(&key))?;

        eprintln!("bench: a private PostgreSQL 15 and a fleet in it");
        let pg = rig.pg.insert(BenchPostgres::start(pg_dir)?);
        rig.dsn = pg.create_db("fleet")?;
        let admin = dir.join("admin");
        moat(&["fleet", "init", "--store", &rig.dsn, "--state-dir", &path(&admin)])?;
        moat(&["fleet", "keys", "add", &path(&keys_file), "--state-dir", &path(&admin)])?;
        let member = |role: &str, name: &str| -> Result<PathBuf> {
            let token = moat(&["fleet", "token", "--role", role, "--name", name, "--state-dir", &path(&admin)])?;
            let at = dir.join(name);
            moat(&["fleet", "join", token.trim(), "--state-dir", &path(&at)])?;
            Ok(at)
        };
        let single = dir.join("single");
        let node_dirs = [member("node", "n1")?, member("node", "n2")?];
        for at in node_dirs.iter().chain([&single]) {
            rig.check_stop()?;
            eprintln!("bench: the busybox image in {}", at.display());
            moat(&["image", "build", "busybox", "--state-dir", &path(at)])?;
        }
        for (i, at) in node_dirs.into_iter().enumerate() {
            rig.check_stop()?;
            let host = format!("127.0.0.{}", i + 2);
            let (listen, advertise) = (format!("{host}:0"), format!("{host}:0"));
            // Its own authorized_keys lists nobody: the fleet's keys are the accounts.
            let mut flags = vec!["--listen", &listen, "--authorized-keys", "/dev/null", "--advertise", &advertise];
            flags.extend(node_flags);
            let node = serve(at, &flags)?;
            rig.nodes.push(node);
        }
        rig.wait_for_live_nodes(2)?;
        let front = member("front", "f1")?;
        rig.front =
            Some(start(moat_command(&["front", "--listen", "127.0.0.1:0", "--state-dir", &path(&front)]), &front)?);
        rig.check_stop()?;
        let flags = ["--listen", "127.0.0.1:0", "--authorized-keys", &path(&keys_file)];
        rig.single = Some(serve(single, &flags)?);

        let bastion = dir.join("bastion");
        std::fs::create_dir(&bastion)?;
        rig.bastion_user = Some(BenchUser::create(&bastion)?);
        let port = bench::free_port()?;
        rig.bastion = Some((bench::start_sshd(&bastion, &keys_file, port)?, port));
        Ok(rig)
    }

    /// Fails once the bench was asked to stop.
    pub fn check_stop(&self) -> Result<()> {
        if self.stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        Ok(())
    }

    fn wait_for_live_nodes(&self, n: usize) -> Result<()> {
        let store = moat_core::Store::connect(&self.dsn)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let now = moat_core::clock::now_ms();
            let live = store.nodes()?.iter().filter(|node| node.is_live(now)).count();
            if live == n {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{live} of {n} nodes live after 20 s");
            }
            self.check_stop()?;
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `ssh -F CONFIG` as the bench's client.
    pub fn ssh(&self) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.arg("-F").arg(&self.ssh_config);
        cmd
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        eprintln!("bench: tearing the fleet down");
        if let Some((mut sshd, _)) = self.bastion.take() {
            let _ = sshd.kill();
            let _ = sshd.wait();
        }
        self.bastion_user.take();
        // The front door holds no boxes and no pool: its dir goes with the rest.
        if let Some(mut front) = self.front.take() {
            front.kill();
        }
        let mut servers: Vec<Server> = std::mem::take(&mut self.nodes);
        servers.extend(self.single.take());
        for server in &mut servers {
            server.kill();
        }
        // A node's boxes are listed in the store: purged before it stops.
        for server in &servers {
            if let Err(e) = crate::purge::run(&server.dir) {
                eprintln!("bench: cannot purge {}: {e:#}", server.dir.display());
            }
        }
        self.pg.take();
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("bench: cannot remove {}: {e}", self.dir.display());
        }
    }
}

pub fn path(p: &Path) -> String {
    p.display().to_string()
}

/// Makes the bench's state dir `state_dir`, refusing one an earlier bench
/// left (its pool may still be mounted).
pub fn fresh_state_dir(state_dir: &Path) -> Result<()> {
    if state_dir.exists() {
        bail!(
            "{} is left from an earlier bench: `moat purge --state-dir {}/single` and remove it",
            path(state_dir),
            path(state_dir)
        );
    }
    std::fs::create_dir(state_dir).with_context(|| format!("create {}", path(state_dir)))
}

/// This binary with `args`, in a process group of its own (a Ctrl-C at the
/// terminal reaches the bench, which tears down in order).
fn moat_command(args: &[&str]) -> Command {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    let mut cmd = Command::new(exe);
    cmd.args(args).env_remove("MOAT_STORE").process_group(0);
    cmd
}

/// Runs `moat ARGS` to completion; its stdout.
pub fn moat(args: &[&str]) -> Result<String> {
    let out = moat_command(args).stdin(Stdio::null()).output()?;
    if !out.status.success() {
        bail!("moat {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `moat serve` on state dir `dir` with `flags`, namespace boxes only (the
/// probe for KVM takes seconds and VM boxes are not measured here).
pub fn serve(dir: PathBuf, flags: &[&str]) -> Result<Server> {
    let mut cmd = moat_command(&["serve", "--state-dir", &path(&dir), "--backend", "ns", "--vm-accel", "tcg"]);
    cmd.args(flags);
    start(cmd, &dir)
}

/// Starts `cmd` (its stderr into DIR.log) and waits for its `listening on ADDR`.
fn start(mut cmd: Command, dir: &Path) -> Result<Server> {
    let log = dir.with_extension("log");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("start {cmd:?}"))?;
    let (mut line, mut printed) = (String::new(), Vec::new());
    if let Some(out) = child.stdout.take() {
        let mut out = std::io::BufReader::new(out);
        // The HTTP edge's lines come first, when it runs.
        while out.read_line(&mut line)? > 0 && !line.starts_with("listening on ") && printed.len() < 8 {
            printed.push(std::mem::take(&mut line).trim().to_string());
        }
    }
    let addr = line.trim().strip_prefix("listening on ").and_then(|a| a.parse().ok());
    let Some(addr) = addr else {
        let _ = child.kill();
        let _ = child.wait();
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        bail!("{cmd:?} did not start:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    };
    Ok(Server { dir: dir.to_path_buf(), addr, printed, child })
}
