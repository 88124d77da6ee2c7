//! The guest kernel unpacked from its `bzImage`, to be booted through its
//! PVH entry point: QEMU then loads the kernel as it is, where a `bzImage`
//! first runs its real-mode setup and decompresses itself inside the guest
//! (under TCG, ~190 ms of every boot: 53 MB of kernel, emulated).
//!
//! The unpacked kernel is made once per kernel and kept; the kernel's
//! decompressor is the host's tool for its format (`lz4`, `gzip`, `xz`,
//! `zstd`, ...). A kernel without a PVH entry, or one that cannot be
//! unpacked, is booted as the `bzImage` it is.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The most an unpacked kernel may be (a stock one is ~55 MB).
const MAX_KERNEL: u64 = 512 << 20;

/// The ELF note naming a kernel's 32-bit PVH entry point
/// (`XEN_ELFNOTE_PHYS32_ENTRY`, owner "Xen").
const PHYS32_ENTRY: u32 = 18;

/// The unpacked kernel of `bzimage`, in `cache` (made now if it is not
/// there yet), if it can be booted through its PVH entry.
pub fn unpacked(bzimage: &Path, cache: &Path) -> io::Result<PathBuf> {
    let meta = std::fs::metadata(bzimage)?;
    let stem = bzimage.file_name().and_then(|n| n.to_str()).unwrap_or("kernel").replace("vmlinuz", "vmlinux");
    let modified = meta.modified()?.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    // Named by what it was unpacked from, so that a kernel replaced in
    // place is unpacked afresh.
    let path = cache.join(format!("{stem}.{}-{modified}", meta.len()));
    if path.is_file() {
        return Ok(path);
    }
    let image = std::fs::read(bzimage)?;
    // A kernel given unpacked already (`--kernel vmlinux`) is booted as it is.
    if has_pvh_entry(&image) {
        return Ok(bzimage.to_path_buf());
    }
    let kernel = decompress(payload(&image)?)?;
    if !has_pvh_entry(&kernel) {
        return Err(io::Error::other("the kernel has no PVH entry point"));
    }
    std::fs::create_dir_all(cache)?;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, &kernel)?;
    std::fs::rename(&partial, &path)?;
    // The cache holds the kernel in use alone (an updated one replaces it).
    for entry in std::fs::read_dir(cache)?.filter_map(Result::ok) {
        if entry.path() != path {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(path)
}

/// The `N` bytes of `bytes` at `at`, if all are there.
fn bytes_at<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    bytes.get(at..at.checked_add(N)?)?.try_into().ok()
}

/// The compressed kernel inside a `bzImage` (boot protocol 2.08 or later,
/// which says where it lies).
fn payload(image: &[u8]) -> io::Result<&[u8]> {
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("not a bzImage: {what}"));
    let u32_at = |at| bytes_at(image, at).map(u32::from_le_bytes);
    if bytes_at(image, 0x202) != Some(*b"HdrS") {
        return Err(invalid("no setup header"));
    }
    let version = bytes_at(image, 0x206).map_or(0, u16::from_le_bytes);
    if version < 0x0208 {
        return Err(invalid("boot protocol older than 2.08"));
    }
    let setup_sectors = match image.get(0x1f1).copied().unwrap_or(0) {
        0 => 4,
        n => usize::from(n),
    };
    let (offset, length) = u32_at(0x248).zip(u32_at(0x24c)).ok_or_else(|| invalid("short header"))?;
    let start = (setup_sectors + 1) * 512 + offset as usize;
    image.get(start..start.saturating_add(length as usize)).ok_or_else(|| invalid("payload beyond the file"))
}

/// Runs the host's decompressor for `data`'s format over it.
fn decompress(data: &[u8]) -> io::Result<Vec<u8>> {
    let tool: &[&str] = match data {
        [0x1f, 0x8b, ..] => &["gzip", "-dc"],
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => &["xz", "-dc"],
        [0x5d, 0, 0, ..] => &["xz", "-dc", "--format=lzma"],
        [0x28, 0xb5, 0x2f, 0xfd, ..] => &["zstd", "-dcq"],
        [0x02, 0x21, 0x4c, 0x18, ..] => &["lz4", "-dcq"],
        [b'B', b'Z', b'h', ..] => &["bzip2", "-dc"],
        [0x89, b'L', b'Z', b'O', ..] => &["lzop", "-dc"],
        _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "a kernel compressed in an unknown format")),
    };
    let program =
        crate::image::which(tool[0]).ok_or_else(|| io::Error::other(format!("{} not found to unpack it", tool[0])))?;
    let mut child = Command::new(program)
        .args(&tool[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut stdin = child.stdin.take().ok_or_else(|| io::Error::other("no stdin"))?;
    let stdout = child.stdout.take().ok_or_else(|| io::Error::other("no stdout"))?;
    let mut out = Vec::new();
    // Fed from a thread of its own: the tool's output fills its pipe long
    // before all its input is in.
    let read = std::thread::scope(|scope| {
        scope.spawn(move || stdin.write_all(data));
        stdout.take(MAX_KERNEL).read_to_end(&mut out)
    });
    // The kernel's build appends the unpacked size to every format's stream
    // (gzip's own trailer holds it), which some tools call trailing garbage:
    // their exit status says nothing, the size does.
    let _ = child.kill();
    let _ = child.wait();
    read?;
    let size = bytes_at(data, data.len().saturating_sub(4)).map(u32::from_le_bytes);
    if size != Some(out.len() as u32) {
        return Err(io::Error::other(format!("{} unpacked {} bytes, not the kernel's {size:?}", tool[0], out.len())));
    }
    Ok(out)
}

/// Whether `elf` is a 64-bit x86 ELF with a PVH entry note.
fn has_pvh_entry(elf: &[u8]) -> bool {
    let u16_at = |at| bytes_at(elf, at).map(u16::from_le_bytes);
    let u64_at = |at| bytes_at(elf, at).map(u64::from_le_bytes);
    // ELF64, little-endian, x86-64.
    if bytes_at(elf, 0) != Some(*b"\x7fELF\x02\x01") || u16_at(18) != Some(62) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(32), u16_at(54), u16_at(56)) else {
        return false;
    };
    // PT_NOTE segments: p_type 4, p_offset at +8, p_filesz at +32.
    let notes = |header: usize| -> Option<&[u8]> {
        if bytes_at(elf, header).map(u32::from_le_bytes) != Some(4) {
            return None;
        }
        let offset = usize::try_from(u64_at(header.checked_add(8)?)?).ok()?;
        let size = usize::try_from(u64_at(header.checked_add(32)?)?).ok()?;
        elf.get(offset..offset.checked_add(size)?)
    };
    (0..usize::from(phnum)).any(|i| {
        usize::try_from(phoff)
            .ok()
            .and_then(|phoff| phoff.checked_add(i * usize::from(phentsize)))
            .and_then(notes)
            .is_some_and(has_phys32_note)
    })
}

/// Whether the notes in `notes` include Xen's `PHYS32_ENTRY`.
fn has_phys32_note(mut notes: &[u8]) -> bool {
    let align4 = |n: usize| n.div_ceil(4) * 4;
    let word = |notes: &[u8], at| bytes_at(notes, at).map_or(0, |b| u32::from_le_bytes(b) as usize);
    while notes.len() >= 12 {
        let (name_size, desc_size, kind) = (word(notes, 0), word(notes, 4), word(notes, 8));
        let name = notes.get(12..12 + name_size);
        if name == Some(b"Xen\0") && kind == PHYS32_ENTRY as usize {
            return true;
        }
        let Some(rest) = notes.get(12 + align4(name_size) + align4(desc_size)..) else { return false };
        notes = rest;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 x86-64 file with one PT_NOTE segment holding `notes`.
    fn elf_with(notes: &[u8]) -> Vec<u8> {
        let mut elf = vec![0u8; 64 + 56];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[18..20].copy_from_slice(&62u16.to_le_bytes());
        elf[32..40].copy_from_slice(&64u64.to_le_bytes());
        elf[54..56].copy_from_slice(&56u16.to_le_bytes());
        elf[56..58].copy_from_slice(&1u16.to_le_bytes());
        elf[64..68].copy_from_slice(&4u32.to_le_bytes());
        elf[72..80].copy_from_slice(&120u64.to_le_bytes());
        elf[96..104].copy_from_slice(&(notes.len() as u64).to_le_bytes());
        elf.extend_from_slice(notes);
        elf
    }

    fn note(name: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
        let mut n = Vec::new();
        n.extend_from_slice(&(name.len() as u32).to_le_bytes());
        n.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        n.extend_from_slice(&kind.to_le_bytes());
        n.extend_from_slice(name);
        n.resize(n.len().div_ceil(4) * 4, 0);
        n.extend_from_slice(desc);
        n.resize(n.len().div_ceil(4) * 4, 0);
        n
    }

    /// A `bzImage`-shaped file whose payload is `kernel`, gzipped.
    fn bzimage_of(kernel: &[u8]) -> Vec<u8> {
        let mut gzip = Command::new("gzip").arg("-c").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        gzip.stdin.take().unwrap().write_all(kernel).unwrap();
        let packed = gzip.wait_with_output().unwrap().stdout;
        let mut image = vec![0u8; 5 * 512 + 100];
        image[0x1f1] = 4;
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        image[0x248..0x24c].copy_from_slice(&100u32.to_le_bytes());
        image[0x24c..0x250].copy_from_slice(&(packed.len() as u32).to_le_bytes());
        image.extend_from_slice(&packed);
        image.extend_from_slice(b"trailing bytes that are not the payload");
        image
    }

    #[test]
    fn finds_the_pvh_note_among_others() {
        let mut notes = note(b"GNU\0", 3, &[1; 20]);
        notes.extend(note(b"Xen\0", 6, b"linux\0"));
        assert!(!has_pvh_entry(&elf_with(&notes)));
        notes.extend(note(b"Xen\0", PHYS32_ENTRY, &[0; 4]));
        assert!(has_pvh_entry(&elf_with(&notes)));
        // Another owner's note of the same number is not it.
        assert!(!has_pvh_entry(&elf_with(&note(b"Foo\0", PHYS32_ENTRY, &[0; 4]))));
    }

    #[test]
    fn hostile_headers_are_refused_without_panics() {
        let good = elf_with(&note(b"Xen\0", PHYS32_ENTRY, &[0; 4]));
        for cut in 0..good.len() {
            let _ = has_pvh_entry(&good[..cut]);
        }
        for at in [32, 72, 96] {
            let mut huge = good.clone();
            huge[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
            assert!(!has_pvh_entry(&huge), "a huge field at {at}");
        }
        let mut notes = note(b"Xen\0", PHYS32_ENTRY, &[0; 4]);
        notes[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(!has_pvh_entry(&elf_with(&notes)));
        assert!(payload(b"not a kernel").is_err());
    }

    #[test]
    fn unpacks_a_bzimage_once_and_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = elf_with(&note(b"Xen\0", PHYS32_ENTRY, &[0; 4]));
        let image = dir.path().join("vmlinuz-6.1.0-test");
        std::fs::write(&image, bzimage_of(&kernel)).unwrap();
        let cache = dir.path().join("kernels");
        let path = unpacked(&image, &cache).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), kernel);
        let given = dir.path().join("vmlinux-given");
        std::fs::write(&given, &kernel).unwrap();
        assert_eq!(unpacked(&given, &cache).unwrap(), given, "an unpacked kernel is used as it is");
        assert!(path.file_name().unwrap().to_str().unwrap().starts_with("vmlinux-6.1.0-test."));
        std::fs::write(&path, b"kept").unwrap();
        assert_eq!(unpacked(&image, &cache).unwrap(), path, "unpacked again");
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");

        let plain = dir.path().join("vmlinuz-plain");
        std::fs::write(&plain, bzimage_of(&elf_with(&note(b"Xen\0", 6, b"linux\0")))).unwrap();
        assert!(unpacked(&plain, &cache).is_err(), "a kernel without a PVH entry");
    }
}
