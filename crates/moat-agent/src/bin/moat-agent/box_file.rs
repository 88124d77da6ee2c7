//! Reading a file of the box's own, which the box's root may have made
//! anything: a FIFO (an open that blocks until a writer comes), a device, a
//! file of gigabytes. What the agent reads on every session's way in
//! (`/etc/environment`, `/etc/passwd`, `/etc/group`) must not let the box
//! lock its owner out: `mkfifo /etc/environment` left every later session
//! waiting, across a restart too.

use std::fs::{File, Metadata, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The most of any one such file read.
pub const MAX_TEXT: u64 = 4 << 20;

/// `path`'s text if it is a regular file of at most [`MAX_TEXT`] bytes
/// (opened without blocking, so a FIFO is passed over); `None` otherwise.
pub fn read_text(path: impl AsRef<Path>) -> Option<String> {
    let mut file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).ok()?;
    text_of(&mut file).map(|(text, _)| text)
}

/// The text of `file` (opened by the caller, without blocking) and its
/// metadata, if it is a regular file of at most [`MAX_TEXT`] bytes.
pub fn text_of(file: &mut File) -> Option<(String, Metadata)> {
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > MAX_TEXT {
        return None;
    }
    let mut text = String::new();
    Read::by_ref(file).take(MAX_TEXT).read_to_string(&mut text).ok()?;
    Some((text, meta))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_a_regular_file_of_bounded_size_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("environment");
        std::fs::write(&plain, "A=1\n").unwrap();
        assert_eq!(read_text(&plain).as_deref(), Some("A=1\n"));
        // A FIFO nobody writes: passed over at once, not waited on.
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let started = std::time::Instant::now();
        assert_eq!(read_text(&fifo), None);
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert_eq!(read_text(dir.path()), None);
        assert_eq!(read_text(dir.path().join("missing")), None);
        let big = dir.path().join("big");
        std::fs::File::create(&big).unwrap().set_len(MAX_TEXT + 1).unwrap();
        assert_eq!(read_text(&big), None);
    }
}
