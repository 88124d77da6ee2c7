//! `image push`: a template written to a real registry (Debian's
//! docker-registry) as an OCI image of its base's layers (mounted from the
//! repository they were pulled from, never sent) and one layer of what the
//! box added, changed and deleted; pulled back by digest, it makes a box
//! with the template's files and the base image's settings.

use crate::fixture::unique;
use crate::images::{login, make_tiny, one_error, umoci, Registry, PASSWORD};
use crate::Env;

/// This test's registry's port on the test internet.
const PORT: u16 = 5013;

pub fn push_sends_what_a_template_adds_and_pulls_back(env: &Env) {
    let work = env.dir.join(unique("push"));
    std::fs::create_dir_all(&work).unwrap();
    let registry = Registry::start(&env.net, &work.join("registry"), PORT);
    let layout = make_tiny(&work, "push");
    // Root's, so that the box can change the image's files.
    umoci(&["config", "--image", &format!("{}:tiny", layout.display()), "--tag", "rooted", "--config.user", "0"]);
    registry.push(&layout, "rooted", "moat/tiny");
    let host = format!("registry.test:{PORT}");
    let ran = login(env, &host, PASSWORD);
    assert_eq!(ran.status, Some(0), "{}", ran.stderr);
    env.alice(None, &["image", "pull", &format!("{host}/moat/tiny:rooted"), "--as", "ptiny"]).ok();

    // A box of it adds a file, changes one, deletes one and a directory,
    // and rewrites one keeping its size and mtime (as npm's 1985 mtimes do).
    let web = unique("push");
    env.alice(None, &["new", &web, "--image", "ptiny"]).ok();
    env.alice(
        Some(&web),
        &["echo added by the box > /srv/added && echo changed > /srv/top && rm /hello2 && rm -r /home/app \
           && m=$(stat -c %Y /hello) && echo HELLO FROM A PULLED IMAGE > /hello && busybox touch -d @$m /hello"],
    )
    .ok();
    env.alice(None, &["image", "save", &web, "ptpl"]).ok();

    // Pushed to another repository: the base's layers are mounted, one layer is sent.
    let out = env.alice(None, &["image", "push", "ptpl", &format!("{host}/moat/mine:v1")]).ok();
    let pushed = out.stdout.trim();
    assert!(pushed.starts_with(&format!("pushed {host}/moat/mine:v1 (sha256:")), "{}{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("layer 1/3") && out.stderr.contains("mounted from moat/tiny"), "{}", out.stderr);
    assert!(out.stderr.contains("layer 3/3") && out.stderr.contains("what ptpl adds"), "{}", out.stderr);
    let digest = pushed.rsplit('(').next().unwrap().trim_end_matches(')').to_string();
    // Again: every blob is there already.
    let again = env.alice(None, &["image", "push", "ptpl", &format!("{host}/moat/mine:v2")]).ok();
    assert_eq!(again.stderr.matches("there already").count(), 4, "{}", again.stderr);

    // Pulled back by digest: the template's files, the base's settings.
    env.alice(None, &["image", "pull", &format!("{host}/moat/mine@{digest}"), "--as", "back"]).ok();
    let back = unique("push");
    env.alice(None, &["new", &back, "--image", "back"]).ok();
    let seen = env
        .alice(
            Some(&back),
            &["cat /srv/added /srv/top; test -e /hello2 || echo no hello2; test -e /home/app || echo no app; cat /hello; id -u; pwd; echo $GREETING"],
        )
        .ok()
        .stdout;
    assert_eq!(
        seen.lines().collect::<Vec<_>>(),
        ["added by the box", "changed", "no hello2", "no app", "HELLO FROM A PULLED IMAGE", "0", "/srv", "hi"],
        "{seen}"
    );

    // A push to a digest, of no image, or of a base the registry cannot mount: one line each.
    let out = env.alice(None, &["image", "push", "ptpl", &format!("{host}/moat/mine@{digest}")]);
    assert!(one_error(&out).contains("not to a digest"), "{}", out.stderr);
    let out = env.alice(None, &["image", "push", "nosuch", &format!("{host}/moat/mine:v3")]);
    assert!(one_error(&out).contains("no image named nosuch"), "{}", out.stderr);
    for name in [&web, &back] {
        env.alice(None, &["rm", name]).ok();
    }
    for image in ["ptiny", "ptpl", "back"] {
        env.alice(None, &["image", "rm", image]).ok();
    }
    drop(registry);
}
