//! Durable boxes against a real S3 server (SeaweedFS on loopback) and a real
//! btrfs filesystem (a loop device): a full upload, an incremental, a restore
//! with every file, and a corrupted object refused; images each way; and a
//! box streamed node to node (no S3 there). Root only (btrfs, loop devices).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use moat_box::sys;
use moat_core::ids::BoxId;
use moat_core::store::durable::DurableLink;
use moat_core::store::Store;
use moat_durable::{restore_box, DurableError, ObjectStoreConfig, Uploader};
use moat_testkit::SeaweedFs;

/// A btrfs filesystem on a loop device, unmounted on drop.
struct Btrfs {
    dir: tempfile::TempDir,
}

impl Btrfs {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("pool.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        run(Command::new("truncate").arg("-s").arg("512M").arg(&img));
        run(Command::new("mkfs.btrfs").arg("-q").arg(&img));
        run(Command::new("mount").arg("-o").arg("loop").arg(&img).arg(&mnt));
        Self { dir }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }
}

impl Drop for Btrfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.root()).status();
    }
}

fn run(cmd: &mut Command) {
    let status = cmd.status().unwrap();
    assert!(status.success(), "{cmd:?}: {status}");
}

/// Every file under `root`: its path, and its contents (or link target).
fn tree(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let t = e.file_type().unwrap();
            if t.is_symlink() {
                out.insert(rel, std::fs::read_link(&path).unwrap().into_os_string().into_encoded_bytes());
            } else if t.is_dir() {
                out.insert(rel + "/", Vec::new());
                stack.push(path);
            } else {
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// What the object store tests start from: a real SeaweedFS with a bucket
/// `moat`, a btrfs pool holding `dirs`, a state store, and an uploader from
/// that pool to `s3://moat/PREFIX`. Dropped in field order: the pool first.
struct Rig {
    fs: Btrfs,
    store: Store,
    client: Arc<dyn object_store::ObjectStore>,
    up: Uploader,
    _state: tempfile::TempDir,
    _s3: SeaweedFs,
}

fn rig(prefix: &str, dirs: &[&str], full_every: u64) -> Rig {
    assert!(is_root(), "this test needs root (btrfs on a loop device)");
    let s3 = SeaweedFs::start();
    s3.create_bucket("moat");
    let fs = Btrfs::new();
    for d in dirs {
        std::fs::create_dir(fs.root().join(d)).unwrap();
    }
    let state = tempfile::tempdir().unwrap();
    let store = Store::open(&state.path().join("moat.db")).unwrap();
    let url = format!("s3://moat/{prefix}");
    let config = ObjectStoreConfig::new_with_keys(&url, Some(s3.endpoint()), None, "any", "any").unwrap();
    let client = config.client().unwrap();
    let up = Uploader {
        store: Arc::clone(&client),
        prefix: config.prefix.clone(),
        snapshots: fs.root().join("durable"),
        full_every,
        node: "n1".into(),
    };
    Rig { fs, store, client, up, _state: state, _s3: s3 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_box_uploads_full_then_incremental_restores_with_every_file_and_a_corrupt_object_is_refused() {
    let rig = rig("fleet1", &["boxes", "durable"], 4);
    let (pool, store, client, up) = (rig.fs.root(), &rig.store, &rig.client, &rig.up);
    let id = BoxId::random();
    sys::subvolume_create(&pool.join("boxes"), id.as_str()).unwrap();
    let root = pool.join("boxes").join(id.as_str());
    std::fs::create_dir_all(root.join("home/agent/src")).unwrap();
    std::fs::write(root.join("home/agent/src/main.rs"), "fn main() {}\n").unwrap();
    std::fs::write(root.join("big"), vec![7u8; 20 << 20]).unwrap();
    std::os::unix::fs::symlink("home/agent", root.join("link")).unwrap();

    // A full stream first.
    assert!(up.changed(&id, &root, None).unwrap());
    let full = up.upload(&id, &root, &[]).await.unwrap();
    assert_eq!((full.link.seq, full.link.parent_seq), (0, None));
    assert!(full.link.key.starts_with(&format!("fleet1/boxes/{id}/0000000000-full-")), "{}", full.link.key);
    assert!(full.raw_bytes > 20 << 20 && full.link.bytes < 1 << 20, "{full:?}");
    store.add_durable_link(&full.link).unwrap();
    up.prune(&id, Some(&full.link.snapshot));
    let links = store.durable_links(&id).unwrap();
    assert!(!up.changed(&id, &root, links.last()).unwrap(), "nothing was written since");

    // A checkpoint (as the pool saves one: a read-only snapshot), sent as
    // the next link, carrying its label and its time.
    let checkpoints = pool.join("checkpoints");
    std::fs::create_dir(&checkpoints).unwrap();
    std::fs::write(root.join("at-c1"), "c1").unwrap();
    sys::subvolume_snapshot(&root, &checkpoints, "c1", true).unwrap();
    let c1 = up.upload_checkpoint(&id, (&checkpoints.join("c1"), "c1", 1234), &links).await.unwrap();
    assert_eq!((c1.link.seq, c1.link.parent_seq, c1.link.checkpoint.as_deref()), (1, Some(0), Some("c1")));
    assert_eq!(c1.link.taken_at_ms, 1234, "a checkpoint is as of when it was saved");
    store.add_durable_link(&c1.link).unwrap();
    up.prune(&id, Some(&c1.link.snapshot));
    let links = store.durable_links(&id).unwrap();
    assert!(up.changed(&id, &root, links.last()).unwrap(), "a checkpoint's link says nothing of the root");

    // Then an incremental of what changed.
    std::fs::remove_file(root.join("at-c1")).unwrap();
    std::fs::write(root.join("home/agent/src/lib.rs"), "pub fn f() {}\n").unwrap();
    std::fs::remove_file(root.join("big")).unwrap();
    std::fs::write(root.join("notes"), vec![1u8; 3 << 20]).unwrap();
    assert!(up.changed(&id, &root, links.last()).unwrap());
    let incr = up.upload(&id, &root, &links).await.unwrap();
    assert_eq!((incr.link.seq, incr.link.parent_seq, incr.link.checkpoint.as_deref()), (2, Some(1), None));
    assert!(incr.raw_bytes < full.raw_bytes / 2, "an incremental carries only the change: {incr:?}");
    store.add_durable_link(&incr.link).unwrap();
    up.prune(&id, Some(&incr.link.snapshot));
    let kept: Vec<_> = std::fs::read_dir(up.box_dir(&id)).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(kept, [std::ffi::OsString::from(&incr.link.snapshot)], "only the next parent is kept");
    let links = store.durable_links(&id).unwrap();
    assert_eq!(links.len(), 3);

    // Restored (on another node: its uploader keeps its snapshots
    // elsewhere), the box has every file, and its root is writable; its
    // checkpoint comes back as it was saved.
    let staging = pool.join("durable");
    let there = Uploader {
        store: Arc::clone(client),
        prefix: up.prefix.clone(),
        snapshots: pool.join("durable-n2"),
        full_every: 4,
        node: "n2".into(),
    };
    std::fs::create_dir_all(there.box_dir(&id)).unwrap();
    let head_there = there.box_dir(&id).join(&incr.link.snapshot);
    let (mut charged, mut kept) = (Vec::new(), Vec::new());
    let into = (pool.join("boxes"), "restored");
    let restored = restore_box(client, &links, &staging, (&into.0, into.1), Some(&there.box_dir(&id)), |received| {
        charged = received.subvolumes.clone();
        for (label, subvolume, saved_ms) in &received.checkpoints {
            kept.push((label.clone(), tree(subvolume), *saved_ms));
        }
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(restored.as_of_ms, incr.link.taken_at_ms);
    assert_eq!(charged.len(), 3, "every received subvolume is charged to the box");
    assert_eq!(tree(&restored.root), tree(&root));
    assert_eq!(kept, [("c1".to_string(), tree(&checkpoints.join("c1")), 1234)]);
    assert!(tree(&checkpoints.join("c1")).contains_key("at-c1") && !tree(&root).contains_key("at-c1"));
    std::fs::write(restored.root.join("written-after"), "ok").unwrap();
    assert!(sys::subvolume_id(&restored.root).unwrap() != sys::subvolume_id(&root).unwrap());

    // That node kept what it received of the head: its next upload is an
    // incremental against it (not the whole box again), and the chain,
    // restored once more, has the change.
    assert!(head_there.is_dir(), "the received head is kept as the head link's snapshot");
    assert!(there.changed(&id, &restored.root, links.last()).unwrap());
    let after = there.upload(&id, &restored.root, &links).await.unwrap();
    assert_eq!((after.link.seq, after.link.parent_seq), (3, Some(2)), "an incremental: {after:?}");
    assert!(after.raw_bytes < 1 << 20, "it carries only the change: {after:?}");
    store.add_durable_link(&after.link).unwrap();
    there.prune(&id, Some(&after.link.snapshot));
    let moved_links = store.durable_links(&id).unwrap();
    let again = restore_box(client, &moved_links, &staging, (&pool.join("boxes"), "after-move"), None, |_| Ok(()))
        .await
        .unwrap();
    assert_eq!(tree(&again.root), tree(&restored.root));
    assert_eq!(std::fs::read(again.root.join("written-after")).unwrap(), b"ok");
    let left: Vec<_> = std::fs::read_dir(&staging)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("incoming-"))
        .collect();
    assert!(left.is_empty(), "the staging dir is gone: {left:?}");

    // A corrupted object (one byte flipped) is refused before anything is received.
    let key = object_store::path::Path::from(links[2].key.as_str());
    let mut bytes = client.get(&key).await.unwrap().bytes().await.unwrap().to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    client.put(&key, bytes.into()).await.unwrap();
    let err =
        restore_box(client, &links, &staging, (&pool.join("boxes"), "again"), None, |_| Ok(())).await.unwrap_err();
    assert!(matches!(err, DurableError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("is corrupt") && err.to_string().contains("nothing was received"), "{err}");
    assert!(!pool.join("boxes/again").exists());
    let left = std::fs::read_dir(&staging)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("incoming-"));
    assert_eq!(left.count(), 0, "nothing is left behind");
}

/// The keys under `prefix`.
async fn keys(client: &Arc<dyn object_store::ObjectStore>, prefix: &str) -> Vec<String> {
    use futures::TryStreamExt;
    let listed: Vec<object_store::ObjectMeta> =
        client.list(Some(&object_store::path::Path::from(prefix))).try_collect().await.unwrap();
    let mut keys: Vec<String> = listed.into_iter().map(|m| m.location.to_string()).collect();
    keys.sort();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_deletes_what_no_record_needs_and_never_what_one_names() {
    use moat_core::{AccountId, BackendKind, Limits, Name};
    use moat_durable::gc;
    let rig = rig("gc", &["boxes", "durable", "staging"], 2);
    let (pool, store, client, up) = (rig.fs.root(), &rig.store, &rig.client, &rig.up);
    let made = (&Name::new("debian").unwrap(), Limits::default(), BackendKind::Ns);
    let live =
        store.insert_new(&AccountId("a".into()), &Name::new("live").unwrap(), made, 1, &Default::default()).unwrap().id;
    let gone = BoxId::random();
    for id in [&live, &gone] {
        sys::subvolume_create(&pool.join("boxes"), id.as_str()).unwrap();
    }
    let root = |id: &BoxId| pool.join("boxes").join(id.as_str());
    // live: full, checkpoint c1's link, full (full_every 2), incremental;
    // gone: one full, then removed.
    let checkpoints = pool.join("checkpoints");
    std::fs::create_dir(&checkpoints).unwrap();
    for (i, id) in [&live, &live, &live, &live, &gone].into_iter().enumerate() {
        std::fs::write(root(id).join(format!("f{i}")), format!("{i}")).unwrap();
        let links = store.durable_links(id).unwrap();
        let made = if i == 1 {
            sys::subvolume_snapshot(&root(id), &checkpoints, "c1", true).unwrap();
            up.upload_checkpoint(id, (&checkpoints.join("c1"), "c1", 5), &links).await.unwrap()
        } else {
            up.upload(id, &root(id), &links).await.unwrap()
        };
        store.add_durable_link(&made.link).unwrap();
        up.prune(id, Some(&made.link.snapshot));
    }
    let links = store.durable_links(&live).unwrap();
    assert_eq!(links.iter().map(|l| l.parent_seq.is_none()).collect::<Vec<_>>(), [true, false, true, false]);

    // A checkpoint's link keeps its run (the full before it) while it exists.
    let done = gc::collect(client, "gc", store, std::time::Duration::from_secs(3600)).await.unwrap();
    assert_eq!(done.objects, 1, "only gone's object: {done:?}");
    assert_eq!(store.durable_links(&live).unwrap(), links);
    let (staging, boxes) = (pool.join("staging"), pool.join("boxes"));
    let mut c1_back = Vec::new();
    restore_box(client, &links, &staging, (&boxes, "c1-back"), None, |r| {
        c1_back = r.checkpoints.iter().map(|(label, subvolume, _)| (label.clone(), tree(subvolume))).collect();
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(c1_back, [("c1".to_string(), tree(&checkpoints.join("c1")))]);
    store.forget_durable_checkpoint(&live, "c1").unwrap();
    let links = store.durable_links(&live).unwrap();
    let stray = format!("gc/boxes/{live}/0000000009-full-cut-short.btrfs.zst");
    client.put(&object_store::path::Path::from(stray.as_str()), vec![1u8; 10].into()).await.unwrap();
    let not_ours = "gc/boxes/not-a-box-id/x";
    client.put(&object_store::path::Path::from(not_ours), vec![1u8; 10].into()).await.unwrap();

    // The checkpoint gone, its run is garbage. A young unnamed object may be
    // an upload about to be recorded: kept.
    let done = gc::collect(client, "gc", store, std::time::Duration::from_secs(3600)).await.unwrap();
    assert_eq!(done.objects, 2, "live's two links before its newest full: {done:?}");
    let head = [links[2].key.clone(), links[3].key.clone()];
    assert_eq!(keys(client, &format!("gc/boxes/{live}")).await, [&head[..], std::slice::from_ref(&stray)].concat());
    assert!(keys(client, &format!("gc/boxes/{gone}")).await.is_empty());
    assert!(store.durable_links(&gone).unwrap().is_empty());
    assert_eq!(store.durable_links(&live).unwrap(), links[2..], "the rows went with the objects");
    assert_eq!(keys(client, "gc/boxes/not-a-box-id").await, [not_ours], "a key naming no box is not moat's");

    // Old enough: the stray goes; what the record names never does.
    let done = gc::collect(client, "gc", store, std::time::Duration::ZERO).await.unwrap();
    assert_eq!(done.objects, 1);
    assert_eq!(keys(client, &format!("gc/boxes/{live}")).await, head);
    let kept = store.durable_links(&live).unwrap();
    let back = restore_box(client, &kept, &pool.join("staging"), (&pool.join("boxes"), "back"), None, |_| Ok(())).await;
    let back = back.unwrap();
    let files: Vec<String> =
        (0..4).map(|i| std::fs::read_to_string(back.root.join(format!("f{i}"))).unwrap()).collect();
    assert_eq!(files, ["0", "1", "2", "3"], "the box restores whole from what was kept");

    // rm: everything of the box at once.
    let done = gc::forget_box(client, "gc", store, &live).await.unwrap();
    assert_eq!(done.objects, 2);
    assert!(keys(client, &format!("gc/boxes/{live}")).await.is_empty());
    assert!(store.durable_links(&live).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_goes_up_whole_comes_back_read_only_elsewhere_and_goes_when_no_one_uses_it() {
    use moat_core::store::images::StoredImage;
    use moat_core::{AccountId, Name};
    use moat_durable::{gc, images};
    let rig = rig("img", &["images", "durable", "staging", "elsewhere"], 4);
    let (pool, store, client, up) = (rig.fs.root(), &rig.store, &rig.client, &rig.up);
    // An image as a pull leaves it (a writable subvolume is sent too).
    let key = "oci-test1";
    sys::subvolume_create(&pool.join("images"), key).unwrap();
    let image = pool.join("images").join(key);
    std::fs::create_dir_all(image.join("usr/bin")).unwrap();
    std::fs::write(image.join("usr/bin/tool"), vec![3u8; 1 << 20]).unwrap();
    std::os::unix::fs::symlink("usr/bin", image.join("bin")).unwrap();

    let kept = images::upload_image(up, &pool.join("images"), key).await.unwrap();
    assert!(kept.object.starts_with("img/images/oci-test1-"), "{}", kept.object);
    assert_eq!(keys(client, "img/images").await, std::slice::from_ref(&kept.object));
    assert!(std::fs::read_dir(pool.join("durable/images")).unwrap().next().is_none(), "its snapshot is gone");
    assert!(store.add_durable_image(&kept).unwrap());
    assert!(images::upload_image(up, &pool.join("images"), "oci-none").await.is_err(), "no such image here");

    // Another node's pool: fetched, checked, kept read-only; staging empty.
    let elsewhere = pool.join("elsewhere");
    images::fetch_image(client, &kept, &pool.join("staging"), &elsewhere).await.unwrap();
    assert_eq!(tree(&elsewhere.join(key)), tree(&image));
    let written = std::fs::write(elsewhere.join(key).join("new"), "x");
    assert!(written.is_err(), "a fetched image is read-only");
    assert_eq!(std::fs::read_dir(pool.join("staging")).unwrap().count(), 0);

    // A corrupted object: refused, nothing kept.
    let object = object_store::path::Path::from(kept.object.as_str());
    let mut bytes = client.get(&object).await.unwrap().bytes().await.unwrap().to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    client.put(&object, bytes.into()).await.unwrap();
    let again = pool.join("again");
    let err = images::fetch_image(client, &kept, &pool.join("staging"), &again).await.unwrap_err();
    assert!(matches!(err, DurableError::Corrupt { .. }), "{err}");
    assert!(!again.join(key).exists());
    assert_eq!(std::fs::read_dir(pool.join("staging")).unwrap().count(), 0);

    // Used by an image of someone's: kept. Used by none: its record, then its object, go.
    let stored = StoredImage {
        account: AccountId("a".into()),
        name: Name::new("tool").unwrap(),
        key: Name::new(key).unwrap(),
        reference: "r/tool:1".into(),
        digest: "sha256:1".into(),
        layers: Vec::new(),
        config: "{}".into(),
        bytes: 1,
        created_ms: 1,
        base_manifest: String::new(),
        base_source: String::new(),
    };
    store.put_image(&stored).unwrap();
    let stray = "img/images/oci-test1-cut-short.btrfs.zst";
    client.put(&object_store::path::Path::from(stray), vec![1u8; 10].into()).await.unwrap();
    let hour = std::time::Duration::from_secs(3600);
    assert_eq!(gc::collect(client, "img", store, hour).await.unwrap().objects, 0, "a young stray may be an upload");
    assert_eq!(gc::collect(client, "img", store, std::time::Duration::ZERO).await.unwrap().objects, 1);
    assert_eq!(keys(client, "img/images").await, std::slice::from_ref(&kept.object));
    store.remove_image(&stored.account, &stored.name).unwrap();
    assert_eq!(gc::collect(client, "img", store, hour).await.unwrap().objects, 1);
    assert!(keys(client, "img/images").await.is_empty());
    assert_eq!(store.durable_image(key).unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_box_streamed_node_to_node_arrives_with_its_checkpoints_and_a_bad_stream_leaves_nothing() {
    use moat_durable::node_stream::{receive_parts, send_parts, Part, PartHeader};
    assert!(is_root(), "this test needs root (btrfs on a loop device)");
    let fs = Btrfs::new();
    let pool = fs.root();
    for d in ["boxes", "checkpoints", "durable", "staging", "target", "kept"] {
        std::fs::create_dir(pool.join(d)).unwrap();
    }
    sys::subvolume_create(&pool.join("boxes"), "b").unwrap();
    let root = pool.join("boxes/b");
    std::fs::write(root.join("first"), vec![5u8; 4 << 20]).unwrap();
    sys::subvolume_snapshot(&root, &pool.join("checkpoints"), "c1", true).unwrap();
    std::fs::write(root.join("second"), "after c1").unwrap();
    std::fs::remove_file(root.join("first")).unwrap();
    sys::subvolume_snapshot(&root, &pool.join("durable"), "head", true).unwrap();
    let parts = [
        Part { path: pool.join("checkpoints/c1"), header: PartHeader { checkpoint: Some("c1".into()), as_of_ms: 7 } },
        Part { path: pool.join("durable/head"), header: PartHeader { checkpoint: None, as_of_ms: 9 } },
    ];

    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    let sending = tokio::spawn(async move { send_parts(&parts, &mut a).await });
    let mut kept = Vec::new();
    let target = pool.join("target");
    let kept_in = pool.join("kept");
    let head = DurableLink {
        box_id: BoxId::random(),
        seq: 1,
        parent_seq: Some(0),
        key: String::new(),
        snapshot: "head".into(),
        sha256: String::new(),
        bytes: 0,
        taken_at_ms: 9,
        uploaded_at_ms: 9,
        node: "n1".into(),
        checkpoint: None,
    };
    let got = receive_parts(&mut b, &pool.join("staging"), (&target, "b"), Some((&kept_in, &head)), |received| {
        assert_eq!(received.subvolumes.len(), 2);
        for (label, subvolume, saved_ms) in &received.checkpoints {
            kept.push((label.clone(), tree(subvolume), *saved_ms));
        }
        Ok(())
    })
    .await
    .unwrap();
    assert!(sending.await.unwrap().unwrap() > 0);
    assert_eq!((got.as_of_ms, got.root.clone()), (9, target.join("b")));
    assert_eq!(tree(&got.root), tree(&root));
    assert_eq!(kept, [("c1".to_string(), tree(&pool.join("checkpoints/c1")), 7)]);
    std::fs::write(got.root.join("writable"), "yes").unwrap();
    assert_eq!(std::fs::read_dir(pool.join("staging")).unwrap().count(), 0, "staging is empty");
    assert_eq!(tree(&kept_in.join("head")), tree(&pool.join("durable/head")), "the root's part is kept where asked");
    sys::subvolume_delete(&kept_in, "head").unwrap();

    // A root that is not the last upload it should be (another name) is
    // refused, and nothing of it is kept.
    let other = DurableLink { snapshot: "other".into(), ..head.clone() };
    let again = [Part { path: pool.join("durable/head"), header: PartHeader { checkpoint: None, as_of_ms: 9 } }];
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move { send_parts(&again, &mut a).await });
    let err = receive_parts(&mut b, &pool.join("staging"), (&target, "b2"), Some((&kept_in, &other)), |_| Ok(()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not as its last upload other"), "{err}");
    assert!(!target.join("b2").exists());
    assert_eq!(std::fs::read_dir(&kept_in).unwrap().count(), 0, "nothing is kept of a root of another name");

    // A stream that is not one (a source that fails, or garbage): refused, nothing left.
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let _ = a.write_all(b"h\0\0\0\x02{}d\0\0\0\x05junk!e\0\0\0\0z\0\0\0\0").await;
    });
    let err = receive_parts(&mut b, &pool.join("staging"), (&target, "bad"), Some((&kept_in, &head)), |_| Ok(()))
        .await
        .unwrap_err();
    assert!(!err.to_string().is_empty());
    assert_eq!(std::fs::read_dir(&kept_in).unwrap().count(), 0, "nothing is kept of a bad stream");
    assert!(!target.join("bad").exists());
    assert_eq!(std::fs::read_dir(pool.join("staging")).unwrap().count(), 0, "staging is empty");
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    let missing = [Part { path: pool.join("nowhere"), header: PartHeader { checkpoint: None, as_of_ms: 1 } }];
    let sending = tokio::spawn(async move { send_parts(&missing, &mut a).await });
    let err = receive_parts(&mut b, &pool.join("staging"), (&target, "bad"), Some((&kept_in, &head)), |_| Ok(()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("could not send the box"), "{err}");
    assert_eq!(std::fs::read_dir(&kept_in).unwrap().count(), 0, "nothing is kept of a failed send");
    assert!(sending.await.unwrap().is_err());
    assert!(!target.join("bad").exists());
}
