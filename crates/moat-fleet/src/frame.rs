//! Frames on a fleet connection: a kind byte, a big-endian `u32` length and
//! that many bytes of one moat-api message (today's JSON, unchanged).
//!
//! A unix packet socket keeps a message's bounds and carries a descriptor
//! beside it; TCP keeps neither, so each message is framed, and the one
//! message that carries a descriptor locally (a session's outcome) is marked
//! [`Kind::Session`]: the bytes after it on the connection are the session's.
//! The reader bounds every frame before it allocates, so a hostile peer
//! cannot make it buffer more than the caller asked for.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A message (a request, an event).
    Message,
    /// A session's outcome: from here on the connection carries the
    /// session's bytes, both ways.
    Session,
}

impl Kind {
    fn byte(self) -> u8 {
        match self {
            Kind::Message => b'm',
            Kind::Session => b's',
        }
    }

    fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            b'm' => Some(Kind::Message),
            b's' => Some(Kind::Session),
            _ => None,
        }
    }
}

const HEADER: usize = 5;

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Writes one frame and flushes it.
pub async fn write<W: AsyncWrite + Unpin>(w: &mut W, kind: Kind, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len()).map_err(|_| invalid("message too large for a frame"))?;
    let mut buf = Vec::with_capacity(HEADER + bytes.len());
    buf.push(kind.byte());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(bytes);
    w.write_all(&buf).await?;
    w.flush().await
}

/// Reads one frame of at most `max` bytes; `None` when the peer closed
/// before a frame began. An unknown kind, a longer frame or a frame cut
/// short are errors. Reads exactly the frame: what follows stays unread.
pub async fn read<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> io::Result<Option<(Kind, Vec<u8>)>> {
    let mut header = [0u8; HEADER];
    let first = r.read(&mut header[..1]).await?;
    if first == 0 {
        return Ok(None);
    }
    r.read_exact(&mut header[1..]).await?;
    let [kind, a, b, c, d] = header;
    let kind = Kind::from_byte(kind).ok_or_else(|| invalid("unknown frame kind"))?;
    let len = u32::from_be_bytes([a, b, c, d]) as usize;
    if len > max {
        return Err(invalid("frame too large"));
    }
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes).await?;
    Ok(Some((kind, bytes)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_keep_their_bounds_and_leave_what_follows() {
        let mut buf = Vec::new();
        write(&mut buf, Kind::Message, b"").await.unwrap();
        write(&mut buf, Kind::Session, b"{\"outcome\":1}").await.unwrap();
        buf.extend_from_slice(b"raw");
        let mut r = &buf[..];
        assert_eq!(read(&mut r, 16).await.unwrap(), Some((Kind::Message, Vec::new())));
        assert_eq!(read(&mut r, 16).await.unwrap(), Some((Kind::Session, b"{\"outcome\":1}".to_vec())));
        assert_eq!(r, b"raw");
    }

    #[tokio::test]
    async fn hostile_frames_are_refused() {
        // Four GiB announced: refused before anything is allocated.
        let mut r: &[u8] = &[b'm', 0xff, 0xff, 0xff, 0xff, 1, 2];
        assert!(read(&mut r, 1 << 20).await.is_err());
        let mut r: &[u8] = &[b'x', 0, 0, 0, 1, 0];
        assert!(read(&mut r, 16).await.is_err());
        // Cut short: in the header, in the body.
        let mut r: &[u8] = &[b'm', 0, 0];
        assert!(read(&mut r, 16).await.is_err());
        let mut r: &[u8] = &[b'm', 0, 0, 0, 9, 1];
        assert!(read(&mut r, 16).await.is_err());
        let mut r: &[u8] = &[];
        assert!(read(&mut r, 16).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn any_bytes_read_without_panic() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let len = (seed % 24) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    [b'm', b's', 0, 1, 7, (seed >> 8) as u8][(seed % 6) as usize]
                })
                .collect();
            let mut r = &bytes[..];
            while let Ok(Some(_)) = read(&mut r, 8).await {}
        }
    }
}
