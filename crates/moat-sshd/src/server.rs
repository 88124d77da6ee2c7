//! The listener: accepts TCP connections, admits unauthenticated ones (see
//! [`crate::admission`]), bounds how long they may take, then hands each to
//! russh with a [`ConnHandler`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use moat_api::ApiClient;
use russh::keys::PrivateKey;
use russh::{Disconnect, MethodKind, MethodSet};
use tokio::net::TcpListener;

use crate::admission::{Admission, AdmissionLimits, Gated, Pending, SlotHolder};
use crate::handler::{ConnHandler, Shared};
use crate::penalty::{Offence, Penalties, PENALIZED_GRACE, PENALIZED_KEX_TIME};
use crate::quickack::QuickAck;
use crate::ratelimit::LogLimit;

/// Key exchanges offered: what modern OpenSSH offers, but the finite-field
/// Diffie-Hellman groups, which cost the server a modular exponentiation of
/// up to 8192 bits per attempt, so a few unauthenticated sockets asking for
/// them ("DHEat") can keep every core busy. The NIST curves are for clients
/// held to FIPS algorithms (RHEL's OpenSSH in FIPS mode, JSch and sshj so
/// set up): one scalar multiplication each, as curve25519.
const KEX_ORDER: &[russh::kex::Name] = &[
    russh::kex::MLKEM768X25519_SHA256,
    russh::kex::CURVE25519,
    russh::kex::CURVE25519_PRE_RFC_8731,
    russh::kex::ECDH_SHA2_NISTP256,
    russh::kex::ECDH_SHA2_NISTP384,
    russh::kex::ECDH_SHA2_NISTP521,
    russh::kex::EXTENSION_SUPPORT_AS_CLIENT,
    russh::kex::EXTENSION_SUPPORT_AS_SERVER,
    russh::kex::EXTENSION_OPENSSH_STRICT_KEX_AS_CLIENT,
    russh::kex::EXTENSION_OPENSSH_STRICT_KEX_AS_SERVER,
];

/// Ciphers offered: OpenSSH's own list (russh's leaves out AES-128-GCM,
/// which FIPS-held clients may offer alone).
const CIPHER_ORDER: &[russh::cipher::Name] = &[
    russh::cipher::CHACHA20_POLY1305,
    russh::cipher::AES_256_GCM,
    russh::cipher::AES_128_GCM,
    russh::cipher::AES_256_CTR,
    russh::cipher::AES_192_CTR,
    russh::cipher::AES_128_CTR,
];

/// Front door settings.
pub struct ServerConfig {
    /// The server's host key.
    pub host_key: PrivateKey,
    /// How many connections may wait and handshake before authenticating.
    pub admission: AdmissionLimits,
    /// Time a client has to authenticate.
    pub auth_timeout: Duration,
    /// Time a client has to send its first bytes.
    pub banner_grace: Duration,
    /// A connection with no traffic this long is closed.
    pub idle_timeout: Duration,
}

impl ServerConfig {
    /// Settings with the default limits (OpenSSH's MaxStartups is 10:30:100;
    /// these wait rather than drop, so the handshake stage can be as small).
    pub fn new(host_key: PrivateKey) -> Self {
        Self {
            host_key,
            admission: AdmissionLimits {
                pending_per_source: 128,
                pending_total: 1024,
                active_per_source: 10,
                active_total: 64,
            },
            auth_timeout: Duration::from_secs(30),
            banner_grace: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(3600),
        }
    }
}

/// What an unauthenticated connection holds; given back when it authenticates.
pub struct UnauthSlot {
    _pending: Pending,
    holder: Arc<SlotHolder>,
}

impl UnauthSlot {
    /// Gives back the connection's places (it has authenticated).
    pub fn release(self) {
        self.holder.release();
    }

    /// Notes that a key the client tried was refused (see [`crate::penalty`]).
    pub fn key_refused(&self) {
        self.holder.key_refused();
    }

    /// Notes that the key exchange is over (see [`Admission::pending`]).
    pub fn kex_done(&self) {
        self.holder.kex_done();
    }
}

/// How long a connection may wait for a handshake slot: those ahead of it
/// hold theirs for [`KEX_TIME`] at most unless they begin their key
/// exchange, so this is a queue far longer than an attack can keep up.
const SLOT_WAIT: Duration = Duration::from_secs(60);
/// How long a connection holding a handshake slot has to begin its key
/// exchange (clients send their KEXINIT with their version string; a
/// socket that spoke and stalled holds the slot no longer). The exchange
/// itself has the authentication timeout: OpenSSH asks its user about an
/// unknown host key in the middle of it.
const KEX_TIME: Duration = Duration::from_secs(10);
/// How long a connection cut before authenticating has to be told why.
const DISCONNECT_TIME: Duration = Duration::from_secs(1);

/// Why an unauthenticated connection is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// It sent nothing before its grace ran out.
    Silent,
    /// It waited its turn for a handshake slot past [`SLOT_WAIT`].
    NoSlot,
    /// It held a slot and did not begin its key exchange in [`KEX_TIME`].
    NoKex,
    /// It did not authenticate in time.
    AuthTimeout,
    /// A newer connection from its source took its pending place.
    Evicted,
}

impl Cut {
    fn as_str(self) -> &'static str {
        match self {
            Cut::Silent => "no version string",
            Cut::NoSlot => "no handshake slot came free in time",
            Cut::NoKex => "no key exchange after its version string",
            Cut::AuthTimeout => "authentication timeout",
            Cut::Evicted => "its source opened too many connections",
        }
    }

    /// Whether the cut is held against the connection's source.
    fn offends(self) -> bool {
        !matches!(self, Cut::Evicted | Cut::NoSlot)
    }
}

/// The time an unauthenticated connection has for each step.
#[derive(Debug, Clone, Copy)]
struct Deadlines {
    /// To send its first bytes.
    grace: Duration,
    /// To begin its key exchange once it holds a handshake slot.
    kex: Duration,
    /// To authenticate once it holds a handshake slot.
    auth: Duration,
}

impl Deadlines {
    /// A connection's, from `config`'s; a penalized source's (see
    /// [`crate::penalty`]) are shorter.
    fn of(config: &ServerConfig, penalized: bool) -> Self {
        let grace = config.banner_grace.min(config.auth_timeout);
        let kex = KEX_TIME.min(config.auth_timeout);
        match penalized {
            false => Self { grace, kex, auth: config.auth_timeout },
            true => {
                Self { grace: grace.min(PENALIZED_GRACE), kex: kex.min(PENALIZED_KEX_TIME), auth: config.auth_timeout }
            }
        }
    }
}

/// Resolves when an unauthenticated connection must be cut, with why: if it
/// sends nothing within its grace (it holds no handshake slot, but a pending
/// place and an fd); if it waits for a slot past [`SLOT_WAIT`]; if, holding
/// one, it has not begun its key exchange or authenticated in time
/// (counted from the slot: a wait in line is not the client's to answer
/// for); or as soon as it is evicted.
async fn unauthenticated_deadline(holder: &SlotHolder, deadlines: Deadlines) -> Cut {
    let deadline = async {
        if tokio::time::timeout(deadlines.grace, holder.spoken()).await.is_err() {
            return Cut::Silent;
        }
        if tokio::time::timeout(SLOT_WAIT, holder.slotted()).await.is_err() {
            return Cut::NoSlot;
        }
        let slotted = tokio::time::Instant::now();
        if tokio::time::timeout(deadlines.kex, holder.kex_begun()).await.is_err() {
            return Cut::NoKex;
        }
        tokio::time::sleep_until(slotted + deadlines.auth).await;
        Cut::AuthTimeout
    };
    tokio::select! {
        why = deadline => why,
        () = holder.evicted() => Cut::Evicted,
    }
}

/// A connection cut: logged (rate-limited) and, if it missed its deadline,
/// held against its source (an evicted one was merely the oldest).
fn cut(penalties: &Penalties, peer: std::net::SocketAddr, why: Cut) {
    if why.offends() {
        penalties.record(peer.ip(), Offence::Deadline);
    }
    let why = why.as_str();
    static LIMIT: LogLimit = LogLimit::every(1000);
    if let Some(dropped) = LIMIT.allow() {
        tracing::info!(%peer, dropped, why, "unauthenticated connection closed");
    }
}

/// Serves SSH on `listener` until the process ends; everything past the SSH
/// layer (keys, boxes, sessions) is asked of `api`.
pub async fn serve(listener: TcpListener, config: ServerConfig, api: ApiClient) -> std::io::Result<()> {
    let (usual, penalized) = (Deadlines::of(&config, false), Deadlines::of(&config, true));
    let russh_config = Arc::new(russh::server::Config {
        keys: vec![config.host_key],
        methods: MethodSet::from(&[MethodKind::PublicKey][..]),
        // Rejections take a constant time; OpenSSH's initial "none" probe need not.
        auth_rejection_time: Duration::from_millis(300),
        auth_rejection_time_initial: Some(Duration::ZERO),
        // OpenSSH's MaxAuthTries (6) counts keys, not the client's first
        // "none" probe, which russh counts too: a user whose right key is the
        // sixth in ssh-agent gets in, as with sshd.
        max_auth_attempts: 7,
        inactivity_timeout: Some(config.idle_timeout),
        keepalive_interval: Some(Duration::from_secs(30)),
        keepalive_max: 4,
        nodelay: true,
        // No library name or version for scanners to match against. It
        // starts with "OpenSSH" for clients that speak OpenSSH's extensions
        // only to a server so named: OpenSSH's own sends `eow@openssh.com`
        // (without it, `ssh box yes | head` ran on for good), and SFTP clients
        // (asyncssh, WinSCP) send SYMLINK's two paths in OpenSSH's order, which
        // a box's SFTP server (the image's `sftp-server`, or the agent's) takes.
        server_id: russh::SshId::Standard(crate::BANNER.into()),
        preferred: russh::Preferred { kex: KEX_ORDER.into(), cipher: CIPHER_ORDER.into(), ..Default::default() },
        ..Default::default()
    });
    let shared = Arc::new(Shared { api, load: Default::default() });
    let admission = Admission::new(config.admission);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                // Out of fds and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let holder = Arc::new(SlotHolder::default());
        let Some(pending) = admission.pending(peer.ip(), &holder) else {
            tracing::debug!(%peer, "too many unauthenticated connections; dropped");
            continue;
        };
        let deadlines = if admission.penalties().is_penalized(peer.ip()) { penalized } else { usual };
        let slot = UnauthSlot { _pending: pending, holder: Arc::clone(&holder) };
        let authenticated = Arc::new(AtomicBool::new(false));
        let ends = (Some(peer), stream.local_addr().ok());
        let handler = ConnHandler::new(Arc::clone(&shared), ends, slot, Arc::clone(&authenticated));
        let russh_config = Arc::clone(&russh_config);
        let admission = admission.clone();
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            // russh runs the session in a task of its own, which ending this
            // one does not end: a cut shuts the socket through this copy.
            let socket = std::os::fd::AsFd::as_fd(&stream).try_clone_to_owned().map(socket2::Socket::from);
            let stream = Gated::new(QuickAck::new(stream), &admission, peer.ip(), Arc::clone(&holder));
            // One deadline for the whole unauthenticated life of the connection,
            // the version exchange (inside run_stream) included.
            let deadline = unauthenticated_deadline(&holder, deadlines);
            tokio::pin!(deadline);
            let penalties = admission.penalties();
            let ended_early = || {
                if !authenticated.load(Ordering::Relaxed) {
                    penalties.record(peer.ip(), holder.offence());
                }
            };
            let session = tokio::select! {
                started = russh::server::run_stream(russh_config, stream, handler) => match started {
                    Ok(session) => session,
                    Err(_) => return ended_early(),
                },
                why = &mut deadline => return cut(penalties, peer, why),
            };
            let handle = session.handle();
            tokio::pin!(session);
            let why = tokio::select! {
                _ = &mut session => return ended_early(),
                why = &mut deadline => why,
            };
            if authenticated.load(Ordering::Relaxed) {
                drop(socket);
                let _ = session.await;
                return;
            }
            cut(penalties, peer, why);
            // Its slot goes to the next in line at once; it is told why, and
            // its socket shut whatever the client does (a session stuck in
            // its key exchange may never take the message).
            holder.release();
            let told = async {
                let _ = handle.disconnect(Disconnect::ByApplication, why.as_str().into(), "en".into()).await;
                let _ = (&mut session).await;
            };
            let _ = tokio::time::timeout(DISCONNECT_TIME, told).await;
            if let Ok(socket) = socket {
                let _ = socket.shutdown(std::net::Shutdown::Both);
            }
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::IpAddr;
    use std::sync::Arc;

    use super::*;
    use crate::admission::{Admission, AdmissionLimits};

    const GRACE: Duration = Duration::from_secs(10);
    const AUTH: Duration = Duration::from_secs(30);

    /// When (from now) and why the deadline of a connection that `step`s
    /// cuts it.
    async fn cut_after(step: impl std::future::Future<Output = ()>, holder: &SlotHolder) -> (Duration, Cut) {
        let start = tokio::time::Instant::now();
        let mut step = std::pin::pin!(step);
        let deadline = unauthenticated_deadline(holder, Deadlines { grace: GRACE, kex: KEX_TIME, auth: AUTH });
        let mut deadline = std::pin::pin!(deadline);
        let mut stepped = false;
        let why = loop {
            tokio::select! {
                why = &mut deadline => break why,
                () = &mut step, if !stepped => stepped = true,
            }
        };
        (start.elapsed(), why)
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_is_held_only_while_the_key_exchange_goes_on() {
        let limits = AdmissionLimits { pending_per_source: 3, pending_total: 5, active_per_source: 2, active_total: 3 };
        let admission = Admission::new(limits);
        let x: IpAddr = "127.0.0.2".parse().unwrap();
        // Silent: cut at the grace.
        let silent = Arc::new(SlotHolder::default());
        assert_eq!(cut_after(std::future::pending(), &silent).await, (GRACE, Cut::Silent));
        // Spoke, then stalled holding a slot: cut at KEX_TIME, not at the
        // authentication timeout.
        let stalled = Arc::new(SlotHolder::default());
        let step = async {
            stalled.heard();
            stalled.hold(admission.active(x, &stalled).await);
        };
        assert_eq!(cut_after(step, &stalled).await, (KEX_TIME, Cut::NoKex));
        // Began its key exchange, then took long over it (a user reading a
        // host key's fingerprint): the authentication timeout alone.
        let asked = Arc::new(SlotHolder::default());
        let step = async {
            asked.heard();
            asked.hold(admission.active(x, &asked).await);
            asked.went_on();
        };
        assert_eq!(cut_after(step, &asked).await, (AUTH, Cut::AuthTimeout));
        stalled.release();
        asked.release();
        // Waited 50 s in line, then exchanged keys: its 30 s to
        // authenticate count from its slot.
        let waited = Arc::new(SlotHolder::default());
        let step = async {
            waited.heard();
            tokio::time::sleep(Duration::from_secs(50)).await;
            waited.hold(admission.active(x, &waited).await);
            waited.went_on();
        };
        assert_eq!(cut_after(step, &waited).await, (Duration::from_secs(80), Cut::AuthTimeout));
        // Never given a slot: cut at SLOT_WAIT, not held against its source.
        let queued = Arc::new(SlotHolder::default());
        let step = async { queued.heard() };
        assert_eq!(cut_after(step, &queued).await, (SLOT_WAIT, Cut::NoSlot));
        assert!(!Cut::NoSlot.offends() && Cut::NoKex.offends());
    }
}
