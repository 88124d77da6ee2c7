//! Secrets: a box holds a placeholder; the gateway writes the real value into
//! one header of requests to one host, and nowhere else; what comes back is
//! scrubbed; limits, kill and usage. The test upstream (llm.test on the test
//! internet) records every request it gets.

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use crate::egress::sh;
use crate::fixture::unique;
use crate::Env;

/// Adds secret `name` for llm.test's Authorization header, value on stdin.
pub(crate) fn add_secret(env: &Env, name: &str, value: &str) {
    let mut cmd = env.daemon.ssh(
        &env.alice,
        None,
        &[
            "secret",
            "add",
            name,
            "--host",
            "llm.test",
            "--header",
            "Authorization",
            "--format",
            "'Bearer {}'",
            "--env",
            "LLM_KEY",
        ],
    );
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(format!("{value}\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "secret add: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stdout).contains(value), "the value was echoed");
}

/// The requests the test internet got whose first line holds `marker`
/// (tests run side by side: each request of this file carries a marker).
pub(crate) fn arrived(env: &Env, marker: &str) -> Vec<String> {
    env.net
        .received()
        .split("----\n")
        .filter(|r| r.lines().next().is_some_and(|l| l.contains(marker)))
        .map(String::from)
        .collect()
}

pub fn reach_only_their_host_and_header(env: &Env) {
    let value = format!("sk-REAL-0123456789-{}", unique("v"));
    let secret = unique("llm");
    add_secret(env, &secret, &value);
    let listed = env.alice(None, &["secret", "ls", "--json"]).ok().stdout;
    assert!(listed.contains("llm.test") && !listed.contains(&value), "{listed}");

    let a = unique("sec");
    env.new_box(&a, &[]);
    env.alice(None, &["secret", "grant", &secret, &a]).ok();
    assert!(env.alice(None, &["policy", &a]).ok().stdout.contains("allow llm.test:443"));
    // The box holds a placeholder, in its sessions and /etc/environment, and
    // the value nowhere.
    let (_, held) = sh(env, &a, "echo $LLM_KEY; grep LLM_KEY /etc/environment");
    let placeholder = held.lines().next().unwrap_or_default().to_string();
    assert!(placeholder.starts_with("moat-placeholder-"), "{held}");
    assert!(held.contains(&format!("LLM_KEY={placeholder}")), "{held}");

    // With the placeholder in the header: the value arrives there, once,
    // and comes back scrubbed (the server echoes it in a header and the body).
    let m = unique("m");
    let (status, out) =
        sh(env, &a, &format!("curl -sS -m 10 -i -H \"Authorization: Bearer $LLM_KEY\" https://llm.test/echo?{m}"));
    assert_eq!(status, Some(0), "{out}");
    let got = arrived(env, &m).concat();
    assert_eq!(got.matches(&value).count(), 1, "the value did not arrive once, in its header: {got}");
    assert!(got.contains(&format!("Authorization: Bearer {value}")), "{got}");
    assert!(!out.contains(&value) && out.contains("[secret removed by moat]"), "the value came back: {out}");
    // Compressed and streamed answers are scrubbed too.
    for path in ["gzip", "stream"] {
        let (status, out) = sh(
            env,
            &a,
            &format!("curl -sS -m 10 --compressed -H \"Authorization: Bearer $LLM_KEY\" https://llm.test/{path}"),
        );
        assert_eq!(status, Some(0), "{path}: {out}");
        assert!(!out.contains(&value) && out.contains("secret removed"), "{path}: {out}");
    }

    // A client that waits for 100 Continue before its body gets it through
    // the scrubbing relay (it would wait out its 15 s otherwise).
    let started = std::time::Instant::now();
    let (_, code) = sh(
        env,
        &a,
        "head -c 5000 /dev/zero > /tmp/body; curl -sS -m 20 --expect100-timeout 15 -H \"Expect: 100-continue\" \
         -H \"Authorization: Bearer $LLM_KEY\" --data-binary @/tmp/body -o /dev/null -w %{http_code} https://llm.test/echo",
    );
    assert_eq!(code, "200");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "100 Continue held back");

    // Nowhere else: not in a body, a query, another header, over plain HTTP,
    // or to another allowed host.
    env.alice(None, &["policy", &a, "allow", "llm.test:80"]).ok();
    env.alice(None, &["policy", &a, "allow", "web.test"]).ok();
    let m = unique("m");
    let script = format!(
        "curl -sS -m 10 -o /dev/null -H \"X-Other: $LLM_KEY\" -d \"$LLM_KEY\" \"https://llm.test/echo?{m}&k=$LLM_KEY\"; \
         curl -sS -m 10 -o /dev/null -H \"Authorization: Bearer $LLM_KEY\" http://llm.test/echo?{m}; \
         curl -sS -m 10 -o /dev/null -k -H \"Authorization: Bearer $LLM_KEY\" https://web.test/?{m}"
    );
    sh(env, &a, &script);
    let got = arrived(env, &m);
    assert_eq!(got.len(), 3, "{got:?}");
    let got = got.concat();
    assert!(!got.contains(&value), "the value went where it does not belong: {got}");
    assert_eq!(got.matches(&placeholder).count(), 5, "{got}");

    // The box's own key is overwritten with the operator's; smuggling is refused.
    let m = unique("m");
    sh(
        env,
        &a,
        &format!("curl -sS -m 10 -o /dev/null -H \"Authorization: Bearer sk-ATTACKER\" https://llm.test/echo?{m}"),
    );
    let got = arrived(env, &m).concat();
    assert!(got.contains(&value) && !got.contains("sk-ATTACKER"), "{got}");
    let m = unique("m");
    let twice = format!(
        "import http.client, os\n\
         c = http.client.HTTPSConnection(\"llm.test\", timeout=10)\n\
         c.putrequest(\"GET\", \"/echo?{m}\")\n\
         c.putheader(\"Authorization\", \"Bearer \" + os.environ[\"LLM_KEY\"])\n\
         c.putheader(\"authorization\", \"x\")\n\
         c.endheaders(); r = c.getresponse(); print(r.status, r.read().decode())\n"
    );
    let (_, out) = sh(env, &a, &format!("python3 -c '{twice}'"));
    assert!(out.contains("two Authorization headers"), "{out}");
    assert!(arrived(env, &m).is_empty(), "a smuggled request reached the host");

    // A placeholder split across writes is one placeholder: in once.
    let m = unique("m");
    let split = format!(
        "import os, socket, ssl, time\n\
         s = ssl.create_default_context().wrap_socket(socket.create_connection((\"llm.test\", 443)), server_hostname=\"llm.test\")\n\
         p = os.environ[\"LLM_KEY\"]\n\
         h = \"GET /echo?{m} HTTP/1.1\\r\\nHost: llm.test\\r\\nConnection: close\\r\\nAuthorization: Bearer \" + p + \"\\r\\n\\r\\n\"\n\
         cut = h.index(p) + 10\n\
         s.sendall(h[:cut].encode()); time.sleep(0.3); s.sendall(h[cut:].encode())\n\
         print(s.recv(100).decode().split()[1])\n"
    );
    let (_, out) = sh(env, &a, &format!("python3 -c '{split}'"));
    assert_eq!(out.trim(), "200");
    assert_eq!(arrived(env, &m).concat().matches(&value).count(), 1);

    // HTTP/1.0 keep-alive: its answer is framed by the close, so nothing
    // sent after the request is read as another (and none gets the value);
    // a byte range, which would let the value come back in slices, is
    // dropped.
    let m = unique("m");
    let http10 = format!(
        "import os, socket, ssl\n\
         s = ssl.create_default_context().wrap_socket(socket.create_connection((\"llm.test\", 443)), server_hostname=\"llm.test\")\n\
         a = \"Authorization: Bearer \" + os.environ[\"LLM_KEY\"] + \"\\r\\n\"\n\
         s.sendall((\"GET /echo?{m}-one HTTP/1.0\\r\\nHost: llm.test\\r\\nConnection: keep-alive\\r\\nRange: bytes=0-9\\r\\n\" + a + \"\\r\\n\"\n\
                    \"GET /echo?{m}-two HTTP/1.1\\r\\nHost: llm.test\\r\\n\" + a + \"\\r\\n\").encode())\n\
         got = b\"\"\n\
         while True:\n    d = s.recv(65536)\n    if not d: break\n    got += d\n\
         print(got.count(b\"HTTP/1.1 \"), got.split()[1].decode())\n"
    );
    let (_, out) = sh(env, &a, &format!("timeout 20 python3 -c '{http10}'"));
    assert_eq!(out.trim(), "1 200", "{out}");
    let got = arrived(env, &m);
    assert_eq!(got.len(), 1, "a request after an HTTP/1.0 one was sent on: {got:?}");
    assert!(got[0].contains("-one") && !got[0].contains("Range"), "{got:?}");

    // Another box granted the same secret has a placeholder of its own; box
    // A's placeholder does not work in it.
    let b = unique("sec");
    env.new_box(&b, &[]);
    env.alice(None, &["secret", "grant", &secret, &b]).ok();
    let (_, b_holds) = sh(env, &b, "echo $LLM_KEY");
    assert!(b_holds.starts_with("moat-placeholder-") && b_holds.trim() != placeholder);
    let m = unique("m");
    let (_, out) =
        sh(env, &b, &format!("curl -sS -m 10 -H \"Authorization: Bearer {placeholder}\" https://llm.test/echo?{m}"));
    assert!(out.contains("not this box's"), "{out}");
    assert!(arrived(env, &m).is_empty());

    // A copy gets its own placeholder; the value is in no file of either box.
    let copy = unique("sec");
    env.alice(None, &["dup", &a, &copy]).ok();
    let (_, copied) = sh(env, &copy, "echo $LLM_KEY");
    assert!(copied.starts_with("moat-placeholder-") && copied.trim() != placeholder, "{copied}");
    for name in [&a, &copy] {
        // Judged by what grep prints, not its status (which an unreadable
        // file makes 2 whether or not the value is found); the last line
        // shows that grep runs and finds what is there (the placeholder).
        let script =
            format!("grep -rl {value} /etc /root /tmp /var /home 2>/dev/null; grep -l LLM_KEY /etc/environment");
        let (_, found) = sh(env, name, &script);
        assert_eq!(found, "/etc/environment\n", "the value is in {name}'s files: {found}");
    }
    // Nor in what the owner reads of the box.
    let log = env.alice(None, &["log", &a, "--json"]).ok().stdout;
    assert!(log.contains(&secret) && !log.contains(&value), "{log}");

    // Revoked: the placeholder is gone and nothing is written in.
    env.alice(None, &["secret", "revoke", &secret, &a]).ok();
    let (_, held) = sh(env, &a, "grep -c LLM_KEY /etc/environment");
    assert_eq!(held.trim(), "0");
    for name in [&a, &b, &copy] {
        env.alice(None, &["rm", name]).ok();
    }
    env.alice(None, &["secret", "rm", &secret]).ok();
}

pub fn limits_kill_and_usage(env: &Env) {
    let value = format!("sk-REAL-0123456789-{}", unique("v"));
    let secret = unique("llm");
    add_secret(env, &secret, &value);
    let a = unique("sec");
    env.new_box(&a, &[]);
    env.alice(None, &["secret", "grant", &secret, &a]).ok();
    env.alice(None, &["secret", "limit", &secret, "--box", &a, "--requests", "2", "--per", "1h"]).ok();
    let call = "curl -sS -m 10 -w \" %{http_code}\" -H \"Authorization: Bearer $LLM_KEY\" https://llm.test/echo";
    for _ in 0..2 {
        let (_, out) = sh(env, &a, call);
        assert!(out.ends_with(" 200"), "{out}");
    }
    let (_, out) = sh(env, &a, call);
    assert!(out.ends_with(" 429") && out.contains("limit of 2 requests per 3600 s"), "{out}");
    // Use is billed per secret and box: requests, and the tokens the host reported.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let usage = env.alice(None, &["usage", "--json"]).ok().stdout;
        let usage: serde_json::Value = serde_json::from_str(&usage).unwrap();
        let row = usage["secrets"].as_array().and_then(|rows| {
            rows.iter().find(|r| r["secret"] == secret.as_str() && r["box_name"] == a.as_str()).cloned()
        });
        if let Some(row) = row.filter(|r| r["requests"] == 2) {
            assert_eq!(row["tokens"], 30, "{row}");
            assert_eq!(row["box_name"], a.as_str());
            break;
        }
        assert!(std::time::Instant::now() < deadline, "secret use not billed: {usage}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }

    // Kill: a kept-alive connection that used the secret is ended at once.
    // The box waits on it after the kill: it must end (nothing else would end
    // it in 30 s: the gateway waits 120 s for a next request, the test
    // server forever).
    env.alice(None, &["secret", "limit", &secret, "--box", &a, "--requests", "100", "--per", "1h"]).ok();
    let script = "import http.client, os, socket, sys\n\
                  c = http.client.HTTPSConnection(\"llm.test\", timeout=10)\n\
                  h = {\"Authorization\": \"Bearer \" + os.environ[\"LLM_KEY\"]}\n\
                  c.request(\"GET\", \"/echo\", headers=h); r = c.getresponse(); r.read(); print(r.status, flush=True)\n\
                  sys.stdin.readline()\n\
                  c.sock.settimeout(30)\n\
                  try:\n    print(\"closed\" if c.sock.recv(1) == b\"\" else \"data\", flush=True)\n\
                  except socket.timeout:\n    print(\"open\", flush=True)\n\
                  except OSError as e:\n    print(\"closed\", type(e).__name__, flush=True)\n";
    let mut py =
        env.daemon.ssh(&env.alice, Some(&a), &["python3", "-c", &format!("'{}'", script.replace('\'', "'\\''"))]);
    py.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut py = py.spawn().unwrap();
    let mut lines = BufReader::new(py.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "200");
    env.alice(None, &["secret", "kill", &secret]).ok();
    writeln!(py.stdin.take().unwrap()).unwrap();
    let after = lines.next().unwrap().unwrap();
    assert!(after.starts_with("closed"), "a connection that used a killed secret was not closed: {after}");
    let _ = py.wait();
    let (_, out) = sh(env, &a, call);
    assert!(out.contains("was killed") && !out.contains(&value), "{out}");
    assert!(env.alice(None, &["secret", "ls"]).ok().stdout.contains("KILLED"));
    env.alice(None, &["rm", &a]).ok();
    env.alice(None, &["secret", "rm", &secret]).ok();
}

/// Windowed limits are counted in the gateway's memory: when it restarts,
/// a box's window starts afresh. Limits without a period (bytes) count from
/// the stored totals, which a restart keeps. (Run alone, after the other
/// tests: it kills the shared daemon's gateway, which cuts every box's
/// connections.)
pub fn windowed_limits_restart_with_the_gateway(env: &Env) {
    let value = format!("sk-REAL-0123456789-{}", unique("v"));
    let secret = unique("llmwin");
    add_secret(env, &secret, &value);
    let a = unique("win");
    env.new_box(&a, &[]);
    env.alice(None, &["secret", "grant", &secret, &a]).ok();
    env.alice(None, &["secret", "limit", &secret, "--box", &a, "--requests", "2", "--per", "1d"]).ok();
    // A request with a marker of its own (all of one length, so each costs
    // the same bytes); what it got back, and whether the host got the value.
    let call = |mark: &str| {
        let script = format!(
            "curl -sS -m 10 -w \" %{{http_code}}\" -H \"Authorization: Bearer $LLM_KEY\" https://llm.test/echo/{mark}"
        );
        let out = sh(env, &a, &script).1;
        let sent = arrived(env, mark).iter().any(|r| r.contains(&format!("Authorization: Bearer {value}")));
        (out, sent)
    };
    let mark = |n: usize| format!("{secret}-{n:04}");
    for n in 0..2 {
        let (out, sent) = call(&mark(n));
        assert!(out.ends_with(" 200") && sent, "request {n}: {out}");
    }
    let (out, _) = call(&mark(2));
    assert!(out.ends_with(" 429") && out.contains("this box's limit of 2 requests per 86400 s"), "{out}");
    // The two are stored (with their bytes) before the gateway goes.
    let stored = || {
        let listed = env.alice(None, &["usage", "--json"]).ok().stdout;
        let usage: serde_json::Value = serde_json::from_str(&listed).unwrap();
        let rows = usage["secrets"].as_array().cloned().unwrap_or_default();
        let row = rows.into_iter().find(|r| r["secret"] == secret.as_str() && r["box_name"] == a.as_str());
        row.filter(|r| r["requests"] == 2).and_then(|r| r["bytes"].as_u64())
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let two = loop {
        if let Some(bytes) = stored() {
            break bytes;
        }
        assert!(std::time::Instant::now() < deadline, "the two requests were never stored");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    // For every box, with no period: room for a third request, not a fourth
    // (counted from the two the store holds).
    let most = (two + two / 4).to_string();
    env.alice(None, &["secret", "limit", &secret, "--bytes", &most]).ok();
    let gateway = crate::egress::gateway_pid(&env.daemon);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(gateway as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    crate::egress::wait_for_egress(|| crate::egress::gateway_pid(&env.daemon) != gateway);
    // The box's day starts again: a request goes through with the value
    // written in (so the secret was armed again and admitted it). Until the
    // new gateway has the box, requests fail to connect.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let third = loop {
        let (out, sent) = call(&mark(3));
        if out.ends_with(" 200") || out.ends_with(" 429") {
            break (out, sent);
        }
        assert!(std::time::Instant::now() < deadline, "no way out after the gateway restarted: {out}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(third.0.ends_with(" 200") && third.1, "the box's window did not start again with the gateway: {third:?}");
    let (out, sent) = call(&mark(4));
    let limit = format!("all boxes' limit of {most} bytes");
    assert!(out.ends_with(" 429") && out.contains(&limit), "the stored bytes were forgotten: {out}");
    assert!(!sent, "a request past the limit reached the host");
    env.alice(None, &["rm", &a]).ok();
    env.alice(None, &["secret", "rm", &secret]).ok();
}
