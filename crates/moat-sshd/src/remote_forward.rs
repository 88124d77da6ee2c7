//! `ssh -R`: a port on the box's loopback, or a unix socket in the box, whose
//! connections go to the client.
//!
//! A forward holds a connection to the box's agent, which listens for as
//! long as it lasts, and a session of the box (it stays awake meanwhile, as
//! for any open channel; access taken away ends the forward). Each
//! connection a program in the box makes to the port is taken on a
//! connection of its own and carried over a `forwarded-tcpip` channel opened
//! to the client, counted as the client's own channels are. The port is
//! always on the box's loopback, whatever address the client named (sshd's
//! `GatewayPorts no`): nothing outside the box could reach another.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use moat_agent::client::{listen, listen_path, take, AgentReader};
use moat_agent::protocol::AgentMsg;
use moat_api::Lease;
use moat_core::Name;
use tokio::net::UnixStream;
use tokio::sync::watch;

use crate::boxchan::{while_leased, ChannelCtx, Target};
use crate::handler::{spawn_channel, ChannelKind, ChannelRoom};
use crate::ratelimit::LogLimit;
use crate::task::AbortOnDrop;

/// Most forwards one connection holds at once.
const MOST: usize = 16;

/// How long the box may take to listen (a parked VM box boots first). The
/// connection waits meanwhile: russh answers a global request in turn.
const LISTEN_WITHIN: Duration = Duration::from_secs(15);

/// What a forward listens on, as the client names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Listened {
    /// `tcpip-forward`: an address (only a name: the port is the box's
    /// loopback's) and a port.
    Port(String, u16),
    /// `streamlocal-forward@openssh.com`: a unix socket's path in the box.
    Path(String),
}

/// A connection's forwards, by what the client names them by.
#[derive(Default)]
pub struct RemoteForwards {
    open: HashMap<Listened, AbortOnDrop>,
}

impl RemoteForwards {
    /// Listens on `asked` in the box the connection's user names, for the
    /// client; what it listens on (a port asked as 0 is one chosen), if it
    /// does.
    pub(crate) async fn add(
        &mut self,
        ctx: ChannelCtx,
        room: ChannelRoom,
        ended: watch::Receiver<()>,
        asked: Listened,
    ) -> Option<Listened> {
        self.open.retain(|_, forward| !forward.0.is_finished());
        if self.open.len() >= MOST || self.open.contains_key(&asked) {
            return None;
        }
        // Held while it listens, as a forward's channel is.
        let place = match room.take(&ctx.account, ChannelKind::Forward) {
            Ok(place) => place,
            Err(why) => {
                static LIMIT: LogLimit = LogLimit::every(1000);
                if let Some(dropped) = LIMIT.allow() {
                    tracing::warn!(account = %ctx.account, dropped, "a remote forward refused: {why}");
                }
                return None;
            }
        };
        let Target::Box(name) = ctx.target().await else {
            return None;
        };
        let listening = tokio::time::timeout(LISTEN_WITHIN, async {
            let (stream, session) = ctx.connect(&name).await.map_err(|e| e.message)?;
            let listened = match &asked {
                Listened::Port(address, port) => {
                    let (bound, arrivals) = listen(stream, *port).await.map_err(|e| e.to_string())?;
                    (Listened::Port(address.clone(), bound), arrivals)
                }
                Listened::Path(path) => {
                    let arrivals = listen_path(stream, path).await.map_err(|e| e.to_string())?;
                    (asked.clone(), arrivals)
                }
            };
            Ok::<_, String>((listened, session))
        });
        let ((listened, arrivals), session) = match listening.await {
            Ok(Ok(listening)) => listening,
            failed => {
                let why = failed.unwrap_or_else(|_| Err("the box did not answer".into())).err();
                static LIMIT: LogLimit = LogLimit::every(1000);
                if let Some(dropped) = LIMIT.allow() {
                    tracing::info!(user = ?ctx.user, ?asked, ?why, dropped, "remote forward refused");
                }
                return None;
            }
        };
        let forward = Arc::new(Forward { ctx, room, ended, name, listened: listened.clone() });
        let run = forward.run(arrivals, session);
        self.open.insert(
            listened.clone(),
            AbortOnDrop(tokio::spawn(async move {
                run.await;
                drop(place);
            })),
        );
        Some(listened)
    }

    /// Stops listening on a forward's port or socket (its connections go
    /// on); whether there was such a forward.
    pub fn cancel(&mut self, listened: &Listened) -> bool {
        self.open.remove(listened).is_some()
    }
}

/// One listening port or socket.
struct Forward {
    ctx: ChannelCtx,
    room: ChannelRoom,
    /// Changes when the connection ends: every carried channel ends then.
    ended: watch::Receiver<()>,
    name: Name,
    /// What the client names it by, for its channels.
    listened: Listened,
}

impl Forward {
    /// Takes each connection the agent tells of, until it stops telling (the
    /// box stopped, or said something else) or the session ends.
    async fn run(self: Arc<Self>, mut arrivals: AgentReader<UnixStream>, session: Lease) {
        while_leased(&session, async {
            while let Ok(Some(AgentMsg::Arrived { id, from_port })) = arrivals.recv().await {
                match self.room.take(&self.ctx.account, ChannelKind::Forward) {
                    Ok(slot) => spawn_channel(self.ended.clone(), slot, Arc::clone(&self).carry(id, from_port)),
                    // Left waiting, the connection is closed by the agent.
                    Err(why) => {
                        static LIMIT: LogLimit = LogLimit::every(1000);
                        if let Some(dropped) = LIMIT.allow() {
                            tracing::warn!(account = %self.ctx.account, dropped, "a forwarded connection refused: {why}");
                        }
                    }
                }
            }
        })
        .await;
    }

    /// Carries the box's connection `id` over a channel to the client.
    async fn carry(self: Arc<Self>, id: u64, from_port: u16) {
        let Ok((mut stream, session)) = self.ctx.connect(&self.name).await else {
            return;
        };
        let Ok(early) = crate::forward::within(crate::forward::AGENT_ANSWER, take(&mut stream, id)).await else {
            return;
        };
        let handle = &self.ctx.handle;
        let channel = match &self.listened {
            Listened::Port(address, port) => {
                let (address, port) = (address.clone(), u32::from(*port));
                handle.channel_open_forwarded_tcpip(address, port, "127.0.0.1", u32::from(from_port)).await
            }
            Listened::Path(path) => handle.channel_open_forwarded_streamlocal(path.clone()).await,
        };
        // The client refusing it (its own target down) closes the box's end.
        let Ok(channel) = channel else {
            return;
        };
        crate::forward::carry_while(&session, &self.ctx, channel, early, stream).await;
    }
}
