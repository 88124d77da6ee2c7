//! Landlock rulesets: the filesystem a confined program may read and write.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// Landlock's filesystem rights a kernel of each ABI knows (1: 13 rights;
/// 2 adds REFER; 3 and later add TRUNCATE): what a ruleset of [`landlock`]
/// handles, so that anything not granted beneath one of its paths is denied.
fn landlock_fs_rights(abi: u32) -> u64 {
    match abi {
        1 => (1 << 13) - 1,
        2 => (1 << 14) - 1,
        _ => (1 << 15) - 1,
    }
}
/// Reading files and directories, and executing.
const LANDLOCK_READ: u64 = 1 | (1 << 2) | (1 << 3);
/// Writing a file (and truncating it, from ABI 3).
const LANDLOCK_WRITE: u64 = (1 << 1) | (1 << 14);

/// The kernel's Landlock ABI version, or `None` where it has no Landlock
/// (too old, or not among the LSMs it booted with).
pub fn landlock_abi() -> Option<u32> {
    // SAFETY: with a null attribute and the VERSION flag the call only returns
    // the ABI version.
    let abi = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) };
    u32::try_from(abi).ok().filter(|abi| *abi >= 1)
}

/// A Landlock ruleset allowing reads beneath each of `read` and reads and
/// writes of `read_write`, and no other file access: for a process to take
/// on before it execs ([`super::child_setup`]). `None` only where the kernel
/// has no Landlock at all ([`landlock_abi`]); callers decide whether to go
/// on without it, and say so.
pub fn landlock(read: &[&Path], read_write: &[&Path]) -> io::Result<Option<OwnedFd>> {
    #[repr(C)]
    struct RulesetAttr {
        handled_access_fs: u64,
    }
    #[repr(C, packed)]
    struct PathBeneath {
        allowed_access: u64,
        parent_fd: i32,
    }
    let Some(abi) = landlock_abi() else {
        return Ok(None);
    };
    let handled = landlock_fs_rights(abi);
    let attr = RulesetAttr { handled_access_fs: handled };
    // SAFETY: `attr` is a ruleset attribute of the size passed, alive across the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0u32,
        )
    };
    let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0).ok_or_else(io::Error::last_os_error)?;
    // SAFETY: the call returned a new descriptor that nothing else owns.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd) };
    let rules =
        read.iter().map(|p| (p, LANDLOCK_READ)).chain(read_write.iter().map(|p| (p, LANDLOCK_READ | LANDLOCK_WRITE)));
    for (path, access) in rules {
        let Ok(parent) = std::fs::File::open(path) else { continue };
        // A file (not a directory) takes only the rights a file can have.
        let access = handled & if parent.metadata()?.is_dir() { access } else { access & !(1 << 3) };
        let rule = PathBeneath { allowed_access: access, parent_fd: parent.as_raw_fd() };
        // SAFETY: `rule` is a path-beneath attribute alive across the call, on
        // the ruleset and the open `parent` we own.
        let rc = unsafe {
            libc::syscall(libc::SYS_landlock_add_rule, ruleset.as_raw_fd(), 1u32, &rule as *const PathBeneath, 0u32)
        };
        if rc < 0 {
            return Err(io::Error::other(format!(
                "landlock rule for {}: {}",
                path.display(),
                io::Error::last_os_error()
            )));
        }
    }
    Ok(Some(ruleset))
}

/// Puts the calling thread (and what it starts later) under a Landlock
/// ruleset allowing every file access beneath the open directory `tree`
/// and none elsewhere (descriptors already open stay usable). `Ok(false)`
/// where the kernel has no Landlock. Needs no_new_privs (or CAP_SYS_ADMIN) first.
pub fn landlock_only_beneath(tree: std::os::fd::BorrowedFd<'_>) -> io::Result<bool> {
    let Some(abi) = landlock_abi() else { return Ok(false) };
    let handled = landlock_fs_rights(abi);
    let Some(ruleset) = landlock(&[], &[])? else { return Ok(false) };
    #[repr(C, packed)]
    struct PathBeneath {
        allowed_access: u64,
        parent_fd: i32,
    }
    let rule = PathBeneath { allowed_access: handled, parent_fd: tree.as_raw_fd() };
    // SAFETY: `rule` is a path-beneath attribute alive across the call, on the
    // ruleset we own and `tree`, open for the call.
    let rc = unsafe {
        libc::syscall(libc::SYS_landlock_add_rule, ruleset.as_raw_fd(), 1u32, &rule as *const PathBeneath, 0u32)
    };
    if rc < 0 {
        return Err(io::Error::other(format!("landlock rule: {}", io::Error::last_os_error())));
    }
    // SAFETY: the call reads only the ruleset descriptor, which we own.
    if unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::sys::child_setup;

    #[test]
    fn a_confined_child_reads_what_it_was_given_and_writes_nothing() {
        let read = [Path::new("/usr"), Path::new("/lib"), Path::new("/lib64"), Path::new("/etc")];
        let Some(ruleset) = landlock(&read, &[Path::new("/dev/null")]).unwrap() else {
            // Only where the kernel has none: where it has, moat must use it.
            assert_eq!(landlock_abi(), None, "the kernel has Landlock, and moat made no ruleset");
            return eprintln!("SKIPPED: this kernel has no Landlock: nothing to check");
        };
        let target = std::env::temp_dir().join(format!("moat-landlock-{}", std::process::id()));
        let script = format!("cat /etc/hostname >/dev/null && echo read; echo x > {} && echo wrote", target.display());
        let mut cmd = std::process::Command::new("/usr/bin/sh");
        cmd.args(["-c", &script]).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null());
        let allow_all = vec![crate::bpf::stmt(crate::bpf::BPF_RET_K, crate::bpf::SECCOMP_RET_ALLOW)];
        child_setup(&mut cmd, &[], allow_all, Some(ruleset.as_fd())).unwrap();
        let out = cmd.output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "read\n");
        assert!(!target.exists(), "the confined child wrote {}", target.display());
    }
}
