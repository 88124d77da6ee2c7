//! `moat front-door` (internal): the unprivileged process that speaks SSH.
//! Started by `moat serve` with the dialer socket as stdin; confines itself
//! before anything else, then waits for its configuration and listening
//! socket, and serves.

use std::os::fd::AsFd;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use moat_api::{ApiClient, Hello, Packets};
use moat_sshd::ServerConfig;

/// Runs the front door as `id` (uid and gid) until its listener fails.
pub fn run(id: u32) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    // Spawned as /proc/self/exe, it would be "exe" in ps and in audit logs.
    let _ = nix::sys::prctl::set_name(c"moat-front");
    // Only stdin (the dialer), stdout and stderr are meant for us.
    moat_box::sys::close_from(3).context("close inherited descriptors")?;
    let dialer = std::io::stdin().as_fd().try_clone_to_owned().context("take the dialer socket")?;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Every descriptor above is open before this line; nothing is opened after.
    crate::privsep::raise_fd_limit();
    moat_box::confine::front_door(id, id).context("confine the front door")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async {
        let dialer = Packets::new(dialer)?;
        let Some(hello) = dialer.recv(64 << 10).await? else { bail!("moat serve went away") };
        let listener = hello.fds.into_iter().next().context("no listening socket came")?;
        let hello: Hello = serde_json::from_slice(&hello.bytes).context("read the configuration")?;
        let listener = std::net::TcpListener::from(listener);
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let host_key = russh::keys::PrivateKey::from_openssh(&hello.host_key).context("read the host key")?;
        let mut config = ServerConfig::new(host_key);
        config.auth_timeout = Duration::from_secs(hello.auth_timeout_secs);
        config.idle_timeout = Duration::from_secs(hello.idle_timeout_secs);
        moat_sshd::serve(listener, config, ApiClient::new(dialer)).await?;
        Ok(())
    })
}
