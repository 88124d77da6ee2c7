//! A real browser for the web URL tests: Debian's headless Chromium, driven
//! through chromedriver (WebDriver over HTTP on loopback). Its resolver maps
//! the test domain to loopback and every other name to nothing, so no
//! lookup leaves the machine; it trusts the edge's CA by its key's hash.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::fixture::Edge;
use crate::forward::free_port;

/// One browser (its own profile: its own cookies) and its chromedriver.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    dir: PathBuf,
}

/// The base64 SHA-256 of the CA certificate's public key, as Chromium's
/// `--ignore-certificate-errors-spki-list` takes it.
fn spki_hash(ca: &Path) -> String {
    let script = format!(
        "openssl x509 -in '{}' -pubkey -noout | openssl pkey -pubin -outform der | openssl dgst -sha256 -binary | base64",
        ca.display()
    );
    let out = Command::new("sh").arg("-c").arg(script).output().expect("openssl");
    assert!(out.status.success(), "spki hash: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

impl Browser {
    /// Starts Chromium with a fresh profile under `dir`, resolving `*.DOMAIN`
    /// to the edge on loopback.
    pub fn start(dir: &Path, edge: &Edge, domain: &str, name: &str) -> Browser {
        let dir = dir.join(format!("browser-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("chromedriver.log")).unwrap())
            .spawn()
            .expect("start chromedriver (scripts/deps.sh installs chromium-driver)");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        // Flags from COMPONENTS.md: no background traffic, no sandbox (root).
        let args = [
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--window-size=800,600".into(),
            format!("--user-data-dir={}", dir.join("profile").display()),
            format!("--host-resolver-rules=MAP *.{domain} 127.0.0.1, MAP * ~NOTFOUND, EXCLUDE localhost"),
            format!("--ignore-certificate-errors-spki-list={}", spki_hash(&edge.ca)),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args},
        }}});
        let mut b = Browser { driver, port, session: String::new(), dir };
        let made = b.call("POST", "/session", Some(caps));
        b.session = made["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {made}")).to_string();
        b
    }

    /// One WebDriver command; its `value`.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut conn = TcpStream::connect(("127.0.0.1", self.port)).expect("reach chromedriver");
        conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            conn,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        // (chromedriver keeps the connection open: read by Content-Length.)
        let mut answer = Vec::new();
        let mut buf = [0u8; 64 << 10];
        let body_at = loop {
            let n = conn.read(&mut buf).expect("read chromedriver");
            assert!(n > 0, "chromedriver closed: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
            if let Some(at) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
        };
        let head = String::from_utf8_lossy(&answer[..body_at]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("chromedriver: {head}"));
        while answer.len() < body_at + length {
            let n = conn.read(&mut buf).expect("read chromedriver");
            assert!(n > 0, "chromedriver closed mid-answer");
            answer.extend_from_slice(&buf[..n]);
        }
        let json = String::from_utf8_lossy(&answer[body_at..body_at + length]).into_owned();
        let value: Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("chromedriver: {e}: {json}"));
        value["value"].clone()
    }

    fn at(&self, what: &str) -> String {
        format!("/session/{}/{what}", self.session)
    }

    /// Loads `url` (returns once it has loaded).
    pub fn goto(&self, url: &str) {
        let v = self.call("POST", &self.at("url"), Some(json!({ "url": url })));
        assert!(v.is_null(), "navigate to {url}: {v}");
    }

    /// Runs `script` in the page; what it returns.
    pub fn eval(&self, script: &str) -> Value {
        self.call("POST", &self.at("execute/sync"), Some(json!({ "script": script, "args": [] })))
    }

    /// The page's text.
    pub fn text(&self) -> String {
        self.eval("return document.body ? document.body.innerText : ''").as_str().unwrap_or_default().to_string()
    }

    /// Waits until the page's text holds `want`; the text.
    #[track_caller]
    pub fn wait_for_text(&self, want: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = self.text();
            if text.contains(want) {
                return text;
            }
            assert!(Instant::now() < deadline, "the page never said {want:?}: {text:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The cookies the browser holds for the page's host.
    pub fn cookies(&self) -> Vec<Value> {
        self.call("GET", &self.at("cookie"), None).as_array().cloned().unwrap_or_default()
    }

    /// A screenshot of the page: (width, height, RGBA pixels).
    pub fn screenshot(&self) -> (u32, u32, Vec<u8>) {
        use base64::Engine as _;
        let v = self.call("GET", &self.at("screenshot"), None);
        let png = base64::engine::general_purpose::STANDARD.decode(v.as_str().expect("a screenshot")).unwrap();
        std::fs::write(self.dir.join("screenshot.png"), &png).unwrap();
        let mut decoder = png::Decoder::new(std::io::Cursor::new(png));
        decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::ALPHA);
        let mut reader = decoder.read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut pixels).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgba, "{info:?}");
        pixels.truncate(info.buffer_size());
        (info.width, info.height, pixels)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.call("DELETE", &format!("/session/{}", self.session), None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // A browser whose session never started (or did not end) is found by
        // its profile dir, which only it names.
        let profile = format!("--user-data-dir={}", self.dir.join("profile").display());
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else { continue };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if cmdline.split(|b| *b == 0).any(|arg| arg == profile.as_bytes()) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
