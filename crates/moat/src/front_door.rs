//! `moat front-door` (internal): the unprivileged process that speaks SSH.
//! Started by `moat serve` (or `moat front`) with the dialer socket as stdin; confines itself
//! before anything else, then waits for its configuration and listening
//! socket, and serves.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use moat_api::{ApiClient, Hello, Packets};
use moat_sshd::ServerConfig;

/// How often the front door gives the host back the memory its heaps hold free.
const TRIM_EVERY: Duration = Duration::from_secs(30);

/// Runs the front door as `id` (uid and gid) until its listener fails.
pub fn run(id: u32) -> Result<()> {
    let start = crate::privsep::ChildStart::new(c"moat-front")?;
    // Every descriptor it needs is open before this line; nothing is opened after.
    moat_box::confine::front_door(id, id).context("confine the front door")?;
    let runtime = start.runtime()?;
    let dialer = start.link;
    runtime.block_on(async {
        let dialer = Packets::new(dialer)?;
        let Some(hello) = dialer.recv(64 << 10).await? else { bail!("moat serve (or moat front) went away") };
        let listener = hello.fds.into_iter().next().context("no listening socket came")?;
        let hello: Hello = serde_json::from_slice(&hello.bytes).context("read the configuration")?;
        let listener = std::net::TcpListener::from(listener);
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let host_key = russh::keys::PrivateKey::from_openssh(&hello.host_key).context("read the host key")?;
        // What connections held (a stalled channel holds its window: 2 MiB)
        // goes back to the host once they are gone.
        tokio::spawn(async {
            let mut every = tokio::time::interval(TRIM_EVERY);
            loop {
                every.tick().await;
                let _ = tokio::task::spawn_blocking(moat_box::sys::trim_heap).await;
            }
        });
        let mut config = ServerConfig::new(host_key);
        config.auth_timeout = Duration::from_secs(hello.auth_timeout_secs);
        config.idle_timeout = Duration::from_secs(hello.idle_timeout_secs);
        moat_sshd::serve(listener, config, ApiClient::new(dialer)).await?;
        Ok(())
    })
}
