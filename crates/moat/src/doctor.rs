//! `moat doctor`: what this host offers and what moat will use.

use std::path::Path;

use anyhow::Result;
use moat_box::host::cgroup::CgroupLayout;
use moat_box::pool::PoolKind;
use moat_box::vm::Accel;

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
        CgroupLayout::detect(&moat_box::host::cgroup::parent_name("")).map_err(|e| e.to_string()).map(|layout| {
            match layout {
                CgroupLayout::V2 { parent } => {
                    format!("cgroup v2 (boxes under {})", parent.display())
                }
                CgroupLayout::V1 { .. } => "hybrid host: cgroup v1 memory, pids, cpu, cpuacct and freezer".into(),
            }
        }),
    );
    let pool = paths::open_pool(state_dir).map_err(|e| format!("{e:#}"));
    check(
        "storage pool",
        pool.as_ref().map_err(Clone::clone).map(|pool| match pool.kind() {
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
    // Not a failure (boxes run and their limits hold), but loud.
    match pool.as_ref().map(|p| p.simple_quotas()) {
        Ok(true) => {
            println!("ok    disk quotas: btrfs simple quotas (box limits, copies, checkpoints, account budgets)")
        }
        Ok(false) => println!("--    disk quotas: {}", paths::FULL_QGROUPS),
        Err(_) => {}
    }
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
    // Not a failure (namespace boxes do not need it), but loud: VM boxes are
    // refused without it.
    let landlock = moat_box::sys::landlock_abi();
    match landlock {
        Some(abi) => println!("ok    landlock: ABI {abi} (confines QEMU of VM boxes)"),
        None => println!(
            "--    landlock: {}",
            crate::microvm::landlock_refusal(None, false).unwrap_or("none in this kernel")
        ),
    }
    let (line, accel) = microvm(state_dir);
    println!("{line}");
    let accel = accel.filter(|_| landlock.is_some());
    if ok {
        match accel {
            Some(Accel::Kvm) => println!("backend: vm by default (a kernel of its own per box, KVM); `new --backend ns` for namespaces"),
            Some(Accel::Tcg) => println!(
                "backend: ns by default (namespaces, seccomp, cgroups); `new --backend vm` runs a box as a microVM on TCG, slowly"
            ),
            None => println!("backend: ns (namespaces, seccomp, cgroups); no microVM boxes here"),
        }
        Ok(())
    } else {
        anyhow::bail!("some checks failed")
    }
}

/// How long a KVM guest may take to its first line (it takes well under a
/// second where KVM works).
const KVM_BOOT: std::time::Duration = std::time::Duration::from_secs(5);
/// The same under TCG (about two seconds here).
const TCG_BOOT: std::time::Duration = std::time::Duration::from_secs(30);

/// What runs a microVM guest here, learnt by booting one (opening `/dev/kvm`
/// proves nothing: on some hosts it opens and every guest hangs). Never a
/// failure: boxes run in namespaces without it.
fn microvm(state_dir: &Path) -> (String, Option<Accel>) {
    use moat_box::vm::probe::{boot, distribution_kernel, Booted, Guest};
    let Some(kernel) = distribution_kernel() else {
        return ("--    microvm: no guest kernel in /boot (apt-get install linux-image-cloud-amd64)".into(), None);
    };
    let agent = match crate::agent::resolve(None, state_dir) {
        Ok(agent) => agent,
        Err(e) => return (format!("--    microvm: no agent to boot: {e:#}"), None),
    };
    // The busybox image as the guest's root disk (a throwaway copy), where it
    // is built (doctor builds none).
    let disk = std::env::temp_dir().join(format!("moat-doctor-{}.ext4", std::process::id()));
    let has_disk = paths::open_pool(state_dir).ok().is_some_and(|pool| {
        let image = moat_core::Name::new("busybox").ok();
        image.is_some_and(|i| {
            pool.has_image(&i) && moat_box::vm::disk::ext4_image(&pool.image_path(&i), &disk, u64::MAX).is_ok()
        })
    });
    let guest = Guest {
        kernel: &kernel,
        agent: &agent,
        disk: has_disk.then_some(disk.as_path()),
        memory_mib: 256,
        as_box: None,
    };
    let kvm = if Path::new("/dev/kvm").exists() {
        boot(guest, Accel::Kvm, KVM_BOOT)
    } else {
        Err(moat_box::vm::probe::ProbeError::Ended("no /dev/kvm".into()))
    };
    let found = |b: &Booted| {
        let disk = b.disk.as_ref().map_or(String::new(), |d| format!("; the busybox image as its disk: {d}"));
        let mut ping = b.answered.map_or("no answer to a ping over virtio-serial".to_string(), |t| {
            format!("the agent answers a ping over virtio-serial in {:.1} ms", t.as_secs_f64() * 1e3)
        });
        if let Some(uname) = &b.uname {
            ping.push_str(&format!("; `uname -r` run in it from its disk: {uname}"));
        }
        format!(
            "(guest kernel {}) to the agent in {:.2} s; virtio devices: {}{disk}; {ping}",
            b.release,
            b.took.as_secs_f64(),
            b.devices.join(" ")
        )
    };
    let kernel_name = kernel.display();
    let (line, accel) = match kvm {
        Ok(b) => (format!("ok    microvm: KVM boots {kernel_name} {}", found(&b)), Some(Accel::Kvm)),
        Err(kvm_err) => match boot(guest, Accel::Tcg, TCG_BOOT) {
            Ok(b) => (
                format!(
                    "ok    microvm: KVM cannot run a guest here ({kvm_err}); TCG (7-30x slower, tsc_early_khz set) \
                     boots {kernel_name} {}",
                    found(&b)
                ),
                Some(Accel::Tcg),
            ),
            Err(tcg_err) => (format!("--    microvm: no guest boots here: KVM: {kvm_err}; TCG: {tcg_err}"), None),
        },
    };
    let _ = std::fs::remove_file(&disk);
    // What `moat serve` will use, learnt afresh.
    if let Some(accel) = accel {
        crate::microvm::remember(state_dir, &kernel, accel);
    }
    (line, accel)
}

fn nix_is_root() -> bool {
    std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap_or(false)
}
