//! Copies between two sockets without the bytes passing through the
//! gateway's memory: splice(2) from one socket into a pipe and from the pipe
//! into the other. For the bytes the gateway never reads: TLS it passes
//! through, raw TCP a rule allows, and plain HTTP responses.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::pipe::{pipe_with, splice, PipeFlags, SpliceFlags};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Most bytes moved by one call.
const CHUNK: usize = 1 << 20;

/// Copies `from` to `to` until `from` ends, then ends `to`'s writing half;
/// counts what it copied into `copied` as it goes.
pub async fn copy(from: &TcpStream, to: &TcpStream, copied: &AtomicU64) -> io::Result<()> {
    let (pipe_out, pipe_in): (OwnedFd, OwnedFd) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
    let flags = SpliceFlags::MOVE | SpliceFlags::NONBLOCK;
    let mut in_pipe = 0usize;
    loop {
        if in_pipe == 0 {
            from.readable().await?;
            match from.try_io(Interest::READABLE, || Ok(splice(from, None, &pipe_in, None, CHUNK, flags)?)) {
                Ok(0) => break,
                Ok(n) => in_pipe = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        to.writable().await?;
        match to.try_io(Interest::WRITABLE, || Ok(splice(&pipe_out, None, to, None, in_pipe, flags)?)) {
            Ok(n) => {
                in_pipe -= n;
                copied.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    let _ = rustix::net::shutdown(to, rustix::net::Shutdown::Write);
    Ok(())
}

/// Copies both ways until both sides are done, adding the bytes `a` sent `b`
/// to `there` and those `b` sent `a` to `back` as they go (so that they are
/// known if the copy is dropped midway).
pub async fn bidirectional(a: &TcpStream, b: &TcpStream, there: &AtomicU64, back: &AtomicU64) -> io::Result<()> {
    let (r1, r2) = tokio::join!(copy(a, b, there), copy(b, a, back));
    r1.and(r2)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_and_ends_cross_both_ways() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // client <-> (a, b) <-> server, with the splicer between a and b.
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (a, _) = listener.accept().await.unwrap();
        let mut server_side = TcpStream::connect(addr).await.unwrap();
        let (b, _) = listener.accept().await.unwrap();
        let splicer = tokio::spawn(async move {
            let (there, back) = (AtomicU64::new(0), AtomicU64::new(0));
            bidirectional(&a, &b, &there, &back).await.map(|()| (there.into_inner(), back.into_inner()))
        });
        let big: Vec<u8> = (0..5_000_000u32).map(|i| i as u8).collect();
        let sent = big.clone();
        let writer = tokio::spawn(async move {
            client.write_all(&sent).await.unwrap();
            client.shutdown().await.unwrap();
            let mut answer = Vec::new();
            client.read_to_end(&mut answer).await.unwrap();
            answer
        });
        let mut got = Vec::new();
        server_side.read_to_end(&mut got).await.unwrap();
        assert!(got == big, "bytes differ");
        server_side.write_all(b"done").await.unwrap();
        server_side.shutdown().await.unwrap();
        assert_eq!(writer.await.unwrap(), b"done");
        assert_eq!(splicer.await.unwrap().unwrap(), (5_000_000, 4));
    }
}
