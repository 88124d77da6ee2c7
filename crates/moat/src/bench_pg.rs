//! The private PostgreSQL 15 cluster `moat bench --fleet` keeps its fleet's
//! store in: its own data directory, listening on loopback on a free port
//! with trust authentication, stopped and deleted when dropped.
//!
//! The tests start theirs with `moat-testkit`, a dev-dependency the binary
//! cannot use (and which panics where this returns errors). Unlike the
//! tests' cluster this one keeps `fsync` on, as a real store does: the
//! placement transaction is timed on it.

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Where Debian's `postgresql-15` puts its programs.
const BIN: &str = "/usr/lib/postgresql/15/bin";

/// A running cluster of the bench's own.
pub struct BenchPostgres {
    dir: PathBuf,
    port: u16,
}

impl BenchPostgres {
    /// Makes a cluster in `dir` (which must not exist; the server runs as the
    /// `postgres` user, so no private directory may lie above it) and starts it.
    pub fn start(dir: &Path) -> Result<Self> {
        if !Path::new(BIN).join("initdb").exists() {
            bail!("PostgreSQL 15 is not installed ({BIN}/initdb is missing): apt-get install postgresql-15");
        }
        std::fs::create_dir(dir).with_context(|| format!("create {}", dir.display()))?;
        // From here on, dropping it deletes the directory.
        let pg = Self { dir: dir.to_path_buf(), port: crate::bench::free_port()? };
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        run(Command::new("chown").arg("postgres:postgres").arg(dir))?;
        let mut initdb = as_postgres("initdb");
        initdb.arg("-D").arg(pg.data()).args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]);
        run(&mut initdb)?;
        let options = format!("-p {} -c listen_addresses=127.0.0.1 -k {}", pg.port, dir.display());
        run(pg.pg_ctl().arg("-l").arg(dir.join("log")).args(["-w", "-o", &options, "start"]))
            .with_context(|| format!("start PostgreSQL (its log: {})", dir.join("log").display()))?;
        Ok(pg)
    }

    /// Makes database `name`; its DSN.
    pub fn create_db(&self, name: &str) -> Result<String> {
        let mut createdb = as_postgres("createdb");
        createdb.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres", name]);
        run(&mut createdb)?;
        Ok(format!("postgres://postgres@127.0.0.1:{}/{name}", self.port))
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn pg_ctl(&self) -> Command {
        let mut pg_ctl = as_postgres("pg_ctl");
        pg_ctl.arg("-D").arg(self.data());
        pg_ctl
    }
}

impl Drop for BenchPostgres {
    fn drop(&mut self) {
        if self.data().join("postmaster.pid").exists() {
            let _ = self.pg_ctl().args(["-m", "immediate", "-w", "stop"]).output();
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("bench: cannot remove {}: {e}", self.dir.display());
        }
    }
}

/// One of PostgreSQL's programs, as the `postgres` user (initdb refuses
/// root), in a process group of its own: a Ctrl-C at the terminal reaches the
/// bench, which stops the server after the nodes that use it.
fn as_postgres(program: &str) -> Command {
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", "postgres", "--"]).arg(Path::new(BIN).join(program)).process_group(0);
    cmd
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}
