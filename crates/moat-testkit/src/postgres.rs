//! A private PostgreSQL 15 cluster for tests: its own data directory in a
//! temp dir, listening on loopback on a free port (and a unix socket in the
//! same dir), with trust authentication. No service, nothing shared with the
//! host's own PostgreSQL, gone when dropped (also when a test panics).
//!
//! Run as root, the server runs as the `postgres` user (initdb refuses root),
//! as Debian's package sets it up. Without PostgreSQL installed this panics,
//! saying so: a test that needs it never passes by skipping.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// Where Debian's `postgresql-15` puts its programs.
const BIN: &str = "/usr/lib/postgresql/15/bin";

/// A running cluster of our own.
pub struct Postgres {
    dir: tempfile::TempDir,
    port: u16,
    databases: AtomicU32,
    /// Serving TLS, and only TLS over TCP.
    tls: bool,
}

impl Postgres {
    /// Makes and starts a cluster used by this caller alone (for tests that
    /// stop and start it).
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Makes and starts a cluster that serves TLS with the certificate
    /// (chain) and key given (PEM), and refuses TCP clients without it.
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Self {
        Self::start_with(Some((cert_pem, key_pem)))
    }

    fn start_with(tls: Option<(&str, &str)>) -> Self {
        let bin = Path::new(BIN);
        assert!(
            bin.join("initdb").exists(),
            "PostgreSQL 15 is not installed ({BIN}/initdb is missing): `apt-get install postgresql`"
        );
        let dir = tempfile::Builder::new().prefix("moat-pg-").tempdir().expect("make a temp dir for PostgreSQL");
        if is_root() {
            run(Command::new("chown").arg("postgres:postgres").arg(dir.path()));
        }
        let data = dir.path().join("data");
        let mut initdb = as_postgres("initdb");
        initdb.arg("-D").arg(&data).args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]);
        run(&mut initdb);
        if let Some((cert, key)) = tls {
            for (file, pem) in [("server.crt", cert), ("server.key", key)] {
                let path = data.join(file);
                std::fs::write(&path, pem).expect("write the server's TLS files");
                std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                    .expect("make the key private");
                if is_root() {
                    run(Command::new("chown").arg("postgres:postgres").arg(&path));
                }
            }
            // TCP clients only over TLS (`hostssl`); the unix socket as it was.
            let hba = data.join("pg_hba.conf");
            let rules = std::fs::read_to_string(&hba).expect("read pg_hba.conf");
            let rules: Vec<String> = rules
                .lines()
                .map(|l| l.strip_prefix("host ").map_or_else(|| l.to_string(), |rest| format!("hostssl {rest}")))
                .collect();
            std::fs::write(&hba, rules.join("\n") + "\n").expect("write pg_hba.conf");
        }
        // A port that was free a moment ago; another taker in between is
        // unlikely, and start() then fails saying why.
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("find a free port").port();
        let pg = Self { dir, port, databases: AtomicU32::new(0), tls: tls.is_some() };
        pg.start_again();
        pg
    }

    /// A cluster shared by the tests running at the same time in this
    /// process (each uses a database of its own): stopped when the last of
    /// them drops it.
    pub fn shared() -> Arc<Self> {
        static SHARED: Mutex<Weak<Postgres>> = Mutex::new(Weak::new());
        let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pg) = shared.upgrade() {
            return pg;
        }
        let pg = Arc::new(Self::start());
        *shared = Arc::downgrade(&pg);
        pg
    }

    /// Makes an empty database; its DSN (`postgres://postgres@127.0.0.1:PORT/NAME`).
    pub fn create_db(&self) -> String {
        let name = format!("db{}", self.databases.fetch_add(1, Ordering::Relaxed));
        let mut createdb = as_postgres("createdb");
        // By its unix socket: TCP may want TLS.
        let socket = self.dir.path().display().to_string();
        createdb.args(["-h", &socket, "-p", &self.port.to_string(), "-U", "postgres", &name]);
        run(&mut createdb);
        self.dsn(&name)
    }

    /// The DSN of database `name` on this cluster.
    pub fn dsn(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory of its unix socket (`.s.PGSQL.PORT`).
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops the server (fast: clients are disconnected), keeping its data.
    pub fn stop(&self) {
        run(self.pg_ctl().args(["-m", "fast", "-w", "stop"]));
    }

    /// Starts the server again after [`Postgres::stop`], on the same port.
    pub fn start_again(&self) {
        let mut options =
            format!("-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off", self.port, self.dir.path().display());
        if self.tls {
            options.push_str(" -c ssl=on");
        }
        let log = self.dir.path().join("log");
        run(self.pg_ctl().arg("-l").arg(&log).args(["-w", "-o", &options, "start"]));
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn pg_ctl(&self) -> Command {
        let mut pg_ctl = as_postgres("pg_ctl");
        pg_ctl.arg("-D").arg(self.data());
        pg_ctl
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // Immediate: nothing here needs a clean shutdown, and a test that
        // panicked may have left clients connected. The temp dir goes after.
        let _ = self.pg_ctl().args(["-m", "immediate", "-w", "stop"]).output();
    }
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// One of PostgreSQL's programs, run as the `postgres` user if we are root.
fn as_postgres(program: &str) -> Command {
    let path = Path::new(BIN).join(program);
    if is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(path);
        cmd
    } else {
        Command::new(path)
    }
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
