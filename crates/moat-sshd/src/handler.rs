//! The per-connection russh handler: public-key authentication and channel
//! routing. Everything it does not implement, russh refuses.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use moat_core::{AccountId, BoxManager};
use russh::server::{Auth, ChannelOpenHandle, Msg, PublicKeyOffer, Session, VerifiedPublicKey};
use russh::{Channel, ChannelOpenFailure};

use crate::auth::AuthorizedKeys;
use crate::boxchan::{self, ChannelCtx};
use crate::forward;
use crate::ratelimit::LogLimit;
use crate::server::UnauthSlot;

/// What every connection shares.
pub struct Shared {
    /// The box manager.
    pub manager: Arc<BoxManager>,
    /// Who may log in.
    pub keys: AuthorizedKeys,
}

/// Most channels (sessions and forwards) open at once on one connection, as
/// OpenSSH's MaxSessions; each holds a connection to a box's agent.
const MAX_CHANNELS: usize = 32;

/// Counts an open channel of a connection; given back on drop.
struct ChannelSlot(Arc<AtomicUsize>);

impl ChannelSlot {
    fn take(open: &Arc<AtomicUsize>) -> Option<Self> {
        let was = open.fetch_add(1, Ordering::Relaxed);
        if was >= MAX_CHANNELS {
            open.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Self(Arc::clone(open)))
    }
}

impl Drop for ChannelSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One connection's state.
pub struct ConnHandler {
    shared: Arc<Shared>,
    peer: Option<SocketAddr>,
    login: Option<(AccountId, String)>,
    /// Held until authentication succeeds, bounding unauthenticated connections.
    slot: Option<UnauthSlot>,
    authenticated: Arc<AtomicBool>,
    channels: Arc<AtomicUsize>,
}

impl ConnHandler {
    /// A handler for a new connection from `peer`.
    pub fn new(
        shared: Arc<Shared>,
        peer: Option<SocketAddr>,
        slot: UnauthSlot,
        authenticated: Arc<AtomicBool>,
    ) -> Self {
        Self { shared, peer, login: None, slot: Some(slot), authenticated, channels: Arc::default() }
    }

    /// Lets a new channel in if the connection is authenticated and under its
    /// channel limit; otherwise refuses it (dropping the reply refuses too).
    /// (`ctx` comes from `Self::ctx`: the session itself may not be held across
    /// the rejection's await.)
    async fn admit(
        &self,
        ctx: Option<ChannelCtx>,
        reply: ChannelOpenHandle,
    ) -> Option<(ChannelCtx, ChannelSlot, ChannelOpenHandle)> {
        let ctx = ctx?;
        match ChannelSlot::take(&self.channels) {
            Some(slot) => Some((ctx, slot, reply)),
            None => {
                reply.reject(ChannelOpenFailure::ResourceShortage).await;
                None
            }
        }
    }

    fn ctx(&self, session: &Session) -> Option<ChannelCtx> {
        let (account, user) = self.login.clone()?;
        Some(ChannelCtx { manager: Arc::clone(&self.shared.manager), account, user, handle: session.handle() })
    }
}

impl russh::server::Handler for ConnHandler {
    type Error = russh::Error;

    async fn auth_publickey_offered(&mut self, _user: &str, offer: PublicKeyOffer<'_>) -> Result<Auth, Self::Error> {
        // Refuse unknown keys before the client bothers to sign with them.
        Ok(match self.shared.keys.account_for(offer.public_key) {
            Some(_) => Auth::Accept,
            None => Auth::reject(),
        })
    }

    async fn auth_publickey(&mut self, user: &str, key: VerifiedPublicKey<'_>) -> Result<Auth, Self::Error> {
        match self.shared.keys.account_for(key.public_key) {
            Some(account) => {
                tracing::info!(peer = ?self.peer, %account, user, "authenticated");
                self.login = Some((account, user.to_string()));
                Ok(Auth::Accept)
            }
            None => {
                static LIMIT: LogLimit = LogLimit::every(1000);
                if let Some(dropped) = LIMIT.allow() {
                    tracing::info!(peer = ?self.peer, user, dropped, "rejected key");
                }
                Ok(Auth::reject())
            }
        }
    }

    async fn auth_succeeded(&mut self, _session: &mut Session) -> Result<(), Self::Error> {
        self.authenticated.store(true, Ordering::Relaxed);
        self.slot = None;
        Ok(())
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some((ctx, slot, reply)) = self.admit(self.ctx(session), reply).await else {
            return Ok(());
        };
        reply.accept().await;
        tokio::spawn(async move {
            boxchan::serve(channel, ctx).await;
            drop(slot);
        });
        Ok(())
    }

    async fn channel_open_direct_tcpip(
        &mut self,
        channel: Channel<Msg>,
        host_to_connect: &str,
        port_to_connect: u32,
        _originator_address: &str,
        _originator_port: u32,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some((ctx, slot, reply)) = self.admit(self.ctx(session), reply).await else {
            return Ok(());
        };
        let host = host_to_connect.to_string();
        tokio::spawn(async move {
            forward::open(channel, reply, ctx, host, port_to_connect).await;
            drop(slot);
        });
        Ok(())
    }
}
