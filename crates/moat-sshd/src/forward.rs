//! `ssh -L`: direct-tcpip channels to a port on a box's own loopback, and
//! direct-streamlocal channels to a unix socket in the box.
//!
//! Only loopback targets are accepted: a forward is a way into the box, never a
//! way for the client to use the box (or the host) as a proxy.

use moat_agent::client::{connect, connect_path};
use russh::server::{ChannelOpenHandle, Msg};
use russh::{Channel, ChannelOpenFailure};
use tokio::io::AsyncWriteExt;

use crate::boxchan::{ChannelCtx, Target};
use crate::ratelimit::LogLimit;

/// Whether `host` names the box's own loopback.
pub fn is_loopback(host: &str) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1" | "[::1]" | "ip6-localhost")
}

/// Opens a forward to `host:port` in the channel's box, or refuses it.
pub async fn open(channel: Channel<Msg>, reply: ChannelOpenHandle, ctx: ChannelCtx, host: String, port: u32) {
    let (name, port) = match (ctx.target().await, u16::try_from(port)) {
        (Target::Box(name), Ok(port)) if is_loopback(&host) => (name, port),
        _ => {
            static LIMIT: LogLimit = LogLimit::every(1000);
            if let Some(dropped) = LIMIT.allow() {
                tracing::info!(user = %ctx.user, %host, port, dropped, "refused port forward");
            }
            return reply.reject(ChannelOpenFailure::AdministrativelyProhibited).await;
        }
    };
    let Ok((mut stream, _session)) = ctx.connect(&name).await else {
        return reply.reject(ChannelOpenFailure::ConnectFailed).await;
    };
    match connect(&mut stream, port).await {
        Ok(early) => carry(channel, reply, early, stream).await,
        Err(_) => reply.reject(ChannelOpenFailure::ConnectFailed).await,
    }
}

/// Opens a forward to the unix socket at `path` in the channel's box (its
/// agent connects and carries the bytes), or refuses it.
pub async fn open_path(channel: Channel<Msg>, reply: ChannelOpenHandle, ctx: ChannelCtx, path: String) {
    let Target::Box(name) = ctx.target().await else {
        return reply.reject(ChannelOpenFailure::AdministrativelyProhibited).await;
    };
    let Ok((mut stream, _session)) = ctx.connect(&name).await else {
        return reply.reject(ChannelOpenFailure::ConnectFailed).await;
    };
    match connect_path(&mut stream, &path).await {
        Ok(early) => carry(channel, reply, early, stream).await,
        Err(e) => {
            static LIMIT: LogLimit = LogLimit::every(1000);
            if let Some(dropped) = LIMIT.allow() {
                tracing::info!(user = %ctx.user, %path, error = %e, dropped, "socket forward not connected");
            }
            reply.reject(ChannelOpenFailure::ConnectFailed).await
        }
    }
}

/// Accepts the channel and splices it to the agent's stream, which carries
/// the bytes now (`early` came after the agent's answer).
async fn carry(channel: Channel<Msg>, reply: ChannelOpenHandle, early: Vec<u8>, stream: tokio::net::UnixStream) {
    reply.accept().await;
    let mut ssh = channel.into_stream();
    if ssh.write_all(&early).await.is_ok() {
        moat_core::splice::both_ways(ssh, stream).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_targets() {
        assert!(is_loopback("localhost") && is_loopback("127.0.0.1") && is_loopback("::1"));
        for other in ["10.0.0.1", "example.com", "127.0.0.2", "0.0.0.0", "", "localhost.evil.com"] {
            assert!(!is_loopback(other), "{other}");
        }
    }
}
