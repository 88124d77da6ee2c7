//! Resource limits of a box, and parsing the sizes users type.

use serde::{Deserialize, Serialize};

/// The cgroup limits a box runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Limits {
    /// CPU bandwidth, in whole CPUs.
    pub cpus: u32,
    /// Memory, in bytes (swap is not allowed on top).
    pub memory: u64,
    /// Most processes and threads at once.
    pub pids: u32,
    /// Most bytes the box may write on top of its image (its exclusive disk use).
    pub disk: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self { cpus: 2, memory: 2 << 30, pids: 2048, disk: 16 << 30 }
    }
}

/// A limit that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// Not a size like `512M` or `2G`.
    #[error("{0:?} is not a size (try 512M or 2G)")]
    BadSize(String),
    /// Outside the allowed range.
    #[error("{what} must be between {min} and {max}")]
    OutOfRange {
        /// Which limit.
        what: &'static str,
        /// Smallest allowed, as the user would type it.
        min: String,
        /// Largest allowed, as the user would type it.
        max: String,
    },
}

impl Limits {
    /// Checks that each limit is in a range the kernel and the host can honour.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let count = |n: u64| n.to_string();
        check("--cpus", u64::from(self.cpus), 1, 256, count)?;
        check("--memory", self.memory, 16 << 20, 1 << 40, format_size)?;
        check("--pids", u64::from(self.pids), 16, 1 << 22, count)?;
        check("--disk", self.disk, 64 << 20, 1 << 50, format_size)?;
        Ok(())
    }
}

fn check(what: &'static str, v: u64, min: u64, max: u64, show: fn(u64) -> String) -> Result<(), LimitsError> {
    if (min..=max).contains(&v) {
        Ok(())
    } else {
        Err(LimitsError::OutOfRange { what, min: show(min), max: show(max) })
    }
}

/// A size as a user would type it: `2147483648` → `2G`; sizes that are no
/// whole number of any unit stay in bytes.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(50, "P"), (40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// `10788864` → `10.3M`: a measured amount, to one decimal.
pub fn format_measured(bytes: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift {
            return format!("{:.1}{unit}", bytes as f64 / f64::from(1u32 << (shift - 10)) / 1024.0);
        }
    }
    bytes.to_string()
}

/// Parses `1048576`, `512K`, `512M`, `2G`, `1T` (powers of 1024; a trailing `B`
/// or `iB` is allowed).
pub fn parse_size(s: &str) -> Result<u64, LimitsError> {
    let bad = || LimitsError::BadSize(s.to_string());
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(bad()),
            };
            (t.get(..i).ok_or_else(bad)?, shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_as_typed() {
        assert_eq!(format_size(2 << 30), "2G");
        assert_eq!(format_size(512 << 20), "512M");
        assert_eq!(format_size(1000), "1000");
        let e = Limits { disk: 1, ..Limits::default() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "--disk must be between 64M and 1P");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1k"), Ok(1024));
        for bad in ["", "G", "2X", "-1G", "1.5G", "99999999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits_are_range_checked() {
        assert!(Limits::default().validate().is_ok());
        assert!(Limits { cpus: 0, ..Limits::default() }.validate().is_err());
        assert!(Limits { memory: 1 << 20, ..Limits::default() }.validate().is_err());
        assert!(Limits { pids: 1, ..Limits::default() }.validate().is_err());
    }
}
