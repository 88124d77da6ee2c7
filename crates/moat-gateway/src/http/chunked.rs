//! Chunked transfer coding, both ways. A request body from a box is followed
//! strictly (every line ends in CRLF, sizes are bare hex): its bytes pass
//! through as they are, and a body that two servers could end at different
//! places would smuggle a request past the gateway. A response body from a
//! host is decoded (its bytes are scrubbed, then re-framed by the gateway), so
//! it is read as leniently as clients read it.

/// Where a chunked body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Chunked {
    /// Reading a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data (0: CR, 1: LF).
    DataEnd(u8),
    /// Reading trailer lines after the last chunk.
    Trailers,
    /// The body is over.
    Done,
}

/// Follows a chunked body's framing across reads, strictly.
#[derive(Debug, Default)]
pub struct ChunkedReader {
    state: Chunked,
    line: Vec<u8>,
}

const MAX_LINE: usize = 4096;

impl ChunkedReader {
    /// Consumes body bytes from the start of `buf`; returns how many belong to
    /// the body (all of `buf` unless the body ended inside it).
    pub fn feed(&mut self, buf: &[u8]) -> Result<usize, &'static str> {
        self.feed_into(buf, None)
    }

    /// As [`feed`](Self::feed), also appending the body's data (the chunks
    /// without their framing) to `data`, for a reader of the body itself.
    pub fn feed_into(&mut self, buf: &[u8], mut data: Option<&mut Vec<u8>>) -> Result<usize, &'static str> {
        let mut i = 0;
        while self.state != Chunked::Done {
            let Some(&b) = buf.get(i) else { break };
            match self.state {
                Chunked::Size | Chunked::Trailers => {
                    i += 1;
                    if self.line.len() >= MAX_LINE {
                        return Err("chunk line too long");
                    }
                    self.line.push(b);
                    if b != b'\n' {
                        continue;
                    }
                    let line = self.line.strip_suffix(b"\r\n").ok_or("a bare LF in a chunked body")?.to_vec();
                    self.line.clear();
                    self.state = match self.state {
                        Chunked::Size => {
                            let (size, extensions) =
                                line.split_at(line.iter().position(|&c| c == b';').unwrap_or(line.len()));
                            if !extensions.iter().all(|&c| c == b'\t' || (b' '..=b'~').contains(&c)) {
                                return Err("a control character in a chunk extension");
                            }
                            let size = std::str::from_utf8(size).map_err(|_| "bad chunk size")?;
                            if size.is_empty() || size.len() > 15 || !size.bytes().all(|c| c.is_ascii_hexdigit()) {
                                return Err("bad chunk size");
                            }
                            match u64::from_str_radix(size, 16).map_err(|_| "bad chunk size")? {
                                0 => Chunked::Trailers,
                                n => Chunked::Data(n),
                            }
                        }
                        _ if line.is_empty() => Chunked::Done,
                        _ if trailer_ok(&line) => Chunked::Trailers,
                        _ => return Err("a trailer that is not a header field"),
                    };
                }
                Chunked::Data(left) => {
                    let n = left.min((buf.len() - i) as u64);
                    if let Some(data) = data.as_deref_mut() {
                        data.extend_from_slice(buf.get(i..i + n as usize).unwrap_or_default());
                    }
                    i += n as usize;
                    self.state = if n == left { Chunked::DataEnd(0) } else { Chunked::Data(left - n) };
                }
                Chunked::DataEnd(k) => {
                    let want = if k == 0 { b'\r' } else { b'\n' };
                    if b != want {
                        return Err("chunk data not followed by CRLF");
                    }
                    i += 1;
                    self.state = if k == 0 { Chunked::DataEnd(1) } else { Chunked::Size };
                }
                Chunked::Done => {}
            }
        }
        Ok(i)
    }

    /// Whether the body is over.
    pub fn done(&self) -> bool {
        self.state == Chunked::Done
    }
}

/// Whether a trailer line is a header field (`name: value`) other than one
/// that frames or routes a message or names another method (a server that
/// merges trailers into headers would read that). Anything else would be
/// forwarded as the box sent it, and a server that skips trailers without
/// parsing them could read a request line hidden there as a request of its
/// own.
fn trailer_ok(line: &[u8]) -> bool {
    let Some(colon) = line.iter().position(|&c| c == b':') else { return false };
    let (name, value) = line.split_at(colon);
    let framing = ["content-length", "transfer-encoding", "host", "trailer", "connection"]
        .iter()
        .any(|f| name.eq_ignore_ascii_case(f.as_bytes()))
        || super::request::is_method_override(name);
    !name.is_empty()
        && name.iter().all(|c| super::is_tchar(*c))
        && !framing
        && value.iter().all(|&c| c == b'\t' || c >= b' ' && c != 0x7f)
}

/// Decodes a chunked body.
#[derive(Default)]
pub struct Dechunk {
    state: DechunkState,
    line: Vec<u8>,
}

#[derive(Default, PartialEq)]
enum DechunkState {
    #[default]
    Size,
    Data(u64),
    DataEnd,
    Trailer,
    Done,
}

impl Dechunk {
    /// Feeds `input`; decoded bytes go to `out`. Returns bytes consumed
    /// (less than all only once the body is done).
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, &'static str> {
        let mut i = 0;
        while self.state != DechunkState::Done {
            let Some(&b) = input.get(i) else { break };
            match self.state {
                DechunkState::Data(left) => {
                    let n = (left.min((input.len() - i) as u64)) as usize;
                    out.extend_from_slice(input.get(i..i + n).unwrap_or_default());
                    i += n;
                    self.state =
                        if left == n as u64 { DechunkState::DataEnd } else { DechunkState::Data(left - n as u64) };
                }
                _ => {
                    i += 1;
                    if b != b'\n' {
                        if self.line.len() > 4096 {
                            return Err("a chunk line too long");
                        }
                        self.line.push(b);
                        continue;
                    }
                    let line = std::mem::take(&mut self.line);
                    let line = line.strip_suffix(b"\r").unwrap_or(&line);
                    self.state = match self.state {
                        DechunkState::Size => {
                            let hex = line.split(|c| *c == b';').next().unwrap_or_default();
                            let hex = super::request::ows(std::str::from_utf8(hex).map_err(|_| "a bad chunk size")?);
                            if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                                return Err("a bad chunk size");
                            }
                            match u64::from_str_radix(hex, 16).map_err(|_| "a bad chunk size")? {
                                0 => DechunkState::Trailer,
                                n => DechunkState::Data(n),
                            }
                        }
                        DechunkState::DataEnd if line.is_empty() => DechunkState::Size,
                        DechunkState::DataEnd => return Err("a chunk longer than its size"),
                        _ if line.is_empty() => DechunkState::Done,
                        _ => DechunkState::Trailer,
                    };
                }
            }
        }
        Ok(i)
    }

    /// Whether the body is over.
    pub fn done(&self) -> bool {
        self.state == DechunkState::Done
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn chunked_framing() {
        let body = b"5;ext=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\nNEXT";
        for split in 0..body.len() - 4 {
            let mut r = ChunkedReader::default();
            let a = r.feed(&body[..split]).unwrap();
            assert_eq!(a, split);
            let b = r.feed(&body[split..]).unwrap();
            assert_eq!(a + b, body.len() - 4, "{split}");
            assert!(r.done());
        }
        let bad_trailers = [
            &b"0\r\nX: y\r\nPOST /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"[..],
            b"0\r\n x: folded\r\n\r\n",
            b"0\r\nContent-Length: 5\r\n\r\n",
            b"0\r\nX-HTTP-Method-Override: DELETE\r\n\r\n",
            b"0\r\nx_http_method: DELETE\r\n\r\n",
            b"0\r\nX: a\x00b\r\n\r\n",
            b"0\r\n: empty name\r\n\r\n",
            b"5;a\rb\r\nhello\r\n0\r\n\r\n",
        ];
        for bad in
            [&b"5\r\nhelloXX"[..], b"zz\r\n", b"5\nhello", b"1234567890123456\r\n"].into_iter().chain(bad_trailers)
        {
            assert!(ChunkedReader::default().feed(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn chunked_bodies_decode_and_stop_at_their_end() {
        let raw = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nX-Trailer: y\r\n\r\nHTTP/1.1 200";
        for split in 1..raw.len() {
            let mut d = Dechunk::default();
            let mut out = Vec::new();
            let used = d.feed(&raw[..split], &mut out).unwrap();
            let used2 = d.feed(&raw[used..], &mut out).unwrap();
            assert_eq!(out, b"Wikipedia", "{split}");
            assert_eq!(&raw[used + used2..], b"HTTP/1.1 200", "{split}");
        }
        let mut d = Dechunk::default();
        assert!(d.feed(b"zz\r\n", &mut Vec::new()).is_err());
        assert!(d.feed(b"2\r\nabc\r\n", &mut Vec::new()).is_err());
        let mut d = Dechunk::default();
        assert!(d.feed("2\u{a0}\r\nab\r\n".as_bytes(), &mut Vec::new()).is_err(), "a Unicode space read as none");
        let mut d = Dechunk::default();
        assert!(d.feed(b"+2\r\nab\r\n", &mut Vec::new()).is_err(), "a sign read as none");
    }
}
