//! Whether and how this host runs microVM boxes: the kernel and QEMU found,
//! and what runs a guest here (KVM, or only TCG), learnt by booting one once
//! per kernel and remembered in the state directory (`moat doctor` learns
//! it afresh).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use moat_box::vm::probe::{self, Guest};
use moat_box::vm::Accel;
use moat_box::vm::{VmConfig, VmMachine};
use moat_box::Host;
use moat_core::BackendKind;

/// The operator's microVM settings.
#[derive(Debug, Clone, clap::Args)]
pub struct VmArgs {
    /// What isolates a box whose `new` does not say: `vm` (a kernel of its
    /// own) or `ns` (namespaces) [default: vm where KVM can run a guest, ns
    /// elsewhere].
    #[arg(long, value_parser = parse_backend)]
    pub backend: Option<BackendKind>,
    /// The guest kernel of VM boxes [default: the newest
    /// /boot/vmlinuz-*-cloud-amd64]; its modules come from
    /// /lib/modules/RELEASE.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// An initramfs unpacked before moat's in every VM box (extra modules).
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// How VM guests' CPUs run: kvm, tcg, or auto (kvm if a guest boots under
    /// it here, else tcg).
    #[arg(long, default_value = "auto", value_parser = ["auto", "kvm", "tcg"])]
    pub vm_accel: String,
    /// Run VM boxes even where the kernel has no Landlock, with QEMU (which
    /// parses what a guest sends) free to open any file its uid can.
    #[arg(long)]
    pub allow_vm_without_landlock: bool,
}

/// Why VM boxes are refused here for want of Landlock, if they are; with
/// the kernel's Landlock ABI (`None`: no Landlock) and the operator's flag.
pub fn landlock_refusal(abi: Option<u32>, allowed: bool) -> Option<&'static str> {
    match (abi, allowed) {
        (None, false) => Some(
            "this kernel has no Landlock, so QEMU would run without file confinement \
             (moat serve --allow-vm-without-landlock accepts that risk)",
        ),
        _ => None,
    }
}

fn parse_backend(s: &str) -> Result<BackendKind, String> {
    BackendKind::parse(s).ok_or_else(|| format!("{s:?} is not ns or vm"))
}

/// How long a KVM guest may take to its first line (well under a second
/// where KVM works; here it hangs).
pub const KVM_BOOT: Duration = Duration::from_secs(5);

/// The VM machine as configured, or why there is none; and the default backend.
pub fn machine(state_dir: &Path, host: &Host, args: &VmArgs) -> (Result<VmMachine, String>, BackendKind) {
    let made = (|| -> Result<(VmMachine, Accel)> {
        let kernel = match &args.kernel {
            Some(k) => k.clone(),
            None => probe::distribution_kernel()
                .context("no guest kernel in /boot (apt-get install linux-image-cloud-amd64)")?,
        };
        let qemu = moat_box::image::which("qemu-system-x86_64")
            .context("qemu-system-x86_64 not found (apt-get install qemu-system-x86)")?;
        let landlock = moat_box::sys::landlock_abi();
        if let Some(refusal) = landlock_refusal(landlock, args.allow_vm_without_landlock) {
            anyhow::bail!("{refusal}");
        }
        if landlock.is_none() {
            tracing::warn!("no Landlock in this kernel: VM boxes run QEMU without file confinement, as asked");
        }
        let accel = match args.vm_accel.as_str() {
            "kvm" => Accel::Kvm,
            "tcg" => Accel::Tcg,
            _ => accel_here(state_dir, &kernel, &host.config.agent),
        };
        let config = VmConfig { kernel, initrd: args.initrd.clone(), qemu, accel };
        Ok((VmMachine::new(host.clone(), config)?, accel))
    })();
    match made {
        Ok((vm, accel)) => {
            let default = args.backend.unwrap_or(if accel == Accel::Kvm { BackendKind::Vm } else { BackendKind::Ns });
            tracing::info!(accel = accel.as_str(), default = %default, "microVM boxes available");
            (Ok(vm), default)
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "no microVM boxes on this server");
            (Err(format!("{e:#}")), BackendKind::Ns)
        }
    }
}

/// Where the last probe's answer is kept.
fn remembered(state_dir: &Path) -> PathBuf {
    state_dir.join("vm-accel")
}

/// KVM if a guest of `kernel` boots under it here, else TCG; remembered per
/// kernel so that only the first start pays for a probe.
pub fn accel_here(state_dir: &Path, kernel: &Path, agent: &Path) -> Accel {
    let key = kernel.display().to_string();
    if let Ok(text) = std::fs::read_to_string(remembered(state_dir)) {
        if let Some((word, of)) = text.trim().split_once(' ') {
            if of == key {
                return if word == "kvm" { Accel::Kvm } else { Accel::Tcg };
            }
        }
    }
    let kvm = Path::new("/dev/kvm").exists()
        && probe::boot(Guest { kernel, agent, disk: None, memory_mib: 256, as_box: None }, Accel::Kvm, KVM_BOOT)
            .is_ok();
    let accel = if kvm { Accel::Kvm } else { Accel::Tcg };
    remember(state_dir, kernel, accel);
    accel
}

/// Keeps what a probe learnt about `kernel`.
pub fn remember(state_dir: &Path, kernel: &Path, accel: Accel) {
    let _ = std::fs::write(remembered(state_dir), format!("{} {}\n", accel.as_str(), kernel.display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_boxes_need_landlock_unless_the_operator_accepts_the_risk() {
        assert!(landlock_refusal(None, false).is_some_and(|r| r.contains("--allow-vm-without-landlock")));
        assert_eq!(landlock_refusal(None, true), None);
        assert_eq!(landlock_refusal(Some(1), false), None);
    }
}
