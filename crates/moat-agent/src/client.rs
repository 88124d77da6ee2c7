//! The host side of the protocol, over any async byte stream.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::protocol::{AgentMsg, HostMsg};

/// Reads [`AgentMsg`] frames from the agent.
pub struct AgentReader<R> {
    inner: R,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> AgentReader<R> {
    /// Wraps the read half of a connection.
    pub fn new(inner: R) -> Self {
        Self { inner, buf: Vec::new() }
    }

    /// The next message; `None` when the agent closed the connection cleanly.
    pub async fn recv(&mut self) -> io::Result<Option<AgentMsg>> {
        loop {
            match AgentMsg::decode(&self.buf) {
                Ok(Some((msg, used))) => {
                    self.buf.drain(..used);
                    return Ok(Some(msg));
                }
                Ok(None) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            if self.inner.read_buf(&mut self.buf).await? == 0 {
                return if self.buf.is_empty() { Ok(None) } else { Err(io::ErrorKind::UnexpectedEof.into()) };
            }
        }
    }

    /// Bytes that arrived after the last frame, and the read half.
    pub fn into_parts(self) -> (Vec<u8>, R) {
        (self.buf, self.inner)
    }
}

/// Writes one message to the agent.
pub async fn send<W: AsyncWrite + Unpin>(writer: &mut W, msg: &HostMsg) -> io::Result<()> {
    writer.write_all(&msg.encode()).await
}

/// What the agent answered to [`HostMsg::Hand`].
#[derive(Debug)]
pub enum HandAnswer {
    /// The connected socket itself, checked to be a connected TCP socket.
    Socket(std::net::TcpStream),
    /// The agent carries the bytes (a microVM guest): the stream is the
    /// connection now, and these bytes came after the answer.
    Carried(Vec<u8>),
    /// Anything else (an `Error`, most likely).
    Other(AgentMsg),
}

/// Asks the agent on `stream` for a connection to `port` ([`HostMsg::Hand`])
/// and reads its answer ([`hand_answer`]).
pub async fn hand(stream: &mut tokio::net::UnixStream, port: u16) -> io::Result<HandAnswer> {
    send(stream, &HostMsg::Hand { port }).await?;
    hand_answer(stream).await
}

/// Asks the agent on `stream` for a connection to `port` on the box's
/// loopback that it carries the bytes of ([`HostMsg::Connect`]); returns the
/// bytes that came after its `Connected` (the stream is the connection now),
/// or why it could not.
pub async fn connect(stream: &mut tokio::net::UnixStream, port: u16) -> io::Result<Vec<u8>> {
    connected(stream, &HostMsg::Connect { port }).await
}

/// As [`connect`], to the unix socket at `path` in the box ([`HostMsg::ConnectPath`]).
pub async fn connect_path(stream: &mut tokio::net::UnixStream, path: &str) -> io::Result<Vec<u8>> {
    connected(stream, &HostMsg::ConnectPath { path: path.as_bytes().to_vec() }).await
}

async fn connected(stream: &mut tokio::net::UnixStream, ask: &HostMsg) -> io::Result<Vec<u8>> {
    send(stream, ask).await?;
    let mut reader = AgentReader::new(&mut *stream);
    match reader.recv().await? {
        Some(AgentMsg::Connected) => Ok(reader.into_parts().0),
        Some(AgentMsg::Error(why)) => Err(io::Error::new(io::ErrorKind::ConnectionRefused, why)),
        other => Err(io::Error::new(io::ErrorKind::InvalidData, format!("the box's agent answered {other:?}"))),
    }
}

/// Reads the agent's answer to [`HostMsg::Hand`], taking the socket that
/// comes with a `Handed` (and saying so), or asking the agent to carry the
/// bytes when the frame came without one (through a relay: a fleet's other
/// node). A box is hostile: what it hands over must be a connected TCP
/// socket, one, on the `Handed` frame, or the answer is an error (and
/// whatever it sent is closed).
pub async fn hand_answer(stream: &mut tokio::net::UnixStream) -> io::Result<HandAnswer> {
    use std::os::fd::OwnedFd;

    let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("the box's agent {why}"));
    let mut buf = Vec::new();
    let mut handed: Option<OwnedFd> = None;
    loop {
        match AgentMsg::decode(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))? {
            Some((AgentMsg::Handed, used)) if used == buf.len() => {
                let Some(fd) = handed else {
                    send(stream, &HostMsg::Carry).await?;
                    return Ok(HandAnswer::Carried(Vec::new()));
                };
                let tcp = connected_tcp(fd).map_err(|_| invalid("handed over no TCP connection"))?;
                send(stream, &HostMsg::Taken).await?;
                return Ok(HandAnswer::Socket(tcp));
            }
            Some((AgentMsg::Handed, _)) => return Err(invalid("sent bytes after handing over a socket")),
            Some(_) if handed.is_some() => return Err(invalid("attached a descriptor to another answer")),
            Some((AgentMsg::Connected, used)) => return Ok(HandAnswer::Carried(buf.split_off(used))),
            Some((other, _)) => return Ok(HandAnswer::Other(other)),
            None => {}
        }
        let (bytes, fds) = recv_with_fds(stream, &mut buf).await?;
        if bytes == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        for fd in fds {
            if handed.replace(fd).is_some() {
                return Err(invalid("handed over more than one descriptor"));
            }
        }
    }
}

/// Appends what one `recvmsg` brings to `buf`; the count and the descriptors
/// that came with it (more than fit are closed by the kernel, and an error).
async fn recv_with_fds(
    stream: &tokio::net::UnixStream,
    buf: &mut Vec<u8>,
) -> io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
    use std::mem::MaybeUninit;

    let mut chunk = [0u8; 4096];
    let (bytes, fds) = stream
        .async_io(tokio::io::Interest::READABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [io::IoSliceMut::new(&mut chunk)];
            let msg = rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
            let mut fds = Vec::new();
            for cmsg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = cmsg {
                    fds.extend(received);
                }
            }
            if msg.flags.contains(ReturnFlags::CTRUNC) {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "the box's agent sent too many descriptors"));
            }
            Ok((msg.bytes, fds))
        })
        .await?;
    buf.extend_from_slice(chunk.get(..bytes).unwrap_or_default());
    Ok((bytes, fds))
}

/// `fd` as a TCP stream, if it is a connected, non-listening TCP socket.
fn connected_tcp(fd: std::os::fd::OwnedFd) -> io::Result<std::net::TcpStream> {
    use rustix::net::{sockopt, AddressFamily, SocketType};

    let not_tcp = || io::Error::new(io::ErrorKind::InvalidData, "not a connected TCP socket");
    let domain = sockopt::socket_domain(&fd)?;
    if sockopt::socket_type(&fd)? != SocketType::STREAM
        || !(domain == AddressFamily::INET || domain == AddressFamily::INET6)
        || sockopt::socket_acceptconn(&fd)?
    {
        return Err(not_tcp());
    }
    rustix::net::getpeername(&fd).map_err(|_| not_tcp())?;
    let tcp = std::net::TcpStream::from(fd);
    tcp.set_nonblocking(true)?;
    Ok(tcp)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::{IoSlice, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::{AsFd, BorrowedFd};
    use std::os::unix::net::UnixStream;

    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

    use super::*;

    /// What a (hostile) agent sends: `bytes` with `fds` attached, then its close.
    async fn answer(bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<HandAnswer> {
        answer_and_reply(bytes, fds).await.0
    }

    /// The host's answer to what an agent sent, and what the host sent back.
    async fn answer_and_reply(bytes: &[u8], fds: &[BorrowedFd<'_>]) -> (io::Result<HandAnswer>, Vec<u8>) {
        let (host, mut agent) = UnixStream::pair().unwrap();
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        }
        rustix::net::sendmsg(&agent, &[IoSlice::new(bytes)], &mut control, SendFlags::empty()).unwrap();
        agent.shutdown(std::net::Shutdown::Write).unwrap();
        host.set_nonblocking(true).unwrap();
        let mut host = tokio::net::UnixStream::from_std(host).unwrap();
        let answer = hand_answer(&mut host).await;
        drop(host);
        let mut reply = Vec::new();
        agent.read_to_end(&mut reply).unwrap();
        (answer, reply)
    }

    fn tcp_pair() -> (TcpStream, TcpStream, TcpListener) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server, listener)
    }

    #[tokio::test]
    async fn a_handed_tcp_connection_is_taken() {
        let (client, mut server, _listener) = tcp_pair();
        let (answer, reply) = answer_and_reply(&AgentMsg::Handed.encode(), &[client.as_fd()]).await;
        let Ok(HandAnswer::Socket(tcp)) = answer else {
            panic!("no socket");
        };
        assert_eq!(reply, HostMsg::Taken.encode(), "the agent is told the socket was taken");
        drop(client);
        tcp.set_nonblocking(false).unwrap();
        (&tcp).write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        server.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
    }

    #[tokio::test]
    async fn whatever_else_a_box_hands_over_is_refused() {
        let (client, _server, listener) = tcp_pair();
        let (unix, _other) = UnixStream::pair().unwrap();
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        let unconnected =
            rustix::net::socket(rustix::net::AddressFamily::INET, rustix::net::SocketType::STREAM, None).unwrap();
        let handed = AgentMsg::Handed.encode();
        for (what, fds) in [
            ("a listening socket", vec![listener.as_fd()]),
            ("a unix socket", vec![unix.as_fd()]),
            ("a UDP socket", vec![udp.as_fd()]),
            ("a file", vec![file.as_fd()]),
            ("an unconnected socket", vec![unconnected.as_fd()]),
            ("two sockets", vec![client.as_fd(), client.as_fd()]),
        ] {
            let err = answer(&handed, &fds).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{what}: {err}");
        }
        let mut handed_and_more = handed.clone();
        handed_and_more.extend_from_slice(b"GET / HTTP/1.1\r\n");
        assert!(answer(&handed_and_more, &[client.as_fd()]).await.is_err(), "bytes after the socket");
        let error = AgentMsg::Error("nothing listens".into()).encode();
        assert!(answer(&error, &[client.as_fd()]).await.is_err(), "a descriptor on an error");
        assert!(answer(&handed[..3], &[]).await.is_err(), "a cut frame");
    }

    #[tokio::test]
    async fn a_handed_frame_without_its_socket_is_carried_instead() {
        // Through a relay (a fleet's other node) the frame comes, the socket not.
        let (answer, reply) = answer_and_reply(&AgentMsg::Handed.encode(), &[]).await;
        assert!(matches!(answer.unwrap(), HandAnswer::Carried(early) if early.is_empty()));
        assert_eq!(reply, HostMsg::Carry.encode());
    }

    #[tokio::test]
    async fn a_guest_carries_the_bytes_and_an_error_is_an_answer() {
        let mut connected = AgentMsg::Connected.encode();
        connected.extend_from_slice(b"early");
        assert!(matches!(answer(&connected, &[]).await.unwrap(), HandAnswer::Carried(early) if early == b"early"));
        let error = AgentMsg::Error("nothing listens on port 8000 in the box".into()).encode();
        assert!(matches!(answer(&error, &[]).await.unwrap(), HandAnswer::Other(AgentMsg::Error(_))));
    }
}
