//! The microVM rows of `moat bench`: a VM box next to raw QEMU booting the
//! same kernel to its first userspace line, on the same machine, in one run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use moat_box::vm::probe::{self, Guest};
use moat_core::{AccountId, BackendKind, BoxManager, BoxSpec, Limits, Name};

use crate::bench::{first_byte, Samples};

/// What a VM row compares: (measurement, samples, peer, peer samples).
pub type Row = (String, Samples, String, Samples);

/// Guest memory of the boxes measured.
const GUEST_MIB: u64 = 1536;
/// What the measured box holds in memory when it is copied (random bytes in
/// a tmpfs, never zero pages, which a save without a memory file skips).
const HELD_MIB: u64 = 1024;

/// `dup` of `src`, `runs` times (each copy removed): until it returns (the
/// copy saved, left suspended), and until the copy's first output.
async fn dup_samples(
    manager: &Arc<BoxManager>,
    account: &AccountId,
    src: &Name,
    runs: usize,
) -> Result<(Samples, Samples)> {
    let (mut dups, mut outputs) = (Vec::new(), Vec::new());
    for i in 0..runs {
        let copy = Name::new(&format!("vm-copy-{i}"))?;
        let t = Instant::now();
        manager.dup(account, src, &copy).await?;
        dups.push(t.elapsed());
        let (handle, session) = manager.open_session(account, &copy).await?;
        first_byte(&handle.agent, "echo x").await?;
        outputs.push(t.elapsed());
        drop(session);
        manager.remove(account, &copy).await?;
    }
    Ok((Samples::sorted(dups), Samples::sorted(outputs)))
}

/// The VM rows, `runs` times each.
pub async fn samples(
    manager: &Arc<BoxManager>,
    account: &AccountId,
    state_dir: &std::path::Path,
    agent: &std::path::Path,
    runs: usize,
) -> Result<Vec<Row>> {
    let kernel = probe::distribution_kernel().context("no guest kernel in /boot")?;
    // As the backend learnt it (remembered under the state dir).
    let accel = crate::microvm::accel_here(state_dir, &kernel, agent);
    // `extra_mib` more memory than the measured boxes': limits of their own,
    // which no warm box has.
    let spec_with = |name: &str, extra_mib: u64| -> Result<BoxSpec> {
        Ok(BoxSpec {
            name: Name::new(name)?,
            image: Name::new("busybox")?,
            limits: Limits {
                cpus: 1,
                memory: (GUEST_MIB + moat_box::vm::qemu::overhead_mib(accel) + extra_mib) << 20,
                ..Limits::default()
            },
            policy: Default::default(),
            backend: Some(BackendKind::Vm),
            run: false,
        })
    };
    let spec = |name: &str| spec_with(name, 0);

    eprintln!(
        "bench: a VM box created to its first command output, and raw QEMU booting the same kernel to its first \
         userspace line, {runs} times each, in turn ({accel:?})"
    );
    // The first makes the image's disk; not timed.
    manager.create(account, spec("vm-warmup")?, Box::new(|_: &str| {})).await?;
    manager.remove(account, &Name::new("vm-warmup")?).await?;
    // Raw QEMU boots a copy of the same disk, which its guest mounts as its root.
    let disk = state_dir.join("pool/bench-raw-disk.raw");
    let base = std::fs::read_dir(state_dir.join("pool/vm-bases"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("busybox.") && n.ends_with(".raw"))
        })
        .context("no disk of the busybox image")?;
    // As the backend boots it (unpacked when the backend was made).
    let unpacked = moat_box::vm::vmlinux::unpacked(&kernel, &state_dir.join("pool/vm-kernels"))?;
    let stock = Guest { kernel: &kernel, agent, disk: Some(&disk), memory_mib: GUEST_MIB, as_box: None };
    let as_box = Guest { as_box: Some(&unpacked), ..stock };
    let (mut raw, mut raw_as_box, mut created, mut warm) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        // In turn, so that a slow patch of the host weighs on all alike.
        for (guest, took) in [(stock, &mut raw), (as_box, &mut raw_as_box)] {
            let copied = std::process::Command::new("cp").arg("--reflink=always").arg(&base).arg(&disk).status()?;
            anyhow::ensure!(copied.success(), "copy the image's disk");
            took.push(probe::boot(guest, accel, Duration::from_secs(60))?.took);
            let _ = std::fs::remove_file(&disk);
        }
        // Booted on demand (limits of its own), then with a warm box ready
        // (asked for every round, the kind is booted ahead after the first).
        for (spec, took) in
            [(spec_with(&format!("vm-{i}"), 1 + i as u64)?, &mut created), (spec(&format!("vm-warm-{i}"))?, &mut warm)]
        {
            let name = spec.name.clone();
            let t = Instant::now();
            manager.create(account, spec, Box::new(|_: &str| {})).await?;
            let (handle, session) = manager.open_session(account, &name).await?;
            first_byte(&handle.agent, "echo x").await?;
            took.push(t.elapsed());
            drop(session);
            manager.remove(account, &name).await?;
        }
    }

    eprintln!("bench: dup of a running {GUEST_MIB} MiB VM box, idle and holding {HELD_MIB} MiB, {runs} times each");
    let src = Name::new("vm-src")?;
    manager.create(account, spec(src.as_str())?, Box::new(|_: &str| {})).await?;
    let idle = dup_samples(manager, account, &src, runs).await?;
    {
        let (handle, _session) = manager.open_session(account, &src).await?;
        // 16 MiB of random bytes over and over (random bytes are slow to make
        // in a TCG guest); the tmpfs made large enough.
        let fill = format!(
            "mount -o remount,size={}m /dev/shm && dd if=/dev/urandom of=/dev/shm/seed bs=1048576 count=16 2>/dev/null \
             && i=0 && while [ $i -lt {} ]; do cat /dev/shm/seed; i=$((i+1)); done > /dev/shm/held \
             && rm /dev/shm/seed && echo held",
            HELD_MIB + 64,
            HELD_MIB / 16
        );
        first_byte(&handle.agent, &fill).await?;
    }
    let held = dup_samples(manager, account, &src, runs).await?;

    eprintln!("bench: first output byte from a suspended and from a running VM box, {runs} times each");
    let (mut resumed, mut running) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        for (suspend_first, out) in [(false, &mut running), (true, &mut resumed)] {
            if suspend_first {
                manager.suspend(account, &src).await?;
            }
            let t = Instant::now();
            let (handle, _session) = manager.open_session(account, &src).await?;
            first_byte(&handle.agent, "echo x").await?;
            out.push(t.elapsed());
        }
    }
    manager.remove(account, &src).await?;

    let raw = Samples::sorted(raw);
    let raw_peer = format!(
        "raw `qemu-system-x86_64 -M microvm` ({accel:?}), same kernel, initramfs and root disk, to its first userspace \
         line on that root"
    );
    let created = Samples::sorted(created);
    let mut rows = vec![
        ("VM box: create + first output of `echo x`".into(), created.clone(), raw_peer.clone(), raw.clone()),
        (
            "VM box: create + first output of `echo x`".into(),
            created,
            format!(
                "the same raw QEMU booting the kernel as a box does (unpacked, PVH entry, `{}`, network and balloon devices)",
                moat_box::vm::qemu::BOOT_OPTIONS
            ),
            Samples::sorted(raw_as_box),
        ),
        (
            "VM box: create + first output of `echo x`, a warm box of its kind ready".into(),
            Samples::sorted(warm),
            raw_peer.clone(),
            raw.clone(),
        ),
    ];
    for (what, (returned, output)) in
        [(format!("idle {GUEST_MIB} MiB box"), idle), (format!("{GUEST_MIB} MiB box holding {HELD_MIB} MiB"), held)]
    {
        rows.push((format!("VM box: `dup` of a running, {what} (returns)"), returned, raw_peer.clone(), raw.clone()));
        rows.push((
            format!("VM box: `dup` of a running, {what}, to the copy's first output"),
            output,
            raw_peer.clone(),
            raw.clone(),
        ));
    }
    rows.extend([(
        "VM box: suspended, session + first output of `echo x`".into(),
        Samples::sorted(resumed),
        "running VM box, same".into(),
        Samples::sorted(running),
    )]);
    Ok(rows)
}
