//! A box streamed node to node, for a move between two live nodes: the
//! source sends `btrfs send` of each of the box's checkpoints and then of
//! its last uploaded snapshot (each an incremental against the one sent
//! before it), and the target receives them as a restore from the object
//! store would, without the object store's upload and download.
//!
//! On the connection (a fleet link: mutual TLS between members), frames of
//! a tag byte, a big-endian `u32` length and the bytes: `h` a part's header
//! (JSON), `d` its stream's data, `e` its end, `x` an error (its message),
//! `z` the end of the box. The receiver bounds every frame and the number
//! of parts before it allocates.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use moat_core::ids::BoxId;
use moat_core::store::durable::DurableLink;
use moat_core::{BoxManager, Received};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::restore::{root_of, Incoming, Restored};
use crate::worker::DurableWorker;
use crate::{btrfs, io_err, DurableError};

/// How a node reaches another to have a box streamed to it (the fleet's
/// links, set by the binary).
pub trait NodeLinks: Send + Sync {
    /// A connection to node `node` at `address` carrying box `id`'s parts
    /// (as [`send_parts`] writes them).
    fn open<'a>(&'a self, node: &'a str, address: &'a str, id: &'a BoxId) -> Opening<'a>;
}

/// A connection being opened by [`NodeLinks::open`].
pub type Opening<'a> = Pin<Box<dyn Future<Output = std::io::Result<Box<dyn AsyncRead + Unpin + Send>>> + Send + 'a>>;

/// The parts of box `id` to stream to node `to` for its move there: its
/// checkpoints, then its last uploaded snapshot (the source's side of the
/// move is done: the box held still, its last change uploaded). Refused
/// unless this node holds the box and a move of it to `to` is ready.
pub async fn parts_for_move(
    manager: &BoxManager,
    worker: &DurableWorker,
    to: &str,
    id: &BoxId,
) -> Result<Vec<Part>, DurableError> {
    let refused = |why: &str| Err(DurableError::Config(format!("box {id} is not sent to node {to}: {why}")));
    let config = |e: moat_core::ManagerError| DurableError::Config(e.to_string());
    let Some(mv) = manager.box_move(id).map_err(config)? else { return refused("it is moving nowhere") };
    if mv.to != to || mv.from != manager.node() || !mv.ready {
        return refused("no ready move of it from this node to that one");
    }
    let Some(head) = manager.durable_links(id).map_err(config)?.pop() else { return refused("it was never uploaded") };
    let snapshot = worker.uploader().box_dir(id).join(&head.snapshot);
    if head.checkpoint.is_some() || !snapshot.is_dir() {
        return refused("its last upload's snapshot is not here");
    }
    let mut parts: Vec<Part> = manager
        .checkpoints_here(id)
        .await
        .map_err(config)?
        .into_iter()
        .map(|c| Part {
            path: worker.dirs().checkpoints.join(id.as_str()).join(&c.label),
            header: PartHeader { checkpoint: Some(c.label), as_of_ms: c.created_ms },
        })
        .collect();
    parts.push(Part { path: snapshot, header: PartHeader { checkpoint: None, as_of_ms: head.taken_at_ms } });
    Ok(parts)
}

/// Largest data frame, and the size asked of the pipes to and from btrfs
/// (a default pipe holds 64 KiB: every read or write a wake-up).
const MAX_DATA: usize = 1 << 20;
/// Largest header frame.
const MAX_HEADER: usize = 64 << 10;
/// Most parts a box is sent in (its checkpoints and its root).
const MAX_PARTS: usize = 1024;
/// How long the source node may send nothing before the receive is given up
/// (and the box received from the object store instead).
const STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// What a part is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartHeader {
    /// The checkpoint it is (`None`: the box's root, the last part).
    pub checkpoint: Option<String>,
    /// As of when (a checkpoint's save, the root's last upload), ms.
    pub as_of_ms: u64,
}

/// One part to send: a read-only subvolume, and what it is.
#[derive(Debug, Clone)]
pub struct Part {
    /// The subvolume.
    pub path: PathBuf,
    /// What it is.
    pub header: PartHeader,
}

/// Writes one frame, in one write (a small head written alone would wait
/// on the peer's acknowledgement where Nagle's algorithm is on).
async fn frame<W: AsyncWrite + Unpin + ?Sized>(out: &mut W, tag: u8, bytes: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(bytes.len()).map_err(std::io::Error::other)?;
    let mut framed = Vec::with_capacity(5 + bytes.len());
    framed.push(tag);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(bytes);
    out.write_all(&framed).await
}

/// Sends `parts` (checkpoints oldest first, the root last) to `out`; the
/// stream bytes sent. A failure is told to the receiver too (`x`).
pub async fn send_parts<W: AsyncWrite + Unpin + ?Sized>(parts: &[Part], out: &mut W) -> Result<u64, DurableError> {
    let mut sent = 0;
    let mut parent: Option<PathBuf> = None;
    for part in parts {
        let header = serde_json::to_vec(&part.header).map_err(|e| DurableError::Config(e.to_string()))?;
        frame(out, b'h', &header).await.map_err(io_err("send a part's header"))?;
        match send_one(&part.path, parent.as_deref(), out).await {
            Ok(bytes) => sent += bytes,
            Err(e) => {
                let _ = frame(out, b'x', e.to_string().as_bytes()).await;
                return Err(e);
            }
        }
        frame(out, b'e', &[]).await.map_err(io_err("end a part"))?;
        parent = Some(part.path.clone());
    }
    frame(out, b'z', &[]).await.map_err(io_err("end the box"))?;
    out.flush().await.map_err(io_err("end the box"))?;
    Ok(sent)
}

/// `btrfs send` of `path` (against `parent`) as data frames.
async fn send_one<W: AsyncWrite + Unpin + ?Sized>(
    path: &Path,
    parent: Option<&Path>,
    out: &mut W,
) -> Result<u64, DurableError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
    let (path, parent) = (path.to_path_buf(), parent.map(Path::to_path_buf));
    let what = format!("btrfs send of {}", path.display());
    let sender = tokio::task::spawn_blocking(move || -> Result<(), DurableError> {
        use std::io::Read;
        let mut child = btrfs::send(&path, parent.as_deref())?;
        let mut stdout = child.stdout.take().ok_or_else(|| DurableError::Config("btrfs send: no stdout".into()))?;
        widen(&stdout);
        // One buffer (a pipe read is 64 KiB or so): each chunk a copy of what was read.
        let mut buf = vec![0u8; MAX_DATA];
        let read = loop {
            match stdout.read(&mut buf) {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    if tx.blocking_send(buf.get(..n).unwrap_or_default().to_vec()).is_err() {
                        break Err(std::io::Error::other("the connection ended"));
                    }
                }
                Err(e) => break Err(e),
            }
        };
        drop(stdout);
        if read.is_err() {
            let _ = child.kill();
        }
        let status = btrfs::finish(child, &what);
        read.map_err(io_err(what))?;
        status
    });
    let mut sent = 0u64;
    let mut failed = None;
    while let Some(chunk) = rx.recv().await {
        if let Err(e) = frame(out, b'd', &chunk).await {
            failed = Some(e);
            break;
        }
        sent += chunk.len() as u64;
    }
    drop(rx);
    let sent_all = sender.await.map_err(|e| DurableError::Config(format!("btrfs send panicked: {e}")))?;
    if let Some(e) = failed {
        return Err(io_err("send a box to another node")(e));
    }
    sent_all.map(|()| sent)
}

/// Reads one frame, bounded by `max`, within [`STALL`].
async fn read_frame<R: AsyncRead + Unpin>(input: &mut R, max: usize) -> Result<(u8, Vec<u8>), DurableError> {
    let stalled = || DurableError::Config(format!("the source node sent nothing for {} s", STALL.as_secs()));
    let mut head = [0u8; 5];
    tokio::time::timeout(STALL, input.read_exact(&mut head))
        .await
        .map_err(|_| stalled())?
        .map_err(io_err("read from the source node"))?;
    let [tag, a, b, c, d] = head;
    let len = u32::from_be_bytes([a, b, c, d]) as usize;
    if len > max {
        return Err(DurableError::Config(format!("the source node sent a frame of {len} bytes (at most {max})")));
    }
    let mut bytes = vec![0u8; len];
    tokio::time::timeout(STALL, input.read_exact(&mut bytes))
        .await
        .map_err(|_| stalled())?
        .map_err(io_err("read from the source node"))?;
    Ok((tag, bytes))
}

/// Receives a box sent by [`send_parts`] as `<parent>/<name>`, staging in
/// `staging`, as [`crate::restore_box`] does from the object store: the
/// root a writable snapshot of the last part, `adopt` called with what was
/// received before it is deleted (if it fails, the root goes too). With
/// `keep` (a directory and the box's newest link), the root's part is
/// received and kept in that directory, as [`crate::restore_box`] keeps its
/// head, if it says it is that link's (as of its time) and arrives under
/// that link's name; a root part of another name fails the receive. On any
/// failure nothing is left.
pub async fn receive_parts<R: AsyncRead + Unpin>(
    input: &mut R,
    staging: &Path,
    (parent, name): (&Path, &str),
    keep: Option<(&Path, &DurableLink)>,
    adopt: impl FnOnce(&Received) -> Result<(), DurableError>,
) -> Result<Restored, DurableError> {
    let mut incoming = Incoming::new(staging, name)?;
    let mut parts: Vec<(PartHeader, PathBuf)> = Vec::new();
    let mut fetched_bytes = 0;
    loop {
        let (tag, bytes) = read_frame(input, MAX_HEADER).await?;
        match tag {
            b'h' if parts.len() < MAX_PARTS => {
                let header: PartHeader = serde_json::from_slice(&bytes)
                    .map_err(|e| DurableError::Config(format!("the source node sent a bad part header: {e}")))?;
                let kept = keep.filter(|(_, head)| header.checkpoint.is_none() && header.as_of_ms == head.taken_at_ms);
                let dir = match kept {
                    Some((dir, _)) => incoming.keep_in(dir),
                    None => incoming.dir.join(parts.len().to_string()),
                };
                std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
                fetched_bytes += receive_one(input, &dir).await?;
                let received = only_subvolume(&dir)?;
                if let Some((dir, head)) = kept.filter(|(dir, head)| received != dir.join(&head.snapshot)) {
                    return Err(DurableError::Config(format!(
                        "the source node sent the root as {}, not as its last upload {} in {}",
                        received.display(),
                        head.snapshot,
                        dir.display()
                    )));
                }
                parts.push((header, received));
            }
            b'z' => break,
            b'x' => {
                let why = String::from_utf8_lossy(&bytes).into_owned();
                return Err(DurableError::Config(format!("the source node could not send the box: {why}")));
            }
            _ => return Err(DurableError::Config(format!("the source node sent an unexpected frame {tag:#x}"))),
        }
    }
    let Some((head, received)) = parts.last().filter(|(h, _)| h.checkpoint.is_none()) else {
        return Err(DurableError::Config("the source node sent no root".into()));
    };
    let subvolumes: Vec<(Option<String>, PathBuf, u64)> =
        parts.iter().map(|(h, p)| (h.checkpoint.clone(), p.clone(), h.as_of_ms)).collect();
    let root = root_of(received, &subvolumes, (parent, name), adopt)?;
    incoming.kept();
    Ok(Restored { root, as_of_ms: head.as_of_ms, fetched_bytes })
}

/// Feeds one part's data frames to `btrfs receive` into `dir`, until its end.
async fn receive_one<R: AsyncRead + Unpin>(input: &mut R, dir: &Path) -> Result<u64, DurableError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
    let into = dir.to_path_buf();
    let receiver = tokio::task::spawn_blocking(move || -> Result<(), DurableError> {
        use std::io::Write;
        let mut child = btrfs::receive(&into)?;
        let mut stdin = child.stdin.take().ok_or_else(|| DurableError::Config("btrfs receive: no stdin".into()))?;
        widen(&stdin);
        let mut fed = Ok(());
        let mut first = true;
        while let Some(chunk) = rx.blocking_recv() {
            if let Err(e) = stdin.write_all(&chunk) {
                fed = Err(e);
                break;
            }
            if std::mem::take(&mut first) && moat_core::fault::armed(MID_PART) {
                crash_once_begun(&into);
            }
        }
        drop(stdin);
        let what = format!("btrfs receive into {}", into.display());
        // Its own error first (a write fails once it has stopped).
        btrfs::finish(child, &what)?;
        fed.map_err(io_err(what))
    });
    let mut bytes = 0u64;
    let read = loop {
        let (tag, data) = match read_frame(input, MAX_DATA).await {
            Ok(frame) => frame,
            Err(e) => break Err(e),
        };
        match tag {
            b'd' => {
                bytes += data.len() as u64;
                if tx.send(data).await.is_err() {
                    // btrfs receive stopped: its error is the outcome.
                    break Ok(());
                }
            }
            b'e' => break Ok(()),
            b'x' => {
                let why = String::from_utf8_lossy(&data).into_owned();
                break Err(DurableError::Config(format!("the source node could not send the box: {why}")));
            }
            _ => break Err(DurableError::Config(format!("the source node sent an unexpected frame {tag:#x}"))),
        }
    };
    drop(tx);
    let received = receiver.await.map_err(|e| DurableError::Config(format!("btrfs receive panicked: {e}")))?;
    read?;
    received.map(|()| bytes)
}

/// The fault point a crash test stops a node at mid-receive: after a
/// part's first data, once btrfs has begun its subvolume.
const MID_PART: &str = "receive-mid-part";

/// Aborts at [`MID_PART`] once `dir` holds what btrfs began receiving (the
/// rest of the stream never comes: a half-written subvolume is left).
fn crash_once_begun(dir: &Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    moat_core::fault::point(MID_PART);
}

/// Asks for a pipe of [`MAX_DATA`] (best effort: the default works, slower).
fn widen(pipe: &impl std::os::fd::AsFd) {
    let size = i32::try_from(MAX_DATA).unwrap_or(i32::MAX);
    let _ = nix::fcntl::fcntl(pipe.as_fd(), nix::fcntl::FcntlArg::F_SETPIPE_SZ(size));
}

/// The one subvolume a receive made in `dir`.
fn only_subvolume(dir: &Path) -> Result<PathBuf, DurableError> {
    let mut made = std::fs::read_dir(dir).map_err(io_err(format!("read {}", dir.display())))?.flatten();
    match (made.next(), made.next()) {
        (Some(one), None) => Ok(one.path()),
        _ => Err(DurableError::Config("a part received no subvolume, or several".into())),
    }
}
