//! A push held until its rules are checked: the body of a
//! `git-receive-pack` request is read from the box (and kept, as it came,
//! in the connection's buffer) until its command list is whole and judged
//! by the push rules, and, where an update is allowed only as a
//! fast-forward, until the pack is whole too (within [`MAX_HELD`]). Only
//! then does anything of the request (its head, a secret written in) go to
//! the host; a refusal is answered on git's own channel
//! ([`crate::git::report`]).

use std::time::Duration;

use moat_core::policy::{HostName, PushRule};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::git::commands::{self, CommandList};
use crate::git::report;
use crate::git::verdict::{self, Judged};
use crate::http::chunked::ChunkedReader;
use crate::http::request::{Body, Request};
use crate::refusal::Refusal;

/// Most bytes of push body held to decide a fast-forward from its pack.
pub const MAX_HELD: usize = 32 << 20;
/// How long the box may pause inside a push body that is being held.
const BODY_WAIT: Duration = Duration::from_secs(60);

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
) -> Result<(), Refusal> {
    if request.coded {
        return Err(Refusal::git_error(false, "moat: compressed push bodies are not read by the gateway".into()));
    }
    let mut body = BodyReader::new(request.body);
    let mut list: Option<(CommandList, Judged)> = None;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let fresh = buf.get(request.head_len + body.raw as usize..).unwrap_or_default();
        body.feed(fresh)?;
        if list.is_none() {
            let read = commands::parse(&body.data, body.ended).map_err(|e| Refusal::git_error(false, format!("moat: {e}")))?;
            if let Some(read) = read {
                let judged = verdict::judge(push.rules, push.name, push.repo, &read);
                list = Some((read, judged));
            }
        }
        if let Some((read, judged)) = &mut list {
            if judged.any_refused() {
                return Err(refused(read, judged));
            }
            if judged.descent.is_empty() {
                return Ok(());
            }
            let held = body.data.len() > MAX_HELD;
            if body.ended || held {
                let pack = if held { None } else { body.data.get(read.len..) };
                verdict::decide_descent(judged, read, pack);
                return if judged.any_refused() { Err(refused(read, judged)) } else { Ok(()) };
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
