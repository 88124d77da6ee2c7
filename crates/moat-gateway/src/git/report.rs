//! A refused push answered on git's own channel, so that `git push` prints
//! the reason next to each ref (` ! [remote rejected] main -> main (moat:
//! ...)`): the report-status a server sends (`unpack ok`, then `ng REF
//! REASON` per ref), inside side-band 1 where the client asked for it, with
//! a line on side-band 2 that git prints as `remote: ...`. Where a client
//! reads no report, or before a push starts (the ref advertisement), an
//! `ERR` pkt-line, which git prints as `remote error: ...`.

use super::commands::CommandList;
use super::pktline;

/// The content type of a push's answer.
pub const RESULT_TYPE: &str = "application/x-git-receive-pack-result";
/// The content type of a push's ref advertisement.
pub const ADVERTISEMENT_TYPE: &str = "application/x-git-receive-pack-advertisement";

/// The body answering a refused push of `list`: each ref with its reason.
pub fn refused(list: &CommandList, refs: &[(String, String)], summary: &str) -> Vec<u8> {
    if !list.has("report-status") && !list.has("report-status-v2") {
        return error(summary);
    }
    let mut report = Vec::new();
    pktline::encode(b"unpack ok\n", &mut report);
    for (refname, why) in refs {
        let why: String = why.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        pktline::encode(format!("ng {refname} {why}\n").as_bytes(), &mut report);
    }
    report.extend_from_slice(b"0000");
    if !list.has("side-band-64k") && !list.has("side-band") {
        return report;
    }
    // Side-band packets carry at most 1000 bytes on plain side-band.
    let max = if list.has("side-band-64k") { pktline::MAX_PKT - 5 } else { 995 };
    let mut out = Vec::new();
    pktline::encode(format!("\x02{summary}\n").as_bytes(), &mut out);
    for piece in report.chunks(max) {
        let mut band = vec![1u8];
        band.extend_from_slice(piece);
        pktline::encode(&band, &mut out);
    }
    out.extend_from_slice(b"0000");
    out
}

/// An `ERR` pkt-line: git stops and prints `remote error: WHY`.
pub fn error(why: &str) -> Vec<u8> {
    let why: String = why.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let mut out = Vec::new();
    pktline::encode(format!("ERR {why}\n").as_bytes(), &mut out);
    out
}
