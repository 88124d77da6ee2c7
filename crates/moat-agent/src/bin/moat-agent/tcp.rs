//! `Connect`: a TCP connection to a port on the box's own loopback, spliced
//! to the host connection.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use moat_agent::protocol::AgentMsg;

use crate::frames::{self, FrameReader};

pub use moat_agent::CONNECT_TRIES_MS as TRIES_MS;

/// A connection to `port` on the box's loopback, IPv4 first; or the box is
/// told nothing listens there.
fn connect(port: u16, host: &UnixStream) -> io::Result<Option<TcpStream>> {
    let targets = [SocketAddr::from((Ipv4Addr::LOCALHOST, port)), SocketAddr::from((Ipv6Addr::LOCALHOST, port))];
    let connected = targets.iter().find_map(|addr| {
        for ms in TRIES_MS {
            match TcpStream::connect_timeout(addr, Duration::from_millis(ms)) {
                Ok(tcp) => return Some(tcp),
                Err(e) if e.kind() == io::ErrorKind::TimedOut => continue,
                Err(_) => return None,
            }
        }
        None
    });
    if connected.is_none() {
        frames::send(host, &AgentMsg::Error(format!("nothing listens on port {port} in the box")))?;
    }
    Ok(connected)
}

/// Carries bytes both ways between the host connection and `port`.
pub fn splice(port: u16, reader: FrameReader, host: UnixStream) -> io::Result<()> {
    let Some(tcp) = connect(port, &host)? else {
        return Ok(());
    };
    frames::send(&host, &AgentMsg::Connected)?;
    relay(tcp, reader, host)
}

/// A connected socket in the box whose bytes the agent carries.
pub trait Carried: io::Read + io::Write + Send + Sized + 'static {
    fn clone_socket(&self) -> io::Result<Self>;
    fn end(&self, how: Shutdown);
}

impl Carried for TcpStream {
    fn clone_socket(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn end(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

impl Carried for UnixStream {
    fn clone_socket(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn end(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

/// Carries bytes both ways between the host connection and `socket`.
pub fn relay(mut socket: impl Carried, reader: FrameReader, host: UnixStream) -> io::Result<()> {
    let (early, mut from_host) = reader.into_parts();
    socket.write_all(&early)?;

    let mut to_socket = socket.clone_socket()?;
    let upstream = std::thread::Builder::new().spawn(move || {
        let ended = io::copy(&mut from_host, &mut to_socket);
        to_socket.end(Shutdown::Write);
        // The host's writing ended. Once its end is closed whole (the client
        // closed the channel or left), nothing the box's side sends can go
        // anywhere: stop reading it too, or a server that sends nothing and
        // never closes would hold this relay (a thread and a connection of
        // the box's) for good.
        if ended.is_ok() {
            moat_agent::hangup::wait(&from_host);
            to_socket.end(Shutdown::Read);
        }
    })?;
    let mut to_host = host;
    let _ = io::copy(&mut socket, &mut to_host);
    let _ = to_host.shutdown(Shutdown::Write);
    let _ = upstream.join();
    Ok(())
}
