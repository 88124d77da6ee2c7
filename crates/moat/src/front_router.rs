//! `moat front-router` (internal): the router of a fleet's front door, run
//! by `moat front`. It drops to its own unprivileged uid before anything
//! else, takes the member's files as one message (it opens none), reaches
//! the store and the nodes, and answers each connection the front door dials
//! (passed to it as a descriptor) with `moat_fleet::router`.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use moat_api::server::Answer;
use moat_api::Packets;
use moat_fleet::dial::Dialer;
use moat_fleet::join::{FleetDir, Token};
use moat_fleet::peer::Peers;
use moat_fleet::router::Router;
use moat_fleet::store::StoreMembers;
use nix::unistd::{Gid, Uid};

use crate::front::RouterReady;

/// Most connections routed at once (each session holds one).
const MAX_CONNECTIONS: usize = 16 << 10;

/// Runs the router as `id` (uid and gid) until `moat front` goes.
pub fn run(id: u32) -> Result<()> {
    let start = crate::privsep::ChildStart::new(c"moat-router")?;
    drop_to(id).context("drop the router's privileges")?;
    let runtime = start.runtime()?;
    let link = start.link;
    runtime.block_on(async {
        let link = Packets::new(link)?;
        let Some(msg) = link.recv(1 << 20).await? else { bail!("moat front went away") };
        let token: Token = serde_json::from_slice(&msg.bytes).context("read the member files")?;
        let dir = Arc::new(FleetDir::from_token(&token)?);
        let dsn = token.store.clone();
        let store = tokio::task::spawn_blocking(move || moat_core::Store::connect(&dsn)).await??;
        let store = Arc::new(store);
        let host_key = {
            let (dir, store) = (Arc::clone(&dir), Arc::clone(&store));
            tokio::task::spawn_blocking(move || dir.host_key(&*store)).await??
        };
        link.send(&serde_json::to_vec(&RouterReady { host_key })?, &[]).await?;
        let peers = Peers::new(Arc::new(StoreMembers(Arc::clone(&store))));
        let router = Router::new(store, Dialer::new(dir.identity.client_config()?, peers));
        // As many open at once as the privileged side allows a front door on one host.
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        loop {
            let permit = Arc::clone(&open).acquire_owned().await?;
            let Some(msg) = link.recv(1).await? else { return Ok(()) };
            let fd = msg.fds.into_iter().next().context("moat front passed no connection")?;
            let conn = Packets::new(fd)?;
            let router = Arc::clone(&router);
            tokio::spawn(async move {
                if let Err(e) = router.answer(conn).await {
                    tracing::debug!(error = %e, "routed connection failed");
                }
                drop(permit);
            });
        }
    })
}

/// Becomes `id`:`id` with no supplementary groups and no capabilities, can
/// gain none (no_new_privs), is not dumpable, and dies with `moat front`.
/// Unlike the front door it is not under seccomp: it dials PostgreSQL and
/// the nodes, and parses nothing a client sends but the typed requests.
fn drop_to(id: u32) -> Result<()> {
    if id == 0 {
        bail!("the router may not run as root");
    }
    nix::unistd::setgroups(&[])?;
    nix::unistd::setresgid(Gid::from_raw(id), Gid::from_raw(id), Gid::from_raw(id))?;
    nix::unistd::setresuid(Uid::from_raw(id), Uid::from_raw(id), Uid::from_raw(id))?;
    nix::sys::prctl::set_dumpable(false)?;
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
    nix::sys::prctl::set_no_new_privs()?;
    nix::unistd::chdir("/")?;
    Ok(())
}
