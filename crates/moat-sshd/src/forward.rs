//! `ssh -L`: direct-tcpip channels to a port on a box's own loopback, and
//! direct-streamlocal channels to a unix socket in the box.
//!
//! Only loopback targets are accepted: a forward is a way into the box, never a
//! way for the client to use the box (or the host) as a proxy.

use std::future::Future;
use std::io;
use std::pin::pin;
use std::time::Duration;

use moat_agent::client::{connect, connect_path};
use moat_api::Lease;
use moat_core::Name;
use russh::server::{ChannelOpenHandle, Msg};
use russh::{Channel, ChannelMsg, ChannelOpenFailure, ChannelReadHalf, ChannelWriteHalf};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

use crate::boxchan::{ChannelCtx, Target};
use crate::ratelimit::LogLimit;

/// Whether `host` names the box's own loopback: a loopback name or address,
/// `0.0.0.0` (which Linux connects to the loopback, as sshd's connect would),
/// or the box's own host name (what a dev server in it prints in its URL).
pub fn names_the_box(host: &str, name: &Name) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1" | "[::1]" | "ip6-localhost" | "0.0.0.0")
        || host.eq_ignore_ascii_case(name.as_str())
}

/// How long a box's agent may take to say whether it connected (it tries a
/// listener whose queue is full for about 5 s); one that does not answer (a
/// wedged agent, a guest that stopped reading) gets the channel refused,
/// not left unanswered.
pub(crate) const AGENT_ANSWER: Duration = Duration::from_secs(15);

/// `work`, or a timeout error once `limit` has passed.
pub(crate) async fn within<T>(limit: Duration, work: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(limit, work).await.unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

/// Opens a forward to `host:port` in the channel's box, or refuses it.
pub async fn open(channel: Channel<Msg>, reply: ChannelOpenHandle, ctx: ChannelCtx, host: String, port: u32) {
    let (name, port) = match (ctx.target().await, u16::try_from(port)) {
        (Target::Box(name), Ok(port)) if names_the_box(&host, &name) => (name, port),
        _ => {
            static LIMIT: LogLimit = LogLimit::every(1000);
            if let Some(dropped) = LIMIT.allow() {
                tracing::info!(user = ?ctx.user, ?host, port, dropped, "refused port forward");
            }
            return reply.reject(ChannelOpenFailure::AdministrativelyProhibited).await;
        }
    };
    let Ok((mut stream, session)) = ctx.connect(&name).await else {
        return reply.reject(ChannelOpenFailure::ConnectFailed).await;
    };
    match within(AGENT_ANSWER, connect(&mut stream, port)).await {
        Ok(early) => {
            reply.accept().await;
            carry_while(&session, &ctx, channel, early, stream).await;
        }
        Err(_) => reply.reject(ChannelOpenFailure::ConnectFailed).await,
    }
}

/// Opens a forward to the unix socket at `path` in the channel's box (its
/// agent connects and carries the bytes), or refuses it.
pub async fn open_path(channel: Channel<Msg>, reply: ChannelOpenHandle, ctx: ChannelCtx, path: String) {
    let Target::Box(name) = ctx.target().await else {
        return reply.reject(ChannelOpenFailure::AdministrativelyProhibited).await;
    };
    let Ok((mut stream, session)) = ctx.connect(&name).await else {
        return reply.reject(ChannelOpenFailure::ConnectFailed).await;
    };
    match within(AGENT_ANSWER, connect_path(&mut stream, &path)).await {
        Ok(early) => {
            reply.accept().await;
            carry_while(&session, &ctx, channel, early, stream).await;
        }
        Err(e) => {
            static LIMIT: LogLimit = LogLimit::every(1000);
            if let Some(dropped) = LIMIT.allow() {
                tracing::info!(user = ?ctx.user, ?path, error = ?e.to_string(), dropped, "socket forward not connected");
            }
            reply.reject(ChannelOpenFailure::ConnectFailed).await
        }
    }
}

/// [`carry`] for as long as the session lasts: access to the box taken
/// away closes the channel (and the stream to the box with it).
pub(crate) async fn carry_while(
    session: &Lease,
    ctx: &ChannelCtx,
    channel: Channel<Msg>,
    early: Vec<u8>,
    stream: UnixStream,
) {
    let id = channel.id();
    if crate::boxchan::while_leased(session, carry(channel, early, stream)).await {
        let _ = ctx.handle.close(id).await;
    }
}

/// Carries bytes between the open channel and the agent's stream (`early`
/// came after the agent's answer), each way to its end then a half-close, as
/// sshd does, until both ways have ended or the client closes the channel. A
/// closed channel's window never opens again: the box's bytes still on their
/// way to it are dropped then, not waited for (a server in the box still
/// streaming would otherwise hold the forward for good).
async fn carry(channel: Channel<Msg>, early: Vec<u8>, stream: UnixStream) {
    let (mut rx, tx) = channel.split();
    let (mut from_box, mut to_box) = stream.into_split();
    let mut sending = pin!(to_client(&mut from_box, &tx, early));
    let mut receiving = Box::pin(from_client(&mut rx, &mut to_box));
    let mut box_done = false;
    // `None`: the box's side failed, so nothing more can reach it or come
    // from it.
    let end = tokio::select! {
        end = &mut receiving => Some(end),
        sent = &mut sending => {
            box_done = true;
            match sent {
                // The box's side ended cleanly: the client's end ends the channel.
                Ok(()) => Some((&mut receiving).await),
                Err(_) => None,
            }
        }
    };
    drop(receiving);
    match end {
        Some(ClientEnd::Closed) => return,
        Some(ClientEnd::Eof) if !box_done => {
            tokio::select! {
                _ = &mut sending => {}
                () = closed(&mut rx) => return,
            }
        }
        _ => {}
    }
    let _ = tx.close().await;
}

/// Bytes read from the box at a time: a whole SSH packet's worth and more
/// (tokio's copy reads 8 KiB, so its packets were a quarter full).
const COPY_BUF: usize = 64 << 10;

/// How the client's side of a forward ended.
enum ClientEnd {
    /// It sent EOF: it sends nothing more, and may still read.
    Eof,
    /// It closed the channel, or the connection ended.
    Closed,
}

/// The client's bytes to the box, to the client's EOF (then the box's side
/// is shut for writing) or its close. Once the box stops taking them, the
/// rest are dropped.
async fn from_client(rx: &mut ChannelReadHalf, to_box: &mut OwnedWriteHalf) -> ClientEnd {
    let mut box_takes = true;
    while let Some(msg) = rx.wait().await {
        match msg {
            ChannelMsg::Data { data } if box_takes => box_takes = to_box.write_all(&data).await.is_ok(),
            ChannelMsg::Eof => {
                let _ = to_box.shutdown().await;
                return ClientEnd::Eof;
            }
            ChannelMsg::Close => break,
            _ => {}
        }
    }
    ClientEnd::Closed
}

/// Waits for the client's close, dropping whatever else it sends.
async fn closed(rx: &mut ChannelReadHalf) {
    while let Some(msg) = rx.wait().await {
        if matches!(msg, ChannelMsg::Close) {
            return;
        }
    }
}

/// The box's bytes to the client (`early` first), then EOF.
async fn to_client(from_box: &mut OwnedReadHalf, tx: &ChannelWriteHalf<Msg>, early: Vec<u8>) -> io::Result<()> {
    let mut writer = tx.make_writer();
    writer.write_all(&early).await?;
    tokio::io::copy_buf(&mut tokio::io::BufReader::with_capacity(COPY_BUF, from_box), &mut writer).await?;
    tx.eof().await.map_err(io::Error::other)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_the_boxs_own_loopback() {
        let web = Name::new("web").unwrap();
        for ours in ["localhost", "127.0.0.1", "::1", "0.0.0.0", "web", "WEB"] {
            assert!(names_the_box(ours, &web), "{ours}");
        }
        for other in ["10.0.0.1", "example.com", "127.0.0.2", "", "localhost.evil.com", "web2", "web.example.com"] {
            assert!(!names_the_box(other, &web), "{other}");
        }
    }
}
