//! Taking access away ends what is open: `unshare` ends the other account's
//! sessions and forwards on the box at once, and a key taken out of the keys
//! file ends its account's sessions and refuses what its connections still
//! open ask for.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::fixture::{run, spawn_with_lines, unique, Key};
use crate::forward::free_port;
use crate::Env;

/// A session printing a line every 200 ms until it is ended.
const TICKS: &str = "while :; do echo tick; sleep 0.2; done";

/// A key of its own, listed in the daemon's keys file until [`Listed`] drops.
struct Listed<'a> {
    file: &'a Path,
    key: Key,
}

impl<'a> Listed<'a> {
    fn add(env: &'a Env, name: &str) -> Self {
        let key = Key::generate(&env.dir, name);
        let file = env.daemon.keys_file.as_path();
        rewrite(file, |keys| format!("{keys}{}", key.public));
        Self { file, key }
    }

    fn remove(&self) {
        rewrite(self.file, |keys| keys.replace(&self.key.public, ""));
    }
}

impl Drop for Listed<'_> {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Rewrites the keys file whole (renamed into place: the daemon, reading it
/// for other tests meanwhile, never sees half of it).
fn rewrite(file: &Path, change: impl FnOnce(&str) -> String) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let keys = std::fs::read_to_string(file).unwrap();
    let part = file.with_extension("part");
    std::fs::write(&part, change(&keys)).unwrap();
    std::fs::rename(&part, file).unwrap();
}

fn fingerprint(env: &Env, key: &Key) -> String {
    let who: Value = serde_json::from_str(&run(&mut env.daemon.ssh(key, None, &["whoami", "--json"])).ok().stdout)
        .expect("whoami --json");
    who["fingerprint"].as_str().unwrap().to_string()
}

/// Waits for the session printing `lines` to end (its ssh to exit), for up
/// to `within`; its status and what it said on stderr.
fn ends_within(child: &mut Child, lines: &Receiver<String>, within: Duration) -> (Option<i32>, String) {
    let deadline = Instant::now() + within;
    loop {
        while lines.try_recv().is_ok() {}
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return (status.code(), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the session went on {within:?} after its access was taken away");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A ticking session through `user` as `key`, seen ticking.
fn ticking(env: &Env, key: &Key, user: &str) -> (Child, Receiver<String>) {
    let mut cmd = env.daemon.ssh(key, Some(user), &[TICKS]);
    let (child, _stdin, lines) = spawn_with_lines(cmd.stderr(Stdio::piped()));
    assert_eq!(lines.recv_timeout(Duration::from_secs(30)).as_deref(), Ok("tick"), "the session never ticked");
    (child, lines)
}

pub fn unshare_ends_the_other_accounts_sessions_and_forwards(env: &Env) {
    let name = unique("taken");
    env.new_box(&name, &[]);
    // A server in the box that streams a line every 200 ms to whoever connects.
    let server = "nohup python3 -c 'import socket, time\n\
         s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind((\"127.0.0.1\", 7000)); s.listen()\n\
         while True:\n    c, _ = s.accept()\n    try:\n        while True: c.sendall(b\"x\\n\"); time.sleep(0.2)\n    \
         except OSError: c.close()\n' >/dev/null 2>&1 &";
    env.alice(Some(&name), &[server]).ok();
    // And a web page that streams a line every 200 ms (HTTP/1.0: until it closes).
    let web = "nohup python3 -c 'import http.server, time\n\
         class S(http.server.BaseHTTPRequestHandler):\n    \
         def do_GET(self):\n        self.send_response(200); self.end_headers()\n        \
         while True: self.wfile.write(b\"w\\n\"); self.wfile.flush(); time.sleep(0.2)\n\
         http.server.ThreadingHTTPServer((\"127.0.0.1\", 7001), S).serve_forever()\n' >/dev/null 2>&1 &";
    env.alice(Some(&name), &[web]).ok();
    env.alice(None, &["expose", &name, "7001"]).ok();
    let carol = Listed::add(env, "carol-unshared");
    let carol_fp = fingerprint(env, &carol.key);
    let owner = {
        let me: Value = serde_json::from_str(&env.alice(None, &["whoami", "--json"]).ok().stdout).unwrap();
        me["owner"].as_str().expect("whoami names the account's owner slug").to_string()
    };
    env.alice(None, &["share", &name, &carol_fp]).ok();
    // Its owner sees whom it is shared with; a share with oneself is refused.
    let info: Value = serde_json::from_str(&env.alice(None, &["info", &name, "--json"]).ok().stdout).unwrap();
    assert_eq!(info["shared_with"], serde_json::json!([carol_fp]), "{info}");
    let own_fp = fingerprint(env, &env.alice);
    let to_self = env.alice(None, &["share", &name, &own_fp]);
    assert!(to_self.status != Some(0) && to_self.stderr.contains("is yours"), "{}", to_self.stderr);
    let shared = format!("{name}.{owner}");
    let (mut session, lines) = ticking(env, &carol.key, &shared);
    let port = free_port();
    let spec = format!("{port}:127.0.0.1:7000");
    let mut tunnel = env
        .daemon
        .ssh_with(&carol.key, Some(&shared), &["-N", "-o", "ExitOnForwardFailure=yes", "-L", &spec], &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stream = connected(port);
    // A remote forward of carol's: a port in alice's box that reaches carol.
    let mut remote = env
        .daemon
        .ssh_with(&carol.key, Some(&shared), &["-N", "-o", "ExitOnForwardFailure=yes", "-R", "7100:127.0.0.1:9"], &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let probe =
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 7100), timeout=2)\" 2>/dev/null; echo $?";
    let deadline = Instant::now() + Duration::from_secs(20);
    while env.alice(Some(&name), &[probe]).ok().stdout != "0\n" {
        assert!(Instant::now() < deadline, "carol's remote forward never listened in the box");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The owner's page streams first: carol's request must not ride in the
    // owner's web session (it outlived the unshare), nor the owner's in hers.
    let mut own_page = web_stream(env, &env.alice, &name, &owner);
    let mut page = web_stream(env, &carol.key, &name, &owner);
    let mut forwarded = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    forwarded.read_line(&mut line).unwrap();
    assert_eq!(line, "x\n");

    env.alice(None, &["unshare", &name, &carol_fp]).ok();
    let (status, said) = ends_within(&mut session, &lines, Duration::from_secs(3));
    assert_ne!(status, Some(0), "{said}");
    assert!(said.contains("access to box") && said.contains("taken away"), "{said}");
    // The forward's connection ends too (the lines already on their way first).
    stream.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let started = Instant::now();
    loop {
        line.clear();
        match forwarded.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => assert!(started.elapsed() < Duration::from_secs(3), "the forward still carries after unshare"),
        }
    }
    let _ = tunnel.kill();
    let _ = tunnel.wait();
    // Carol's remote forward's port closes in the box.
    let deadline = Instant::now() + Duration::from_secs(5);
    while env.alice(Some(&name), &[probe]).ok().stdout != "1\n" {
        assert!(Instant::now() < deadline, "carol's remote forward still listens after unshare");
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = remote.kill();
    let _ = remote.wait();
    // The web page's stream ends too (curl exits once the edge closes it);
    // the owner's goes on, until the port is exposed no more.
    let (status, said) = ends_within(&mut page.0, &page.1, Duration::from_secs(4));
    assert_ne!(status, Some(0), "the page ended cleanly? {said}");
    while own_page.1.try_recv().is_ok() {}
    assert_eq!(own_page.1.recv_timeout(Duration::from_secs(3)).as_deref(), Ok("w"), "the owner's page ended too");
    env.alice(None, &["unexpose", &name, "7001"]).ok();
    let (status, said) = ends_within(&mut own_page.0, &own_page.1, Duration::from_secs(4));
    assert_ne!(status, Some(0), "the owner's page outlived unexpose: {said}");
    // And nothing new opens.
    let again = run(&mut env.daemon.ssh(&carol.key, Some(&shared), &["true"]));
    assert_ne!(again.status, Some(0));
    env.alice(None, &["rm", &name]).ok();
}

/// A streaming page of `name` (port 7001, private, shared with `key`)
/// signed in to as `key` and seen streaming: curl, and its lines.
fn web_stream(env: &Env, key: &Key, name: &str, owner: &str) -> (Child, Receiver<String>) {
    let edge = env.daemon.edge.clone().expect("the shared daemon runs an HTTP edge");
    let link = run(&mut env.daemon.ssh(key, None, &["url", name, "7001", "--owner", owner])).ok();
    let link = link.stdout.lines().next().unwrap().to_string();
    let host = link.trim_start_matches("https://").split('/').next().unwrap().to_string();
    let bare = host.split(':').next().unwrap();
    let resolve = format!("{bare}:{}:127.0.0.1", edge.port);
    let jar = env.dir.join(format!("{name}-{}.cookies", key.path.file_name().unwrap().to_string_lossy()));
    let curl = |extra: &[&str]| {
        let mut cmd = std::process::Command::new("curl");
        cmd.args(["-s", "--cacert"]).arg(&edge.ca).args(["--resolve", &resolve, "-b"]).arg(&jar).arg("-c").arg(&jar);
        cmd.args(extra);
        cmd
    };
    let signed = run(&mut curl(&["-o", "/dev/null", "-w", "%{http_code}", &link])).ok();
    assert_eq!(signed.stdout, "303", "the sign-in link");
    let mut cmd = curl(&["-N", &format!("https://{host}/stream")]);
    let (child, _stdin, lines) = spawn_with_lines(cmd.stderr(Stdio::piped()));
    assert_eq!(lines.recv_timeout(Duration::from_secs(30)).as_deref(), Ok("w"), "the page never streamed");
    (child, lines)
}

/// A connection to the forward's local port (ssh may take a moment to listen).
fn connected(port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => return stream,
            Err(e) => assert!(Instant::now() < deadline, "no forward on {port}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn a_removed_key_ends_its_sessions_and_connections(env: &Env) {
    let dave = Listed::add(env, "dave-removed");
    let name = unique("dave");
    let made = run(&mut env.daemon.ssh(&dave.key, None, &["new", &name, "--image", "busybox"])).ok();
    assert_eq!(made.stdout.trim(), name);
    let (mut session, lines) = ticking(env, &dave.key, &name);
    // A connection kept open (as an IDE or a ControlMaster keeps one).
    let socket = env.dir.join(format!("{name}.ctl"));
    let control = format!("ControlPath={}", socket.display());
    let mut master = env
        .daemon
        .ssh_with(&dave.key, None, &["-M", "-N", "-o", &control], &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let through_master = || run(&mut env.daemon.ssh_with(&dave.key, None, &["-o", &control], &["ls"]));
    // The master listens on its socket once it is connected (a command before
    // that would connect on its own, and after the key's removal be refused
    // at its login instead).
    let deadline = Instant::now() + Duration::from_secs(20);
    while run(&mut env.daemon.ssh_with(&dave.key, None, &["-o", &control, "-O", "check"], &[])).status != Some(0) {
        assert!(Instant::now() < deadline, "the master connection never came up");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(through_master().status, Some(0));

    dave.remove();
    let (status, said) = ends_within(&mut session, &lines, Duration::from_secs(4));
    assert_ne!(status, Some(0), "{said}");
    assert!(said.contains("taken away"), "{said}");
    let refused = through_master();
    assert_ne!(refused.status, Some(0), "{}", refused.stdout);
    assert!(refused.stderr.contains("no longer listed"), "{}", refused.stderr);
    let _ = master.kill();
    let _ = master.wait();
    let _ = std::fs::remove_file(&socket);

    // Listed again, the account finds its box as it left it, and removes it.
    rewrite(dave.file, |keys| format!("{keys}{}", dave.key.public));
    let gone = run(&mut env.daemon.ssh(&dave.key, None, &["rm", &name]));
    assert_eq!(gone.status, Some(0), "{}", gone.stderr);
}

/// An RSA key signs in with SHA-2 signatures, and never with `ssh-rsa`'s
/// SHA-1, which OpenSSH refuses since 8.8.
pub fn rsa_keys_sign_in_with_sha2_only(env: &Env) {
    let path = env.dir.join("rsa-user");
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "rsa", "-b", "2048", "-N", "", "-C", "rsa-user", "-f"])
        .arg(&path)
        .status()
        .unwrap();
    assert!(made.success());
    let public = std::fs::read_to_string(path.with_extension("pub")).unwrap();
    let listed = Listed { file: env.daemon.keys_file.as_path(), key: Key { path, public } };
    rewrite(listed.file, |keys| format!("{keys}{}", listed.key.public));
    let whoami = |extra: &[&str]| run(&mut env.daemon.ssh_with(&listed.key, None, extra, &["whoami"]));
    assert_eq!(whoami(&[]).status, Some(0), "rsa-sha2-512");
    let sha1 = whoami(&["-o", "PubkeyAcceptedAlgorithms=ssh-rsa"]);
    assert_eq!(sha1.status, Some(255), "ssh-rsa (SHA-1) was accepted: {}", sha1.stdout);
}
