//! Images pulled from a real registry (Debian's docker-registry, TLS from the
//! test internet's CA, htpasswd auth) on the test internet, made by the test
//! with umoci and pushed with skopeo: login, pull (a multi-platform index
//! resolved to linux/amd64, by tag and by digest), layers shared, a box made
//! from the image with its files as the image says (whiteouts, hard links,
//! setuid, file capabilities, owners), and hostile images refused with
//! nothing left behind.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::fixture::{run, unique};
use crate::testnet::{TestNet, WEB};
use crate::Env;

const USER: &str = "moat";
pub(crate) const PASSWORD: &str = "s3cret-pull";
/// Where this file's registry listens, on the test internet.
const PORT: u16 = 5000;

/// A docker-registry in the test internet's namespace; killed on drop.
pub(crate) struct Registry {
    child: Child,
    dir: PathBuf,
    netns: String,
    port: u16,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `ip netns exec` may leave the registry as a process of its own:
        // end the one serving this config, by its pid.
        let config = self.dir.join("config.yml").display().to_string();
        let pids =
            Command::new("ip").args(["netns", "pids", &self.netns]).output().map(|o| o.stdout).unwrap_or_default();
        for pid in String::from_utf8_lossy(&pids).split_whitespace() {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&config) {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
    }
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Registry {
    /// Starts one on `port` (each test its own), with `dir` for its files.
    pub(crate) fn start(net: &TestNet, dir: &Path, port: u16) -> Registry {
        std::fs::create_dir_all(dir.join("storage")).unwrap();
        let htpasswd = run_ok(Command::new("htpasswd").args(["-Bbn", USER, PASSWORD]));
        std::fs::write(dir.join("htpasswd"), htpasswd).unwrap();
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {WEB}:{port}\n  tls:\n    certificate: {}\n    key: {}\nauth:\n  htpasswd:\n    realm: moat-test\n    path: {}\n",
            dir.join("storage").display(),
            net.dir.join("web.pem").display(),
            net.dir.join("web.key").display(),
            dir.join("htpasswd").display()
        );
        std::fs::write(dir.join("config.yml"), config).unwrap();
        let log = std::fs::File::create(dir.join("registry.log")).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &net.name, "docker-registry", "serve"])
            .arg(dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let registry = Registry { child, dir: dir.to_path_buf(), netns: net.name.clone(), port };
        // skopeo's trust for the registry, as containers' tools look for it.
        let certs = dir.join("certs").join(format!("{WEB}:{port}"));
        std::fs::create_dir_all(&certs).unwrap();
        std::fs::copy(net.dir.join("ca.pem"), certs.join("ca.crt")).unwrap();
        for _ in 0..100 {
            let up = Command::new("ip")
                .args(["netns", "exec", &net.name, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
                .arg(net.dir.join("ca.pem"))
                .arg(format!("https://{WEB}:{port}/v2/"))
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout) == "401");
            if up {
                return registry;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!(
            "the registry did not come up: {}",
            std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default()
        );
    }

    /// Pushes `layout:tag` as `repo:tag`, every platform of an index.
    pub(crate) fn push(&self, layout: &Path, tag: &str, repo: &str) {
        let port = self.port;
        run_ok(
            Command::new("ip")
                .args(["netns", "exec", &self.netns, "skopeo", "copy", "--all", "-q", "--dest-creds"])
                .arg(format!("{USER}:{PASSWORD}"))
                .arg("--dest-cert-dir")
                .arg(self.dir.join("certs").join(format!("{WEB}:{port}")))
                .arg(format!("oci:{}:{tag}", layout.display()))
                .arg(format!("docker://{WEB}:{port}/{repo}:{tag}")),
        );
    }
}

fn sh(script: &str) {
    run_ok(Command::new("sh").args(["-c", script]));
}

pub(crate) fn umoci(args: &[&str]) -> String {
    run_ok(Command::new("umoci").args(args))
}

/// Writes `bytes` as a blob of the layout; its descriptor's digest and size.
fn put_blob(layout: &Path, bytes: &[u8]) -> (String, usize) {
    use sha2::Digest as _;
    let hex = hex::encode(sha2::Sha256::digest(bytes));
    std::fs::write(layout.join("blobs/sha256").join(&hex), bytes).unwrap();
    (format!("sha256:{hex}"), bytes.len())
}

fn blob(layout: &Path, digest: &str) -> serde_json::Value {
    let hex = digest.trim_start_matches("sha256:");
    serde_json::from_slice(&std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap()).unwrap()
}

/// Tags `digest` (of `media_type`) as `tag` in the layout's index.
fn tag(layout: &Path, tag: &str, media_type: &str, digest: &str, size: usize) {
    let path = layout.join("index.json");
    let mut index: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    index["manifests"].as_array_mut().unwrap().push(serde_json::json!({
        "mediaType": media_type, "digest": digest, "size": size,
        "annotations": {"org.opencontainers.image.ref.name": tag}
    }));
    std::fs::write(path, serde_json::to_vec(&index).unwrap()).unwrap();
}

/// The manifest `tag` names in the layout.
fn manifest_of(layout: &Path, name: &str) -> (String, serde_json::Value) {
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let entry = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == name)
        .unwrap()
        .clone();
    let digest = entry["digest"].as_str().unwrap().to_string();
    (digest.clone(), blob(layout, &digest))
}

/// An image of busybox with what a layer can carry: an owner, a setuid
/// binary, a file capability, a hard link, and (in a second layer) a
/// whiteout; its config sets Env, WorkingDir and User. `marker` goes into a
/// file of its first layer: tests running at once share no layer (a layer
/// one pulled is "have it" for the others, content-addressed).
pub(crate) fn make_tiny(work: &Path, marker: &str) -> PathBuf {
    let layout = work.join("layout");
    umoci(&["init", "--layout", &layout.display().to_string()]);
    let image = format!("{}:tiny", layout.display());
    umoci(&["new", "--image", &image]);
    let bundle = work.join("bundle");
    umoci(&["unpack", "--image", &image, &bundle.display().to_string()]);
    let rootfs = bundle.join("rootfs");
    for dir in ["bin", "etc", "srv", "home/app"] {
        std::fs::create_dir_all(rootfs.join(dir)).unwrap();
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "stat", "ls", "id", "test", "env", "pwd", "grep"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    std::fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
        .unwrap();
    std::fs::write(rootfs.join("etc/group"), "root:x:0:\napp:x:1000:\n").unwrap();
    std::fs::write(rootfs.join("hello"), "hello from a pulled image\n").unwrap();
    std::fs::write(rootfs.join("marker"), marker).unwrap();
    std::fs::hard_link(rootfs.join("hello"), rootfs.join("hello2")).unwrap();
    std::fs::write(rootfs.join("gone"), "whited out above\n").unwrap();
    std::fs::write(rootfs.join("home/app/mine"), "app's\n").unwrap();
    std::os::unix::fs::chown(rootfs.join("home/app/mine"), Some(1000), Some(1000)).unwrap();
    std::fs::copy("/bin/busybox", rootfs.join("bin/suid")).unwrap();
    sh(&format!(
        "chmod 4755 {0}/bin/suid && cp /bin/busybox {0}/bin/capped && setcap cap_net_bind_service+ep {0}/bin/capped",
        rootfs.display()
    ));
    umoci(&["repack", "--image", &image, &bundle.display().to_string()]);
    std::fs::remove_dir_all(&bundle).unwrap();
    umoci(&["unpack", "--image", &image, &bundle.display().to_string()]);
    std::fs::remove_file(bundle.join("rootfs/gone")).unwrap();
    std::fs::write(bundle.join("rootfs/srv/top"), "second layer\n").unwrap();
    umoci(&["repack", "--image", &image, &bundle.display().to_string()]);
    std::fs::remove_dir_all(&bundle).unwrap();
    umoci(&[
        "config",
        "--image",
        &image,
        "--config.env",
        "GREETING=hi",
        "--config.workingdir",
        "/srv",
        "--config.user",
        "app",
    ]);
    layout
}

/// Tags `multi`: an index of an arm64 manifest (listed first) and tiny's
/// amd64 one; the amd64 manifest's digest.
fn make_multi(layout: &Path) -> String {
    let (amd64, manifest) = manifest_of(layout, "tiny");
    let mut arm = manifest.clone();
    arm["annotations"] = serde_json::json!({"moat.test": "not for this host"});
    let (arm, arm_size) = put_blob(layout, &serde_json::to_vec(&arm).unwrap());
    let amd64_size =
        std::fs::metadata(layout.join("blobs/sha256").join(amd64.trim_start_matches("sha256:"))).unwrap().len();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": arm, "size": arm_size,
             "platform": {"architecture": "arm64", "os": "linux"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": amd64, "size": amd64_size,
             "platform": {"architecture": "amd64", "os": "linux"}}
        ]
    });
    let (digest, size) = put_blob(layout, &serde_json::to_vec(&index).unwrap());
    tag(layout, "multi", "application/vnd.oci.image.index.v1+json", &digest, size);
    amd64
}

/// Tags `liar`: an image of one new layer whose config names another diff id.
fn make_liar(work: &Path, layout: &Path) {
    let image = format!("{}:liar", layout.display());
    umoci(&["new", "--image", &image]);
    let bundle = work.join("liar");
    umoci(&["unpack", "--image", &image, &bundle.display().to_string()]);
    std::fs::write(bundle.join("rootfs/lie"), "a layer unlike its diff id\n").unwrap();
    umoci(&["repack", "--image", &image, &bundle.display().to_string()]);
    let (_, mut manifest) = manifest_of(layout, "liar");
    let mut config = blob(layout, manifest["config"]["digest"].as_str().unwrap());
    config["rootfs"]["diff_ids"][0] = serde_json::json!(format!("sha256:{}", "ab".repeat(32)));
    let (digest, size) = put_blob(layout, &serde_json::to_vec(&config).unwrap());
    manifest["config"]["digest"] = digest.into();
    manifest["config"]["size"] = size.into();
    let (digest, size) = put_blob(layout, &serde_json::to_vec(&manifest).unwrap());
    // The new manifest takes the tag.
    let path = layout.join("index.json");
    let mut index: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    index["manifests"]
        .as_array_mut()
        .unwrap()
        .retain(|m| m["annotations"]["org.opencontainers.image.ref.name"] != "liar");
    std::fs::write(&path, serde_json::to_vec(&index).unwrap()).unwrap();
    tag(layout, "liar", "application/vnd.oci.image.manifest.v1+json", &digest, size);
}

/// The one line of a failed command's error (progress lines may come before).
pub(crate) fn one_error(out: &crate::fixture::Ran) -> String {
    let errors: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("moat:")).collect();
    assert_eq!(errors.len(), 1, "{}", out.stderr);
    assert_eq!(out.stderr.lines().last(), errors.first().copied(), "{}", out.stderr);
    errors.first().map_or(String::new(), |l| l.to_string())
}

pub(crate) fn login(env: &Env, registry: &str, password: &str) -> crate::fixture::Ran {
    let mut cmd = env.daemon.ssh(&env.alice, None, &["image", "login", registry, USER]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(format!("{password}\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    crate::fixture::Ran {
        status: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A subvolume's field from `btrfs subvolume show` (`None`: not one, or gone).
fn subvolume_field(path: &Path, name: &str) -> Option<String> {
    let out = Command::new("btrfs").args(["subvolume", "show"]).arg(path).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().find_map(|l| l.trim_start().strip_prefix(name).map(|v| v.trim().to_string()))
}

fn pool_entries(state: &Path, dir: &str) -> impl Iterator<Item = std::fs::DirEntry> {
    std::fs::read_dir(state.join("pool").join(dir)).into_iter().flatten().filter_map(Result::ok)
}

/// The UUIDs of the images in `state`'s pool.
fn image_uuids(state: &Path) -> Vec<String> {
    pool_entries(state, "images").filter_map(|e| subvolume_field(&e.path(), "UUID:")).collect()
}

/// A spare root in `state`'s pool made of one of the images `parents`, if any.
fn spare_of(state: &Path, parents: &[String]) -> Option<String> {
    pool_entries(state, "boxes").filter(|e| e.file_name().to_string_lossy().starts_with("spare-")).find_map(|e| {
        let parent = subvolume_field(&e.path(), "Parent UUID:")?;
        parents.contains(&parent).then(|| e.file_name().to_string_lossy().into_owned())
    })
}

/// What the pool holds that a pull is making (none once it ended).
fn partials(env: &Env) -> Vec<String> {
    let layers = env.daemon.state_dir.join("pool/layers");
    let mut found: Vec<String> = std::fs::read_dir(layers)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with('.'))
        .collect();
    let blobs = env.daemon.state_dir.join("pool/blobs");
    found.extend(
        std::fs::read_dir(blobs)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().into_string().ok()),
    );
    found
}

pub fn pull_login_new_and_hostile_images(env: &Env) {
    let work = env.dir.join(unique("images"));
    std::fs::create_dir_all(&work).unwrap();
    let registry = Registry::start(&env.net, &work.join("registry"), PORT);
    let layout = make_tiny(&work, "pull");
    let amd64 = make_multi(&layout);
    make_liar(&work, &layout);
    make_nouser_and_bare(&work, &layout);
    registry.push(&layout, "tiny", "moat/tiny");
    registry.push(&layout, "multi", "moat/multi");
    registry.push(&layout, "liar", "moat/liar");
    registry.push(&layout, "nouser", "moat/tiny");
    registry.push(&layout, "bare", "moat/bare");
    let host = format!("registry.test:{PORT}");

    // No login: one line saying what to do.
    let out = env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:tiny")]);
    assert_ne!(out.status, Some(0));
    assert!(one_error(&out).contains("asks for a login"), "{}", out.stderr);
    let ran = login(env, &host, "wrong-password");
    assert_eq!(ran.status, Some(0), "{}", ran.stderr);
    let out = env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:tiny")]);
    assert!(out.stderr.contains("refused the login"), "{}", out.stderr);
    let ran = login(env, &host, PASSWORD);
    assert_eq!(ran.status, Some(0), "{}", ran.stderr);
    assert!(!ran.stdout.contains(PASSWORD) && !ran.stderr.contains(PASSWORD));

    // A multi-platform index resolves to linux/amd64; progress streams.
    let out = env.alice(None, &["image", "pull", &format!("{host}/moat/multi:multi"), "--as", "multi"]).ok();
    assert!(out.stdout.contains(&amd64), "{}", out.stdout);
    assert!(out.stderr.contains("layer 1/2") && out.stderr.contains("unpacking"), "{}", out.stderr);
    // The same image by tag shares every layer; by digest, the same image.
    let out = env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:tiny")]).ok();
    assert!(
        out.stderr.contains("layer 1/2") && out.stderr.contains("have it") && !out.stderr.contains("unpacking"),
        "{}",
        out.stderr
    );
    let out = env.alice(None, &["image", "pull", &format!("{host}/moat/tiny@{amd64}"), "--as", "pinned"]).ok();
    assert!(out.stdout.contains(&amd64), "{}", out.stdout);
    let listed: serde_json::Value =
        serde_json::from_str(&env.alice(None, &["image", "ls", "--json"]).ok().stdout).unwrap();
    let names: Vec<&str> = listed.as_array().unwrap().iter().filter_map(|i| i["name"].as_str()).collect();
    assert!(names.contains(&"multi") && names.contains(&"tiny-tiny") && names.contains(&"pinned"), "{listed}");
    // Another account sees none of them, and cannot make a box of one.
    let bobs = crate::fixture::run(&mut env.daemon.ssh(&env.bob, None, &["image", "ls", "--json"])).ok().stdout;
    assert_eq!(bobs.trim(), "[]");
    let b = unique("img");
    let out = crate::fixture::run(&mut env.daemon.ssh(&env.bob, None, &["new", &b, "--image", "multi"]));
    assert!(out.stderr.contains("no image named multi"), "{}", out.stderr);

    // A box of it has the image's files as the image says, and its sessions
    // the image's Env, WorkingDir and User.
    let a = unique("img");
    env.alice(None, &["new", &a, "--image", "tiny-tiny"]).ok();
    let session =
        env.alice(Some(&a), &["echo $GREETING; pwd; id -u; id -g; echo $HOME; env | grep -c MOAT_IMAGE"]).stdout;
    assert_eq!(session.lines().collect::<Vec<_>>(), ["hi", "/srv", "1000", "1000", "/home/app", "0"], "{session}");
    // A template: the box's files as of now, new boxes from it, the image's
    // session settings kept, each copy its own.
    env.alice(Some(&a), &["echo made in the box > /tmp/made"]).ok();
    env.alice(None, &["image", "save", &a, "tpl"]).ok();
    env.alice(Some(&a), &["echo changed after the save > /tmp/made"]).ok();
    let c = unique("img");
    env.alice(None, &["new", &c, "--image", "tpl"]).ok();
    let from_tpl = env.alice(Some(&c), &["cat /tmp/made; id -u; pwd; echo $GREETING"]).ok().stdout;
    assert_eq!(from_tpl.lines().collect::<Vec<_>>(), ["made in the box", "1000", "/srv", "hi"], "{from_tpl}");
    env.alice(Some(&c), &["echo mine > /tmp/made"]).ok();
    let d = unique("img");
    env.alice(None, &["new", &d, "--image", "tpl"]).ok();
    assert_eq!(env.alice(Some(&d), &["cat /tmp/made"]).ok().stdout.trim(), "made in the box");
    let bobs = crate::fixture::run(&mut env.daemon.ssh(&env.bob, None, &["new", &unique("img"), "--image", "tpl"]));
    assert!(bobs.stderr.contains("no image named tpl"), "{}", bobs.stderr);
    for name in [&c, &d] {
        env.alice(None, &["rm", name]).ok();
    }
    let state = &env.daemon.state_dir;
    let images_before = image_uuids(state);
    env.alice(None, &["image", "rm", "tpl"]).ok();
    // Its spare roots (snapshots made ahead for its next box) go with it.
    let gone: Vec<String> = images_before.into_iter().filter(|u| !image_uuids(state).contains(u)).collect();
    assert_eq!(gone.len(), 1, "image rm removed {} image subvolumes", gone.len());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while let Some(orphan) = spare_of(state, &gone) {
        assert!(std::time::Instant::now() < deadline, "spare root {orphan} outlived its image");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // A User the image has no line for: one line at `new`, no box.
    env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:nouser")]).ok();
    let nobody = unique("img");
    let out = env.alice(None, &["new", &nobody, "--image", "tiny-nouser"]);
    assert!(one_error(&out).contains("\"nosuch\", which its /etc/passwd does not have"), "{}", out.stderr);
    assert!(!env.alice(None, &["ls"]).ok().stdout.contains(&nobody));
    // An image without a shell still runs its own programs.
    env.alice(None, &["image", "pull", &format!("{host}/moat/bare:bare")]).ok();
    let bare = unique("img");
    env.alice(None, &["new", &bare, "--image", "bare-bare"]).ok();
    let said = env.alice(Some(&bare), &["busybox echo no shell here"]).ok().stdout;
    assert_eq!(said.trim(), "no shell here");
    env.alice(None, &["rm", &bare]).ok();
    let files = env
        .alice(
            Some(&a),
            &["cat /hello; test ! -e /gone && echo gone; cat /srv/top; stat -c '%i' /hello /hello2; stat -c '%a %u:%g' /bin/suid /home/app/mine"],
        )
        .ok()
        .stdout;
    let lines: Vec<&str> = files.lines().collect();
    assert_eq!(lines[..3], ["hello from a pulled image", "gone", "second layer"], "{files}");
    assert_eq!(lines[3], lines[4], "a hard link: {files}");
    assert_eq!(lines[5..], ["4755 0:0", "644 1000:1000"], "{files}");
    // The file capability is on the image's file (read from the host).
    let pool_images = env.daemon.state_dir.join("pool/images");
    let key = std::fs::read_dir(&pool_images)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.join("bin/capped").exists())
        .unwrap();
    let caps = run_ok(Command::new("getcap").arg(key.join("bin/capped")));
    assert!(caps.contains("cap_net_bind_service"), "{caps}");
    // The pool's key of alice's image is no name bob's `new` takes.
    let key_name = key.file_name().unwrap().to_string_lossy().into_owned();
    let out = crate::fixture::run(&mut env.daemon.ssh(&env.bob, None, &["new", &b, "--image", &key_name]));
    assert!(out.stderr.contains("no image named"), "{}", out.stderr);

    // A layer unlike its config's diff id: refused, nothing kept.
    let out = env.alice(None, &["image", "pull", &format!("{host}/moat/liar:liar")]);
    assert_ne!(out.status, Some(0));
    assert!(one_error(&out).contains("not the config's diff id"), "{}", out.stderr);
    assert!(partials(env).is_empty(), "{:?}", partials(env));
    let listed = env.alice(None, &["image", "ls"]).ok().stdout;
    assert!(!listed.contains("liar"), "{listed}");
    // A digest the registry does not have.
    let wrong = format!("sha256:{}", "0".repeat(64));
    let out = env.alice(None, &["image", "pull", &format!("{host}/moat/tiny@{wrong}")]);
    assert_ne!(out.status, Some(0));
    assert!(one_error(&out).contains("404"), "{}", out.stderr);

    // rm: the image goes; the box keeps its files.
    env.alice(None, &["image", "rm", "tiny-tiny"]).ok();
    assert!(!env.alice(None, &["image", "ls"]).ok().stdout.contains("tiny-tiny"));
    env.alice(Some(&a), &["cat /hello"]).ok();
    env.alice(None, &["rm", &a]).ok();
    for name in ["multi", "pinned", "tiny-nouser", "bare-bare"] {
        env.alice(None, &["image", "rm", name]).ok();
    }
    drop(registry);
}

/// A registry that lies (testnet/hostile_registry.py) on the test internet;
/// killed on drop.
struct Hostile {
    child: Child,
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn hostile_registries_are_refused_and_leave_nothing(env: &Env) {
    let work = env.dir.join(unique("hostile"));
    std::fs::create_dir_all(&work).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/testnet/hostile_registry.py");
    let mut child = Command::new("ip")
        .args(["netns", "exec", &env.net.name, "python3"])
        .arg(script)
        .args([WEB, "5001"])
        .arg(env.net.dir.join("web.pem"))
        .arg(env.net.dir.join("web.key"))
        .arg(&work)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut ready).unwrap();
    let _hostile = Hostile { child };
    assert_eq!(ready.trim(), "ready");
    let pull = |repo: &str| {
        env.alice(None, &["image", "pull", &format!("registry.test:5001/{repo}"), "--as", &format!("h-{repo}")])
    };

    // The control, and a blob served from another host the registry named.
    pull("good").ok();
    let out = pull("redirect").ok();
    assert!(out.stdout.contains("h-redirect"), "{}", out.stdout);
    let log = std::fs::read_to_string(work.join("hostile.log")).unwrap();
    assert!(log.contains("GET other.test /storage/"), "{log}");
    for (repo, why) in [
        ("insecure", "only https"),
        ("inward", "127.0.0.1"),
        ("wrong", "does not match its digest"),
        ("stall", "stalled"),
        ("endless", "is over"),
        ("bomb", "unpacks to more than"),
        ("escape", "escapes the image"),
        // Each layer alone is under the bound; the image is not.
        ("zeros", "unpacks to more than"),
        // The tar crate reads a long name whole: the unpacker's heap is bounded.
        ("longname", "out of memory"),
    ] {
        let t = std::time::Instant::now();
        let out = pull(repo);
        assert_ne!(out.status, Some(0), "{repo}");
        let line = one_error(&out);
        assert!(line.contains(why), "{repo}: {line}");
        assert!(t.elapsed().as_secs() < 30, "{repo} took {:?}", t.elapsed());
        assert!(partials(env).is_empty(), "{repo} left {:?}", partials(env));
    }
    // A registry that trickles (a byte a second, under the 3 s stall bound)
    // is told as too slow; meanwhile the account's next pull waits its turn
    // (and goes when the trickle ends), and another account's pulls go on.
    let trickle = std::thread::scope(|scope| {
        let ended = |repo| move || (pull(repo), std::time::Instant::now());
        let trickle = scope.spawn(ended("trickle"));
        std::thread::sleep(std::time::Duration::from_secs(2));
        let again = scope.spawn(ended("good"));
        let t = std::time::Instant::now();
        let bobs =
            run(&mut env.daemon.ssh(&env.bob, None, &["image", "pull", "registry.test:5001/good", "--as", "h-bob"]));
        assert_eq!(bobs.status, Some(0), "{}", bobs.stderr);
        assert!(t.elapsed().as_secs() < 20, "bob's pull waited {:?} behind alice's", t.elapsed());
        let (trickle, trickle_ended) = trickle.join().unwrap();
        let (again, again_ended) = again.join().unwrap();
        assert_eq!(again.status, Some(0), "{}", again.stderr);
        assert!(again_ended > trickle_ended, "alice's second pull did not wait for her first");
        trickle
    });
    assert_ne!(trickle.status, Some(0));
    assert!(one_error(&trickle).contains("too slow"), "{}", trickle.stderr);
    assert!(partials(env).is_empty(), "trickle left {:?}", partials(env));
    run(&mut env.daemon.ssh(&env.bob, None, &["image", "rm", "h-bob"])).ok();
    let listed = env.alice(None, &["image", "ls"]).ok().stdout;
    let names: Vec<&str> =
        listed.lines().skip(1).filter_map(|l| l.split_whitespace().next()).filter(|n| n.starts_with("h-")).collect();
    assert_eq!(names, ["h-good", "h-redirect"], "{listed}");
    for name in names {
        env.alice(None, &["image", "rm", name]).ok();
    }
}

/// Tags `nouser` (tiny run as a user it has no line for) and `bare` (one
/// static binary, no shell).
fn make_nouser_and_bare(work: &Path, layout: &Path) {
    let image = format!("{}:tiny", layout.display());
    umoci(&["config", "--image", &image, "--tag", "nouser", "--config.user", "nosuch"]);
    let bundle = work.join("bare");
    let bare = format!("{}:bare", layout.display());
    umoci(&["new", "--image", &bare]);
    umoci(&["unpack", "--image", &bare, &bundle.display().to_string()]);
    std::fs::create_dir_all(bundle.join("rootfs/bin")).unwrap();
    std::fs::copy("/bin/busybox", bundle.join("rootfs/bin/busybox")).unwrap();
    umoci(&["repack", "--image", &bare, &bundle.display().to_string()]);
    std::fs::remove_dir_all(&bundle).unwrap();
}
