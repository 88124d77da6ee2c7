//! `new NAME --image I --run`: a pulled image's Entrypoint and Cmd as the
//! box's service, run as the image says (its User, WorkingDir, Env), served
//! through `ssh -L`, started again when it dies, its output in `log NAME
//! --service`; kept by copies and through a suspend.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::fixture::unique;
use crate::forward::{free_port, tunnel};
use crate::images::{login, make_tiny, one_error, umoci, Registry, PASSWORD};
use crate::Env;

/// This test's registry's port on the test internet: each test's is its own
/// (the pull test's 5000, the hostile registry's 5001, the push test's 5013),
/// as tests run at once.
const PORT: u16 = 5011;

/// Tags `svc` on tiny: a shell entrypoint whose command says it is up, then
/// serves the image's WorkingDir (`/srv`) on port 8000 as the image's User.
fn make_service(layout: &Path) {
    let image = format!("{}:tiny", layout.display());
    umoci(&[
        "config",
        "--image",
        &image,
        "--tag",
        "svc",
        "--config.entrypoint",
        "/bin/sh",
        "--config.entrypoint",
        "-c",
        "--config.cmd",
        "echo \"service up as $(id -u) in $(pwd) saying $GREETING\"; exec busybox httpd -f -v -p 127.0.0.1:8000",
    ]);
    // A hostile service: output without end, and a child that keeps its pipe.
    umoci(&[
        "config",
        "--image",
        &image,
        "--tag",
        "flood",
        "--config.cmd",
        "/bin/sh",
        "--config.cmd",
        "-c",
        "--config.cmd",
        "(busybox sleep 1000 &); exec busybox yes flood-line",
    ]);
}

/// Polls `get` until it returns what `done` accepts, for up to 30 s.
fn eventually(what: &str, mut get: impl FnMut() -> String, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = get();
        if done(&got) {
            return got;
        }
        assert!(Instant::now() < deadline, "{what}: never came; last: {got}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn curl(port: u16, path: &str) -> String {
    let url = format!("http://127.0.0.1:{port}{path}");
    crate::fixture::run(std::process::Command::new("curl").args(["-s", "-m", "5", &url])).stdout
}

pub fn run_serves_the_images_program_and_restarts_it(env: &Env) {
    let work = env.dir.join(unique("svc"));
    std::fs::create_dir_all(&work).unwrap();
    let registry = Registry::start(&env.net, &work.join("registry"), PORT);
    let layout = make_tiny(&work, "service");
    make_service(&layout);
    registry.push(&layout, "tiny", "moat/tiny");
    registry.push(&layout, "svc", "moat/tiny");
    registry.push(&layout, "flood", "moat/tiny");
    let host = format!("registry.test:{PORT}");
    let ran = login(env, &host, PASSWORD);
    assert_eq!(ran.status, Some(0), "{}", ran.stderr);
    env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:svc"), "--as", "svc"]).ok();
    env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:flood"), "--as", "flood"]).ok();
    env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:tiny"), "--as", "nocmd"]).ok();

    // An image that names nothing to run, a built-in image, a box without a
    // service: one line each, and no box.
    let none = unique("svc");
    let out = env.alice(None, &["new", &none, "--image", "nocmd", "--run"]);
    assert!(one_error(&out).contains("names no Entrypoint or Cmd"), "{}", out.stderr);
    let out = env.alice(None, &["new", &none, "--image", "busybox", "--run"]);
    assert!(one_error(&out).contains("names no Entrypoint or Cmd"), "{}", out.stderr);
    assert!(!env.alice(None, &["ls"]).ok().stdout.contains(&none));

    // The service runs as the image says and serves through -L.
    let web = unique("svc");
    env.alice(None, &["new", &web, "--image", "svc", "--run"]).ok();
    let port = free_port();
    let tunnel_up = tunnel(env, &web, &format!("{port}:localhost:8000"));
    let page = eventually("the service's page", || curl(port, "/top"), |p| p == "second layer\n");
    assert_eq!(page, "second layer\n");
    let log = env.alice(None, &["log", &web, "--service"]).ok().stdout;
    assert!(log.contains("service up as 1000 in /srv saying hi"), "{log}");
    assert!(log.contains("] started /bin/sh -c "), "{log}");
    drop(tunnel_up);

    // Killed from a session, it is started again. (busybox-static has no
    // pkill: the server is the one process that runs as `busybox` itself.)
    let kill = "for p in /proc/[0-9]*; do [ \"$(cat $p/comm)\" = busybox ] && kill ${p#/proc/}; done; true";
    env.alice(Some(&web), &[kill]).ok();
    let log = eventually(
        "the service started again",
        || env.alice(None, &["log", &web, "--service"]).ok().stdout,
        |l| l.matches("] started ").count() >= 2,
    );
    assert!(log.contains("it was ended by signal 15") && log.contains("starting it again in 1 s"), "{log}");

    // A copy runs its parent's service; a suspended box's service answers
    // when a session resumes it.
    let copy = unique("svc");
    env.alice(None, &["dup", &web, &copy]).ok();
    env.alice(None, &["suspend", &web]).ok();
    for name in [&copy, &web] {
        let port = free_port();
        let _t = tunnel(env, name, &format!("{port}:localhost:8000"));
        eventually(&format!("{name}'s page"), || curl(port, "/top"), |p| p == "second layer\n");
    }

    // A service that floods: its log holds the newest 256 KiB, and is read at once.
    let flood = unique("svc");
    env.alice(None, &["new", &flood, "--image", "flood", "--run"]).ok();
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();
    let log = env.alice(None, &["log", &flood, "--service"]).ok().stdout;
    assert!(started.elapsed() < Duration::from_secs(10), "log --service took {:?}", started.elapsed());
    assert!(log.len() <= 256 * 1024 + 1 && log.len() > 200 * 1024, "{} bytes", log.len());
    assert!(log.ends_with("flood-line\n") || log.contains("flood-line\nflood"), "{}", &log[log.len() - 200..]);
    env.alice(Some(&flood), &["echo still answers"]).ok();
    env.alice(None, &["rm", &flood]).ok();

    // log --service of a box without one, or of a stopped one.
    let plain = unique("svc");
    env.alice(None, &["new", &plain, "--image", "nocmd"]).ok();
    let out = env.alice(None, &["log", &plain, "--service"]);
    assert!(one_error(&out).contains("has no service"), "{}", out.stderr);
    env.alice(None, &["stop", &copy]).ok();
    let out = env.alice(None, &["log", &copy, "--service"]);
    assert!(one_error(&out).contains("is stopped"), "{}", out.stderr);
    for name in [&web, &copy, &plain] {
        env.alice(None, &["rm", name]).ok();
    }
    for image in ["svc", "nocmd", "flood"] {
        env.alice(None, &["image", "rm", image]).ok();
    }
    drop(registry);
}

/// VM boxes are made from the same pulled images and templates (a disk
/// made once per image): the image's session settings, its `--run`
/// service, a template's files.
pub fn vm_boxes_of_pulled_images_and_templates(env: &Env) {
    const VM_PORT: u16 = 5012;
    let work = env.dir.join(unique("vmimg"));
    std::fs::create_dir_all(&work).unwrap();
    let registry = Registry::start(&env.net, &work.join("registry"), VM_PORT);
    let layout = make_tiny(&work, "vm");
    make_service(&layout);
    registry.push(&layout, "svc", "moat/tiny");
    let host = format!("registry.test:{VM_PORT}");
    let ran = login(env, &host, PASSWORD);
    assert_eq!(ran.status, Some(0), "{}", ran.stderr);
    env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:svc"), "--as", "vsvc"]).ok();

    let vm = unique("vmimg");
    env.alice(None, &["new", &vm, "--image", "vsvc", "--backend", "vm", "--run"]).ok();
    let session = env.alice(Some(&vm), &["echo $GREETING; pwd; id -u; cat /hello; stat -c '%a' /bin/suid"]).ok().stdout;
    assert_eq!(
        session.lines().collect::<Vec<_>>(),
        ["hi", "/srv", "1000", "hello from a pulled image", "4755"],
        "{session}"
    );
    let port = free_port();
    let _t = tunnel(env, &vm, &format!("{port}:localhost:8000"));
    eventually("the VM's service's page", || curl(port, "/top"), |p| p == "second layer\n");
    let log = env.alice(None, &["log", &vm, "--service"]).ok().stdout;
    assert!(log.contains("service up as 1000 in /srv saying hi"), "{log}");

    // A template saved from a namespace box of the image makes a VM box.
    let ns = unique("vmimg");
    env.alice(None, &["new", &ns, "--image", "vsvc"]).ok();
    env.alice(Some(&ns), &["echo kept for the guest > /tmp/made"]).ok();
    env.alice(None, &["image", "save", &ns, "vtpl"]).ok();
    let from_tpl = unique("vmimg");
    env.alice(None, &["new", &from_tpl, "--image", "vtpl", "--backend", "vm"]).ok();
    let made = env.alice(Some(&from_tpl), &["cat /tmp/made; echo $GREETING"]).ok().stdout;
    assert_eq!(made.lines().collect::<Vec<_>>(), ["kept for the guest", "hi"], "{made}");
    for name in [&vm, &ns, &from_tpl] {
        env.alice(None, &["rm", name]).ok();
    }
    for image in ["vsvc", "vtpl"] {
        env.alice(None, &["image", "rm", image]).ok();
    }
    drop(registry);
}
