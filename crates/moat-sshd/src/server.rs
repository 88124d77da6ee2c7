//! The listener: accepts TCP connections, bounds unauthenticated ones (per
//! source address and in total) and how long they may take, then hands each to
//! russh with a [`ConnHandler`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moat_core::BoxManager;
use russh::keys::PrivateKey;
use russh::{Disconnect, MethodKind, MethodSet};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth::AuthorizedKeys;
use crate::handler::{ConnHandler, Shared};
use crate::quickack::QuickAck;
use crate::ratelimit::LogLimit;

/// Key exchanges offered: what modern OpenSSH prefers, and nothing else. The
/// finite-field Diffie-Hellman groups cost the server a modular
/// exponentiation of up to 8192 bits per attempt, so a few unauthenticated
/// sockets asking for them ("DHEat") can keep every core busy.
const KEX_ORDER: &[russh::kex::Name] = &[
    russh::kex::MLKEM768X25519_SHA256,
    russh::kex::CURVE25519,
    russh::kex::CURVE25519_PRE_RFC_8731,
    russh::kex::EXTENSION_SUPPORT_AS_CLIENT,
    russh::kex::EXTENSION_SUPPORT_AS_SERVER,
    russh::kex::EXTENSION_OPENSSH_STRICT_KEX_AS_CLIENT,
    russh::kex::EXTENSION_OPENSSH_STRICT_KEX_AS_SERVER,
];

/// Front door settings.
pub struct ServerConfig {
    /// The server's host key.
    pub host_key: PrivateKey,
    /// Who may log in.
    pub keys: AuthorizedKeys,
    /// Most connections not yet authenticated, in total.
    pub max_unauthenticated: usize,
    /// Most connections not yet authenticated, per source address.
    pub max_unauthenticated_per_source: usize,
    /// Time a client has to authenticate.
    pub auth_timeout: Duration,
    /// A connection with no traffic this long is closed.
    pub idle_timeout: Duration,
}

impl ServerConfig {
    /// Settings with the default limits.
    pub fn new(host_key: PrivateKey, keys: AuthorizedKeys) -> Self {
        Self {
            host_key,
            keys,
            max_unauthenticated: 64,
            max_unauthenticated_per_source: 10,
            auth_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(3600),
        }
    }
}

/// A place among the unauthenticated connections; given back on drop.
pub struct UnauthSlot {
    _total: OwnedSemaphorePermit,
    per_source: Arc<Mutex<HashMap<IpAddr, usize>>>,
    source: IpAddr,
}

impl Drop for UnauthSlot {
    fn drop(&mut self) {
        let mut counts = self.per_source.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.source);
            }
        }
    }
}

/// Serves SSH on `listener` until the process ends.
pub async fn serve(listener: TcpListener, config: ServerConfig, manager: Arc<BoxManager>) -> std::io::Result<()> {
    let russh_config = Arc::new(russh::server::Config {
        keys: vec![config.host_key],
        methods: MethodSet::from(&[MethodKind::PublicKey][..]),
        // Rejections take a constant time; OpenSSH's initial "none" probe need not.
        auth_rejection_time: Duration::from_millis(300),
        auth_rejection_time_initial: Some(Duration::ZERO),
        max_auth_attempts: 6,
        inactivity_timeout: Some(config.idle_timeout),
        keepalive_interval: Some(Duration::from_secs(30)),
        keepalive_max: 4,
        nodelay: true,
        // No library name or version for scanners to match against.
        server_id: russh::SshId::Standard("SSH-2.0-moat".into()),
        preferred: russh::Preferred { kex: KEX_ORDER.into(), ..Default::default() },
        ..Default::default()
    });
    let shared = Arc::new(Shared { manager, keys: config.keys });
    let total = Arc::new(Semaphore::new(config.max_unauthenticated));
    let per_source: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
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
        let Ok(permit) = Arc::clone(&total).try_acquire_owned() else {
            tracing::debug!(%peer, "too many unauthenticated connections; dropped");
            continue;
        };
        {
            let mut counts = per_source.lock().unwrap_or_else(PoisonError::into_inner);
            let n = counts.entry(peer.ip()).or_insert(0);
            if *n >= config.max_unauthenticated_per_source {
                tracing::debug!(%peer, "too many unauthenticated connections from this source; dropped");
                continue;
            }
            *n += 1;
        }
        let slot = UnauthSlot { _total: permit, per_source: Arc::clone(&per_source), source: peer.ip() };
        let authenticated = Arc::new(AtomicBool::new(false));
        let handler = ConnHandler::new(Arc::clone(&shared), Some(peer), slot, Arc::clone(&authenticated));
        let russh_config = Arc::clone(&russh_config);
        let auth_timeout = config.auth_timeout;
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let stream = QuickAck::new(stream);
            // The version exchange happens here; a client that stalls in it times out too.
            let session = match tokio::time::timeout(
                auth_timeout,
                russh::server::run_stream(russh_config, stream, handler),
            )
            .await
            {
                Ok(Ok(session)) => session,
                _ => return,
            };
            let handle = session.handle();
            tokio::pin!(session);
            tokio::select! {
                _ = &mut session => return,
                () = tokio::time::sleep(auth_timeout) => {}
            }
            if !authenticated.load(Ordering::Relaxed) {
                static LIMIT: LogLimit = LogLimit::every(1000);
                if let Some(dropped) = LIMIT.allow() {
                    tracing::info!(%peer, dropped, "authentication timed out");
                }
                let _ =
                    handle.disconnect(Disconnect::ByApplication, "authentication timeout".into(), "en".into()).await;
                return;
            }
            let _ = session.await;
        });
    }
}
