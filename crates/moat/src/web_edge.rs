//! `moat web-edge` (internal): the unprivileged process that speaks HTTP for
//! boxes' web URLs. Started by `moat serve --http-listen` with the dialer
//! socket as stdin; confines itself as the front door does (no privilege,
//! the same system call list, and `connect` for the sockets the privileged
//! side makes in a box's network: it opens no file and makes no socket),
//! then waits for its configuration and listening socket, and serves.

use anyhow::{bail, Context, Result};
use moat_api::{ApiClient, Packets};
use moat_web::WebHello;

/// Runs the edge as `id` (uid and gid) until its listener fails.
pub fn run(id: u32) -> Result<()> {
    let start = crate::privsep::ChildStart::new(c"moat-web-edge")?;
    // rustls picks its provider from what is compiled in, before confinement
    // would forbid nothing it needs (it opens no file): set it explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    moat_box::confine::edge(id, id).context("confine the HTTP edge")?;
    // Event loops of a thread each (nginx's shape): a request is served on
    // one thread from its accept to its last byte, with no hop between
    // threads (a runtime of two workers cost 15% more latency). One per CPU
    // but one: the boxes' servers it fronts need a CPU to answer (on two
    // CPUs, one loop carried 0.89-0.94x nginx's requests a second, two
    // 0.81-0.86x).
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let per_cpu = start.workers().saturating_sub(1).max(1);
    let dialer = start.link;
    runtime.block_on(async {
        let dialer = Packets::new(dialer)?;
        let Some(hello) = dialer.recv(1 << 20).await? else { bail!("moat serve went away") };
        let listener = hello.fds.into_iter().next().context("no listening socket came")?;
        let hello: WebHello = serde_json::from_slice(&hello.bytes).context("read the configuration")?;
        let listener = std::net::TcpListener::from(listener);
        listener.set_nonblocking(true)?;
        let loops = if hello.loops == 0 { per_cpu } else { hello.loops };
        moat_web::serve(listener, hello, ApiClient::new(dialer), loops).await?;
        Ok(())
    })
}
