//! A cpio archive in the "newc" format, the one the kernel unpacks as an
//! initramfs. Only what an initramfs needs: directories and regular files,
//! owned by root, uncompressed (the kernel takes it as it is).

/// An archive being written.
#[derive(Default)]
pub struct Archive {
    out: Vec<u8>,
    next_ino: u32,
}

impl Archive {
    /// A directory `path` (no leading `/`), mode `mode` (permission bits).
    pub fn dir(&mut self, path: &str, mode: u32) {
        self.entry(path, 0o040_000 | (mode & 0o7777), &[]);
    }

    /// A regular file `path` holding `data`.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) {
        self.entry(path, 0o100_000 | (mode & 0o7777), data);
    }

    /// Every directory and regular file below `tree` (links and the rest are
    /// left out), under `prefix`, with their permission bits.
    pub fn tree(&mut self, tree: &std::path::Path, prefix: &str) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let mut dirs = vec![(tree.to_path_buf(), prefix.to_string())];
        while let Some((dir, at)) = dirs.pop() {
            let mut entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
            entries.sort_by_key(std::fs::DirEntry::file_name);
            for entry in entries {
                let Some(name) = entry.file_name().to_str().map(str::to_string) else { continue };
                let path = format!("{at}/{name}");
                let meta = entry.metadata()?;
                let mode = meta.permissions().mode();
                if meta.is_dir() {
                    self.dir(&path, mode);
                    dirs.push((entry.path(), path));
                } else if meta.is_file() {
                    self.file(&path, mode, &std::fs::read(entry.path())?);
                }
            }
        }
        Ok(())
    }

    /// The archive, its trailer written.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.out
    }

    fn entry(&mut self, path: &str, mode: u32, data: &[u8]) {
        self.next_ino += 1;
        let name_len = path.len() + 1;
        let fields = [
            self.next_ino,
            mode,
            0, // uid
            0, // gid
            if mode & 0o040_000 != 0 { 2 } else { 1 },
            0, // mtime
            u32::try_from(data.len()).unwrap_or(u32::MAX),
            0,
            0,
            0,
            0,
            u32::try_from(name_len).unwrap_or(u32::MAX),
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(path.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    /// Header and name, and data, each end on a 4-byte boundary.
    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cpio_reads_what_we_write() {
        let mut a = Archive::default();
        a.dir("proc", 0o755);
        a.file("init", 0o755, b"#!/bin/sh\necho hi\n");
        let bytes = a.finish();
        assert!(bytes.len().is_multiple_of(4));
        let dir = tempfile::tempdir().unwrap();
        let mut cpio = std::process::Command::new("cpio")
            .args(["-i", "--quiet", "--no-absolute-filenames"])
            .current_dir(dir.path())
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(cpio.stdin.as_mut().unwrap(), &bytes).unwrap();
        drop(cpio.stdin.take());
        assert!(cpio.wait().unwrap().success());
        assert_eq!(std::fs::read_to_string(dir.path().join("init")).unwrap(), "#!/bin/sh\necho hi\n");
        assert!(dir.path().join("proc").is_dir());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.path().join("init")).unwrap().permissions().mode() & 0o777, 0o755);
    }
}
