//! A stream as it is kept: `btrfs send`'s bytes zstd-compressed, and the
//! SHA-256 of what is stored. A fetched object is hostile input until its
//! hash matches the record's: [`Verifier`] hashes it as it lands in a
//! staging file, and nothing is decompressed or received before [`Verifier::check`]
//! passes.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::io::{self, Read, Write};

use sha2::{Digest, Sha256};

/// How many compressed bytes go to the object store at a time.
pub const CHUNK: usize = 8 << 20;

/// zstd's level: fast enough to keep up with a disk.
const LEVEL: i32 = 3;

/// What [`pack`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    /// SHA-256 of the compressed bytes, hex.
    pub sha256: String,
    /// How many compressed bytes.
    pub bytes: u64,
    /// How many bytes the stream had before compression.
    pub raw_bytes: u64,
}

/// Compresses `input` and hands the compressed bytes to `sink` in chunks of
/// up to [`CHUNK`]; their hash and size.
pub fn pack(input: impl Read, mut sink: impl FnMut(Vec<u8>) -> io::Result<()>) -> io::Result<Packed> {
    let mut counted = Counted { inner: input, count: 0 };
    let mut hash = Sha256::new();
    let mut bytes = 0u64;
    {
        let mut enc = zstd::stream::read::Encoder::new(&mut counted, LEVEL)?;
        loop {
            let mut chunk = vec![0u8; CHUNK];
            let mut filled = 0;
            while filled < CHUNK {
                let n = enc.read(chunk.get_mut(filled..).unwrap_or_default())?;
                if n == 0 {
                    break;
                }
                filled += n;
            }
            chunk.truncate(filled);
            if chunk.is_empty() {
                break;
            }
            hash.update(&chunk);
            bytes += chunk.len() as u64;
            sink(chunk)?;
        }
    }
    Ok(Packed { sha256: hex::encode(hash.finalize()), bytes, raw_bytes: counted.count })
}

/// Decompresses a verified object into `out` (a `btrfs receive`'s stdin).
pub fn unpack(input: impl Read, out: impl Write) -> io::Result<()> {
    zstd::stream::copy_decode(input, out)
}

/// Hashes an object's bytes as they are written to its staging file.
#[derive(Default)]
pub struct Verifier {
    hash: Sha256,
    bytes: u64,
}

impl Verifier {
    /// Counts `chunk` in.
    pub fn update(&mut self, chunk: &[u8]) {
        self.hash.update(chunk);
        self.bytes += chunk.len() as u64;
    }

    /// Whether what came hashes to `expected` (hex); the hash it had, if not.
    pub fn check(self, expected: &str) -> Result<u64, String> {
        let found = hex::encode(self.hash.finalize());
        if found.eq_ignore_ascii_case(expected) {
            Ok(self.bytes)
        } else {
            Err(found)
        }
    }
}

/// A reader that counts what passes through it.
struct Counted<R> {
    inner: R,
    count: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn stream(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn a_packed_stream_verifies_and_unpacks_to_what_went_in() {
        let input = stream(3 * CHUNK);
        let mut stored = Vec::new();
        let mut chunks = 0;
        let packed = pack(&input[..], |c| {
            assert!(c.len() <= CHUNK);
            chunks += 1;
            stored.extend_from_slice(&c);
            Ok(())
        })
        .unwrap();
        assert!(chunks >= 1);
        assert_eq!(packed.raw_bytes, input.len() as u64);
        assert_eq!(packed.bytes, stored.len() as u64);
        assert!(packed.bytes < packed.raw_bytes / 4, "{packed:?}");
        let mut v = Verifier::default();
        for part in stored.chunks(1000) {
            v.update(part);
        }
        assert_eq!(v.check(&packed.sha256), Ok(packed.bytes));
        let mut out = Vec::new();
        unpack(&stored[..], &mut out).unwrap();
        assert_eq!(out, input);
    }

    #[test]
    fn one_flipped_bit_fails_the_check() {
        let mut stored = Vec::new();
        let packed = pack(&stream(100_000)[..], |c| {
            stored.extend_from_slice(&c);
            Ok(())
        })
        .unwrap();
        let mut v = Verifier::default();
        let mid = stored.len() / 2;
        stored[mid] ^= 1;
        v.update(&stored);
        let found = v.check(&packed.sha256).unwrap_err();
        assert_ne!(found, packed.sha256);
        // The empty stream has a hash too, and it is not anyone else's.
        assert!(Verifier::default().check(&packed.sha256).is_err());
    }

    #[test]
    fn a_sink_that_fails_ends_the_pack() {
        let err = pack(&stream(1000)[..], |_| Err(io::Error::other("store down"))).unwrap_err();
        assert_eq!(err.to_string(), "store down");
    }
}
