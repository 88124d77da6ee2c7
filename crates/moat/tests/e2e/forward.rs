//! Port forwarding: -L and -D into the box, -R from the box to the client;
//! everything else is refused.

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
    // 48 connections at once over the one SSH connection: forwards are not
    // held to the 32 sessions a connection may have (as under sshd).
    let held: Vec<std::net::TcpStream> = (0..48)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            std::io::Write::write_all(&mut s, b"GET / HTTP/1.0\r\n\r\n").unwrap();
            s
        })
        .collect();
    for (i, mut s) in held.into_iter().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = String::new();
        let _ = std::io::Read::read_to_string(&mut s, &mut answer);
        assert!(answer.ends_with("hello-from-box\n"), "connection {i}: {answer:?}");
    }
    // The box's own name (what a dev server in it prints) is its loopback.
    let by_name = free_port();
    let _t = tunnel(env, &name, &format!("{by_name}:{name}:8000"));
    until_answered("the tunnel to the box's name", || curl(by_name), "hello-from-box\n");
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
    // A remote forward (-R) needs a box: the control plane has no loopback.
    let mut cmd =
        env.daemon.ssh_with(&env.alice, None, &["-o", "ExitOnForwardFailure=yes", "-R", "0:127.0.0.1:9"], &["ls"]);
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

/// `ssh -R 9000:127.0.0.1:PORT` (OpenSSH): programs in the box reach a
/// server on the client's side through the box's loopback (a page, and 8 MiB
/// whose digest matches); a port the box already uses is refused; the port
/// closes in the box when ssh ends; the same through a socket path. paramiko
/// and asyncssh ask for any free port and carry bytes both ways, then cancel.
pub fn remote_forward_reaches_the_client(env: &Env) {
    let name = unique("rfwd");
    env.new_box(&name, &[]);
    let www = env.dir.join(format!("{name}-www"));
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("index.html"), "hello-from-client\n").unwrap();
    let big: Vec<u8> = (0..8u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(www.join("big"), &big).unwrap();
    let local = free_port();
    let server = Command::new("python3")
        .args(["-m", "http.server", &local.to_string(), "--bind", "127.0.0.1"])
        .current_dir(&www)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _server = Tunnel(server);
    let in_box = |cmd: &str| env.alice(Some(&name), &[cmd]);
    let mut forward = remote(env, &name, &format!("9000:127.0.0.1:{local}"));
    until_answered("the remote forward", || in_box("curl -s -m 5 http://127.0.0.1:9000/"), "hello-from-client\n");
    let digest = |bytes: &[u8]| {
        let mut cmd = Command::new("sha256sum");
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), bytes).unwrap();
        String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap()
    };
    let got = in_box("curl -s -m 60 http://127.0.0.1:9000/big | sha256sum").ok();
    assert_eq!(got.stdout, digest(&big), "8 MiB through the remote forward changed");

    // A port the box already listens on is refused, as sshd refuses one in use.
    in_box("nohup python3 -m http.server 9001 --bind 127.0.0.1 >/dev/null 2>&1 &").ok();
    let listens = || in_box("curl -s -m 5 -o /dev/null http://127.0.0.1:9001/ && echo ok");
    until_answered("the box's own server", listens, "ok\n");
    let mut cmd = env.daemon.ssh_with(
        &env.alice,
        Some(&name),
        &["-o", "ExitOnForwardFailure=yes", "-R", &format!("9001:127.0.0.1:{local}")],
        &["true"],
    );
    let out = run(&mut cmd);
    assert_eq!(out.status, Some(255), "{}", out.stderr);
    assert!(out.stderr.contains("forwarding failed"), "{}", out.stderr);

    forward.end();
    let closed = || in_box("curl -s -m 5 http://127.0.0.1:9000/; echo rc=$?");
    until_answered("the closed remote forward", closed, "rc=7\n");

    // To a socket path (streamlocal-forward): made mode 0600, gone with ssh.
    let mut socket = remote(env, &name, &format!("/run/fwd.sock:127.0.0.1:{local}"));
    let through_socket = || in_box("curl -s -m 5 --unix-socket /run/fwd.sock http://client/");
    until_answered("the socket remote forward", through_socket, "hello-from-client\n");
    assert_eq!(in_box("stat -c %a /run/fwd.sock").ok().stdout, "600\n");
    socket.end();
    until_answered("the socket's removal", || in_box("test -e /run/fwd.sock; echo $?"), "1\n");

    let out = crate::clients::python_client(env, "remote_forward.py", &name).ok();
    assert!(out.stdout.contains("remote forwards: paramiko and asyncssh ok"), "{}", out.stdout);
    env.alice(None, &["rm", &name]).ok();
}

/// Runs `ssh -N -R SPEC` to box `name` in the background until dropped.
fn remote(env: &Env, name: &str, spec: &str) -> Tunnel {
    let opts = ["-N", "-o", "ExitOnForwardFailure=yes", "-R", spec];
    let mut cmd = env.daemon.ssh_with(&env.alice, Some(name), &opts, &[]);
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    Tunnel(cmd.spawn().unwrap())
}

/// 256 forwards at once on one connection all open and the 257th is refused
/// at once, while another connection's command still runs: the box's agent
/// carries them with room to spare (254 used up its descriptors before, and
/// the box's sessions hung).
pub fn many_forwards_leave_the_box_answering(env: &Env) {
    let name = unique("manyfwd");
    env.new_box(&name, &["--image", "busybox"]);
    let out = crate::clients::python_client(env, "many_forwards.py", &name).ok();
    assert!(out.stdout.contains("256 forwards held, the next refused, the box still answers"), "{}", out.stdout);
    env.alice(None, &["rm", &name]).ok();
}
