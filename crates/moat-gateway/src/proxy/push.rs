//! A push held until its rules are checked: the body of a
//! `git-receive-pack` request is read from the box (and kept, as it came,
//! in the connection's buffer) until its command list is whole and judged
//! by the push rules, and, where an update is allowed only as a
//! fast-forward, until the pack is whole too (within [`MAX_HELD`]). Only
//! then does anything of the request (its head, a secret written in) go to
//! the host; a refusal is answered on git's own channel
//! ([`crate::git::report`]).

use std::sync::Arc;
use std::time::Duration;

use moat_core::policy::{HostName, PushRule};
use moat_core::slots::Slots;
use moat_core::AccountId;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::Semaphore;

use crate::git::commands::{self, CommandList};
use crate::git::report;
use crate::git::verdict::{self, Judged};
use crate::http::chunked::ChunkedReader;
use crate::http::request::{Body, Request};
use crate::refusal::Refusal;

/// Most bytes of push body held to decide a fast-forward from its pack.
pub const MAX_HELD: usize = 32 << 20;
/// Most bytes of a push body held as they came, its chunks' framing
/// included: chunk lines may carry extensions of kilobytes, and a body of
/// one-byte chunks each with 4 KiB of them held 1.58 GB of the gateway for
/// 375 KB of data (git's own chunks are 64 KiB and more, their framing a
/// few bytes).
const MAX_RAW: u64 = MAX_HELD as u64 + (MAX_HELD as u64 >> 2);
/// How long the box may pause inside a push body that is being held.
const BODY_WAIT: Duration = Duration::from_secs(60);
/// How long a push body may take to arrive whole (one trickling a byte a
/// minute would hold its turn and its memory for ever).
const BODY_TIME: Duration = Duration::from_secs(300);
/// Push bodies held at once, every box together: each may take twice
/// [`MAX_HELD`] of memory (as it came, and decoded).
const HOLDS_AT_ONCE: usize = 8;
/// How long a push waits for a turn to be held.
const TURN_WAIT: Duration = Duration::from_secs(30);

/// Push bodies one box may have held at once (so that one box cannot take
/// every turn).
pub const BOX_HOLDS: usize = 2;
/// Push bodies one account's boxes may have held at once: half the
/// gateway's (four boxes of one account, a `race 4`, trickling pushes took
/// every turn from every other account for 300 s).
pub const ACCOUNT_HOLDS: usize = HOLDS_AT_ONCE / 2;

/// The turns to hold a push body, every box's together.
pub fn holds() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(HOLDS_AT_ONCE))
}

/// Each account's turns to hold a push body.
pub fn account_holds() -> Arc<Slots<AccountId>> {
    Slots::new(ACCOUNT_HOLDS)
}

/// One box's turns to hold a push body: its own, its account's, everyone's.
pub struct BoxTurns {
    all: Arc<Semaphore>,
    accounts: Arc<Slots<AccountId>>,
    account: AccountId,
    mine: Semaphore,
}

impl BoxTurns {
    /// The turns of a box of `account`, under the gateway's `all` and
    /// every account's `accounts`.
    pub fn new(all: Arc<Semaphore>, accounts: Arc<Slots<AccountId>>, account: AccountId) -> Self {
        Self { all, accounts, account, mine: Semaphore::new(BOX_HOLDS) }
    }
}

/// What a push is, as far as the rules go.
pub struct Push<'a> {
    /// The host.
    pub name: &'a HostName,
    /// The repository's path.
    pub repo: &'a str,
    /// The rules that name it.
    pub rules: &'a [PushRule],
}

/// The body framing followed, with what of it is decoded.
struct BodyReader {
    framing: Body,
    chunked: ChunkedReader,
    /// Raw bytes of body consumed so far (framing included).
    raw: u64,
    /// The body's data.
    data: Vec<u8>,
    ended: bool,
}

impl BodyReader {
    fn new(framing: Body) -> Self {
        let ended = framing == Body::Length(0);
        Self { framing, chunked: ChunkedReader::default(), raw: 0, data: Vec::new(), ended }
    }

    /// Consumes what of `raw` (bytes after those consumed) is body.
    fn feed(&mut self, raw: &[u8]) -> Result<(), Refusal> {
        match self.framing {
            Body::Length(len) => {
                let take = (len - self.raw).min(raw.len() as u64) as usize;
                self.data.extend_from_slice(raw.get(..take).unwrap_or_default());
                self.raw += take as u64;
                self.ended = self.raw == len;
            }
            Body::Chunked => {
                let n = self.chunked.feed_into(raw, Some(&mut self.data)).map_err(Refusal::BadChunk)?;
                self.raw += n as u64;
                self.ended = self.chunked.done();
            }
        }
        Ok(())
    }
}

/// Reads the push body after `request`'s head in `buf` (more from
/// `from_box` as needed) until it is decided: `Ok` to send it (all that was
/// read stays in `buf`, after the head), or the refusal to answer.
pub async fn hold<R: AsyncRead + Unpin>(
    from_box: &mut R,
    buf: &mut Vec<u8>,
    request: &Request,
    push: Push<'_>,
    turns: &BoxTurns,
) -> Result<(), Refusal> {
    if request.coded {
        return Err(Refusal::git_error(false, "moat: compressed push bodies are not read by the gateway".into()));
    }
    let busy = || Refusal::git_error(false, "moat: the gateway is holding as many pushes as it can: try again".into());
    // One of the box's own turns first, then one of its account's, then
    // one of everyone's.
    let mine = turns.mine.try_acquire().map_err(|_| {
        Refusal::git_error(false, format!("moat: this box has {BOX_HOLDS} pushes held already: one at a time"))
    })?;
    let ours = turns.accounts.take(&turns.account).ok_or_else(|| {
        Refusal::git_error(false, format!("moat: this account's boxes have {ACCOUNT_HOLDS} pushes held already"))
    })?;
    let _turns = match tokio::time::timeout(TURN_WAIT, turns.all.acquire()).await {
        Ok(Ok(turn)) => (mine, ours, turn),
        _ => return Err(busy()),
    };
    match tokio::time::timeout(BODY_TIME, read_and_judge(from_box, buf, request, push)).await {
        Ok(judged) => judged,
        Err(_) => Err(Refusal::git_error(false, "moat: the push body took too long to arrive".into())),
    }
}

/// [`hold`]'s reading, once it has its turn.
async fn read_and_judge<R: AsyncRead + Unpin>(
    from_box: &mut R,
    buf: &mut Vec<u8>,
    request: &Request,
    push: Push<'_>,
) -> Result<(), Refusal> {
    let mut body = BodyReader::new(request.body);
    let mut list: Option<(CommandList, Judged)> = None;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let fresh = buf.get(request.head_len + body.raw as usize..).unwrap_or_default();
        body.feed(fresh)?;
        if list.is_none() {
            let read =
                commands::parse(&body.data, body.ended).map_err(|e| Refusal::git_error(false, format!("moat: {e}")))?;
            if let Some(read) = read {
                let judged = verdict::judge(push.rules, push.name, push.repo, &read);
                list = Some((read, judged));
            }
        }
        let too_raw = body.raw > MAX_RAW;
        if too_raw && list.is_none() {
            let why = "moat: the push's command list is not whole within what the gateway reads";
            return Err(Refusal::git_error(false, why.into()));
        }
        if let Some((read, judged)) = &list {
            if judged.any_refused() {
                return Err(refused(read, judged));
            }
            if judged.descent.is_empty() {
                return Ok(());
            }
        }
        let held = body.data.len() > MAX_HELD || too_raw;
        if body.ended || held {
            if let Some((read, judged)) = list.take() {
                let data = if held { None } else { Some(std::mem::take(&mut body.data)) };
                return decide(read, judged, data).await;
            }
        }
        if body.ended {
            // A whole body is always decided above; never wait on a closed one.
            return Err(Refusal::git_error(false, "moat: the push body ended early".into()));
        }
        let n = match tokio::time::timeout(BODY_WAIT, from_box.read(&mut chunk)).await {
            Ok(Ok(0)) => return Err(Refusal::ClosedInBody),
            Ok(Ok(n)) => n,
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(Refusal::git_error(false, "moat: the push body stalled".into())),
        };
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
}

/// Decides the fast-forwards `judged` waits on from the pack in `data` (the
/// body's data; `None`: more than the gateway holds). Off the event loop:
/// inflating a pack and walking its commits took seconds of a loop every
/// box's egress shares.
async fn decide(read: CommandList, mut judged: Judged, data: Option<Vec<u8>>) -> Result<(), Refusal> {
    let walked = tokio::task::spawn_blocking(move || {
        let pack = data.as_deref().and_then(|d| d.get(read.len..));
        verdict::decide_descent(&mut judged, &read, pack);
        (read, judged)
    })
    .await;
    let Ok((read, judged)) = walked else {
        return Err(Refusal::git_error(false, "moat: cannot verify fast-forward (the check failed)".into()));
    };
    if judged.any_refused() {
        Err(refused(&read, &judged))
    } else {
        Ok(())
    }
}

/// The answer to a push with refused refs.
fn refused(list: &CommandList, judged: &Judged) -> Refusal {
    let refs = judged.report(list);
    let first = refs.iter().zip(&judged.refused).find_map(|((r, _), why)| why.as_ref().map(|w| (r, w)));
    let reason = match first {
        Some((refname, why)) => format!("push refused: {refname}: {why}"),
        None => "push refused".into(),
    };
    let summary = "moat: this push was refused by the box's push rules; nothing of it reached the server";
    Refusal::Git { body: report::refused(list, &refs, summary), content_type: report::RESULT_TYPE, reason }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::ReadBuf;

    use super::*;
    use crate::git::commands::tests::body as pkt_body;
    use crate::git::pack::tests::{pack, repo};
    use crate::http::request::{read_head, Head};

    /// Hands out its pieces one read at a time, as a box writing in pieces.
    struct Pieces(Vec<Vec<u8>>);

    impl AsyncRead for Pieces {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            if !self.0.is_empty() {
                let piece = self.0.remove(0);
                let n = piece.len().min(out.remaining());
                out.put_slice(&piece[..n]);
                if n < piece.len() {
                    self.0.insert(0, piece[n..].to_vec());
                }
            }
            Poll::Ready(Ok(()))
        }
    }

    const Z: &str = "0000000000000000000000000000000000000000";

    /// A box's turns, in a gateway of its own.
    fn turns() -> BoxTurns {
        BoxTurns::new(holds(), account_holds(), AccountId("SHA256:a".into()))
    }

    /// Rules, commands, pack, and the decision wanted (a part of the refusal).
    type Case<'a> = (Vec<&'a str>, Vec<String>, &'a [u8], Result<(), &'a str>);

    /// A push request of `commands` (then `pack`), Content-Length or chunked.
    fn request(commands: &[String], pack: &[u8], chunked: bool) -> Vec<u8> {
        let mut lines: Vec<String> = commands.to_vec();
        if let Some(first) = lines.first_mut() {
            first.push_str("\0report-status side-band-64k ofs-delta");
        }
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let mut body = pkt_body(&lines);
        body.extend_from_slice(pack);
        let mut out = b"POST /moat/repo.git/git-receive-pack HTTP/1.1\r\nHost: github.com\r\n".to_vec();
        if chunked {
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
            for piece in body.chunks(7) {
                out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                out.extend_from_slice(piece);
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"0\r\n\r\n");
        } else {
            out.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
            out.extend_from_slice(&body);
        }
        out
    }

    /// The decision on `raw`, sent in pieces cut at `cuts`.
    async fn decide(rules: &[&str], raw: &[u8], cuts: &[usize]) -> Result<(), String> {
        let rules: Vec<PushRule> =
            rules.iter().map(|r| PushRule::parse(&r.split(' ').collect::<Vec<_>>()).unwrap()).collect();
        let head_len = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let Head::Request(request) = read_head(&raw[..head_len]) else { panic!("head") };
        let mut pieces = Vec::new();
        let mut at = head_len;
        for &cut in cuts.iter().filter(|&&c| c > head_len && c < raw.len()) {
            pieces.push(raw[at..cut].to_vec());
            at = cut;
        }
        pieces.push(raw[at..].to_vec());
        let mut buf = raw[..head_len].to_vec();
        let name = HostName::parse("github.com").unwrap();
        let push = Push { name: &name, repo: "moat/repo", rules: &rules };
        let decided = hold(&mut Pieces(pieces), &mut buf, &request, push, &turns()).await;
        // Whatever was read stays, as it came, for the host.
        assert!(raw.starts_with(&buf));
        decided.map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn pushes_are_decided_by_their_commands_and_packs_whole_or_in_pieces() {
        let dir = std::env::temp_dir().join(format!("moat-push-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let c = repo(&dir, 4);
        let thin = pack(&dir, &format!("{}\n^{}\n", c[3], c[1]), &["--thin", "--delta-base-offset"]);
        let agent = "github.com/moat/repo refs/heads/agent/*";
        let ff = "github.com/moat/repo refs/heads/agent/* --fast-forward";
        let update = |r: &str, old: &str, new: &str| format!("{old} {new} {r}");
        for chunked in [false, true] {
            let cases: Vec<Case<'_>> = vec![
                (vec![agent], vec![update("refs/heads/agent/x", &c[1], &c[3])], &thin, Ok(())),
                (vec![ff], vec![update("refs/heads/agent/x", &c[1], &c[3])], &thin, Ok(())),
                (vec![ff], vec![update("refs/heads/agent/x", Z, &c[3])], &thin, Ok(())),
                (
                    vec![agent],
                    vec![update("refs/heads/main", &c[1], &c[3])],
                    &thin,
                    Err("no push rule covers this ref (allowed: refs/heads/agent/*)"),
                ),
                (vec![agent], vec![update("refs/heads/agent/x", &c[1], Z)], b"", Err("deleting needs --delete")),
                (vec!["github.com/moat/repo refs/*"], vec![update("refs/tags/v1", Z, &c[3])], &thin, Err("tags need")),
                (vec![ff], vec![update("refs/heads/agent/x", &c[3], &c[2])], &thin, Err("cannot verify fast-forward")),
                (vec![ff], vec![update("refs/heads/agent/x", &c[0], &c[3])], &thin, Err("cannot verify fast-forward")),
                (
                    vec![ff],
                    vec![update("refs/heads/agent/x", &c[1], &c[3])],
                    &thin[..thin.len() - 3],
                    Err("cannot verify"),
                ),
                (
                    vec![agent],
                    vec![update("refs/heads/agent/x", &c[1], &c[3]), update("refs/heads/main", &c[1], &c[3])],
                    &thin,
                    Err("refs/heads/main"),
                ),
            ];
            for (rules, commands, pack, want) in cases {
                let raw = request(&commands, pack, chunked);
                let whole = decide(&rules, &raw, &[]).await;
                match (&whole, want) {
                    (Ok(()), Ok(())) => {}
                    (Err(got), Err(want)) if got.contains(want) => {}
                    _ => panic!("{rules:?} {commands:?} chunked={chunked}: {whole:?}, wanted {want:?}"),
                }
                // The same decision however the box splits its writes.
                let step = (raw.len() / 97).max(1);
                for cut in (0..raw.len()).step_by(step) {
                    assert_eq!(decide(&rules, &raw, &[cut, cut + 1, cut + 5]).await, whole, "cut at {cut}");
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn malformed_and_oversize_pushes_are_refused() {
        let rules = ["github.com/moat/repo refs/heads/*"];
        let bad =
            b"POST /moat/repo.git/git-receive-pack HTTP/1.1\r\nHost: github.com\r\nContent-Length: 8\r\n\r\nzzzz0000";
        assert_eq!(decide(&rules, bad, &[]).await, Err("moat: a malformed pkt-line length".into()));
        let cut =
            b"POST /moat/repo.git/git-receive-pack HTTP/1.1\r\nHost: github.com\r\nContent-Length: 8\r\n\r\n0009abc";
        assert_eq!(decide(&rules, cut, &[]).await, Err("closed inside a request body".into()));
        let gz = b"POST /x/git-receive-pack HTTP/1.1\r\nHost: github.com\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\n0000";
        assert!(decide(&rules, gz, &[]).await.unwrap_err().contains("compressed"));
        // A command list past the bound, without a flush.
        let mut endless =
            format!("POST /x HTTP/1.1\r\nHost: github.com\r\nContent-Length: {}\r\n\r\n", 2 << 20).into_bytes();
        for _ in 0..(2 << 20) / 16 {
            endless.extend_from_slice(b"0010shallow 1111");
        }
        assert_eq!(decide(&rules, &endless, &[]).await, Err("moat: the push's command list is too large".into()));
        // A pack larger than is held cannot show a fast-forward.
        let (a, b) = ("1".repeat(40), "2".repeat(40));
        let big = request(&[format!("{a} {b} refs/heads/x")], &vec![7u8; MAX_HELD + 1], false);
        let ff = ["github.com/moat/repo refs/heads/* --fast-forward"];
        let refused = decide(&ff, &big, &[]).await.unwrap_err();
        assert!(refused.contains("cannot verify fast-forward (the pack is larger than the gateway holds"), "{refused}");
        // A probe (an empty list) goes.
        let probe = b"POST /x HTTP/1.1\r\nHost: github.com\r\nContent-Length: 4\r\n\r\n0000";
        assert_eq!(decide(&rules, probe, &[]).await, Ok(()));
        // Chunks of one byte, each with 4 KiB of extensions: what is held as
        // it came is bounded (it grew to 1.58 GB for 375 KB of data).
        let padded = |list: &[u8]| {
            let mut raw = b"POST /x HTTP/1.1\r\nHost: github.com\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            raw.extend_from_slice(format!("{:x}\r\n", list.len()).as_bytes());
            raw.extend_from_slice(list);
            raw.extend_from_slice(b"\r\n");
            let chunk = format!("1;{}\r\nP\r\n", "e".repeat(4000));
            while raw.len() as u64 <= MAX_RAW + (1 << 20) {
                raw.extend_from_slice(chunk.as_bytes());
            }
            raw
        };
        let list = pkt_body(&[&format!("{a} {b} refs/heads/x\0report-status")]);
        let refused = decide(&ff, &padded(&list), &[]).await.unwrap_err();
        assert!(refused.contains("cannot verify fast-forward (the pack is larger than the gateway holds"), "{refused}");
        let refused = decide(&rules, &padded(b"fff0"), &[]).await.unwrap_err();
        assert!(refused.contains("command list is not whole"), "{refused}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickled_push_gives_its_turn_up_and_a_full_gateway_says_so() {
        let rules = [PushRule::parse(&["github.com/moat/repo", "refs/heads/agent/*", "--fast-forward"]).unwrap()];
        let raw = b"POST /x HTTP/1.1\r\nHost: github.com\r\nContent-Length: 100000\r\n\r\n";
        let Head::Request(request) = read_head(raw) else { panic!("head") };
        let name = HostName::parse("github.com").unwrap();
        let push = || Push { name: &name, repo: "moat/repo", rules: &rules };
        // A command line begun, then a byte every 50 s: never a minute's
        // pause, and never done.
        let (mut box_side, mut ours) = tokio::io::duplex(64);
        tokio::spawn(async move {
            let _ = tokio::io::AsyncWriteExt::write_all(&mut box_side, b"0fff").await;
            while tokio::io::AsyncWriteExt::write_all(&mut box_side, b"a").await.is_ok() {
                tokio::time::sleep(Duration::from_secs(50)).await;
            }
        });
        let box_turns = turns();
        let started = tokio::time::Instant::now();
        let mut buf = raw.to_vec();
        let err = hold(&mut ours, &mut buf, &request, push(), &box_turns).await.unwrap_err();
        assert_eq!(
            (started.elapsed(), err.to_string()),
            (BODY_TIME, "moat: the push body took too long to arrive".into())
        );
        assert_eq!(box_turns.all.available_permits(), HOLDS_AT_ONCE, "its turn was kept");
        assert_eq!(box_turns.accounts.held(&box_turns.account), 0, "its account's turn was kept");
        // Every turn taken: told so after a wait.
        let all = box_turns.all.acquire_many(HOLDS_AT_ONCE as u32).await.unwrap();
        let mut buf = raw.to_vec();
        let err = hold(&mut tokio::io::empty(), &mut buf, &request, push(), &box_turns).await.unwrap_err();
        assert!(err.to_string().contains("as many pushes as it can"), "{err}");
        drop(all);
        // An account whose boxes hold their share: told so at once, while
        // another account's box still gets a turn.
        let theirs: Vec<_> = (0..ACCOUNT_HOLDS).map(|_| box_turns.accounts.take(&box_turns.account).unwrap()).collect();
        let err = hold(&mut tokio::io::empty(), &mut buf, &request, push(), &box_turns).await.unwrap_err();
        assert!(err.to_string().contains("this account's boxes have"), "{err}");
        let other =
            BoxTurns::new(Arc::clone(&box_turns.all), Arc::clone(&box_turns.accounts), AccountId("SHA256:b".into()));
        let err = hold(&mut tokio::io::empty(), &mut buf, &request, push(), &other).await.unwrap_err();
        assert_eq!(err.to_string(), "closed inside a request body", "another account's box was refused a turn");
        drop(theirs);
        // A box with its own turns taken: told so at once.
        let _both = box_turns.mine.acquire_many(BOX_HOLDS as u32).await.unwrap();
        let err = hold(&mut tokio::io::empty(), &mut buf, &request, push(), &box_turns).await.unwrap_err();
        assert!(err.to_string().contains("this box has"), "{err}");
    }
}
