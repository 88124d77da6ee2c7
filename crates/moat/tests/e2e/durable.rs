//! Durable boxes: a daemon with an object store (a real SeaweedFS on
//! loopback) uploads a box at suspend, at checkpoint and every upload
//! interval while it runs and changes; `info` says as of when; the objects
//! are in the bucket, a full stream first, then incrementals.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::fixture::{run, Daemon};
use crate::Env;

fn info(d: &Daemon, env: &Env, name: &str) -> serde_json::Value {
    let out = run(&mut d.ssh(&env.alice, None, &["info", name, "--json"])).ok().stdout;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Waits until box `name`'s newest upload is newer than `after_ms`, and no
/// upload is pending; its `as_of_ms`.
fn durable_after(d: &Daemon, env: &Env, name: &str, after_ms: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let i = info(d, env, name);
        let durable = &i["durable"];
        if let Some(as_of) = durable["as_of_ms"].as_u64() {
            if as_of > after_ms && durable["pending"] == false {
                return as_of;
            }
        }
        assert!(Instant::now() < deadline, "box {name} was not made durable after {after_ms}: {i}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The keys under `prefix` in the bucket (SeaweedFS without IAM answers
/// unsigned listings).
fn keys(endpoint: &str, bucket: &str, prefix: &str) -> Vec<String> {
    let out = Command::new("curl")
        .args(["-sf", &format!("{endpoint}/{bucket}?list-type=2&prefix={prefix}")])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("<Key>").skip(1).filter_map(|s| s.split("</Key>").next()).map(str::to_string).collect()
}

pub fn boxes_upload_at_suspend_checkpoint_and_every_interval(env: &Env) {
    let mut s3 = moat_testkit::SeaweedFs::start();
    s3.create_bucket("moat");
    let endpoint = s3.endpoint();
    let state = env.dir.join("durable");
    // Credentials from a file (never the command line).
    let creds = env.dir.join("durable-s3.env");
    std::fs::write(&creds, "AWS_ACCESS_KEY_ID=test\nAWS_SECRET_ACCESS_KEY=test\n").unwrap();
    let creds = creds.to_str().unwrap().to_string();
    let daemon = |interval: &str| {
        let flags = [
            "--object-store",
            "s3://moat/e2e",
            "--s3-endpoint",
            &endpoint,
            "--s3-credentials",
            &creds,
            "--upload-interval",
            interval,
        ];
        Daemon::start(state.clone(), env.daemon.keys_file.clone(), &flags)
    };
    // First only suspend and checkpoint upload (no interval comes round).
    let mut d = daemon("3600");
    let ssh = |d: &Daemon, user: Option<&str>, args: &[&str]| run(&mut d.ssh(&env.alice, user, args));
    ssh(&d, None, &["new", "b", "--image", "busybox"]).ok();
    ssh(&d, Some("b"), &["echo one > /root/f; sync"]).ok();

    // At suspend: made durable as of after the write, and up to date.
    let t0 = now_ms();
    ssh(&d, None, &["suspend", "b"]).ok();
    let first = durable_after(&d, env, "b", t0);
    let text = ssh(&d, None, &["info", "b"]).ok().stdout;
    assert!(text.contains("\ndurable:  as of ") && text.contains("up to date"), "{text}");
    let id = info(&d, env, "b")["id"].as_str().unwrap().to_string();
    let prefix = format!("e2e/boxes/{id}/");
    let listed = keys(&endpoint, "moat", &prefix);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(listed[0].contains("/0000000000-full-"), "{listed:?}");

    // At checkpoint: the checkpoint as an incremental, then the root (an
    // incremental against it).
    ssh(&d, Some("b"), &["echo two > /root/g; sync"]).ok();
    ssh(&d, None, &["checkpoint", "b"]).ok();
    let second = durable_after(&d, env, "b", first);
    let listed = keys(&endpoint, "moat", &prefix);
    assert!(listed.len() == 3 && listed[1].contains("/0000000001-incr-"), "{listed:?}");
    assert!(listed[2].contains("/0000000002-incr-"), "{listed:?}");

    // Every interval, a running box that changed, while it keeps answering;
    // an unchanged one is not uploaded again.
    d.kill();
    let mut d = daemon("2");
    ssh(&d, Some("b"), &["echo three > /root/h; sync"]).ok();
    durable_after(&d, env, "b", second);
    assert_eq!(ssh(&d, Some("b"), &["cat /root/f /root/g /root/h"]).ok().stdout, "one\ntwo\nthree\n");
    std::thread::sleep(Duration::from_secs(3));
    let n = keys(&endpoint, "moat", &prefix).len();
    assert!(n >= 3 && keys(&endpoint, "moat", &prefix)[n - 1].contains("-incr-"), "{n}");
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(keys(&endpoint, "moat", &prefix).len(), n, "an unchanged box was uploaded again");

    // The object store gone for a minute: boxes and sessions go on (a
    // suspend, a checkpoint, a new box, a session every 2 s to each, a
    // writer in the background); the uploads wait.
    s3.stop();
    let down = Instant::now();
    let before = info(&d, env, "b")["durable"]["as_of_ms"].as_u64().unwrap();
    ssh(&d, Some("b"), &["echo four > /root/i; sync"]).ok();
    ssh(&d, None, &["suspend", "b"]).ok();
    assert_eq!(ssh(&d, Some("b"), &["cat /root/i"]).ok().stdout, "four\n");
    ssh(&d, None, &["checkpoint", "b", "down"]).ok();
    ssh(&d, None, &["new", "b2", "--image", "busybox"]).ok();
    ssh(&d, Some("b2"), &["echo five > /root/f; sync"]).ok();
    let writer = "setsid sh -c 'while :; do date >> /root/log; sleep 0.2; done' >/dev/null 2>&1 </dev/null &";
    ssh(&d, Some("b2"), &[writer]).ok();
    assert!(down.elapsed() < Duration::from_secs(20), "{:?}", down.elapsed());
    assert_eq!(info(&d, env, "b")["durable"]["pending"], true);
    while down.elapsed() < Duration::from_secs(60) {
        let at = Instant::now();
        assert_eq!(ssh(&d, Some("b"), &["cat /root/f"]).ok().stdout, "one\n");
        assert_eq!(ssh(&d, Some("b2"), &["cat /root/f"]).ok().stdout, "five\n");
        assert!(at.elapsed() < Duration::from_secs(5), "two sessions took {:?} with the store down", at.elapsed());
        std::thread::sleep(Duration::from_secs(2));
    }
    // Back: the uploads catch up by themselves (a backoff is at most 64 s by now).
    let back = now_ms();
    s3.start_again();
    let caught_up = durable_after(&d, env, "b", before);
    assert!(caught_up > before);
    durable_after(&d, env, "b2", back);
    let listed = keys(&endpoint, "moat", &prefix);
    assert!(listed.last().is_some_and(|k| k.contains("-incr-")), "{listed:?}");
    d.purge();
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}
