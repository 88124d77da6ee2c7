//! `moat purge`: stop every box, delete it, unmount the pool and remove the
//! state directory. For uninstalling, and for tests that must leave nothing.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use moat_box::host::cgroup::CgroupLayout;
use moat_box::ns::hostview::HostView;
use moat_box::ns::{boxtmp, sysview, NsConfig, NsMachine};
use moat_box::{Host, HostBackend, HostConfig};
use moat_core::{Backend, Store};

use crate::paths;

/// The store whose boxes the state dir's pool holds: a fleet node's (its
/// own boxes in the fleet's store, which then no longer lists them), or the
/// state dir's own database.
fn state_store(state_dir: &Path) -> Result<Store> {
    if !state_dir.join("fleet.json").exists() {
        return Store::open(&state_dir.join("moat.db")).context("open the state database");
    }
    let dir = moat_fleet::join::FleetDir::load(state_dir).context("read the fleet membership")?;
    let store = Store::connect(&dir.config.store).context("open the fleet's store")?;
    Ok(store.for_node(&dir.member.name))
}

/// Removes everything under `state_dir`; the daemon must not be running.
pub fn run(state_dir: &Path) -> Result<()> {
    if !state_dir.exists() {
        return Ok(());
    }
    // The store first: a directory whose store cannot be opened (a fleet's
    // admin directory, which holds its CA: no member, nothing to purge) is
    // left as it is, no pool made or mounted for it.
    let store = state_store(state_dir)
        .with_context(|| format!("{} is not a server's state directory that can be purged", state_dir.display()))?;
    if !state_dir.join("pool.img").exists() && !state_dir.join("pool").exists() {
        return run_without_pool(state_dir, store, "it has none");
    }
    let pool = match paths::open_pool(state_dir) {
        Ok(pool) => pool,
        Err(e) => return run_without_pool(state_dir, store, &format!("{e:#}")),
    };
    let config = HostConfig {
        run_dir: state_dir.join("run"),
        helper: "/nonexistent".into(),
        agent: "/nonexistent".into(),
        account_disk: u64::MAX,
        cgroup_parent: paths::cgroup_parent(state_dir)?,
    };
    let host = Host::open(pool, config)?;
    // Removal needs no machine: a VM box goes as a namespace box does.
    let ns = NsMachine::new(host.clone(), NsConfig::default());
    let backend = Arc::new(HostBackend::new(host, ns, Err("purging".into())));
    for rec in store.list_here()? {
        eprintln!("removing box {} ({})", rec.name, rec.id);
        backend.destroy(&rec).with_context(|| format!("remove box {}", rec.name))?;
        store.delete(&rec.id)?;
    }
    drop(store);
    let backend = Arc::into_inner(backend).context("backend still shared")?;
    // What still runs from this pool that the store does not list here: a
    // lost node's copies of boxes re-homed elsewhere (they hold the pool).
    // Only those: the cgroup parent may be shared with other daemons.
    let boxes = backend.host().pool.boxes_dir();
    for name in backend.host().cgroups.box_names().into_iter().filter(|name| boxes.join(name).exists()) {
        eprintln!("ending box {name}, which the store no longer lists here");
        if let Err(e) = backend.host().cgroups.destroy(&name) {
            eprintln!("cannot end box {name}: {e}");
        }
    }
    backend.host().cgroups.remove_parents();
    let pool = backend.into_pool().context("the pool is still in use")?;
    pool.unmount()?;
    HostView::stop(&paths::host_view_dir(state_dir));
    sysview::stop(&paths::shared_sys_dir(state_dir));
    boxtmp::stop(&paths::shared_tmp_dir(state_dir));
    crate::uid_block::release(state_dir);
    std::fs::remove_dir_all(state_dir).with_context(|| format!("remove {}", state_dir.display()))?;
    Ok(())
}

/// Removes everything under `state_dir` when its pool cannot be opened (a
/// filesystem the kernel made read-only after an I/O error, say): every box
/// is ended by its cgroups, which needs no pool, and the pool is detached
/// as it is. What the pool held goes with the state directory.
fn run_without_pool(state_dir: &Path, store: Store, why: &str) -> Result<()> {
    eprintln!("no pool to open ({why}): ending its boxes by their cgroups");
    let cgroups = CgroupLayout::detect(&paths::cgroup_parent(state_dir)?).context("cgroups")?;
    for rec in store.list_here()? {
        eprintln!("removing box {} ({})", rec.name, rec.id);
        cgroups.destroy(&rec.id).with_context(|| format!("end box {}", rec.name))?;
        store.delete(&rec.id)?;
    }
    drop(store);
    cgroups.remove_parents();
    // Lazily: a broken filesystem may refuse a plain unmount; the loop
    // device mount(8) made for it clears itself with the last reference.
    let root = state_dir.join("pool");
    if let Err(e) = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH) {
        if e != nix::errno::Errno::EINVAL {
            return Err(e).with_context(|| format!("unmount {}", root.display()));
        }
    }
    HostView::stop(&paths::host_view_dir(state_dir));
    sysview::stop(&paths::shared_sys_dir(state_dir));
    boxtmp::stop(&paths::shared_tmp_dir(state_dir));
    crate::uid_block::release(state_dir);
    std::fs::remove_dir_all(state_dir).with_context(|| format!("remove {}", state_dir.display()))?;
    Ok(())
}
