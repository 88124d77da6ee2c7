//! The front door: keys are accounts, only public keys, and a flood of
//! unauthenticated connections cannot lock a real user out.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::fixture::{run, unique, Daemon, Key};
use crate::Env;

pub fn keys_are_accounts(env: &Env) {
    let name = unique("mine");
    env.new_box(&name, &["--image", "busybox"]);
    let bob = |user: Option<&str>, args: &[&str]| run(&mut env.daemon.ssh(&env.bob, user, args));
    // Bob does not see alice's box...
    let listed = bob(None, &["ls", "--json"]).ok().stdout;
    assert!(!listed.contains(&name), "{listed}");
    // ...and every way of touching it answers as for a box that does not exist.
    let missing = "no-such-box-at-all";
    for args in [vec!["info"], vec!["rm"], vec!["info", "--json"]] {
        let with = |n: &str| {
            let mut a = vec![args[0], n];
            a.extend_from_slice(&args[1..]);
            let out = bob(None, &a);
            (out.status, out.stderr.replace(n, "NAME"), out.stdout)
        };
        assert_eq!(with(&name), with(missing), "{args:?}");
    }
    let as_user = |n: &str| {
        let out = bob(Some(n), &["cat /etc/hostname"]);
        (out.status, out.stderr.replace(n, "NAME"), out.stdout)
    };
    assert_eq!(as_user(&name), as_user(missing));
    // Bob can have a box by the same name; it is a different box.
    bob(None, &["new", &name, "--image", "busybox"]).ok();
    bob(Some(&name), &["touch /bob-was-here"]).ok();
    let out = env.alice(Some(&name), &["test -e /bob-was-here && echo shared || echo separate"]).ok();
    assert_eq!(out.stdout, "separate\n");
    bob(None, &["rm", &name]).ok();
    env.alice(Some(&name), &["true"]).ok();
}

/// The operator's limits: boxes per account, and the largest box.
pub fn operator_limits_are_enforced(env: &Env) {
    let state = env.dir.join("limits-state");
    let mut daemon = Daemon::start(state, env.daemon.keys_file.clone(), &["--max-boxes", "2", "--max-memory", "512M"]);
    let ssh = |args: &[&str]| run(&mut daemon.ssh(&env.alice, None, args));
    let out = ssh(&["new", "big", "--image", "busybox", "--memory", "1G"]);
    assert_eq!((out.status, out.stderr.as_str()), (Some(1), "moat: --memory may be at most 512M on this server\n"));
    ssh(&["new", "one", "--image", "busybox", "--memory", "256M"]).ok();
    ssh(&["new", "two", "--image", "busybox", "--memory", "256M"]).ok();
    let out = ssh(&["new", "three", "--image", "busybox", "--memory", "256M"]);
    assert_eq!(out.stderr, "moat: you have 2 boxes, the most this server allows; remove one first\n");
    let out = ssh(&["dup", "one", "three"]);
    assert_eq!(out.status, Some(1), "{}", out.stderr);
    // Another account has its own count.
    run(&mut daemon.ssh(&env.bob, None, &["new", "one", "--image", "busybox", "--memory", "256M"])).ok();
    ssh(&["rm", "two"]).ok();
    ssh(&["dup", "one", "three"]).ok();
    daemon.purge();
}

pub fn only_public_keys(env: &Env) {
    // A key that is not in authorized_keys.
    let carol = Key::generate(&env.dir, "carol");
    let out = run(&mut env.daemon.ssh(&carol, None, &["ls"]));
    assert_eq!(out.status, Some(255));
    assert!(out.stderr.contains("Permission denied"), "{}", out.stderr);
    // Password and keyboard-interactive are not offered at all.
    let opts = ["-o", "PubkeyAuthentication=no", "-o", "PreferredAuthentications=password,keyboard-interactive"];
    let mut cmd = env.daemon.ssh_with(&env.alice, None, &opts, &["ls"]);
    let out = run(&mut cmd);
    assert_eq!(out.status, Some(255));
    assert!(out.stderr.contains("Permission denied (publickey)"), "{}", out.stderr);
}

pub fn unauthenticated_flood_does_not_lock_out(env: &Env) {
    let state = env.dir.join("hygiene-state");
    let daemon = Daemon::start(state, env.daemon.keys_file.clone(), &["--auth-timeout", "2"]);
    let target: SocketAddr = format!("127.0.0.1:{}", daemon.port).parse().unwrap();
    // 80 silent connections from one source: far past the per-source limit.
    let flood: Vec<TcpStream> = (0..80).filter_map(|_| connect_from("127.0.0.2", target)).collect();
    assert_eq!(flood.len(), 80);
    // A real user from a third address still gets in, at once.
    let started = Instant::now();
    let mut cmd = daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.3"], &["help"]);
    run(&mut cmd).ok();
    // And one from the flooding address itself, once the flood has timed out.
    std::thread::sleep(Duration::from_secs(3));
    let mut cmd = daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.2"], &["help"]);
    run(&mut cmd).ok();
    assert!(started.elapsed() < Duration::from_secs(15));
    // The silent connections are cut after the authentication timeout.
    let mut cut = 0;
    for mut conn in flood.into_iter().take(20) {
        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 256];
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => {
                    cut += 1;
                    break;
                }
                Ok(_) => {}
            }
        }
    }
    assert_eq!(cut, 20, "silent connections were not closed");
    let mut daemon = daemon;
    daemon.purge();
}

/// A source whose connections misbehave is penalized: it gets two handshake
/// slots instead of ten (so two of its slow talkers hold up its next
/// connection), but it is never refused outright, and other sources are
/// untouched.
pub fn penalized_sources_wait_their_turn_but_are_never_refused(env: &Env) {
    let state = env.dir.join("penalty-state");
    let daemon = Daemon::start(state, env.daemon.keys_file.clone(), &[]);
    let target: SocketAddr = format!("127.0.0.1:{}", daemon.port).parse().unwrap();
    // Four connections that end with their key refused: 20 s of penalty, in force.
    let carol = Key::generate(&env.dir, "carol-penalty");
    for _ in 0..4 {
        let out = run(&mut daemon.ssh_with(&carol, None, &["-o", "BindAddress=127.0.0.9"], &["ls"]));
        assert_eq!(out.status, Some(255));
    }
    // Two slow talkers from each address: they say their version, then stall.
    let talkers = |from: &str| -> Vec<TcpStream> {
        (0..2)
            .filter_map(|_| connect_from(from, target))
            .inspect(|mut conn| {
                let _ = std::io::Write::write_all(&mut conn, b"SSH-2.0-slow\r\n");
            })
            .collect()
    };
    let timed_ssh = |from: &str| {
        let started = Instant::now();
        let mut cmd = daemon.ssh_with(&env.alice, None, &["-o", &format!("BindAddress={from}")], &["help"]);
        run(&mut cmd).ok();
        started.elapsed()
    };
    let _honest = talkers("127.0.0.10");
    let penalized = talkers("127.0.0.9");
    std::thread::sleep(Duration::from_millis(300));
    let elsewhere = timed_ssh("127.0.0.10");
    // The penalized talkers go away after 2 s, freeing its slots.
    let freed = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        drop(penalized);
    });
    let waited = timed_ssh("127.0.0.9");
    freed.join().unwrap();
    assert!(elsewhere < Duration::from_millis(1500), "an unpenalized source waited {elsewhere:?}");
    assert!(waited >= Duration::from_millis(1500), "a penalized source's third handshake did not wait ({waited:?})");
    let mut daemon = daemon;
    daemon.purge();
}

/// A TCP connection to `target` from source address `from`.
fn connect_from(from: &str, target: SocketAddr) -> Option<TcpStream> {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).ok()?;
    let src: std::net::SocketAddrV4 = format!("{from}:0").parse().ok()?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(src)).ok()?;
    let SocketAddr::V4(dst) = target else {
        return None;
    };
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(dst)).ok()?;
    Some(TcpStream::from(fd))
}

/// The banner names no library or version, and the finite-field
/// Diffie-Hellman exchanges (the "DHEat" CPU drain) are not offered.
pub fn banner_and_key_exchanges(env: &Env) {
    let mut socket = TcpStream::connect(("127.0.0.1", env.daemon.port)).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut banner = [0u8; 14];
    socket.read_exact(&mut banner).unwrap();
    assert_eq!(&banner, b"SSH-2.0-moat\r\n");
    for kex in
        ["diffie-hellman-group14-sha256", "diffie-hellman-group-exchange-sha256", "diffie-hellman-group18-sha512"]
    {
        let out = run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", &format!("KexAlgorithms={kex}")], &["ls"]));
        // (ssh's "no matching key exchange" is below the suite's LogLevel=ERROR.)
        assert_eq!((out.status, out.stdout.as_str()), (Some(255), ""), "{kex} was accepted");
    }
    let out = run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", "KexAlgorithms=curve25519-sha256"], &["ls"]));
    out.ok();
}

/// An orchestrator's burst from one address is served, not reset: 100
/// connections at once all succeed. And 500 silent sockets from 50 addresses
/// hold no handshake slot: a real client gets in at once beside them.
pub fn bursts_wait_and_silent_sockets_lock_nobody_out(env: &Env) {
    let mut children: Vec<_> = (0..100)
        .map(|_| {
            let mut cmd = env.daemon.ssh_with(&env.alice, Some("moat"), &["-o", "BindAddress=127.0.0.9"], &["ls"]);
            cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let failed: Vec<String> = children
        .drain(..)
        .map(|c| c.wait_with_output().unwrap())
        .filter(|o| !o.status.success() || !o.stdout.starts_with(b"NAME"))
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .collect();
    assert!(failed.is_empty(), "{} of 100 parallel connections failed: {:?}", failed.len(), failed.first());

    let target: SocketAddr = format!("127.0.0.1:{}", env.daemon.port).parse().unwrap();
    let silent: Vec<TcpStream> =
        (0..500).filter_map(|i| connect_from(&format!("127.0.2.{}", 1 + i % 50), target)).collect();
    assert_eq!(silent.len(), 500);
    let started = Instant::now();
    run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.2.1"], &["help"])).ok();
    run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.10"], &["help"])).ok();
    assert!(started.elapsed() < Duration::from_secs(10), "a real client waited {:?}", started.elapsed());
    drop(silent);
}

/// `moat doctor` learns what runs a microVM guest by booting one (the
/// distribution's kernel, the agent as its init), not by opening /dev/kvm.
pub fn doctor_boots_a_guest(env: &Env) {
    // With the busybox image built, the guest gets it as its root disk.
    let name = unique("vm");
    env.new_box(&name, &["--image", "busybox"]);
    let out = std::process::Command::new(crate::fixture::moat_bin())
        .arg("doctor")
        .arg("--state-dir")
        .arg(&env.daemon.state_dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let line = text.lines().find(|l| l.contains("microvm:")).unwrap_or_else(|| panic!("no microvm line: {text}"));
    // It says which backend `new` uses by default, and it follows from what boots.
    let kvm = line.contains("microvm: KVM boots");
    let default = if kvm { "backend: vm by default" } else { "backend: ns by default" };
    assert!(text.lines().any(|l| l.starts_with(default)), "{text}");
    assert!(line.starts_with("ok    microvm:") && line.contains("to the agent in"), "{line}");
    // It loaded the virtio modules the initramfs carries, found its devices,
    // and read the image from its disk (which the host never mounted).
    let disk = "virtio devices: block console rng; the busybox image as its disk: ext4,";
    assert!(line.contains(disk) && line.contains("/bin/sh present"), "{line}");
    // And its agent answered the host through a stream over virtio-serial,
    // and ran a program from the disk, now the guest's root: on the guest's
    // own kernel.
    assert!(line.contains("/bin/sh present, the guest's root now"), "{line}");
    assert!(line.contains("; the agent answers a ping over virtio-serial in "), "{line}");
    // The guest ran its own kernel, not the host's.
    let guest = line.split("(guest kernel ").nth(1).and_then(|r| r.split(')').next()).unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert!(!guest.is_empty() && guest != host.trim(), "guest {guest:?}, host {host:?}");
    assert!(std::path::Path::new(&format!("/boot/vmlinuz-{guest}")).exists(), "{line}");
    let uname = line.split("`uname -r` run in it from its disk: ").nth(1).unwrap_or_default();
    assert_eq!(uname, guest, "{line}");
    env.alice(None, &["rm", &name]).ok();
}
