//! Extended attributes of open files, read: what `diff` compares of a file
//! beyond its bytes (a `setcap` changes only `security.capability`). Each
//! read asks the size first, so a file with none costs one call and no
//! buffer; one that grew between the two calls is `ERANGE`.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Linux's most bytes of a file's attribute names (`XATTR_LIST_MAX`), and of
/// one attribute's value (`XATTR_SIZE_MAX`).
const XATTR_MAX: usize = 64 << 10;

/// The attribute names of open file `fd`, each ended by a NUL (none where
/// its file system keeps none).
pub fn xattr_names(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let read = |buf: &mut [u8]| {
        // SAFETY: `buf` has `buf.len()` writable bytes (none: a size query),
        // which is all the kernel writes; the fd is open for the call.
        unsafe { libc::flistxattr(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) }
    };
    match sized(read) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => Ok(Vec::new()),
        other => other,
    }
}

/// Attribute `name` of open file `fd`, or `None` where the file has no such
/// attribute (any more).
pub fn xattr_value(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<Option<Vec<u8>>> {
    let read = |buf: &mut [u8]| {
        // SAFETY: `name` is NUL-ended and `buf` has `buf.len()` writable
        // bytes (none: a size query), which is all the kernel writes; the fd
        // is open for the call.
        unsafe { libc::fgetxattr(fd.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }
    };
    match sized(read) {
        Err(e) if e.raw_os_error() == Some(libc::ENODATA) => Ok(None),
        other => other.map(Some),
    }
}

/// What `read` (a call taking a buffer and returning its length, or -1)
/// gives: its size asked first, then read into a buffer that large.
fn sized(mut read: impl FnMut(&mut [u8]) -> isize) -> io::Result<Vec<u8>> {
    let len = usize::try_from(read(&mut [])).map_err(|_| io::Error::last_os_error())?;
    let mut buf = vec![0u8; len.min(XATTR_MAX)];
    if len == 0 {
        return Ok(buf);
    }
    let got = usize::try_from(read(&mut buf)).map_err(|_| io::Error::last_os_error())?;
    buf.truncate(got);
    Ok(buf)
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
