//! The records of a guest's `Walk`: one entry of its file system each, as
//! the host compares them for `diff`. A record is the path, a NUL, the
//! numbers as decimal text separated by spaces, a NUL, the link target
//! (empty if none), a NUL. Neither a path nor a target holds a NUL.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

/// What is compared about an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its type (`st_mode & S_IFMT`).
    pub kind: u32,
    /// Its permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size in bytes.
    pub size: u64,
    /// Modification time: seconds and nanoseconds.
    pub mtime: (i64, i64),
    /// Status change time: seconds and nanoseconds. No program can set it,
    /// so a file that kept it since a snapshot was not written since, even
    /// if its size and modification time were put back. (None from an agent
    /// older than it: a guest running since before an upgrade.)
    pub ctime: Option<(i64, i64)>,
    /// Device number, for device files.
    pub rdev: u64,
}

/// The longest record decoded (three PATH_MAX fields and the numbers).
pub const MAX_RECORD: usize = 3 * 4096 + 256;

/// Appends the record of `path` to `out`.
pub fn encode(path: &OsStr, e: &Entry, target: Option<&OsStr>, out: &mut Vec<u8>) {
    out.extend_from_slice(path.as_bytes());
    out.push(0);
    let mut numbers =
        format!("{} {} {} {} {} {} {} {}", e.kind, e.mode, e.uid, e.gid, e.size, e.mtime.0, e.mtime.1, e.rdev);
    if let Some((secs, nanos)) = e.ctime {
        numbers.push_str(&format!(" {secs} {nanos}"));
    }
    out.extend_from_slice(numbers.as_bytes());
    out.push(0);
    out.extend_from_slice(target.map_or(&[][..], OsStr::as_bytes));
    out.push(0);
}

/// One record off the front of `buf`: (path, entry, target, bytes used);
/// `Ok(None)` if more bytes are needed.
#[allow(clippy::type_complexity)]
pub fn decode(buf: &[u8]) -> Result<Option<(Vec<u8>, Entry, Option<Vec<u8>>, usize)>, String> {
    let mut fields = Vec::with_capacity(3);
    let mut start = 0;
    for (i, b) in buf.iter().enumerate() {
        if *b == 0 {
            fields.push(&buf[start..i]);
            start = i + 1;
            if fields.len() == 3 {
                break;
            }
        }
    }
    if fields.len() < 3 {
        return if buf.len() > MAX_RECORD { Err("a record too long".into()) } else { Ok(None) };
    }
    let numbers = std::str::from_utf8(fields[1]).map_err(|_| "numbers not text".to_string())?;
    let n: Vec<&str> = numbers.split(' ').collect();
    // The change time last, and only from agents that send it.
    let (kind, mode, uid, gid, size, secs, nanos, rdev, ctime) = match n[..] {
        [kind, mode, uid, gid, size, secs, nanos, rdev] => (kind, mode, uid, gid, size, secs, nanos, rdev, None),
        [kind, mode, uid, gid, size, secs, nanos, rdev, csecs, cnanos] => {
            (kind, mode, uid, gid, size, secs, nanos, rdev, Some((csecs, cnanos)))
        }
        _ => return Err(format!("a record of {} numbers", n.len())),
    };
    let bad = |what: &str| format!("a bad {what}");
    let entry = Entry {
        kind: kind.parse().map_err(|_| bad("type"))?,
        mode: mode.parse().map_err(|_| bad("mode"))?,
        uid: uid.parse().map_err(|_| bad("owner"))?,
        gid: gid.parse().map_err(|_| bad("group"))?,
        size: size.parse().map_err(|_| bad("size"))?,
        mtime: (secs.parse().map_err(|_| bad("time"))?, nanos.parse().map_err(|_| bad("time"))?),
        ctime: match ctime {
            Some((secs, nanos)) => {
                Some((secs.parse().map_err(|_| bad("time"))?, nanos.parse().map_err(|_| bad("time"))?))
            }
            None => None,
        },
        rdev: rdev.parse().map_err(|_| bad("device"))?,
    };
    let target = (!fields[2].is_empty()).then(|| fields[2].to_vec());
    Ok(Some((fields[0].to_vec(), entry, target, start)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_hostile_ones_are_errors() {
        let e = Entry {
            kind: 0o100000,
            mode: 0o644,
            uid: 0,
            gid: 5,
            size: 12,
            mtime: (-3, 999),
            ctime: Some((7, 1)),
            rdev: 0,
        };
        let mut buf = Vec::new();
        encode(OsStr::new("/etc/a b"), &e, None, &mut buf);
        encode(OsStr::new("/l"), &e, Some(OsStr::new("../x")), &mut buf);
        let (path, got, target, used) = decode(&buf).unwrap().unwrap();
        assert_eq!((path.as_slice(), &got, target), (&b"/etc/a b"[..], &e, None));
        let (path, _, target, rest) = decode(&buf[used..]).unwrap().unwrap();
        assert_eq!((path.as_slice(), target.as_deref(), used + rest), (&b"/l"[..], Some(&b"../x"[..]), buf.len()));
        assert_eq!(decode(&buf[..5]).unwrap(), None);
        assert!(decode(b"/p\x001 2 3\x00\x00").is_err());
        assert!(decode(b"/p\x00a b c d e f g h i j\x00\x00").is_err());
        let (_, old, _, _) = decode(b"/p\x001 2 3 4 5 6 7 8\x00\x00").unwrap().unwrap();
        assert_eq!(old.ctime, None, "an older agent's record, without its change time");
        assert!(decode(&vec![b'x'; MAX_RECORD + 1]).is_err());
    }
}
