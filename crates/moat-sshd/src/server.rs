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
use crate::penalty::{Offence, Penalties, PENALIZED_GRACE};
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

/// Why an unauthenticated connection is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// It sent nothing before its grace ran out.
    Silent,
    /// It did not authenticate in time.
    AuthTimeout,
    /// A newer connection from its source took its pending place.
    Evicted,
}

impl Cut {
    fn as_str(self) -> &'static str {
        match self {
            Cut::Silent => "no version string",
            Cut::AuthTimeout => "authentication timeout",
            Cut::Evicted => "its source opened too many connections",
        }
    }
}

/// Resolves when an unauthenticated connection must be cut, with why: at
/// `grace` if it has sent nothing (it holds no handshake slot, but a pending
/// place and an fd), else at `auth_timeout`; or as soon as it is evicted.
async fn unauthenticated_deadline(holder: &SlotHolder, grace: Duration, auth_timeout: Duration) -> Cut {
    let deadline = async {
        tokio::time::sleep(grace).await;
        if !holder.spoke() {
            return Cut::Silent;
        }
        tokio::time::sleep(auth_timeout.saturating_sub(grace)).await;
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
    if why != Cut::Evicted {
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
    let grace = config.banner_grace.min(config.auth_timeout);
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
        let penalties = admission.penalties();
        let grace = if penalties.is_penalized(peer.ip()) { grace.min(PENALIZED_GRACE) } else { grace };
        let slot = UnauthSlot { _pending: pending, holder: Arc::clone(&holder) };
        let authenticated = Arc::new(AtomicBool::new(false));
        let ends = (Some(peer), stream.local_addr().ok());
        let handler = ConnHandler::new(Arc::clone(&shared), ends, slot, Arc::clone(&authenticated));
        let russh_config = Arc::clone(&russh_config);
        let auth_timeout = config.auth_timeout;
        let admission = admission.clone();
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let stream = Gated::new(QuickAck::new(stream), &admission, peer.ip(), Arc::clone(&holder));
            // One deadline for the whole unauthenticated life of the connection,
            // the version exchange (inside run_stream) included.
            let deadline = unauthenticated_deadline(&holder, grace, auth_timeout);
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
                let _ = session.await;
                return;
            }
            cut(penalties, peer, why);
            let _ = handle.disconnect(Disconnect::ByApplication, why.as_str().into(), "en".into()).await;
        });
    }
}
