//! A guest's initramfs: moat's part, the same for every boot (the agent as
//! `/init` and the virtio modules), and each box's own files appended as an
//! archive of their own (the kernel unpacks archives one after another).

use std::path::Path;

use crate::vm::cpio::Archive;

/// A guest's initramfs: the agent as `/init`, the directories it mounts the
/// kernel's filesystems on, and the virtio modules of kernel `release` (from
/// `modules_root`/RELEASE, their signatures cut off), numbered in the order
/// they load.
pub fn initramfs(agent: &[u8], modules_root: &Path, release: &str) -> std::io::Result<Vec<u8>> {
    let mut a = Archive::default();
    for dir in ["dev", "proc", "sys", "lib", "lib/moat", "lib/moat/modules"] {
        a.dir(dir, 0o755);
    }
    a.file("init", 0o755, agent);
    let dir = modules_root.join(release);
    for (i, file) in crate::vm::modules::load_order(&dir, crate::vm::modules::GUEST_MODULES)?.iter().enumerate() {
        let base = file.rsplit('/').next().unwrap_or(file);
        let path = format!("{}/{i:02}-{base}", moat_agent::GUEST_MODULES_DIR.trim_start_matches('/'));
        a.file(&path, 0o644, crate::vm::modules::unsigned(&std::fs::read(dir.join(file))?));
    }
    Ok(a.finish())
}

/// An archive to unpack after [`initramfs()`] (the kernel takes archives one
/// after another): the host's files for one box's root, from its mini-root
/// `files`, where the agent looks for them.
pub fn files_archive(files: &Path) -> std::io::Result<Vec<u8>> {
    let mut a = Archive::default();
    let at = moat_agent::GUEST_FILES_DIR.trim_start_matches('/');
    a.dir(at.split('/').next().unwrap_or(at), 0o755);
    a.dir(at, 0o755);
    a.tree(files, at)?;
    Ok(a.finish())
}
