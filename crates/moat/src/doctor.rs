//! `moat doctor`: what this host offers and what moat will use.

use std::path::Path;

use anyhow::Result;
use moat_box::ns::cgroup::CgroupLayout;
use moat_box::pool::PoolKind;

use crate::paths;

/// Prints one line per check; fails if a box could not run.
pub fn run(state_dir: &Path) -> Result<()> {
    let mut ok = true;
    let mut check = |what: &str, result: Result<String, String>| match result {
        Ok(detail) => println!("ok    {what}: {detail}"),
        Err(detail) => {
            ok = false;
            println!("FAIL  {what}: {detail}");
        }
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    check("kernel", Ok(kernel.trim().to_string()));
    check("root", if nix_is_root() { Ok("running as root".into()) } else { Err("moat serve must run as root".into()) });
    check(
        "cgroups",
        CgroupLayout::detect().map_err(|e| e.to_string()).map(|layout| match layout {
            CgroupLayout::V2 { parent } => {
                format!("cgroup v2 (boxes under {})", parent.display())
            }
            CgroupLayout::V1 { .. } => "hybrid host: cgroup v1 memory, pids, cpu, cpuacct and freezer".into(),
        }),
    );
    check(
        "storage pool",
        paths::open_pool(state_dir).map_err(|e| format!("{e:#}")).map(|pool| match pool.kind() {
            PoolKind::Native => {
                format!("btrfs at {} (state dir is on btrfs)", pool.root().display())
            }
            PoolKind::Loop { image } => format!(
                "btrfs loop image {} mounted at {} (state dir is not on btrfs; snapshots need it)",
                image.display(),
                pool.root().display()
            ),
        }),
    );
    check(
        "agent",
        crate::agent::resolve(None, state_dir)
            .map(|p| format!("{} (static)", p.display()))
            .map_err(|e| format!("{e:#}")),
    );
    for (tool, package, need) in [
        ("mkfs.btrfs", "btrfs-progs", "the loop-backed pool"),
        ("ssh-keygen", "openssh-client", "the host key"),
        ("debootstrap", "debootstrap", "the debian image"),
        ("busybox", "busybox-static", "the busybox image"),
        ("ip", "iproute2", "a box's network (routes to the egress gateway)"),
        ("nft", "nftables", "a box's network (redirects to the egress gateway)"),
    ] {
        check(
            tool,
            moat_box::image::which(tool)
                .map(|p| p.display().to_string())
                .ok_or_else(|| format!("missing (apt-get install {package}); needed for {need}")),
        );
    }
    if ok {
        println!("backend: ns (namespaces, seccomp, cgroups); the microVM backend is not built yet");
        Ok(())
    } else {
        anyhow::bail!("some checks failed")
    }
}

fn nix_is_root() -> bool {
    std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap_or(false)
}
