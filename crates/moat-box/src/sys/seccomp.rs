//! Installing a seccomp filter on the calling thread, with or without a
//! listener for its user-notification verdicts.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// The kernel's view of `filter`; it borrows `filter`, which must outlive it.
fn fprog(filter: &[libc::sock_filter]) -> io::Result<libc::sock_fprog> {
    Ok(libc::sock_fprog {
        len: u16::try_from(filter.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        filter: filter.as_ptr().cast_mut(),
    })
}

/// Sets the calling thread's seccomp filter (no_new_privs must be set already).
pub fn install_seccomp(filter: &[libc::sock_filter]) -> io::Result<()> {
    let prog = fprog(filter)?;
    // SAFETY: `prog` points at `filter`, which outlives the call; the kernel copies
    // the program before returning.
    let rc = unsafe { libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Installs a seccomp filter whose `SECCOMP_RET_USER_NOTIF` verdicts go to the
/// returned listener (close-on-exec, as the kernel makes it).
pub fn install_seccomp_with_listener(filter: &[libc::sock_filter]) -> io::Result<OwnedFd> {
    let prog = fprog(filter)?;
    // SAFETY: `prog` points at `filter`, which outlives the call; the kernel copies
    // the program before returning, and returns a new fd we then own.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &prog as *const libc::sock_fprog,
        )
    };
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
