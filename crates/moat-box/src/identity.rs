//! What makes a box a machine of its own: host name, machine-id, random seed and
//! SSH host keys. Minted when a box is made (and again for every duplicate), by
//! the host, into the box's root.
//!
//! The root may be controlled by a box (a duplicate's is), so every path is
//! resolved with `RESOLVE_IN_ROOT`: a symlink planted in the box cannot make the
//! host write outside it.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use moat_core::Name;

use crate::in_root::{exists_in_root, parents_in_root, read_in_root, write_in_root};
use crate::trust;

/// SSH host key types an image may carry, by their file names' middle part.
const HOST_KEY_TYPES: &[&str] = &["rsa", "ecdsa", "ed25519"];

/// Where a box keeps its random seed, if it has systemd.
const RANDOM_SEED: &str = "var/lib/systemd/random-seed";

/// The identity files a box may make itself (systemd writes a random seed,
/// `ssh-keygen -A` host keys): [`mint`] replaces those in the root it is
/// given, but a VM box's are on its disk, which the host never reads, so a
/// copy's guest is asked which it holds ([`mint_held`]).
pub const BOX_MADE: &[&str] =
    &[RANDOM_SEED, "etc/ssh/ssh_host_rsa_key", "etc/ssh/ssh_host_ecdsa_key", "etc/ssh/ssh_host_ed25519_key"];

/// Writes a fresh identity for a box called `name` into `root`: host name,
/// machine-id, random seed, new SSH host keys for each kind the image has, and
/// a TLS CA the box trusts. Returns the CA's private key (PEM), which belongs
/// on the host.
pub fn mint(root: &Path, name: &Name) -> io::Result<String> {
    let dir: OwnedFd = std::fs::File::open(root)?.into();
    write_host_name(&dir, name)?;
    let machine_id = format!("{}\n", hex::encode(random::<16>()));
    write_in_root(&dir, "etc/machine-id", machine_id.as_bytes(), 0o444)?;
    // Only images with systemd have a seed to replace.
    if_present(mint_file(&dir, RANDOM_SEED, name).map(drop))?;
    for key in BOX_MADE.iter().filter(|rel| **rel != RANDOM_SEED) {
        if exists_in_root(&dir, key) {
            mint_file(&dir, key, name)?;
        }
    }
    let (ca_cert, ca_key) = moat_core::box_ca::mint().map_err(io::Error::other)?;
    trust::install(&dir, &ca_cert)?;
    Ok(ca_key)
}

/// Gives the box in `root` a new TLS CA (it trusts the new one only), the
/// same machine otherwise: a box received on another node, whose CA key
/// stayed on the node it came from. Returns the CA's private key (PEM).
pub fn rekey_ca(root: &Path) -> io::Result<String> {
    let dir: OwnedFd = std::fs::File::open(root)?.into();
    let (ca_cert, ca_key) = moat_core::box_ca::mint().map_err(io::Error::other)?;
    trust::install(&dir, &ca_cert)?;
    Ok(ca_key)
}

/// Writes into `root` new identity files for those of `held` (paths of
/// [`BOX_MADE`] a box holds in files the host cannot reach) that `root`
/// lacks (what it has, [`mint`] made new already). Returns every path
/// written (a host key's `.pub` beside it).
pub fn mint_held(root: &Path, name: &Name, held: &[&str]) -> io::Result<Vec<String>> {
    let dir: OwnedFd = std::fs::File::open(root)?.into();
    let mut written = Vec::new();
    for rel in held.iter().filter(|rel| BOX_MADE.contains(rel)) {
        if exists_in_root(&dir, rel) {
            continue;
        }
        parents_in_root(&dir, rel)?;
        written.extend(mint_file(&dir, rel, name)?);
    }
    Ok(written)
}

/// Writes a new `rel` (the random seed, or an SSH host key with its `.pub`)
/// into `dir`; the paths written.
fn mint_file(dir: &OwnedFd, rel: &str, name: &Name) -> io::Result<Vec<String>> {
    let kind = rel.strip_prefix("etc/ssh/ssh_host_").and_then(|k| k.strip_suffix("_key"));
    match kind.filter(|kind| HOST_KEY_TYPES.contains(kind)) {
        Some(kind) => {
            let (private, public) = generate_host_key(kind, name)?;
            let public_rel = format!("{rel}.pub");
            write_in_root(dir, rel, &private, 0o600)?;
            write_in_root(dir, &public_rel, &public, 0o644)?;
            Ok(vec![rel.to_string(), public_rel])
        }
        None => {
            write_in_root(dir, rel, &random::<512>(), 0o600)?;
            Ok(vec![rel.to_string()])
        }
    }
}

/// Gives the box in `root` a new host name (after a promote).
pub fn rename(root: &Path, name: &Name) -> io::Result<()> {
    let dir: OwnedFd = std::fs::File::open(root)?.into();
    write_host_name(&dir, name)
}

/// Gives the box in `root` host name `name` if its files say another (a
/// restored checkpoint keeps its own /etc/hosts when the name is the same).
pub fn rename_if_changed(root: &Path, name: &Name) -> io::Result<()> {
    let dir: OwnedFd = std::fs::File::open(root)?.into();
    // Unreadable (a FIFO, a huge file: the box's doing) counts as another name.
    let now = read_in_root(&dir, "etc/hostname", 256).ok().flatten().unwrap_or_default();
    if String::from_utf8_lossy(&now).trim() == name.as_str() {
        return Ok(());
    }
    write_host_name(&dir, name)
}

fn write_host_name(dir: &OwnedFd, name: &Name) -> io::Result<()> {
    write_in_root(dir, "etc/hostname", format!("{name}\n").as_bytes(), 0o644)?;
    let hosts = format!("127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    write_in_root(dir, "etc/hosts", hosts.as_bytes(), 0o644)
}

fn if_present(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// A new host key pair of `kind`, made by ssh-keygen in a private host
/// directory (never inside the box's tree, whose paths the box controls).
fn generate_host_key(kind: &str, name: &Name) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let dir = std::env::temp_dir().join(format!("moat-hostkey-{}-{}", std::process::id(), hex::encode(random::<8>())));
    std::fs::create_dir(&dir)?;
    let key = dir.join("key");
    let out = std::process::Command::new("ssh-keygen")
        .args(["-q", "-N", "", "-t", kind, "-C", &format!("root@{name}"), "-f"])
        .arg(&key)
        .output();
    let result = out.and_then(|out| {
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "ssh-keygen -t {kind}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok((std::fs::read(&key)?, std::fs::read(key.with_extension("pub"))?))
    });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    // getrandom only fails before the kernel's pool is initialised, long past here.
    let _ = getrandom::fill(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mint_writes_identity_and_stays_inside_root() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("etc")).unwrap();
        // A hostile box points its hostname at a host file.
        let victim = outside.path().join("victim");
        std::fs::write(&victim, "host data").unwrap();
        std::os::unix::fs::symlink(&victim, root.path().join("etc/hostname")).unwrap();
        // And its hosts file through a directory symlink that leaves the root.
        std::fs::create_dir(root.path().join("var")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("var/lib")).unwrap();
        std::fs::create_dir(outside.path().join("systemd")).unwrap();
        let name = Name::new("web").unwrap();
        let ca_key = mint(root.path(), &name).unwrap();
        assert!(ca_key.starts_with("-----BEGIN PRIVATE KEY-----"), "{ca_key}");
        assert!(std::fs::read_to_string(root.path().join(trust::CA_FILE)).unwrap().contains("BEGIN CERTIFICATE"));
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host data");
        assert_eq!(std::fs::read_dir(outside.path().join("systemd")).unwrap().count(), 0);
        let first = std::fs::read_to_string(root.path().join("etc/machine-id")).unwrap();
        assert_eq!(std::fs::read_to_string(root.path().join("etc/hostname")).unwrap(), "web\n");
        mint(root.path(), &name).unwrap();
        let second = std::fs::read_to_string(root.path().join("etc/machine-id")).unwrap();
        assert_eq!(first.len(), 33);
        assert_ne!(first, second);
        // Host keys are replaced only for the kinds the image has.
        std::fs::create_dir(root.path().join("etc/ssh")).unwrap();
        std::fs::write(root.path().join("etc/ssh/ssh_host_ed25519_key"), "old").unwrap();
        mint(root.path(), &name).unwrap();
        let key = std::fs::read_to_string(root.path().join("etc/ssh/ssh_host_ed25519_key")).unwrap();
        assert!(key.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"), "{key}");
        assert!(std::fs::read_to_string(root.path().join("etc/ssh/ssh_host_ed25519_key.pub"))
            .unwrap()
            .contains("root@web"));
        assert!(!root.path().join("etc/ssh/ssh_host_rsa_key").exists());
    }

    #[test]
    fn mint_held_writes_what_the_box_made_and_the_root_lacks() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("etc/ssh")).unwrap();
        std::fs::write(root.path().join("etc/ssh/ssh_host_rsa_key"), "minted at dup").unwrap();
        let name = Name::new("copy").unwrap();
        let held = ["etc/ssh/ssh_host_rsa_key", "etc/ssh/ssh_host_ed25519_key", RANDOM_SEED, "etc/passwd"];
        let written = mint_held(root.path(), &name, &held).unwrap();
        assert_eq!(
            written,
            ["etc/ssh/ssh_host_ed25519_key", "etc/ssh/ssh_host_ed25519_key.pub", RANDOM_SEED],
            "only what the root lacks, of the box's own identity files"
        );
        assert_eq!(std::fs::read_to_string(root.path().join("etc/ssh/ssh_host_rsa_key")).unwrap(), "minted at dup");
        let key = std::fs::read_to_string(root.path().join("etc/ssh/ssh_host_ed25519_key")).unwrap();
        assert!(key.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"), "{key}");
        assert_eq!(std::fs::read(root.path().join(RANDOM_SEED)).unwrap().len(), 512);
        assert!(!root.path().join("etc/passwd").exists());
    }
}
