//! Extended attributes of open files, read: what `diff` compares of a file
//! beyond its bytes (a `setcap` changes only `security.capability`).

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The attribute names of open file `fd` into `names` (each ended by a
/// NUL): their length in bytes, 0 where its file system keeps none.
pub fn xattr_names(fd: BorrowedFd<'_>, names: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `names` has `names.len()` writable bytes, which is all the
    // kernel writes; the fd is open for the call.
    let n = unsafe { libc::flistxattr(fd.as_raw_fd(), names.as_mut_ptr().cast(), names.len()) };
    match usize::try_from(n) {
        Ok(n) => Ok(n),
        Err(_) if io::Error::last_os_error().raw_os_error() == Some(libc::ENOTSUP) => Ok(0),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

/// Attribute `name` of open file `fd` into `value`: its length, or `None`
/// where the file no longer has it.
pub fn xattr_value(fd: BorrowedFd<'_>, name: &CStr, value: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: `name` is NUL-ended and `value` has `value.len()` writable
    // bytes, which is all the kernel writes; the fd is open for the call.
    let n = unsafe { libc::fgetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
    match usize::try_from(n) {
        Ok(n) => Ok(Some(n)),
        Err(_) if io::Error::last_os_error().raw_os_error() == Some(libc::ENODATA) => Ok(None),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

/// Sets attribute `name` of open file `fd` to `value` (tests make files
/// that differ in one).
#[cfg(test)]
pub fn set_xattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: `name` is NUL-ended and `value` is readable for its length.
    let r = unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
