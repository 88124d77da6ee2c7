//! Port forwarding: -L into the box works; everything else is refused.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::fixture::{run, unique};
use crate::Env;

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub(crate) fn curl(port: u16) -> crate::fixture::Ran {
    run(Command::new("curl").args(["-s", "-m", "5", &format!("http://127.0.0.1:{port}/")]))
}

/// Runs `ssh -N -L ...` in the background until dropped.
pub(crate) struct Tunnel(pub(crate) std::process::Child);

impl Tunnel {
    /// Ends ssh: SIGTERM, which `timeout` passes on (SIGKILL would orphan ssh).
    fn end(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.0.wait();
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        self.end();
    }
}

pub(crate) fn tunnel(env: &Env, name: &str, spec: &str) -> Tunnel {
    tunnel_with(env, name, spec, &[], Stdio::null())
}

fn tunnel_with(env: &Env, name: &str, spec: &str, opts: &[&str], stderr: Stdio) -> Tunnel {
    let mut all = vec!["-N", "-o", "ExitOnForwardFailure=yes", "-L", spec];
    all.extend_from_slice(opts);
    let mut cmd = env.daemon.ssh_with(&env.alice, Some(name), &all, &[]);
    cmd.stdout(Stdio::null()).stderr(stderr);
    Tunnel(cmd.spawn().unwrap())
}

/// Starts an HTTP server on port 8000 of box `name`'s loopback whose page
/// says `page`.
fn serve_page_on_8000(env: &Env, name: &str, page: &str) {
    let start = format!(
        "mkdir -p /srv/www && echo {page} > /srv/www/index.html && cd /srv/www && \
         nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &"
    );
    env.alice(Some(name), &[&start]).ok();
}

/// Asks `get` until it answers `want` (a server and a tunnel starting), for
/// up to 20 s.
fn until_answered(what: &str, get: impl Fn() -> crate::fixture::Ran, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = get();
        if out.stdout == want {
            return;
        }
        assert!(Instant::now() < deadline, "no answer through {what}: {:?} {}", out.status, out.stderr);
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn local_reaches_box_server(env: &Env) {
    let name = unique("fwd");
    env.new_box(&name, &[]);
    serve_page_on_8000(env, &name, "hello-from-box");
    let port = free_port();
    let _t = tunnel(env, &name, &format!("{port}:localhost:8000"));
    until_answered("the tunnel", || curl(port), "hello-from-box\n");
}

/// `ssh -D` (a SOCKS proxy, as VS Code's Remote-SSH opens one): names of the
/// box's loopback reach its servers; any other target is refused, and the
/// proxy goes on serving.
pub fn dynamic_forward_reaches_only_the_box(env: &Env) {
    let name = unique("dfwd");
    env.new_box(&name, &[]);
    serve_page_on_8000(env, &name, "hello-via-socks");
    let port = free_port();
    let mut cmd = env.daemon.ssh_with(
        &env.alice,
        Some(&name),
        &["-N", "-o", "ExitOnForwardFailure=yes", "-D", &port.to_string()],
        &[],
    );
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    let _t = Tunnel(cmd.spawn().unwrap());
    let via = |url: &str| {
        run(Command::new("curl").args(["-s", "-m", "5", "--socks5-hostname", &format!("127.0.0.1:{port}"), url]))
    };
    until_answered("ssh -D", || via("http://localhost:8000/"), "hello-via-socks\n");
    assert_eq!(via("http://127.0.0.1:8000/").stdout, "hello-via-socks\n");
    for outside in ["http://example.invalid/", "http://10.0.0.1:8000/", "http://127.0.0.2:8000/"] {
        let out = via(outside);
        assert_ne!(out.status, Some(0), "{outside} reached through ssh -D: {}", out.stdout);
    }
    assert_eq!(via("http://localhost:8000/").stdout, "hello-via-socks\n", "the proxy stopped serving");
    env.alice(None, &["rm", &name]).ok();
}

/// Starts a server on a unix socket at /run/u.sock in box `name`, serving
/// "hello-over-unix" (the e2e clients' `unix_http_server.py`).
fn start_unix_server(env: &Env, name: &str) {
    let script = include_str!("clients/unix_http_server.py");
    let start = format!(
        "mkdir -p /srv/u && echo hello-over-unix > /srv/u/index.html && cat > /tmp/u.py <<'PY'\n{script}PY\n\
         nohup python3 /tmp/u.py /run/u.sock /srv/u >/dev/null 2>&1 &"
    );
    env.alice(Some(name), &[&start]).ok();
}

/// `ssh -L LOCAL.sock:/box/path.sock` (OpenSSH's direct-streamlocal): a
/// server on a unix socket in the box answers through the local socket; a
/// socket path with nothing there is refused and the tunnel lives on.
pub fn socket_forward_reaches_box_unix_server(env: &Env) {
    let name = unique("sfwd");
    env.new_box(&name, &[]);
    start_unix_server(env, &name);
    let local = env.dir.join(format!("{name}.sock"));
    let _t = tunnel(env, &name, &format!("{}:/run/u.sock", local.display()));
    let get = |socket: &std::path::Path| {
        run(Command::new("curl").args(["-s", "-m", "5", "--unix-socket"]).arg(socket).arg("http://box/"))
    };
    until_answered("the socket tunnel", || get(&local), "hello-over-unix\n");
    let missing = env.dir.join(format!("{name}-missing.sock"));
    let spec = format!("{}:/run/nothing-here.sock", missing.display());
    let mut t = tunnel_with(env, &name, &spec, &["-v"], Stdio::piped());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !missing.exists() {
        assert!(Instant::now() < deadline, "the socket tunnel never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_ne!(get(&missing).status, Some(0));
    assert_eq!(get(&local).stdout, "hello-over-unix\n", "the first tunnel still answers");
    t.end();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut t.0.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("open failed: connect failed"), "the server did not refuse the forward: {stderr}");
    // Malformed and unwanted channel opens from paramiko: refused, nothing hangs.
    let out = crate::clients::python_client(env, "hostile_channels.py", &name).ok();
    assert!(out.stdout.contains("hostile channel opens refused"), "{}", out.stdout);
    env.alice(None, &["rm", &name]).ok();
}

pub fn outside_targets_and_other_forwards_refused(env: &Env) {
    let name = unique("nofwd");
    env.new_box(&name, &["--image", "busybox"]);
    // A forward to anything but the box's loopback is refused by the server
    // before any connection is attempted (the name does not even resolve).
    let port = free_port();
    // (-v: ssh reports the server's answer to each forward.)
    let mut t = tunnel_with(env, &name, &format!("{port}:example.invalid:80"), &["-v"], Stdio::piped());
    // Wait for ssh to listen, so that the refusal below is the server's.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the tunnel never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_ne!(curl(port).status, Some(0));
    t.end();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut t.0.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("administratively prohibited"), "the server did not refuse the forward: {stderr}");
    // Remote forwarding (-R) is refused.
    let mut cmd = env.daemon.ssh_with(
        &env.alice,
        Some(&name),
        &["-o", "ExitOnForwardFailure=yes", "-R", "0:127.0.0.1:9"],
        &["true"],
    );
    let out = run(&mut cmd);
    assert_eq!(out.status, Some(255), "{}", out.stderr);
    assert!(out.stderr.contains("forwarding failed"), "{}", out.stderr);
    // Agent forwarding: the box gets no agent socket.
    let agent_dir = env.dir.join(format!("{name}-agent"));
    std::fs::create_dir_all(&agent_dir).unwrap();
    let mut cmd = Command::new("ssh-agent");
    cmd.arg("-a")
        .arg(agent_dir.join("sock"))
        .arg("timeout")
        .arg("120")
        .arg("ssh")
        .args(env.daemon.ssh_opts(&env.alice));
    cmd.args(["-A", "-p", &env.daemon.port.to_string(), &format!("{name}@127.0.0.1"), "echo \"[$SSH_AUTH_SOCK]\""]);
    let out = run(&mut cmd).ok();
    assert_eq!(out.stdout, "[]\n");
    // X11 forwarding: no DISPLAY in the box.
    let mut cmd = env.daemon.ssh_with(&env.alice, Some(&name), &["-X"], &["echo \"[$DISPLAY]\""]);
    cmd.env("DISPLAY", ":0");
    let out = run(&mut cmd).ok();
    assert_eq!(out.stdout, "[]\n");
}
