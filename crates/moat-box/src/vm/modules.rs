//! The kernel modules a guest needs before it can see its devices. In
//! Debian's cloud kernel every virtio driver is a module (the transport,
//! the block device, the console, the entropy source), so the initramfs
//! carries them, found through the kernel's `modules.dep`, dependencies first.

use std::collections::{HashMap, HashSet};
use std::path::Path;

/// What a box's guest loads: the virtio-mmio transport (QEMU's microvm has no
/// PCI) and the devices a box uses.
pub const GUEST_MODULES: &[&str] =
    &["virtio_mmio", "virtio_blk", "virtio_console", "virtio_rng", "virtio_net", "virtio_balloon"];

/// The files of `wanted` modules and everything they depend on, in an order
/// they can be loaded in (each after its dependencies), as paths relative to
/// `modules_dir` (`/lib/modules/RELEASE`). A module the kernel does not have
/// as a module (built in, or absent) is left out.
pub fn load_order(modules_dir: &Path, wanted: &[&str]) -> std::io::Result<Vec<String>> {
    let dep = std::fs::read_to_string(modules_dir.join("modules.dep"))?;
    Ok(order(&dep, wanted))
}

fn order(dep: &str, wanted: &[&str]) -> Vec<String> {
    let mut deps: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut by_name: HashMap<String, &str> = HashMap::new();
    for line in dep.lines() {
        let Some((file, rest)) = line.split_once(':') else { continue };
        deps.insert(file, rest.split_whitespace().collect());
        by_name.insert(module_name(file), file);
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for name in wanted {
        if let Some(file) = by_name.get(*name) {
            visit(file, &deps, &mut seen, &mut out);
        }
    }
    out
}

/// What ends a signed module file (after the signature and its 12-byte
/// description, whose last 4 bytes are the signature's length, big-endian).
const SIGNATURE_MAGIC: &[u8] = b"~Module signature appended~\n";

/// `module` without its appended signature, if it has one. The guest's
/// kernel would check it on every load (under TCG, ~185 ms of a boot for a
/// box's ten modules) and enforces none: the modules come from the host's
/// own `/lib/modules`, and root in a guest may load any module anyway.
pub fn unsigned(module: &[u8]) -> &[u8] {
    let Some(body) = module.strip_suffix(SIGNATURE_MAGIC) else { return module };
    let Some(length) = body.len().checked_sub(4).and_then(|at| body.get(at..)) else { return module };
    let length = u32::from_be_bytes([length[0], length[1], length[2], length[3]]) as usize;
    match body.len().checked_sub(12 + length) {
        Some(end) => &body[..end],
        None => module,
    }
}

/// Depth first, dependencies before the module (a cycle cannot loop: each
/// file is visited once).
fn visit<'a>(file: &'a str, deps: &HashMap<&'a str, Vec<&'a str>>, seen: &mut HashSet<&'a str>, out: &mut Vec<String>) {
    if !seen.insert(file) {
        return;
    }
    for dep in deps.get(file).into_iter().flatten() {
        visit(dep, deps, seen, out);
    }
    out.push(file.to_string());
}

/// A module's name from its file: `kernel/drivers/char/hw_random/virtio-rng.ko`
/// is `virtio_rng`.
fn module_name(file: &str) -> String {
    let base = file.rsplit('/').next().unwrap_or(file);
    base.split('.').next().unwrap_or(base).replace('-', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_cut_off_and_only_they() {
        let mut signed = b"\x7fELF module body".to_vec();
        let body_len = signed.len();
        signed.extend_from_slice(&[0xaa; 40]);
        signed.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 40]);
        signed.extend_from_slice(SIGNATURE_MAGIC);
        assert_eq!(unsigned(&signed), &signed[..body_len]);
        let plain = b"\x7fELF module body, unsigned".to_vec();
        assert_eq!(unsigned(&plain), &plain[..]);
        // A length beyond the file leaves it as it is; so does any cut of it.
        let mut lying = signed.clone();
        let at = lying.len() - SIGNATURE_MAGIC.len() - 4;
        lying[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(unsigned(&lying), &lying[..]);
        for cut in 0..signed.len() {
            let _ = unsigned(&signed[cut..]);
        }
    }

    #[test]
    fn dependencies_come_first_and_once() {
        let dep = "kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/drivers/virtio/virtio_ring.ko:\n\
                   kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n";
        let got = order(dep, &["virtio_mmio", "virtio_rng", "not_a_module"]);
        assert_eq!(
            got,
            [
                "kernel/drivers/virtio/virtio_ring.ko",
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_mmio.ko",
                "kernel/drivers/char/hw_random/virtio-rng.ko"
            ]
        );
    }
}
