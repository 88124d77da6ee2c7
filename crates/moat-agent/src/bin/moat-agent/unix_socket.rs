//! `ConnectPath`: a connection to a unix stream socket in the box (`ssh -L`
//! to a socket path, as an IDE's server or a Docker daemon listen), its bytes
//! carried over the host connection as for `Connect`.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use moat_agent::protocol::AgentMsg;
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};

use crate::frames::{self, FrameReader};
use crate::tcp::{self, TRIES_MS};

/// Connects to the socket at `path` and carries bytes both ways, or tells
/// the host why it cannot.
pub fn splice(path: &[u8], reader: FrameReader, host: UnixStream) -> io::Result<()> {
    match connect_to(path) {
        Ok(socket) => {
            frames::send(&host, &AgentMsg::Connected)?;
            tcp::relay(socket, reader, host)
        }
        Err(why) => frames::send(&host, &AgentMsg::Error(why)),
    }
}

/// `path` as a socket's path: absolute, at most 107 bytes (what a socket
/// address holds), no NUL among them; or why it is not one.
pub fn socket_path(path: &[u8]) -> Result<&Path, String> {
    if !path.starts_with(b"/") || path.contains(&0) || path.len() > 107 {
        let shown = String::from_utf8_lossy(path);
        return Err(format!("{shown:?} is not an absolute socket path (at most 107 bytes)"));
    }
    Ok(Path::new(OsStr::from_bytes(path)))
}

/// A connection to the socket at `path` (see [`socket_path`]). A listener
/// whose queue is full is tried again (a non-blocking connect says so at
/// once) for about 5 s, as a port is.
fn connect_to(path: &[u8]) -> Result<UnixStream, String> {
    let path = socket_path(path)?;
    let shown = path.display();
    let addr = UnixAddr::new(path).map_err(|e| format!("{shown}: {e}"))?;
    for ms in TRIES_MS {
        let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)
            .map_err(|e| format!("socket: {e}"))?;
        match connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
            Ok(()) => {
                let stream = UnixStream::from(fd);
                stream.set_nonblocking(false).map_err(|e| format!("{shown}: {e}"))?;
                return Ok(stream);
            }
            Err(nix::errno::Errno::EAGAIN) => std::thread::sleep(Duration::from_millis(ms)),
            Err(e) => return Err(format!("cannot connect to {shown} in the box: {e}")),
        }
    }
    Err(format!("{shown} in the box accepts no connection"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_absolute_paths_that_fit() {
        for bad in [&b""[..], b"relative.sock", b"/a\0b", &[b'/'; 108]] {
            assert!(connect_to(bad).is_err(), "{bad:?}");
        }
        let err = connect_to(b"/nonexistent/moat-test.sock").unwrap_err();
        assert!(err.contains("cannot connect"), "{err}");
    }

    #[test]
    fn a_listening_socket_is_reached() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut stream = connect_to(path.as_os_str().as_bytes()).unwrap();
        let (mut accepted, _) = listener.accept().unwrap();
        io::Write::write_all(&mut stream, b"hi").unwrap();
        let mut got = [0u8; 2];
        io::Read::read_exact(&mut accepted, &mut got).unwrap();
        assert_eq!(&got, b"hi");
    }
}
