//! A test internet: a network namespace of the test's own holding a DNS
//! server with a query log, HTTP and HTTPS servers (with a CA of the test's)
//! that echo what reached them, and a UDP sink. The daemon's gateway dials
//! from it (`--upstream-netns`), so no test traffic leaves the machine, and
//! the host's network configuration is not touched. Removed at teardown.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The address every test host has (TEST-NET-3, so the gateway must be told
/// it may dial it).
pub const WEB: &str = "203.0.113.10";

/// Names the test DNS server knows.
pub const NAMES: &[(&str, &str)] = &[
    ("web.test", WEB),
    ("other.test", WEB),
    ("third.test", WEB),
    ("llm.test", WEB),
    // Stand-ins for the real ones, so that the shipped presets are what is
    // tested (the gateway asks this test DNS server only).
    ("github.com", WEB),
    ("pypi.org", WEB),
    ("registry.npmjs.org", WEB),
    ("index.crates.io", WEB),
    ("static.crates.io", WEB),
    ("registry.test", WEB),
    ("private.test", "10.1.2.3"),
    ("loop.test", "127.0.0.1"),
];

/// The package on the test index (`pip download moatdemo`).
pub const PACKAGE: &str = "moatdemo-1.0-py3-none-any.whl";

/// The package on the test npm registry (`npm install moatdemo`).
pub const NPM_PACKAGE: &str = "moatdemo-1.0.0.tgz";

/// The crate on the test crates.io (`moatdemo = "1"`).
pub const CRATE: &str = "moatdemo-1.0.0.crate";

pub struct TestNet {
    pub name: String,
    pub dir: PathBuf,
    servers: Vec<Child>,
}

fn sh(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Writes a gzipped tar of `files` (name, text) to `path`.
pub fn tar_gz(path: &Path, files: &[(&str, &str)]) {
    let script = "import io, sys, tarfile\n\
        t = tarfile.open(sys.argv[1], 'w:gz')\n\
        for name, text in zip(sys.argv[2::2], sys.argv[3::2]):\n\
        \x20   info = tarfile.TarInfo(name)\n\
        \x20   info.size, info.mode = len(text.encode()), 0o644\n\
        \x20   t.addfile(info, io.BytesIO(text.encode()))\n\
        t.close()\n";
    sh(Command::new("python3").args(["-c", script]).arg(path).args(files.iter().flat_map(|(n, t)| [n, t])));
}

impl TestNet {
    pub fn start(dir: &Path) -> TestNet {
        let dir = dir.join("testnet");
        std::fs::create_dir_all(&dir).expect("testnet dir");
        let name = format!("moat-e2e-{}", std::process::id());
        sh(Command::new("ip").args(["netns", "add", &name]));
        let mut net = TestNet { name, dir, servers: Vec::new() };
        sh(Command::new("ip").args(["-n", &net.name, "link", "set", "lo", "up"]));
        sh(Command::new("ip").args(["-n", &net.name, "addr", "add", &format!("{WEB}/32"), "dev", "lo"]));
        net.make_certificates();
        net.make_content();
        let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/testnet");
        let d = net.dir.clone();
        let mut dns =
            vec![scripts.join("dns.py").display().to_string(), WEB.into(), d.join("dns.log").display().to_string()];
        dns.extend(NAMES.iter().map(|(n, a)| format!("{n}={a}")));
        net.spawn(&dns);
        let web = [
            scripts.join("web.py").display().to_string(),
            WEB.into(),
            d.join("web.pem").display().to_string(),
            d.join("web.key").display().to_string(),
            d.join("udp.log").display().to_string(),
            d.join("data").display().to_string(),
        ];
        net.spawn(&web);
        net.wait_ready();
        net
    }

    fn spawn(&mut self, args: &[String]) {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name, "python3"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("servers.log")).map(Stdio::from).unwrap_or(Stdio::null()))
            .spawn()
            .expect("start a test server");
        self.servers.push(child);
    }

    fn make_certificates(&self) {
        let d = &self.dir;
        let openssl = |args: &[&str]| sh(Command::new("openssl").current_dir(d).args(args));
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=moat e2e CA",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "web.key",
            "-out",
            "web.csr",
            "-subj",
            "/CN=web.test",
        ]);
        std::fs::write(
            d.join("ext"),
            "subjectAltName=DNS:web.test,DNS:other.test,DNS:github.com,DNS:pypi.org,DNS:registry.npmjs.org,DNS:index.crates.io,DNS:static.crates.io,DNS:llm.test,DNS:registry.test,IP:203.0.113.10\n",
        )
        .expect("ext");
        openssl(&[
            "x509",
            "-req",
            "-in",
            "web.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "web.pem",
            "-days",
            "2",
            "-extfile",
            "ext",
        ]);
    }

    /// A bare git repository with one commit (`github.com/moat/repo.git`), a
    /// wheel on the package index, a package on the npm registry and a crate
    /// on crates.io.
    fn make_content(&self) {
        let data = self.dir.join("data");
        let work = self.dir.join("work");
        std::fs::create_dir_all(data.join("pypi")).expect("pypi dir");
        std::fs::create_dir_all(&work).expect("work dir");
        let git = |dir: &Path, args: &[&str]| {
            sh(Command::new("git")
                .current_dir(dir)
                .args(["-c", "user.name=test", "-c", "user.email=test@test", "-c", "init.defaultBranch=main"])
                .args(args))
        };
        git(&data, &["init", "-q", "--bare", "git/moat/repo.git"]);
        git(&data.join("git/moat/repo.git"), &["config", "http.receivepack", "true"]);
        std::fs::write(work.join("README"), "cloned through the gateway\n").expect("README");
        git(&work, &["init", "-q"]);
        git(&work, &["add", "README"]);
        git(&work, &["commit", "-q", "-m", "first"]);
        git(&work, &["push", "-q", &data.join("git/moat/repo.git").display().to_string(), "HEAD:main"]);
        let wheel = data.join("pypi").join(PACKAGE);
        let script = "import sys, zipfile\n\
            z = zipfile.ZipFile(sys.argv[1], 'w')\n\
            z.writestr('moatdemo/__init__.py', 'VALUE = 1\\n')\n\
            z.writestr('moatdemo-1.0.dist-info/METADATA', 'Metadata-Version: 2.1\\nName: moatdemo\\nVersion: 1.0\\n')\n\
            z.writestr('moatdemo-1.0.dist-info/WHEEL', 'Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
            z.writestr('moatdemo-1.0.dist-info/RECORD', '')\n";
        sh(Command::new("python3").args(["-c", script]).arg(&wheel));
        std::fs::create_dir_all(data.join("npm")).expect("npm dir");
        tar_gz(
            &data.join("npm").join(NPM_PACKAGE),
            &[
                ("package/package.json", r#"{"name": "moatdemo", "version": "1.0.0", "main": "index.js"}"#),
                ("package/index.js", "module.exports = { value: 1 };"),
            ],
        );
        // The operator's OSV export: a malicious npm package.
        std::fs::create_dir_all(self.dir.join("osv/npm")).expect("osv dir");
        let record = r#"{"id": "MAL-2026-7", "summary": "Malicious code in evil (npm)",
            "affected": [{"package": {"ecosystem": "npm", "name": "evil"}, "versions": ["1.0.0"]}]}"#;
        std::fs::write(self.dir.join("osv/npm/MAL-2026-7.json"), record).expect("OSV record");
        // A .crate is a gzipped tar of one directory, NAME-VERSION.
        std::fs::create_dir_all(data.join("crates")).expect("crates dir");
        tar_gz(
            &data.join("crates").join(CRATE),
            &[
                (
                    "moatdemo-1.0.0/Cargo.toml",
                    "[package]\nname = \"moatdemo\"\nversion = \"1.0.0\"\nedition = \"2021\"\n",
                ),
                ("moatdemo-1.0.0/src/lib.rs", "pub const VALUE: u32 = 1;\n"),
            ],
        );
    }

    /// The commits on `main` of the test git server's repository.
    pub fn git_log(&self) -> String {
        let repo = self.dir.join("data/git/moat/repo.git");
        let out = Command::new("git").arg("-C").arg(repo).args(["log", "--format=%s", "main"]).output();
        out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
    }

    /// A new bare repository `github.com/moat/NAME.git` on the test git
    /// server (pushes enabled: only the gateway can stop one), holding one
    /// commit on `main`.
    pub fn git_repo(&self, name: &str) {
        let data = self.dir.join("data");
        let bare = data.join(format!("git/moat/{name}.git"));
        let git = |args: &[&str]| {
            sh(Command::new("git")
                .args(["-c", "user.name=test", "-c", "user.email=test@test", "-c", "init.defaultBranch=main"])
                .args(args))
        };
        git(&["init", "-q", "--bare", &bare.display().to_string()]);
        git(&["-C", &bare.display().to_string(), "config", "http.receivepack", "true"]);
        let work = self.dir.join(format!("work-{name}"));
        git(&["init", "-q", &work.display().to_string()]);
        std::fs::write(work.join("README"), format!("{name}\n")).expect("README");
        git(&["-C", &work.display().to_string(), "add", "README"]);
        git(&["-C", &work.display().to_string(), "commit", "-q", "-m", "first"]);
        git(&["-C", &work.display().to_string(), "push", "-q", &bare.display().to_string(), "HEAD:main"]);
    }

    /// The refs of `github.com/moat/NAME.git` on the server, `ID REF` a line.
    pub fn git_refs(&self, name: &str) -> String {
        let repo = self.dir.join(format!("data/git/moat/{name}.git"));
        let out = Command::new("git")
            .arg("-C")
            .arg(repo)
            .args(["for-each-ref", "--format=%(objectname) %(refname)"])
            .output();
        out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
    }

    /// Waits until the servers answer (from inside the namespace).
    fn wait_ready(&self) {
        for _ in 0..100 {
            let ok = Command::new("ip")
                .args(["netns", "exec", &self.name, "curl", "-sf", "-m", "1", "--cacert"])
                .arg(self.dir.join("ca.pem"))
                .args(["--resolve", &format!("web.test:443:{WEB}"), "https://web.test/"])
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!(
            "the test internet did not come up: {}",
            std::fs::read_to_string(self.dir.join("servers.log")).unwrap_or_default()
        );
    }

    /// Flags for `moat serve` to use this internet.
    pub fn daemon_flags(&self) -> Vec<String> {
        vec![
            "--upstream-netns".into(),
            format!("/run/netns/{}", self.name),
            "--upstream-dns".into(),
            format!("{WEB}:53"),
            "--upstream-allow".into(),
            format!("{WEB}/32"),
            "--upstream-ca".into(),
            self.dir.join("ca.pem").display().to_string(),
            "--osv-db".into(),
            self.dir.join("osv").display().to_string(),
        ]
    }

    /// The CA's certificate (for boxes to trust).
    pub fn ca(&self) -> String {
        std::fs::read_to_string(self.dir.join("ca.pem")).expect("ca.pem")
    }

    /// Names the test DNS server was asked for so far.
    pub fn dns_queries(&self) -> String {
        std::fs::read_to_string(self.dir.join("dns.log")).unwrap_or_default()
    }

    /// Every request the web servers got so far (heads and bodies).
    pub fn received(&self) -> String {
        std::fs::read_to_string(self.dir.join("data/received.log")).unwrap_or_default()
    }

    /// Datagrams the UDP sink got so far, and pings (ICMP echo requests).
    pub fn udp_received(&self) -> String {
        std::fs::read_to_string(self.dir.join("udp.log")).unwrap_or_default()
    }

    /// Stops the servers and removes the namespace (once).
    pub fn stop(&mut self) {
        if self.name.is_empty() {
            return;
        }
        for mut child in self.servers.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
        // `ip netns exec` leaves python as its own process: end whatever runs there.
        let _ = Command::new("ip").args(["netns", "pids", &self.name]).output().map(|o| {
            for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        });
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
        self.name.clear();
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        self.stop();
    }
}
