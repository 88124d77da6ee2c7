//! Web URLs against hostile clients, with raw sockets over TLS: a host not
//! under the domain, huge heads and header floods, conflicting lengths and
//! request smuggling, slowloris heads and bodies, a box that never answers,
//! too many requests to one box and too many connections from one address.
//! Each gets a bounded, clear refusal, and another box's URL answers
//! meanwhile.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

use crate::fixture::{run, Daemon, Edge};
use crate::hygiene::connect_from;
use crate::Env;

const DOMAIN: &str = "hostile.test";

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

fn client_config(ca: &Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(ca).unwrap()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// A TLS connection to the edge for `host`, from `from` (a loopback address).
fn connect(edge: &Edge, host: &str, from: &str) -> Option<Tls> {
    let tcp = connect_from(from, SocketAddr::from(([127, 0, 0, 1], edge.port)))?;
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let name = ServerName::try_from(host.split(':').next().unwrap().to_string()).unwrap();
    let conn = rustls::ClientConnection::new(client_config(&edge.ca), name).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    // The handshake, now: a connection the edge closed at once fails here.
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock).ok()?;
    }
    Some(tls)
}

/// Everything the edge sends until it closes the connection (or 30 s pass).
fn read_all(tls: &mut Tls) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        match tls.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `raw` and reads the answer to the end; with how long that took.
fn exchange(edge: &Edge, host: &str, raw: &[u8]) -> (String, Duration) {
    let started = Instant::now();
    let mut tls = connect(edge, host, "127.0.0.1").expect("connect");
    tls.write_all(raw).unwrap();
    tls.flush().unwrap();
    (read_all(&mut tls), started.elapsed())
}

pub fn get(edge: &Edge, host: &str, path: &str) -> String {
    exchange(edge, host, format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes()).0
}

fn status(answer: &str) -> &str {
    answer.split(' ').nth(1).unwrap_or("(none)")
}

/// Another box's URL answers at once: the hostile client stalls no one else.
#[track_caller]
fn others_answer(edge: &Edge, host: &str) {
    let started = Instant::now();
    let answer = get(edge, host, "/");
    assert!(answer.contains("fine-b"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(2), "another box waited {:?}", started.elapsed());
}

pub fn hostile_clients_get_bounded_refusals(env: &Env) {
    let flags = [
        "--http-listen",
        "127.0.0.1:0",
        "--http-domain",
        DOMAIN,
        "--http-max-per-source",
        "8",
        "--http-max-per-box",
        "2",
        "--http-head-timeout",
        "2",
        "--http-body-timeout",
        "2",
        "--http-answer-timeout",
        "3",
        // Three event loops, though this host's CPUs would give one: every
        // limit below holds across the loops a connection may land in.
        "--http-loops",
        "3",
    ];
    let daemon = Daemon::start(env.dir.join("web-hostile-state"), env.daemon.keys_file.clone(), &flags);
    let edge = daemon.edge.clone().expect("an edge");
    let ssh = |user: Option<&str>, args: &[&str]| run(&mut daemon.ssh(&env.alice, user, args)).ok();
    let mut hosts = Vec::new();
    for b in ["a", "b"] {
        ssh(None, &["new", b, "--image", "busybox"]);
        let setup = format!(
            "mkdir -p /www/cgi-bin && echo fine-{b} > /www/index.html && \
             printf '#!/bin/sh\\nsleep 600\\n' > /www/cgi-bin/slow && \
             printf '#!/bin/sh\\ncat >/dev/null\\necho Content-Type: text/plain\\necho\\necho got\\n' > /www/cgi-bin/read && \
             printf '#!/bin/sh\\necho \"Set-Cookie: tossed=1; Domain={DOMAIN}; Path=/\"\\necho \"Set-Cookie: __Host-moat=000; Path=/; Secure\"\\necho \"Clear-Site-Data: \\\\\"cookies\\\\\", \\\\\"cache\\\\\"\"\\necho Content-Type: text/plain\\necho\\necho cookies\\n' > /www/cgi-bin/cookies && \
             printf '#!/bin/sh\\nyes \"$(printf \"HTTP/1.1 100 Continue\\\\r\\\\n\\\\r\")\"\\n' > /www/continue && \
             chmod +x /www/cgi-bin/slow /www/cgi-bin/read /www/cgi-bin/cookies /www/continue && \
             (busybox httpd -p 127.0.0.1:8000 -h /www &)"
        );
        ssh(Some(b), &[&setup]);
        ssh(None, &["expose", b, "8000", "--public"]);
        hosts.push(crate::web::host_of(&crate::web::url_in(&ssh(None, &["urls", b, "--json"]).stdout, 8000)));
    }
    let (a, b) = (hosts[0].clone(), hosts[1].clone());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !get(&edge, &b, "/").contains("fine-b") || !get(&edge, &a, "/").contains("fine-a") {
        assert!(Instant::now() < deadline, "the boxes' servers never answered");
        std::thread::sleep(Duration::from_millis(200));
    }

    // The edge holds its socket alone, confined as the front door is, as a
    // uid of its own; killed, it is started again and serves.
    let edge_pid = crate::privsep::front_door(edge.port);
    assert_eq!(crate::privsep::assert_confined(edge_pid), 1_048_572);
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(edge_pid as i32), nix::sys::signal::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::panic::catch_unwind(|| get(&edge, &b, "/")).is_ok_and(|a| a.contains("fine-b")) {
        assert!(Instant::now() < deadline, "the edge was not started again");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_ne!(crate::privsep::front_door(edge.port), edge_pid);

    // A port nothing listens on gets the page saying so; a server on ::1
    // alone is reached too (the box's agent tries 127.0.0.1, then ::1).
    let public_host = |port: u16| {
        ssh(None, &["expose", "a", &port.to_string(), "--public"]);
        crate::web::host_of(&crate::web::url_in(&ssh(None, &["urls", "a", "--json"]).stdout, port))
    };
    let nobody = get(&edge, &public_host(8009), "/");
    assert!(nobody.starts_with("HTTP/1.1 502") && nobody.contains("Start a server on port 8009"), "{nobody}");
    ssh(Some("a"), &["(busybox httpd -p '[::1]:8002' -h /www &)"]);
    let six = public_host(8002);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !get(&edge, &six, "/").contains("fine-a") {
        assert!(Instant::now() < deadline, "a server on ::1 alone never answered: {}", get(&edge, &six, "/"));
        std::thread::sleep(Duration::from_millis(200));
    }

    // The sockets the edge is given in a box's network (a batch at a time)
    // go with their session: after a burst of connections, and the second
    // a session lingers, the edge holds no more descriptors than before.
    let edge_pid = crate::privsep::front_door(edge.port);
    let loops = std::fs::read_dir(format!("/proc/{edge_pid}/task"))
        .unwrap()
        .filter(|t| std::fs::read_to_string(t.as_ref().unwrap().path().join("comm")).unwrap().trim() == "moat-web-loop")
        .count();
    assert_eq!(loops, 2, "the edge's event loops besides its first");
    let held = || std::fs::read_dir(format!("/proc/{edge_pid}/fd")).unwrap().count();
    std::thread::sleep(Duration::from_secs(2));
    let before = held();
    std::thread::scope(|s| {
        // Two at a time: the edge here lets two requests at once reach a box.
        for _ in 0..2 {
            s.spawn(|| (0..30).for_each(|_| assert!(get(&edge, &six, "/").contains("fine-a"))));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while held() > before {
        assert!(Instant::now() < deadline, "the edge holds {} descriptors, {before} before the burst", held());
        std::thread::sleep(Duration::from_millis(100));
    }

    // A host not under the domain, and a second Host, are refused.
    let (answer, _) = exchange(&edge, &a, b"GET / HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n");
    assert_eq!(status(&answer), "421", "{answer}");
    assert!(answer.contains("not a name under this server's domain"), "{answer}");
    let two = format!("GET / HTTP/1.1\r\nHost: {a}\r\nHost: {b}\r\nConnection: close\r\n\r\n");
    assert_eq!(status(&exchange(&edge, &a, two.as_bytes()).0), "400");

    // A huge head, and a flood of header fields.
    let huge = format!("GET / HTTP/1.1\r\nHost: {a}\r\nX-Big: {}\r\n\r\n", "x".repeat(100 << 10));
    let (answer, took) = exchange(&edge, &a, huge.as_bytes());
    assert_eq!(status(&answer), "431", "{answer}");
    assert!(took < Duration::from_secs(5));
    let mut flood = format!("GET / HTTP/1.1\r\nHost: {a}\r\n");
    for i in 0..500 {
        flood.push_str(&format!("X-H{i}: 1\r\n"));
    }
    flood.push_str("\r\n");
    assert_eq!(status(&exchange(&edge, &a, flood.as_bytes()).0), "431");

    // Conflicting lengths are refused; Content-Length with Transfer-Encoding
    // is framed by the chunks and the connection closed after it, so the
    // request hidden in the body never reaches the box.
    let two_lengths = format!("POST / HTTP/1.1\r\nHost: {a}\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde");
    assert_eq!(status(&exchange(&edge, &a, two_lengths.as_bytes()).0), "400");
    let smuggled = format!(
        "POST / HTTP/1.1\r\nHost: {a}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: {a}\r\n\r\n"
    );
    let (answer, _) = exchange(&edge, &a, smuggled.as_bytes());
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{answer}");
    std::thread::sleep(Duration::from_millis(500));
    let log = ssh(None, &["log", "a"]).stdout;
    assert!(log.contains("POST /") && !log.contains("/smuggled"), "{log}");

    // Slowloris: a head that never ends is cut at the head deadline (2 s).
    let started = Instant::now();
    let mut slow = connect(&edge, &a, "127.0.0.1").unwrap();
    slow.write_all(format!("GET / HTTP/1.1\r\nHost: {a}\r\nX-Slow: ").as_bytes()).unwrap();
    slow.flush().unwrap();
    others_answer(&edge, &b);
    let answer = read_all(&mut slow);
    let took = started.elapsed();
    assert!(took > Duration::from_millis(1500) && took < Duration::from_secs(8), "{took:?}: {answer}");
    // A body that stops coming is given up at the body deadline.
    let started = Instant::now();
    let mut slow = connect(&edge, &a, "127.0.0.1").unwrap();
    let post = format!("POST /cgi-bin/read HTTP/1.1\r\nHost: {a}\r\nContent-Length: 1000\r\n\r\n0123456789");
    slow.write_all(post.as_bytes()).unwrap();
    slow.flush().unwrap();
    others_answer(&edge, &b);
    let answer = read_all(&mut slow);
    let took = started.elapsed();
    assert!(took > Duration::from_millis(1500) && took < Duration::from_secs(10), "{took:?}: {answer}");
    assert_eq!(status(&answer), "400", "the visitor's doing, not the box's: {answer}");
    assert!(answer.contains("stalled"), "{answer}");
    // So is a body whose chunks are not well formed.
    let bad_chunks = format!(
        "POST /cgi-bin/read HTTP/1.1\r\nHost: {a}\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\nxyz\r\n0\r\n\r\n"
    );
    let answer = exchange(&edge, &a, bad_chunks.as_bytes()).0;
    assert_eq!(status(&answer), "400", "{answer}");
    assert!(answer.contains("not well formed"), "{answer}");

    // A box that never answers: 504 at the answer deadline (3 s).
    let (answer, took) = exchange(&edge, &a, format!("GET /cgi-bin/slow HTTP/1.1\r\nHost: {a}\r\n\r\n").as_bytes());
    assert_eq!(status(&answer), "504", "{answer}");
    assert!(answer.contains("did not answer in 3 s"), "{answer}");
    assert!(took < Duration::from_secs(10), "{took:?}");

    // Two requests in flight to a box are its limit; the third is refused
    // at once; the other box answers.
    let held: Vec<_> = (0..2)
        .map(|_| {
            let mut tls = connect(&edge, &a, "127.0.0.1").unwrap();
            tls.write_all(format!("GET /cgi-bin/slow HTTP/1.1\r\nHost: {a}\r\n\r\n").as_bytes()).unwrap();
            tls.flush().unwrap();
            tls
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let (answer, took) =
        exchange(&edge, &a, format!("GET / HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\r\n").as_bytes());
    assert_eq!(status(&answer), "503", "{answer}");
    assert!(answer.contains("too many requests in flight"), "{answer}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    others_answer(&edge, &b);
    drop(held);

    // Eight connections from one address are its limit; the ninth is closed
    // at once; another address gets in.
    let mut open: Vec<Tls> = (0..8).map(|_| connect(&edge, &a, "127.0.0.2").expect("within the limit")).collect();
    assert!(connect(&edge, &a, "127.0.0.2").is_none(), "a ninth connection from one address got in");
    let mut other = connect(&edge, &b, "127.0.0.3").expect("another address");
    other.write_all(format!("GET / HTTP/1.1\r\nHost: {b}\r\nConnection: close\r\n\r\n").as_bytes()).unwrap();
    assert!(read_all(&mut other).contains("fine-b"));
    open.pop();
    std::thread::sleep(Duration::from_millis(200));
    assert!(connect(&edge, &a, "127.0.0.2").is_some(), "a slot given back is free again");
    drop(open);

    // Every box URL is one site to a browser: a page of box b may not post
    // to box a (nor open a WebSocket to it); a page of a itself may.
    let post = |origin: &str| {
        let raw = format!(
            "POST /cgi-bin/read HTTP/1.1\r\nHost: {a}\r\nOrigin: https://{origin}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
        );
        exchange(&edge, &a, raw.as_bytes()).0
    };
    let across = post(&b);
    assert_eq!(status(&across), "403", "{across}");
    assert!(across.contains("a page of another box"), "{across}");
    assert!(post(&a).contains("got"));
    let ws = format!(
        "GET / HTTP/1.1\r\nHost: {a}\r\nOrigin: https://{b}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    assert_eq!(status(&exchange(&edge, &a, ws.as_bytes()).0), "403");

    // A box sets cookies for its own URL only, and never the edge's.
    let cookies = get(&edge, &a, "/cgi-bin/cookies");
    assert!(cookies.contains("cookies"), "{cookies}");
    let set: Vec<&str> = cookies.lines().filter(|l| l.to_ascii_lowercase().starts_with("set-cookie:")).collect();
    assert_eq!(set, ["set-cookie: tossed=1; Path=/"], "{cookies}");
    // Nor clears the cookies of the whole domain (every box's sign-ins).
    let cleared: Vec<&str> =
        cookies.lines().filter(|l| l.to_ascii_lowercase().starts_with("clear-site-data:")).collect();
    assert_eq!(cleared, ["clear-site-data: \"cache\""], "{cookies}");

    // A box that answers `100 Continue` without end, as fast as `yes`
    // writes, holds neither the edge nor another box: past 16 such answers
    // to one request the connection fails (each read of them was parsed
    // whole, and held the edge's loop for seconds).
    ssh(Some("a"), &["(busybox nc -ll -p 8100 -e /www/continue &)"]);
    let flooding = public_host(8100);
    let (answer, took) = exchange(&edge, &flooding, format!("GET / HTTP/1.1\r\nHost: {flooding}\r\n\r\n").as_bytes());
    assert_eq!(status(&answer), "502", "{answer}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    let started = Instant::now();
    let mut held = connect(&edge, &flooding, "127.0.0.1").unwrap();
    held.write_all(format!("GET / HTTP/1.1\r\nHost: {flooding}\r\n\r\n").as_bytes()).unwrap();
    held.flush().unwrap();
    for _ in 0..3 {
        others_answer(&edge, &b);
    }
    assert!(started.elapsed() < Duration::from_secs(6));
    drop(held);
    drop(daemon);
}
