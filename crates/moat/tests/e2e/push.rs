//! Git push rules: a box pushes through the gateway, with the real git
//! client, to the test internet's real `git http-backend`, only to the refs
//! its policy's push rules allow; every other push is refused on git's own
//! channel (so `git push` prints the rule) and nothing of it reaches the
//! server; a token bound to the host goes only into pushes that are allowed;
//! hostile push bodies are refused and the gateway stays up.

use std::io::Write;
use std::process::Stdio;

use crate::egress::sh;
use crate::fixture::unique;
use crate::Env;

/// Writes `content` to `path` in box `name`.
fn put(env: &Env, name: &str, path: &str, content: &str) {
    let mut cmd = env.daemon.ssh(&env.alice, Some(name), &["sh", "-c", &format!("'cat > {path}'")]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    child.stdin.as_mut().unwrap().write_all(content.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

/// Sends hand-made push bodies over TLS through the gateway: `malformed`
/// (a bad pkt-line length), `oversize` (a command list past the gateway's
/// bound), `split` (a valid push to `main`, written a few bytes at a time).
const HOSTILE: &str = r#"
import socket, ssl, sys, time
mode, repo, old = sys.argv[1:4]
def pkt(s):
    b = s.encode()
    return b"%04x" % (len(b) + 4) + b
if mode == "malformed":
    body = b"zzzz0000"
elif mode == "oversize":
    body = pkt("shallow " + "1" * 40) * 50000
else:
    body = pkt(old + " " + "2" * 40 + " refs/heads/main\0report-status side-band-64k") + b"0000"
head = "POST /moat/%s.git/git-receive-pack HTTP/1.1\r\nHost: github.com\r\n" % repo
head += "Content-Type: application/x-git-receive-pack-request\r\n"
if mode == "split":
    # The pack's first bytes after the commands: still coming, a little at a
    # time, when the refusal is sent (which must reach the client whole).
    body += b"PACK" + b"\0" * 508
    head += "Transfer-Encoding: chunked\r\n\r\n"
    data = head.encode() + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i+3]), body[i:i+3]) for i in range(0, len(body), 3)) + b"0\r\n\r\n"
else:
    data = head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body
s = ssl.create_default_context().wrap_socket(socket.create_connection(("github.com", 443), timeout=20), server_hostname="github.com")
if mode == "split":
    for i in range(0, len(data), 5):
        s.sendall(data[i:i+5])
        time.sleep(0.002)
else:
    try:
        s.sendall(data)
    except OSError:
        pass
out = b""
try:
    while True:
        got = s.recv(65536)
        if not got:
            break
        out += got
except OSError:
    pass
print(repr(out))
"#;

pub fn push_rules_decide_each_ref(env: &Env) {
    let repo = unique("push");
    let other = unique("other");
    env.net.git_repo(&repo);
    env.net.git_repo(&other);
    let name = unique("git");
    env.new_box(&name, &["--policy", "github-read"]);
    let rule = |words: &[&str]| {
        let mut all = vec!["policy", name.as_str(), "allow", "push"];
        all.extend_from_slice(words);
        env.alice(None, &all).ok().stdout
    };
    let shown = rule(&[&format!("github.com/moat/{repo}"), "refs/heads/agent/*"]);
    assert!(shown.contains(&format!("allow push github.com/moat/{repo} refs/heads/agent/*")), "{shown}");
    rule(&[&format!("github.com/moat/{repo}"), "refs/heads/ff/*", "--fast-forward"]);

    // A token bound to github.com: the box holds a placeholder, and git
    // sends it in the header the secret names.
    let token = format!("ghp_REAL0123456789abcdef{}", unique("t").replace('-', ""));
    let secret = unique("gh");
    let mut cmd = env.daemon.ssh(
        &env.alice,
        None,
        &[
            "secret",
            "add",
            &secret,
            "--host",
            "github.com",
            "--header",
            "Authorization",
            "--format",
            "'Bearer {}'",
            "--env",
            "GH_TOKEN",
        ],
    );
    cmd.stdin(Stdio::piped()).stdout(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    child.stdin.as_mut().unwrap().write_all(format!("{token}\n").as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    env.alice(None, &["secret", "grant", &secret, &name]).ok();

    let git = "git -c user.name=a -c user.email=a@a -c http.extraHeader=\"Authorization: Bearer $GH_TOKEN\"";
    let (status, out) = sh(env, &name, &format!("{git} clone -q https://github.com/moat/{repo}.git /tmp/r 2>&1"));
    assert_eq!(status, Some(0), "clone: {out}");
    let push = |refspec: &str| sh(env, &name, &format!("cd /tmp/r && {git} push origin {refspec} 2>&1"));
    let main_before = env.net.git_refs(&repo);

    // An allowed ref: the push goes, with the token.
    let (status, out) = sh(env, &name, &format!("cd /tmp/r && {git} commit -q --allow-empty -m one && {git} push -q origin HEAD:refs/heads/agent/one 2>&1 && git rev-parse HEAD"));
    assert_eq!(status, Some(0), "allowed push: {out}");
    let head = out.lines().last().unwrap_or_default().to_string();
    assert!(env.net.git_refs(&repo).contains(&format!("{head} refs/heads/agent/one")), "{}", env.net.git_refs(&repo));

    // main, a delete, a tag: refused by name, on git's own channel.
    let (status, out) = push("HEAD:main");
    assert_ne!(status, Some(0));
    assert!(out.contains("[remote rejected]") && out.contains("moat: no push rule covers this ref"), "main: {out}");
    assert!(out.contains("remote: moat: this push was refused"), "{out}");
    let (status, out) = push(":refs/heads/agent/one");
    assert_ne!(status, Some(0));
    assert!(out.contains("deleting needs --delete"), "delete: {out}");
    let (status, out) = sh(env, &name, &format!("cd /tmp/r && git tag v1 && {git} push origin v1 2>&1"));
    assert_ne!(status, Some(0));
    assert!(out.contains("[remote rejected]") && out.contains("v1"), "tag: {out}");

    // --fast-forward: a new branch and a real fast-forward go; a rewrite
    // (a force push) does not.
    let (status, out) = push("HEAD:refs/heads/ff/one");
    assert_eq!(status, Some(0), "{out}");
    let (status, out) = sh(
        env,
        &name,
        &format!("cd /tmp/r && {git} commit -q --allow-empty -m two && {git} push origin HEAD:refs/heads/ff/one 2>&1"),
    );
    assert_eq!(status, Some(0), "fast-forward: {out}");
    let ff_before = env.net.git_refs(&repo);
    let (status, out) = sh(env, &name, &format!("cd /tmp/r && {git} commit -q --amend --allow-empty -m rewritten && {git} push -f origin HEAD:refs/heads/ff/one 2>&1"));
    assert_ne!(status, Some(0));
    assert!(out.contains("fast-forward"), "force push: {out}");
    assert_eq!(env.net.git_refs(&repo), ff_before);
    // A rewrite naming the old commit in a second `parent` header after the
    // others: git (and the server) take it for no parent.
    let hidden = format!(
        "cd /tmp/r && b=$(printf \"tree %s\\nparent %s\\nauthor a <a@a> 1 +0000\\ncommitter a <a@a> 1 +0000\\nparent %s\\n\\nhidden\\n\" \
         $({git} rev-parse HEAD^{{tree}}) $({git} rev-parse HEAD~1) $({git} rev-parse origin/ff/one) \
         | {git} hash-object -t commit -w --literally --stdin) && {git} push -f origin $b:refs/heads/ff/one 2>&1"
    );
    let (status, out) = sh(env, &name, &hidden);
    assert_ne!(status, Some(0), "a rewrite hiding the old commit in a late parent header got through: {out}");
    assert!(out.contains("fast-forward"), "hidden parent: {out}");
    assert_eq!(env.net.git_refs(&repo), ff_before);

    // Another repository of the same host.
    let (status, out) = sh(
        env,
        &name,
        &format!("cd /tmp/r && {git} push https://github.com/moat/{other}.git HEAD:refs/heads/agent/one 2>&1"),
    );
    assert_ne!(status, Some(0));
    assert!(out.contains(&format!("no push rule names github.com/moat/{other}")), "other repo: {out}");
    assert!(!env.net.git_refs(&other).contains("agent"), "{}", env.net.git_refs(&other));

    // Hostile bodies: refused, the gateway alive after them.
    put(env, &name, "/tmp/hostile.py", HOSTILE);
    let main_id = main_before.split(' ').next().unwrap_or_default().to_string();
    for (mode, want) in [
        ("malformed", "a malformed pkt-line length"),
        ("oversize", "command list is too large"),
        ("split", "ng refs/heads/main moat: no push rule covers this ref"),
    ] {
        let (_, out) = sh(env, &name, &format!("python3 /tmp/hostile.py {mode} {repo} {main_id}"));
        assert!(out.contains(want), "{mode}: {out}");
    }
    let (status, out) = sh(env, &name, &format!("{git} ls-remote https://github.com/moat/{repo}.git 2>&1"));
    assert_eq!(status, Some(0), "the gateway after hostile pushes: {out}");

    // The server's refs: main as it was, the allowed refs only.
    let refs = env.net.git_refs(&repo);
    assert!(refs.contains(main_before.trim()), "main moved: {refs}");
    assert!(!refs.contains("refs/tags/") && refs.contains("refs/heads/agent/one"), "{refs}");
    // Nothing of a refused push reached the server, and the token arrived
    // only in the pushes that were allowed (two to ff/one, one to agent/one).
    let pushes: Vec<String> = env
        .net
        .received()
        .split("----\n")
        .filter(|r| r.starts_with(&format!("POST github.com /moat/{repo}.git/git-receive-pack")))
        .map(String::from)
        .collect();
    assert_eq!(pushes.len(), 3, "{pushes:?}");
    assert!(pushes.iter().all(|p| p.contains(&format!("Authorization: Bearer {token}"))), "{pushes:?}");
    let others = env
        .net
        .received()
        .split("----\n")
        .filter(|r| r.contains(&format!("/moat/{other}.git/git-receive-pack")))
        .count();
    assert_eq!(others, 0, "a push to another repository reached the server");

    let log = crate::egress::log(env, &name);
    assert!(log.contains("push refused: refs/heads/main"), "{log}");
    env.alice(None, &["rm", &name]).ok();
    env.alice(None, &["secret", "rm", &secret]).ok();
}
