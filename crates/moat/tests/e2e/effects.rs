//! The effects ledger: what a box did outside that a restore does not undo
//! (requests other than GET/HEAD/OPTIONS, connections the gateway passed
//! through unread), recorded host-side from the gateway's log, listed by
//! `effects`, told after `restore`, and per copy after `diff`.

use std::time::{Duration, Instant};

use crate::egress::sh;
use crate::fixture::unique;
use crate::Env;

/// `effects NAME ARGS...`'s output once it holds `want` (the log reaches
/// the store a moment after the request).
fn effects_with(env: &Env, name: &str, args: &[&str], want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut all = vec!["effects", name];
        all.extend_from_slice(args);
        let out = env.alice(None, &all).ok().stdout;
        if out.contains(want) || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn effects_are_told_where_they_matter(env: &Env) {
    let name = unique("fx");
    env.new_box(&name, &[]);
    env.alice(None, &["policy", &name, "allow", "web.test"]).ok();
    assert_eq!(env.alice(None, &["effects", &name]).ok().stdout, "no effects\n");
    env.alice(None, &["checkpoint", &name, "c1"]).ok();
    let m = unique("order");
    let (status, _) = sh(
        env,
        &name,
        &format!(
            "curl -sS -m 10 -o /dev/null -X POST -d x=1 http://web.test/{m} && curl -sS -m 10 -o /dev/null http://web.test/read && \
             curl -sS -m 10 -k -o /dev/null https://web.test/hidden"
        ),
    );
    assert_eq!(status, Some(0));
    // The POST and the connection passed through unread; not the GET.
    let out = effects_with(env, &name, &[], "opaque");
    assert!(out.contains(&format!("request web.test:80 POST /{m}")), "{out}");
    assert!(out.contains("opaque  web.test:443"), "{out}");
    assert!(!out.contains("/read"), "a GET is no effect: {out}");
    let json = env.alice(None, &["effects", &name, "--json", "--since", "c1"]).ok().stdout;
    let kinds: Vec<String> = json
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["kind"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(kinds, ["request", "opaque"], "{json}");
    let later = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 5).to_string();
    assert_eq!(env.alice(None, &["effects", &name, "--since", &later]).ok().stdout, "no effects\n");

    // A restore puts the files back and says what it cannot take back.
    let out = env.alice(None, &["restore", &name, "c1"]).ok().stdout;
    assert!(out.starts_with("before-c1\n"), "{out}");
    assert!(out.contains(&format!("since checkpoint c1, {name} did what a restore does not undo:")), "{out}");
    assert!(out.contains(&format!("1 request to web.test: POST /{m} -")), "{out}");
    assert!(out.contains("1 opaque connection to web.test:443"), "{out}");

    // Two copies: each one's effects since they split, not those before,
    // to the millisecond: the parent was made, posted and restored within
    // a second or so (a warm-pool box), and the dup follows at once (when
    // the split was known to the second, its POST counted as the copy's).
    let copy = unique("fx");
    env.alice(None, &["dup", &name, &copy]).ok();
    let gone = unique("gone");
    sh(env, &copy, &format!("curl -sS -m 10 -o /dev/null -X DELETE http://web.test/{gone}"));
    effects_with(env, &copy, &[], &gone);
    let out = env.alice(None, &["diff", &name, &copy]).ok().stdout;
    assert!(out.contains(&format!("{copy} since the split did what a restore does not undo:")), "{out}");
    assert!(out.contains(&format!("DELETE /{gone}")), "{out}");
    let before = || {
        let fx = |n: &str| env.alice(None, &["effects", n, "--json"]).ok().stdout;
        let info = |n: &str| env.alice(None, &["info", n, "--json"]).ok().stdout;
        format!("{}\n{}\n{}\n{}", fx(&name), fx(&copy), info(&name), info(&copy))
    };
    assert!(
        !out.contains(&m) && !out.contains(&format!("{name} since the split")),
        "effects before the split: {out}\n{}",
        before()
    );
    // A request whose body the box cuts short reached the host all the same
    // (which may act on it): an effect, saying so.
    let cut = unique("cut");
    let script = format!(
        "import socket; s = socket.create_connection((\"web.test\", 80)); \
         s.sendall(b\"POST /{cut} HTTP/1.1\\r\\nHost: web.test\\r\\nContent-Length: 100\\r\\n\\r\\nhalf of a body\"); \
         import time; time.sleep(1); s.close()"
    );
    sh(env, &name, &format!("python3 -c '{script}'"));
    let out = effects_with(env, &name, &[], &cut);
    assert!(out.contains(&format!("request web.test:80 POST /{cut}")), "a request cut short is no effect: {out}");
    let log = crate::egress::log(env, &name);
    assert!(log.contains("its body was cut short"), "{log}");
    // A GET that asks the server to read it as a DELETE (servers honouring
    // `X-HTTP-Method-Override` do): an effect, in words that say so.
    let hidden = unique("hidden");
    let (status, _) = sh(
        env,
        &name,
        &format!("curl -sS -m 10 -o /dev/null -H 'X-HTTP-Method-Override: delete' http://web.test/{hidden}"),
    );
    assert_eq!(status, Some(0));
    let out = effects_with(env, &name, &[], &hidden);
    assert!(out.contains(&format!("request web.test:80 GET as DELETE /{hidden}")), "{out}");
    env.alice(None, &["rm", &copy]).ok();
    env.alice(None, &["rm", &name]).ok();
}
