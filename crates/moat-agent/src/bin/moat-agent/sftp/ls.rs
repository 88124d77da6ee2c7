//! `ls -l` lines, which SFTP's `READDIR` answers carry for clients that
//! print them as they come (OpenSSH's `sftp` does).

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;

use super::wire::Attrs;

/// A name as `READDIR` gives it: with an `ls -l` line (as of `now`).
pub(super) fn named(name: Vec<u8>, meta: &Metadata, now: i64) -> (Vec<u8>, Vec<u8>, Attrs) {
    let mut long = format!(
        "{} {:>4} {:<8} {:<8} {:>8} {} ",
        mode_string(meta.mode()),
        meta.nlink(),
        meta.uid(),
        meta.gid(),
        meta.size(),
        ls_time(meta.mtime(), now)
    )
    .into_bytes();
    long.extend_from_slice(&name);
    (name, long, Attrs::of(meta))
}

/// Seconds since 1970.
pub(super) fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// `drwxr-xr-x` and the like.
fn mode_string(mode: u32) -> String {
    let kind = match mode & libc::S_IFMT {
        libc::S_IFDIR => 'd',
        libc::S_IFLNK => 'l',
        libc::S_IFCHR => 'c',
        libc::S_IFBLK => 'b',
        libc::S_IFIFO => 'p',
        libc::S_IFSOCK => 's',
        _ => '-',
    };
    let mut s = String::with_capacity(10);
    s.push(kind);
    for (shift, special, set, unset) in [(6, 0o4000, 's', 'S'), (3, 0o2000, 's', 'S'), (0, 0o1000, 't', 'T')] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(match (bits & 1 != 0, mode & special != 0) {
            (true, true) => set,
            (false, true) => unset,
            (true, false) => 'x',
            (false, false) => '-',
        });
    }
    s
}

/// `ls -l`'s time: month, day and time within half a year, else the year.
fn ls_time(at: i64, now: i64) -> String {
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let (year, month, day) = civil_from_days(at.div_euclid(86_400));
    let month = MONTHS.get(month.saturating_sub(1) as usize).unwrap_or(&"Jan");
    let recent = (now - at).abs() < 182 * 86_400;
    if recent {
        let secs = at.rem_euclid(86_400);
        format!("{month} {day:>2} {:02}:{:02}", secs / 3600, secs % 3600 / 60)
    } else {
        format!("{month} {day:>2} {year:>5}")
    }
}

/// Year, month (1-12) and day of the day `days` after 1970-01-01 (Howard
/// Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ls_lines_read_as_ls_writes_them() {
        assert_eq!(mode_string(0o100_644), "-rw-r--r--");
        assert_eq!(mode_string(0o040_755 | 0o1000), "drwxr-xr-t");
        assert_eq!(mode_string(0o104_755), "-rwsr-xr-x");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        assert_eq!(ls_time(1_767_225_600 + 3_600 + 120, 1_767_225_600 + 86_400), "Jan  1 01:02");
        assert_eq!(ls_time(0, 1_767_225_600), "Jan  1  1970");
    }
}
