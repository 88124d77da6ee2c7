//! The front door: keys are accounts, only public keys, and a flood of
//! unauthenticated connections cannot lock a real user out.

use std::io::{Read, Write};
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

/// 200 silent connections from one source (past its pending queue, 128, and
/// more than all handshake slots, 64) lock nobody out: a real user from
/// another address gets in while they are still there, and one from the
/// flooding address once they are cut.
pub fn unauthenticated_flood_does_not_lock_out(env: &Env) {
    let state = env.dir.join("hygiene-state");
    let daemon = Daemon::start(state, env.daemon.keys_file.clone(), &[]);
    let target: SocketAddr = format!("127.0.0.1:{}", daemon.port).parse().unwrap();
    let flood: Vec<TcpStream> = (0..200).filter_map(|_| connect_from("127.0.0.2", target)).collect();
    assert_eq!(flood.len(), 200);
    let mut cmd = daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.3"], &["help"]);
    run(&mut cmd).ok();
    // Silent sockets are cut after 10 s; had the user waited for that, the
    // newest of the flood would be closed by now.
    let soon = Instant::now() + Duration::from_millis(100);
    assert!(!closed_by(&flood[199], soon), "the user got in only once the flood was cut");
    // The silent connections are cut (after the 10 s grace for a first word;
    // 60 s is generous for a loaded machine, and none is left open).
    let deadline = Instant::now() + Duration::from_secs(60);
    let open: Vec<usize> =
        flood.iter().enumerate().filter(|(_, conn)| !closed_by(conn, deadline)).map(|(i, _)| i).collect();
    assert!(open.is_empty(), "silent connections {open:?} were not closed");
    // The flooding address itself gets in (penalized now, but never refused).
    let mut cmd = daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.2"], &["help"]);
    run(&mut cmd).ok();
    let mut daemon = daemon;
    daemon.purge();
}

/// `n` connections from `from` to the shared daemon that send a version
/// string and then nothing.
fn stalled_handshakes(env: &Env, from: &str, n: usize) -> Vec<TcpStream> {
    let target: SocketAddr = format!("127.0.0.1:{}", env.daemon.port).parse().unwrap();
    let stalled: Vec<TcpStream> = (0..n)
        .filter_map(|_| connect_from(from, target))
        .map(|mut conn| {
            conn.write_all(b"SSH-2.0-stall\r\n").unwrap();
            conn
        })
        .collect();
    assert_eq!(stalled.len(), n);
    stalled
}

/// Sockets that send a version string and then stall hold a handshake slot
/// for 10 s at most: an honest client from the same address waiting behind
/// all ten of them gets in once they are cut (they kept their slots, and the
/// client waited out its own deadline, while they stayed open).
pub fn stalled_handshakes_give_their_slots_up(env: &Env) {
    let stalled = stalled_handshakes(env, "127.0.0.11", 10);
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.11"], &["help"])).ok();
    assert!(started.elapsed() < Duration::from_secs(25), "got in after {:?}", started.elapsed());
    let deadline = Instant::now() + Duration::from_secs(5);
    assert!(stalled.iter().all(|conn| closed_by(conn, deadline)), "a stalled socket was left open");
}

/// Forty sockets that send a version string and stall, from the honest
/// client's own address (a NAT it shares with an attacker, or the same host):
/// the client, which sends its key exchange at once, takes the first
/// handshake slot given back, ahead of the stalled sockets waiting in line
/// (it waited behind all of them, 10 s a round: 24 s behind 16, a minute and
/// more behind 50).
pub fn an_honest_client_goes_before_stalled_sockets_of_its_address(env: &Env) {
    let stalled = stalled_handshakes(env, "127.0.0.12", 40);
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.12"], &["help"])).ok();
    // The first slot comes back at 10 s (the stalled sockets' deadline).
    assert!(started.elapsed() < Duration::from_secs(18), "got in after {:?}", started.elapsed());
    drop(stalled);
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
    // Two slow talkers from each address: they say their version, then
    // stall. Each holds a handshake slot once the server sends its key
    // exchange (only after reading their version, which it reads only with a
    // slot): waited for, not guessed with a sleep.
    let talkers = |from: &str| -> Vec<TcpStream> {
        let conns: Vec<TcpStream> = (0..2).filter_map(|_| connect_from(from, target)).collect();
        for mut conn in &conns {
            std::io::Write::write_all(&mut conn, b"SSH-2.0-slow\r\n").unwrap();
        }
        for conn in &conns {
            assert!(read_past_banner(conn), "a talker from {from} got no handshake slot");
        }
        conns
    };
    let honest = talkers("127.0.0.10");
    let penalized = talkers("127.0.0.9");
    // An unpenalized source's third handshake does not wait for its two
    // talkers, which hold their slots until their 30 s authentication timeout.
    let mut cmd = daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.10"], &["help"]);
    run(&mut cmd).ok();
    let soon = Instant::now() + Duration::from_millis(100);
    assert!(honest.iter().all(|c| !closed_by(c, soon)), "an unpenalized source waited for its talkers to be cut");
    // A penalized source's third waits for one of its two slots: it gets in
    // only once its talkers go away (2 s on: how long they hold them).
    let freed = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        let at = Instant::now();
        drop(penalized);
        at
    });
    let mut cmd = daemon.ssh_with(&env.alice, None, &["-o", "BindAddress=127.0.0.9"], &["help"]);
    run(&mut cmd).ok();
    let done = Instant::now();
    let dropped = freed.join().unwrap();
    assert!(done >= dropped, "a penalized source's third handshake did not wait for a slot");
    let mut daemon = daemon;
    daemon.purge();
}

/// Whether the server closes `conn` by `deadline` (it may send its banner
/// first). A read that times out is not a close.
fn closed_by(mut conn: &TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 256];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        conn.set_read_timeout(Some(left)).unwrap();
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return true, // reset
        }
    }
}

/// 500 idle sockets from one address, past its pending queue (128), and an
/// honest `ssh` from that same address (a NAT, a CI runner) still gets in at
/// once: a full source makes room by closing its own oldest connection that
/// has not finished its key exchange, instead of refusing the newest.
pub fn one_source_cannot_lock_itself_out(env: &Env) {
    let state = env.dir.join("one-source-state");
    let daemon = Daemon::start(state, env.daemon.keys_file.clone(), &[]);
    let target: SocketAddr = format!("127.0.0.1:{}", daemon.port).parse().unwrap();
    let started = Instant::now();
    let idle: Vec<TcpStream> = (0..500).filter_map(|_| connect_from("127.0.0.1", target)).collect();
    assert_eq!(idle.len(), 500);
    run(&mut daemon.ssh(&env.alice, None, &["help"])).ok();
    // Idle sockets are also cut after 10 s of silence, which would let the
    // ssh in without any eviction: only a run faster than that proves it.
    let grace = Duration::from_secs(10);
    let ran = started.elapsed();
    assert!(ran < grace, "too slow to tell an eviction from the 10 s grace ({ran:?})");
    // The oldest were closed to make room (before their grace ran out); the
    // newest are still open.
    assert!(closed_by(&idle[0], started + grace), "the oldest idle socket was not closed");
    let soon = Instant::now() + Duration::from_millis(100);
    assert!(!closed_by(&idle[499], soon), "the newest idle socket was closed");
    drop(idle);
    let mut daemon = daemon;
    daemon.purge();
}

/// Whether the server sends `conn` more than its version line (its key
/// exchange) within 30 s.
fn read_past_banner(mut conn: &TcpStream) -> bool {
    conn.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let (mut got, mut buf) = (0, [0u8; 512]);
    while got <= moat_sshd::BANNER.len() + 2 {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got += n,
        }
    }
    true
}

/// A TCP connection to `target` from source address `from`.
pub(crate) fn connect_from(from: &str, target: SocketAddr) -> Option<TcpStream> {
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
    let mut banner = vec![0u8; moat_sshd::BANNER.len() + 2];
    socket.read_exact(&mut banner).unwrap();
    assert_eq!(banner, b"SSH-2.0-OpenSSH_moat\r\n");
    for kex in
        ["diffie-hellman-group14-sha256", "diffie-hellman-group-exchange-sha256", "diffie-hellman-group18-sha512"]
    {
        let out = run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", &format!("KexAlgorithms={kex}")], &["ls"]));
        // (ssh's "no matching key exchange" is below the suite's LogLevel=ERROR.)
        assert_eq!((out.status, out.stdout.as_str()), (Some(255), ""), "{kex} was accepted");
    }
    let out = run(&mut env.daemon.ssh_with(&env.alice, None, &["-o", "KexAlgorithms=curve25519-sha256"], &["ls"]));
    out.ok();
    // A client held to FIPS algorithms: NIST curves, AES-GCM or CTR alone.
    for (kex, cipher) in [
        ("ecdh-sha2-nistp256", "aes128-gcm@openssh.com"),
        ("ecdh-sha2-nistp384", "aes256-gcm@openssh.com"),
        ("ecdh-sha2-nistp521", "aes128-ctr"),
    ] {
        let algorithms = ["-o", &format!("KexAlgorithms={kex}"), "-c", cipher];
        let out = run(&mut env.daemon.ssh_with(&env.alice, None, &algorithms, &["whoami"]));
        assert_eq!(out.status, Some(0), "{kex} with {cipher}: {}", out.stderr);
    }
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
    // This host's kernel (6.7 or later) has btrfs simple quotas, and says so;
    // an older one is told what it loses and how to get it.
    let quotas = text.lines().find(|l| l.contains("disk quotas:")).unwrap_or_else(|| panic!("no quota line: {text}"));
    assert!(quotas.starts_with("ok    disk quotas: btrfs simple quotas"), "{quotas}");
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
