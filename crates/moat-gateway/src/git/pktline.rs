//! pkt-lines: four hex digits of length (the four included), then that
//! many bytes less four; `0000` is a flush, `0001` a delimiter, `0002` the
//! end of a response. Read from a buffer that may hold only part of one.

use super::GitError;

/// Largest pkt-line git writes (LARGE_PACKET_MAX).
pub const MAX_PKT: usize = 65520;

/// One pkt-line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pkt<'a> {
    /// `0000`.
    Flush,
    /// `0001`.
    Delim,
    /// `0002`.
    ResponseEnd,
    /// A line's payload (without its length).
    Data(&'a [u8]),
}

/// The pkt-line at the start of `buf` and the bytes it takes (`None`: more
/// bytes are needed).
pub fn next(buf: &[u8]) -> Result<Option<(Pkt<'_>, usize)>, GitError> {
    let Some(digits) = buf.get(..4) else { return Ok(None) };
    let mut len = 0usize;
    for &d in digits {
        let v = (d as char).to_digit(16).ok_or(GitError::BadLength)?;
        len = len * 16 + v as usize;
    }
    match len {
        0 => return Ok(Some((Pkt::Flush, 4))),
        1 => return Ok(Some((Pkt::Delim, 4))),
        2 => return Ok(Some((Pkt::ResponseEnd, 4))),
        3 => return Err(GitError::BadLength),
        n if n > MAX_PKT => return Err(GitError::BadLength),
        _ => {}
    }
    Ok(buf.get(4..len).map(|data| (Pkt::Data(data), len)))
}

/// `data` as one pkt-line.
pub fn encode(data: &[u8], out: &mut Vec<u8>) {
    // Callers keep payloads short; a longer one is cut rather than framed wrong.
    let data = data.get(..MAX_PKT - 4).unwrap_or(data);
    out.extend_from_slice(format!("{:04x}", data.len() + 4).as_bytes());
    out.extend_from_slice(data);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn lines_flushes_and_bad_lengths() {
        assert_eq!(next(b"0009hello0000").unwrap(), Some((Pkt::Data(b"hello"), 9)));
        assert_eq!(next(b"0000").unwrap(), Some((Pkt::Flush, 4)));
        assert_eq!(next(b"0001").unwrap(), Some((Pkt::Delim, 4)));
        assert_eq!(next(b"0009hel").unwrap(), None);
        assert_eq!(next(b"00").unwrap(), None);
        for bad in [&b"0003"[..], b"zzzz", b"fff1", b"+004", b"ffff"] {
            assert_eq!(next(bad), Err(GitError::BadLength), "{bad:?}");
        }
        let mut out = Vec::new();
        encode(b"unpack ok\n", &mut out);
        assert_eq!(out, b"000eunpack ok\n");
    }
}
