//! `Connect`: a TCP connection to a port on the box's own loopback, spliced to
//! the host connection.

use std::io::{self, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use moat_agent::protocol::AgentMsg;

use crate::frames::{self, FrameReader};

pub fn splice(port: u16, reader: FrameReader, host: UnixStream) -> io::Result<()> {
    let targets = [SocketAddr::from((Ipv4Addr::LOCALHOST, port)), SocketAddr::from((Ipv6Addr::LOCALHOST, port))];
    let connected =
        targets.iter().map(|addr| TcpStream::connect_timeout(addr, Duration::from_secs(5))).find_map(Result::ok);
    let Some(mut tcp) = connected else {
        return frames::send(&host, &AgentMsg::Error(format!("nothing listens on port {port} in the box")));
    };
    frames::send(&host, &AgentMsg::Connected)?;
    let (early, mut from_host) = reader.into_parts();
    tcp.write_all(&early)?;

    let mut to_tcp = tcp.try_clone()?;
    let upstream = std::thread::Builder::new().spawn(move || {
        let _ = io::copy(&mut from_host, &mut to_tcp);
        let _ = to_tcp.shutdown(Shutdown::Write);
    })?;
    let mut to_host = host;
    let _ = io::copy(&mut tcp, &mut to_host);
    let _ = to_host.shutdown(Shutdown::Write);
    let _ = upstream.join();
    Ok(())
}
