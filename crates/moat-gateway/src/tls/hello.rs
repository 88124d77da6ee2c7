//! Reads the server name out of a TLS ClientHello without terminating TLS.
//! The hello may span several records; anything the gateway cannot read one
//! way only (no SNI, two names, Encrypted Client Hello, a malformed message)
//! is refused.

use moat_core::policy::HostName;

/// Largest ClientHello read (post-quantum key shares make them ~2 KB; 64 KiB
/// is the format's own bound on the extensions).
pub const MAX_HELLO: usize = 1 << 16;

/// What a ClientHello said, or why it is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// More bytes are needed.
    Incomplete,
    /// The server name it asks for.
    Name(HostName),
    /// Refused, with the reason for the log.
    Refused(&'static str),
}

const EXT_SERVER_NAME: u16 = 0;
const EXT_ECH: u16 = 0xfe0d;

/// Reads `buf` (the first bytes the box sent) as a ClientHello.
pub fn read_hello(buf: &[u8]) -> Hello {
    // Gather the handshake bytes from consecutive handshake records.
    let mut handshake = Vec::new();
    let mut at = 0;
    loop {
        let Some(&[kind, major, _minor, len_hi, len_lo]) = buf.get(at..at + 5) else { return more_or_too_big(buf) };
        if kind != 0x16 || major != 3 {
            return Hello::Refused("not a TLS handshake");
        }
        let len = usize::from(u16::from_be_bytes([len_hi, len_lo]));
        if len == 0 || len > 1 << 14 {
            return Hello::Refused("bad TLS record length");
        }
        let Some(body) = buf.get(at + 5..at + 5 + len) else { return more_or_too_big(buf) };
        handshake.extend_from_slice(body);
        at += 5 + len;
        if let Some(&[kind, l1, l2, l3]) = handshake.get(..4) {
            if kind != 1 {
                return Hello::Refused("first handshake message is not a ClientHello");
            }
            let want = 4 + (usize::from(l1) << 16 | usize::from(l2) << 8 | usize::from(l3));
            if want > MAX_HELLO {
                return Hello::Refused("ClientHello too large");
            }
            if let Some(body) = handshake.get(4..want) {
                return match server_name(body) {
                    Ok(name) => Hello::Name(name),
                    Err(why) => Hello::Refused(why),
                };
            }
        }
    }
}

/// Bytes a box may send before its ClientHello is complete: the largest
/// hello, and the headers of the records it is split over (a hello spread
/// over hundreds of tiny records is refused rather than buffered).
const MAX_HELLO_BYTES: usize = MAX_HELLO + 5 * 8;

fn more_or_too_big(buf: &[u8]) -> Hello {
    if buf.len() >= MAX_HELLO_BYTES {
        Hello::Refused("ClientHello too large")
    } else {
        Hello::Incomplete
    }
}

/// A cursor that fails instead of panicking.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        let (head, rest) = self.0.split_at_checked(n).ok_or("truncated ClientHello")?;
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<usize, &'static str> {
        let &[b] = self.take(1)? else { return Err("truncated ClientHello") };
        Ok(usize::from(b))
    }

    fn u16(&mut self) -> Result<usize, &'static str> {
        let &[hi, lo] = self.take(2)? else { return Err("truncated ClientHello") };
        Ok(usize::from(u16::from_be_bytes([hi, lo])))
    }

    fn vec8(&mut self) -> Result<&'a [u8], &'static str> {
        let n = self.u8()?;
        self.take(n)
    }

    fn vec16(&mut self) -> Result<Reader<'a>, &'static str> {
        let n = self.u16()?;
        Ok(Reader(self.take(n)?))
    }
}

fn server_name(body: &[u8]) -> Result<HostName, &'static str> {
    let mut r = Reader(body);
    r.take(2 + 32)?; // legacy_version, random
    r.vec8()?; // legacy_session_id
    r.vec16()?; // cipher_suites
    r.vec8()?; // legacy_compression_methods
    if r.0.is_empty() {
        return Err("no SNI");
    }
    let mut extensions = r.vec16()?;
    if !r.0.is_empty() {
        return Err("bytes after the extensions");
    }
    let mut seen = Vec::new();
    let mut name = None;
    while !extensions.0.is_empty() {
        let kind = extensions.u16()? as u16;
        let mut data = extensions.vec16()?;
        if seen.contains(&kind) {
            return Err("an extension twice");
        }
        seen.push(kind);
        match kind {
            EXT_ECH => return Err("Encrypted Client Hello"),
            EXT_SERVER_NAME => {
                let mut list = data.vec16()?;
                if !data.0.is_empty() || list.u8()? != 0 {
                    return Err("malformed SNI");
                }
                let host = list.vec16()?.0;
                if !list.0.is_empty() {
                    return Err("more than one server name");
                }
                let text = std::str::from_utf8(host).map_err(|_| "SNI is not ASCII")?;
                // SNI never ends in a dot (RFC 6066); one that does is not the dialled name.
                if text.ends_with('.') {
                    return Err("SNI ends in a dot");
                }
                name = Some(HostName::parse(text).map_err(|_| "SNI is not a host name")?);
            }
            _ => {}
        }
    }
    name.ok_or("no SNI")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
pub(crate) mod tests {
    use super::*;

    /// A minimal ClientHello with these extensions, in one record.
    pub fn hello(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut exts = Vec::new();
        for (kind, data) in extensions {
            exts.extend_from_slice(&kind.to_be_bytes());
            exts.extend_from_slice(&(data.len() as u16).to_be_bytes());
            exts.extend_from_slice(data);
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1, 0, (body.len() >> 8) as u8, body.len() as u8];
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1, (hs.len() >> 8) as u8, hs.len() as u8];
        rec.extend_from_slice(&hs);
        rec
    }

    pub fn sni(name: &[u8]) -> (u16, Vec<u8>) {
        let mut entry = vec![0, (name.len() >> 8) as u8, name.len() as u8];
        entry.extend_from_slice(name);
        let mut data = (entry.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&entry);
        (EXT_SERVER_NAME, data)
    }

    #[test]
    fn names_and_refusals() {
        let ok = hello(&[(10, vec![0, 2, 0, 29]), sni(b"PyPI.org")]);
        assert_eq!(read_hello(&ok), Hello::Name(HostName::parse("pypi.org").unwrap()));
        for cut in [1, 5, 20, ok.len() - 1] {
            assert_eq!(read_hello(&ok[..cut]), Hello::Incomplete, "{cut}");
        }
        assert_eq!(read_hello(&hello(&[(10, vec![0, 2, 0, 29])])), Hello::Refused("no SNI"));
        assert_eq!(
            read_hello(&hello(&[sni(b"a.org"), (EXT_ECH, vec![0; 8])])),
            Hello::Refused("Encrypted Client Hello")
        );
        assert_eq!(read_hello(&hello(&[sni(b"a.org"), sni(b"b.org")])), Hello::Refused("an extension twice"));
        assert_eq!(read_hello(&hello(&[sni(b"a\0.org")])), Hello::Refused("SNI is not a host name"));
        assert_eq!(read_hello(&hello(&[sni(b"a.org.")])), Hello::Refused("SNI ends in a dot"));
        assert_eq!(read_hello(b"GET / HTTP/1.1\r\n"), Hello::Refused("not a TLS handshake"));
    }

    #[test]
    fn a_hello_split_over_records() {
        let whole = hello(&[sni(b"a.org")]);
        let hs = &whole[5..];
        let (a, b) = hs.split_at(10);
        let mut split = vec![0x16, 3, 1, 0, a.len() as u8];
        split.extend_from_slice(a);
        split.extend_from_slice(&[0x16, 3, 1, (b.len() >> 8) as u8, b.len() as u8]);
        split.extend_from_slice(b);
        assert_eq!(read_hello(&split), Hello::Name(HostName::parse("a.org").unwrap()));
    }
}
