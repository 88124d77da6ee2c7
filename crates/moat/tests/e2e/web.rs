//! Web URLs: a real browser signs in to a private URL and runs an app from a
//! box (a page that loads a script and opens a WebSocket to the same box);
//! another account is refused until `share`; a public URL needs nothing; a
//! suspended box wakes on a request; every request is in `log NAME`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::browser::Browser;
use crate::fixture::{run, unique, Key};
use crate::Env;

/// The shared daemon's web domain (see `main`).
pub const DOMAIN: &str = "moat.test";

/// The app a box serves: a page, its script, a WebSocket that answers
/// `pong:` and what it got, the request's headers as JSON, and server-sent
/// events a second apart.
const APP: &str = r#"
import base64, hashlib, http.server, json, struct, sys, time
PAGE = b'<!doctype html><html><head><title>moat app</title><script src="/app.js"></script></head><body><h1 id="t">loading</h1></body></html>'
JS = b'''
window.addEventListener("load", () => {
  fetch("/headers").then(r => r.json()).then(h => { window.seen = h; });
  const ws = new WebSocket("wss://" + location.host + "/ws");
  ws.onopen = () => ws.send("ping");
  ws.onmessage = (e) => {
    document.getElementById("t").textContent = "app ok: " + e.data;
    document.body.style.background = "rgb(0, 192, 0)";
  };
  ws.onerror = () => { document.getElementById("t").textContent = "websocket failed"; };
});
'''
class App(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def answer(self, body, kind):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
            self.end_headers()
            self.wfile.flush()
            head = self.rfile.read(2)
            n = head[1] & 127
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            mask = self.rfile.read(4)
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(self.rfile.read(n)))
            reply = b"pong:" + data
            self.wfile.write(bytes([0x81, len(reply)]) + reply)
            self.wfile.flush()
            self.rfile.read(1)
            self.close_connection = True
        elif self.path == "/app.js":
            self.answer(JS, "application/javascript")
        elif self.path == "/headers":
            self.answer(json.dumps({k.lower(): v for k, v in self.headers.items()}).encode(), "application/json")
        elif self.path == "/events":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for word in ["one", "two"]:
                self.wfile.write(("data: %s\n\n" % word).encode())
                self.wfile.flush()
                time.sleep(1)
            self.close_connection = True
        else:
            self.answer(PAGE, "text/html")
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), App).serve_forever()
"#;

/// Starts the app in box `name` on each of `ports`.
fn start_app(env: &Env, name: &str, ports: &[u16]) {
    let mut script = format!("mkdir -p /srv && cat > /srv/app.py <<'APP'\n{APP}\nAPP\n");
    for port in ports {
        script.push_str(&format!("nohup python3 /srv/app.py {port} >/dev/null 2>&1 &\n"));
    }
    env.alice(Some(name), &[&script]).ok();
}

/// The URL `urls NAME --json` gives for `port`.
pub fn url_of(env: &Env, name: &str, port: u16) -> String {
    url_in(&env.alice(None, &["urls", name, "--json"]).ok().stdout, port)
}

/// The URL for `port` in what `urls --json` printed (`listed`).
pub fn url_in(listed: &str, port: u16) -> String {
    let listed: Value = serde_json::from_str(listed).unwrap();
    let found = listed.as_array().unwrap().iter().find(|e| e["port"] == port).unwrap_or_else(|| panic!("{listed}"));
    found["url"].as_str().unwrap().to_string()
}

/// The host (and edge port) of a box's URL, as a client names it.
pub fn host_of(url: &str) -> String {
    url.trim_start_matches("https://").trim_end_matches('/').to_string()
}

/// The first line `url ARGS` prints: a sign-in link.
fn link(env: &Env, key: &Key, args: &[&str]) -> String {
    let mut all = vec!["url"];
    all.extend_from_slice(args);
    let out = run(&mut env.daemon.ssh(key, None, &all)).ok();
    out.stdout.lines().next().unwrap().to_string()
}

/// Whether most of the screenshot is the app's green.
fn mostly_green(b: &Browser) -> bool {
    let (w, h, px) = b.screenshot();
    let green = px.chunks_exact(4).filter(|p| p[0] < 40 && (170..=215).contains(&p[1]) && p[2] < 40).count();
    green * 2 > (w * h) as usize
}

fn state_of(env: &Env, name: &str) -> String {
    let info: Value = serde_json::from_str(&env.alice(None, &["info", name, "--json"]).ok().stdout).unwrap();
    info["state"].as_str().unwrap().to_string()
}

pub fn private_urls_sign_in_share_and_wake_in_a_browser(env: &Env) {
    let edge = env.daemon.edge.clone().expect("the shared daemon runs an HTTP edge");
    let name = unique("webapp");
    env.new_box(&name, &[]);
    start_app(env, &name, &[8000, 8001]);
    let exposed = env.alice(None, &["expose", &name, "8000"]).ok().stdout;
    assert!(exposed.contains("private") && exposed.contains(&format!("url {name} 8000")), "{exposed}");
    let url = url_of(env, &name, 8000);
    let host = host_of(&url);
    assert!(host.starts_with(&format!("8000-{name}-")) && host.contains(&format!(".{DOMAIN}:")), "{url}");

    // Private: the 401 page says how to get in, and nothing reached the box.
    let alice = Browser::start(&env.dir, &edge, DOMAIN, &format!("{name}-alice"));
    alice.goto(&url);
    let page = alice.wait_for_text("401");
    assert!(page.contains(&format!("url {name} 8000")), "{page}");
    assert!(!env.alice(None, &["log", &name]).ok().stdout.contains(" web "), "a refused request reached the box");

    // The sign-in link sets the cookie and sends the browser on to the app,
    // whose script came from the box and whose WebSocket reached it.
    let signin = link(env, &env.alice, &[&name, "8000"]);
    alice.goto(&signin);
    alice.wait_for_text("app ok: pong:ping");
    assert!(mostly_green(&alice), "the screenshot does not show the app");
    // The page came over HTTP/2 (ALPN); the WebSocket took HTTP/1.1's Upgrade.
    let protocol = alice.eval("return performance.getEntriesByType('navigation')[0].nextHopProtocol");
    assert_eq!(protocol, "h2");
    let cookies = alice.cookies();
    assert_eq!(cookies.len(), 1, "{cookies:?}");
    let c = &cookies[0];
    assert_eq!(c["name"], "__Host-moat");
    assert_eq!(
        (c["httpOnly"].as_bool(), c["secure"].as_bool(), c["sameSite"].as_str()),
        (Some(true), Some(true), Some("Lax"))
    );
    assert!(!c["domain"].as_str().unwrap().starts_with('.'), "not host-only: {c}");
    // What the box saw: its own Host, the visitor's in X-Forwarded-*, no session cookie.
    let seen = alice.eval("return JSON.stringify(window.seen || null)");
    let seen: Value = serde_json::from_str(seen.as_str().unwrap()).unwrap();
    assert_eq!(seen["host"], "localhost:8000", "{seen}");
    assert_eq!(seen["x-forwarded-proto"], "https", "{seen}");
    assert_eq!(seen["x-forwarded-host"].as_str(), Some(host.as_str()), "{seen}");
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1", "{seen}");
    assert!(seen.get("cookie").is_none_or(|c| !c.as_str().unwrap_or("").contains("__Host-moat")), "{seen}");
    // What a visitor says a proxy said never reaches the box: the edge is its proxy.
    let forged = "return fetch('/headers', {headers: {'X-Forwarded-Ssl': 'off', 'X-Original-URL': '/admin', \
                  'True-Client-IP': '6.6.6.6', 'X-Forwarded-Prefix': '/evil'}}).then(r => r.text())";
    let seen: Value = serde_json::from_str(alice.eval(forged).as_str().unwrap()).unwrap();
    for name in ["x-forwarded-ssl", "x-original-url", "true-client-ip", "x-forwarded-prefix"] {
        assert!(seen.get(name).is_none(), "{name} reached the box: {seen}");
    }
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1", "{seen}");
    // A link works once.
    alice.goto(&signin);
    assert!(alice.wait_for_text("401").contains("used already"));

    // Another account: refused, and cannot get a link, until shared.
    let owner = host.split('.').next().unwrap().rsplit('-').next().unwrap().to_string();
    let bob = Browser::start(&env.dir, &edge, DOMAIN, &format!("{name}-bob"));
    bob.goto(&url);
    bob.wait_for_text("401");
    let refused = run(&mut env.daemon.ssh(&env.bob, None, &["url", &name, "8000", "--owner", &owner]));
    assert_ne!(refused.status, Some(0), "{}", refused.stdout);
    assert!(refused.stderr.contains("no box named"), "{}", refused.stderr);
    let who: Value =
        serde_json::from_str(&run(&mut env.daemon.ssh(&env.bob, None, &["whoami", "--json"])).ok().stdout).unwrap();
    let bob_fp = who["fingerprint"].as_str().unwrap().to_string();
    let shared_user = format!("{name}.{owner}");
    let bob_ssh = || run(&mut env.daemon.ssh(&env.bob, Some(&shared_user), &["cat /srv/app.py | wc -l"]));
    assert_ne!(bob_ssh().status, Some(0), "bob reached alice's box by ssh before a share");
    env.alice(None, &["share", &name, &bob_fp]).ok();
    bob.goto(&link(env, &env.bob, &[&name, "8000", "--owner", &owner]));
    bob.wait_for_text("app ok: pong:ping");
    let out = bob_ssh().ok();
    assert!(out.stdout.trim().parse::<u32>().unwrap() > 10, "{}", out.stdout);
    assert!(env.alice(None, &["urls"]).ok().stdout.contains(&name));
    let shared = run(&mut env.daemon.ssh(&env.bob, None, &["urls"])).ok().stdout;
    assert!(shared.contains("shared"), "{shared}");
    env.alice(None, &["unshare", &name, &bob_fp]).ok();
    // The edge reuses an allowed answer, and its connection to the box, for a second.
    std::thread::sleep(Duration::from_millis(1200));
    bob.goto(&url);
    bob.wait_for_text("401");
    assert_ne!(bob_ssh().status, Some(0), "bob reached alice's box by ssh after unshare");

    // A public URL needs nothing (bob is signed out of it).
    env.alice(None, &["expose", &name, "8001", "--public"]).ok();
    bob.goto(&url_of(env, &name, 8001));
    bob.wait_for_text("app ok: pong:ping");

    // Server-sent events stream: the first arrives before the second is sent.
    let events = format!("{}events", url_of(env, &name, 8001));
    let mut curl = Command::new("curl")
        .args(["-sN", "-m", "10", "--cacert"])
        .arg(&edge.ca)
        .args(["--resolve", &format!("{}:127.0.0.1", host.replacen("8000-", "8001-", 1)), &events])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut lines = BufReader::new(curl.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "data: one");
    let first = started.elapsed();
    assert_eq!(lines.find(|l| l.as_deref().is_ok_and(|l| !l.is_empty())).unwrap().unwrap(), "data: two");
    assert!(first + Duration::from_millis(500) < started.elapsed(), "events came together: {first:?}");
    let _ = curl.wait();

    // Suspended between two requests, while the edge still holds its session
    // (and a stream to its agent), the box wakes for the second.
    let public_host = host.replacen("8000-", "8001-", 1);
    let get = || {
        let out = Command::new("curl")
            .args(["-sS", "-m", "10", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
            .arg(&edge.ca)
            .args(["--resolve", &format!("{public_host}:127.0.0.1"), &url_of(env, &name, 8001)])
            .output()
            .unwrap();
        let code = String::from_utf8_lossy(&out.stdout).into_owned();
        format!("{code}{}", String::from_utf8_lossy(&out.stderr).trim())
    };
    assert_eq!(get(), "200");
    env.alice(None, &["suspend", &name]).ok();
    let started = Instant::now();
    assert_eq!(get(), "200");
    assert!(started.elapsed() < Duration::from_secs(3), "the second request took {:?}", started.elapsed());
    assert_eq!(state_of(env, &name), "running");

    // A suspended box wakes on the next request, and the page works.
    env.alice(None, &["suspend", &name]).ok();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(state_of(env, &name), "suspended");
    // (Its cookie still works: the spent link's refusal did not sign it out.)
    alice.goto(&url);
    alice.wait_for_text("app ok: pong:ping");
    assert_eq!(state_of(env, &name), "running");

    // Every request that reached the box, with who made it.
    std::thread::sleep(Duration::from_millis(500));
    let log = env.alice(None, &["log", &name]).ok().stdout;
    let alice_fp = alice_fingerprint(env);
    for want in [
        "GET /app.js".to_string(),
        "200 in".into(),
        format!("by {alice_fp}"),
        format!("by {bob_fp}"),
        "by public".into(),
        "GET /ws".into(),
    ] {
        assert!(log.contains(&want), "{want:?} not in the log:\n{log}");
    }

    // A stopped box is a 503 naming start; nothing is served once unexposed.
    env.alice(None, &["stop", &name]).ok();
    bob.goto(&url_of(env, &name, 8001));
    assert!(bob.wait_for_text("503").contains(&format!("start {name}")));
    env.alice(None, &["unexpose", &name, "8001"]).ok();
    bob.goto(&format!("https://{}/", host.replacen("8000-", "8001-", 1)));
    // Told as a private URL, as a box that is not there is: whoever knows a
    // key's slug learns nothing of which boxes and ports it exposes.
    let gone = bob.wait_for_text("401");
    let nosuch = host.replacen("8000-", "8001-", 1).replacen(&format!("-{name}-"), "-nosuchbox-", 1);
    bob.goto(&format!("https://{nosuch}/"));
    assert_eq!(bob.wait_for_text("401"), gone.replace(&name, "nosuchbox"));
    env.alice(None, &["rm", &name]).ok();
}

fn alice_fingerprint(env: &Env) -> String {
    let who: Value = serde_json::from_str(&env.alice(None, &["whoami", "--json"]).ok().stdout).unwrap();
    who["fingerprint"].as_str().unwrap().to_string()
}
