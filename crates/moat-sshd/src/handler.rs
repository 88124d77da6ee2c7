//! The per-connection russh handler: public-key authentication and channel
//! routing. Everything it does not implement, russh refuses.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use moat_api::ApiClient;
use moat_core::slots::Slot;
use moat_core::AccountId;
use russh::server::{Auth, ChannelOpenHandle, Msg, PublicKeyOffer, Session, VerifiedPublicKey};
use russh::{Channel, ChannelId, ChannelOpenFailure};
use tokio::sync::watch;

use crate::accounts::{AccountLoad, CHANNELS_PER_ACCOUNT, CONNECTIONS_PER_ACCOUNT};
use crate::boxchan::{self, ChannelCtx};
use crate::forward;
use crate::ratelimit::LogLimit;
use crate::remote_forward::{Listened, RemoteForwards};
use crate::server::UnauthSlot;
use crate::setup::ChannelSetup;

/// What every connection shares.
pub struct Shared {
    /// The privileged side: accounts, boxes, sessions.
    pub api: ApiClient,
    /// What each account holds.
    pub load: AccountLoad,
}

/// Most session channels (shells, commands, sftp, verbs) open at once on
/// one connection, as OpenSSH's MaxSessions; each holds a connection to a
/// box's agent.
const MAX_SESSIONS: usize = 32;

/// Most forwarded connections (`-L`, `-D`, and each `-R` port and what it
/// carries) open at once on one connection. OpenSSH bounds them by nothing
/// but its file descriptors; here each holds a connection to the privileged
/// side, so they are bounded, apart from sessions (an IDE's tunnels and
/// what a program in the box opens through `-R` must not take the client's
/// sessions), and the account's places bound them all.
const MAX_FORWARDS: usize = 256;

/// What a channel is, for the bound of its kind on its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChannelKind {
    /// A session channel.
    Session,
    /// A forward, or a `-R` port.
    Forward,
}

/// Counts an open channel of a connection, and holds its account's place
/// for it; given back on drop.
pub(crate) struct ChannelSlot {
    open: Arc<AtomicUsize>,
    _account: Slot<AccountId>,
}

impl Drop for ChannelSlot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Room for one connection's channels: its own count of each kind, and its
/// account's places.
#[derive(Clone)]
pub(crate) struct ChannelRoom {
    shared: Arc<Shared>,
    sessions: Arc<AtomicUsize>,
    forwards: Arc<AtomicUsize>,
}

impl ChannelRoom {
    fn new(shared: Arc<Shared>) -> Self {
        Self { shared, sessions: Arc::default(), forwards: Arc::default() }
    }

    /// A place for one more channel of `kind` of `account`'s, or why there
    /// is none.
    pub(crate) fn take(&self, account: &AccountId, kind: ChannelKind) -> Result<ChannelSlot, String> {
        let Some(place) = self.shared.load.channel(account) else {
            return Err(format!("the account has the most channels open ({CHANNELS_PER_ACCOUNT})"));
        };
        let (open, most, what) = match kind {
            ChannelKind::Session => (&self.sessions, MAX_SESSIONS, "sessions"),
            ChannelKind::Forward => (&self.forwards, MAX_FORWARDS, "forwards"),
        };
        if open.fetch_add(1, Ordering::Relaxed) >= most {
            open.fetch_sub(1, Ordering::Relaxed);
            return Err(format!("the connection has the most {what} open ({most})"));
        }
        Ok(ChannelSlot { open: Arc::clone(open), _account: place })
    }
}

/// Runs a channel's task (holding `slot`) until it ends or the connection
/// does (`ended` changes: its sender is the connection's handler). A write
/// to a channel waits for the client's window, which a client that left (or
/// stopped reading, then left) never opens again: without this, such a task
/// would wait forever, holding the box awake and its processes' pipes open,
/// and the agent's writes blocked.
pub(crate) fn spawn_channel(
    mut ended: watch::Receiver<()>,
    slot: ChannelSlot,
    task: impl Future<Output = ()> + Send + 'static,
) {
    tokio::spawn(async move {
        tokio::select! {
            () = task => {}
            // (Nothing is ever sent: this is the sender's drop.)
            _ = ended.changed() => {}
        }
        drop(slot);
    });
}

/// One connection's state.
pub struct ConnHandler {
    shared: Arc<Shared>,
    peer: Option<SocketAddr>,
    /// The address the client connected to.
    local: Option<SocketAddr>,
    login: Option<(AccountId, String)>,
    /// Held until authentication succeeds, bounding unauthenticated connections.
    slot: Option<UnauthSlot>,
    /// Its account's place for it, once authenticated (`None` then: the
    /// account had none left, and the connection is ended).
    account_place: Option<Slot<AccountId>>,
    authenticated: Arc<AtomicBool>,
    channels: ChannelRoom,
    /// Each open session channel's setup (environment, program chosen). Weak:
    /// the channel's task owns it, so an entry dies with its channel even when
    /// russh never reports the close (it drops the client's reply to ours).
    setups: HashMap<ChannelId, Weak<ChannelSetup>>,
    /// The ports the client asked the box to forward to it (`ssh -R`).
    remote_forwards: RemoteForwards,
    /// Dropped with the handler, when the connection ends: every channel's
    /// task ends then too (see [`spawn_channel`]).
    ended: watch::Sender<()>,
}

impl ConnHandler {
    /// A handler for a new connection from `peer`.
    pub fn new(
        shared: Arc<Shared>,
        (peer, local): (Option<SocketAddr>, Option<SocketAddr>),
        slot: UnauthSlot,
        authenticated: Arc<AtomicBool>,
    ) -> Self {
        Self {
            channels: ChannelRoom::new(Arc::clone(&shared)),
            shared,
            peer,
            local,
            login: None,
            slot: Some(slot),
            account_place: None,
            authenticated,
            setups: HashMap::new(),
            remote_forwards: RemoteForwards::default(),
            ended: watch::Sender::new(()),
        }
    }

    /// Listens in the box for the client (`ssh -R`); what on, if it does.
    /// (`ctx` comes from `Self::ctx`: the session may not be held across an await.)
    async fn remote_forward(&mut self, asked: Listened, ctx: Option<ChannelCtx>) -> Option<Listened> {
        let ctx = ctx?;
        let room = self.channels.clone();
        self.remote_forwards.add(ctx, room, self.ended.subscribe(), asked).await
    }

    /// Runs a channel's task until it ends or the connection does.
    fn spawn_channel(&self, slot: ChannelSlot, task: impl Future<Output = ()> + Send + 'static) {
        spawn_channel(self.ended.subscribe(), slot, task);
    }

    /// Lets a new channel in if the connection is authenticated and under its
    /// channel limit; otherwise refuses it (dropping the reply refuses too).
    /// (`ctx` comes from `Self::ctx`: the session itself may not be held across
    /// the rejection's await.)
    async fn admit(
        &self,
        ctx: Option<ChannelCtx>,
        kind: ChannelKind,
        reply: ChannelOpenHandle,
    ) -> Option<(ChannelCtx, ChannelSlot, ChannelOpenHandle)> {
        let ctx = ctx?;
        match self.channels.take(&ctx.account, kind) {
            Ok(slot) => Some((ctx, slot, reply)),
            Err(why) => {
                static LIMIT: LogLimit = LogLimit::every(1000);
                if let Some(dropped) = LIMIT.allow() {
                    tracing::warn!(peer = ?self.peer, account = %ctx.account, dropped, "a channel refused: {why}");
                }
                reply.reject(ChannelOpenFailure::ResourceShortage).await;
                None
            }
        }
    }

    /// The setup of an open session channel (None for a forward, or a channel
    /// whose task has ended).
    fn setup(&self, channel: ChannelId) -> Option<Arc<ChannelSetup>> {
        self.setups.get(&channel).and_then(Weak::upgrade)
    }

    /// The account `key` is, if the operator listed it.
    async fn account_for(&self, key: &russh::keys::PublicKey) -> Option<AccountId> {
        let key = crate::auth::key_text(key)?;
        match self.shared.api.authorize(&key).await {
            Ok(account) => account,
            Err(e) => {
                tracing::warn!(error = %e, "cannot check a key");
                None
            }
        }
    }

    /// Refuses a key, noting it against the connection's source.
    fn refuse(&self) -> Auth {
        if let Some(slot) = &self.slot {
            slot.key_refused();
        }
        Auth::reject()
    }

    fn ctx(&self, session: &Session) -> Option<ChannelCtx> {
        let (account, user) = self.login.clone()?;
        let ends = self.peer.zip(self.local);
        Some(ChannelCtx { api: self.shared.api.clone(), account, user, handle: session.handle(), ends })
    }
}

impl russh::server::Handler for ConnHandler {
    type Error = russh::Error;

    /// The client asks to authenticate: its key exchange is over.
    async fn authentication_banner(&mut self) -> Result<Option<String>, Self::Error> {
        if let Some(slot) = &self.slot {
            slot.kex_done();
        }
        Ok(None)
    }

    async fn auth_publickey_offered(&mut self, _user: &str, offer: PublicKeyOffer<'_>) -> Result<Auth, Self::Error> {
        // Refuse unknown keys before the client bothers to sign with them.
        if is_sha1_rsa(offer.algorithm) {
            return Ok(self.refuse());
        }
        Ok(match self.account_for(offer.public_key).await {
            Some(_) => Auth::Accept,
            None => self.refuse(),
        })
    }

    async fn auth_publickey(&mut self, user: &str, key: VerifiedPublicKey<'_>) -> Result<Auth, Self::Error> {
        if is_sha1_rsa(key.algorithm) {
            return Ok(self.refuse());
        }
        match self.account_for(key.public_key).await {
            Some(account) => {
                tracing::info!(peer = ?self.peer, %account, ?user, "authenticated");
                self.account_place = self.shared.load.connection(&account);
                self.login = Some((account, user.to_string()));
                Ok(Auth::Accept)
            }
            None => {
                static LIMIT: LogLimit = LogLimit::every(1000);
                if let Some(dropped) = LIMIT.allow() {
                    tracing::info!(peer = ?self.peer, user, dropped, "rejected key");
                }
                Ok(self.refuse())
            }
        }
    }

    async fn auth_succeeded(&mut self, session: &mut Session) -> Result<(), Self::Error> {
        self.authenticated.store(true, Ordering::Relaxed);
        if let Some(slot) = self.slot.take() {
            slot.release();
        }
        if self.account_place.is_none() {
            let why =
                format!("your account has {CONNECTIONS_PER_ACCOUNT} connections open, the most it may; close some");
            tracing::warn!(peer = ?self.peer, "a connection ended: its account has the most open");
            session.disconnect(russh::Disconnect::TooManyConnections, &why, "en")?;
        }
        if let Some((account, _)) = &self.login {
            session.set_window_budget(self.shared.load.window(account));
        }
        Ok(())
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some((ctx, slot, reply)) = self.admit(self.ctx(session), ChannelKind::Session, reply).await else {
            return Ok(());
        };
        reply.accept().await;
        let setup = Arc::new(ChannelSetup::default());
        self.setups.retain(|_, setup| setup.strong_count() > 0);
        self.setups.insert(channel.id(), Arc::downgrade(&setup));
        self.spawn_channel(slot, boxchan::serve(channel, ctx, setup));
        Ok(())
    }

    // Channel requests are answered here, in the order they arrive, and only
    // when the client asked for an answer (RFC 4254 5.4). russh keeps one
    // "wants a reply" flag per channel and its channel messages always claim a
    // reply is wanted, so an answer sent later from the channel's task could
    // land on the next request: an unanswerable `env` failure then read as the
    // `exec` failing (git's GIT_PROTOCOL, `ssh -o SetEnv`).

    async fn pty_request(
        &mut self,
        channel: ChannelId,
        _term: &str,
        _col_width: u32,
        _row_height: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(russh::Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let ok = self.setup(channel).is_some_and(|s| s.take_terminal());
        answer(session, channel, ok)
    }

    async fn env_request(
        &mut self,
        channel: ChannelId,
        variable_name: &str,
        variable_value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let ok = self.setup(channel).is_some_and(|s| s.offer_env(variable_name, variable_value));
        answer(session, channel, ok)
    }

    async fn shell_request(&mut self, channel: ChannelId, session: &mut Session) -> Result<(), Self::Error> {
        let ok = self.setup(channel).is_some_and(|s| s.start());
        answer(session, channel, ok)
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        // As sshd: a command holding a NUL is refused (no program could be
        // given it whole; cut there, it would run as something else).
        let ok = !data.contains(&0) && self.setup(channel).is_some_and(|s| s.start());
        answer(session, channel, ok)
    }

    async fn subsystem_request(
        &mut self,
        channel: ChannelId,
        name: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let ok = name == boxchan::SFTP_SUBSYSTEM && self.setup(channel).is_some_and(|s| s.start());
        answer(session, channel, ok)
    }

    async fn x11_request(
        &mut self,
        channel: ChannelId,
        _single_connection: bool,
        _x11_auth_protocol: &str,
        _x11_auth_cookie: &str,
        _x11_screen_number: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        answer(session, channel, false)
    }

    async fn channel_close(&mut self, channel: ChannelId, _session: &mut Session) -> Result<(), Self::Error> {
        self.setups.remove(&channel);
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
        let Some((ctx, slot, reply)) = self.admit(self.ctx(session), ChannelKind::Forward, reply).await else {
            return Ok(());
        };
        let host = host_to_connect.to_string();
        self.spawn_channel(slot, forward::open(channel, reply, ctx, host, port_to_connect));
        Ok(())
    }

    async fn tcpip_forward(
        &mut self,
        address: &str,
        port: &mut u32,
        session: &mut Session,
    ) -> Result<bool, Self::Error> {
        // A port that cannot be is refused before the box is woken.
        let Ok(asked) = u16::try_from(*port) else { return Ok(false) };
        let asked = Listened::Port(address.to_string(), asked);
        Ok(match self.remote_forward(asked, self.ctx(session)).await {
            Some(Listened::Port(_, bound)) => {
                *port = u32::from(bound);
                true
            }
            _ => false,
        })
    }

    async fn cancel_tcpip_forward(
        &mut self,
        address: &str,
        port: u32,
        _session: &mut Session,
    ) -> Result<bool, Self::Error> {
        let Ok(port) = u16::try_from(port) else { return Ok(false) };
        Ok(self.remote_forwards.cancel(&Listened::Port(address.to_string(), port)))
    }

    async fn streamlocal_forward(&mut self, socket_path: &str, session: &mut Session) -> Result<bool, Self::Error> {
        let asked = Listened::Path(socket_path.to_string());
        Ok(self.remote_forward(asked, self.ctx(session)).await.is_some())
    }

    async fn cancel_streamlocal_forward(
        &mut self,
        socket_path: &str,
        _session: &mut Session,
    ) -> Result<bool, Self::Error> {
        Ok(self.remote_forwards.cancel(&Listened::Path(socket_path.to_string())))
    }

    async fn channel_open_direct_streamlocal(
        &mut self,
        channel: Channel<Msg>,
        socket_path: &str,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some((ctx, slot, reply)) = self.admit(self.ctx(session), ChannelKind::Forward, reply).await else {
            return Ok(());
        };
        let path = socket_path.to_string();
        self.spawn_channel(slot, forward::open_path(channel, reply, ctx, path));
        Ok(())
    }
}

/// Answers a channel request; russh sends nothing if the client wanted no answer.
fn answer(session: &mut Session, channel: ChannelId, ok: bool) -> Result<(), russh::Error> {
    if ok {
        session.channel_success(channel)
    } else {
        session.channel_failure(channel)
    }
}

/// Whether a key is used with `ssh-rsa` signatures, whose SHA-1 OpenSSH
/// refuses since 8.8 (an RSA key still signs in as rsa-sha2-256 or -512).
fn is_sha1_rsa(algorithm: &russh::keys::Algorithm) -> bool {
    *algorithm == russh::keys::Algorithm::Rsa { hash: None }
}
