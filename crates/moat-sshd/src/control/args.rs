//! Readers of the arguments verbs share (a box name, `--json`, a period),
//! each failing with one line of usage.

use moat_core::Name;

/// A command line that does not parse: one line, exit status 2.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// A usage error saying `msg`.
pub fn usage(msg: impl Into<String>) -> UsageError {
    UsageError(msg.into())
}

/// A box (or secret) name, required.
pub fn name_arg(what: &str, value: Option<&String>) -> Result<Name, UsageError> {
    let value = value.ok_or_else(|| usage(format!("{what}: missing NAME (see 'help')")))?;
    Name::new(value).map_err(|e| usage(format!("{what}: {e}")))
}

/// A checkpoint's label, required.
pub fn label_arg(what: &str, value: Option<&String>) -> Result<Name, UsageError> {
    let value = value.ok_or_else(|| usage(format!("{what}: missing LABEL (see 'help')")))?;
    Name::new(value).map_err(|e| usage(format!("{what}: label: {e}")))
}

/// Nothing more.
pub fn no_more(verb: &str, args: &[String]) -> Result<(), UsageError> {
    match args.first() {
        None => Ok(()),
        Some(extra) => Err(usage(format!("{verb}: unexpected argument {extra:?}"))),
    }
}

/// `VERB NAME` and nothing more.
pub fn only_name(verb: &str, args: &[String]) -> Result<Name, UsageError> {
    let name = name_arg(verb, args.first())?;
    no_more(verb, rest(args, 1))?;
    Ok(name)
}

/// `VERB NAME [--json]`.
pub fn name_and_json(verb: &str, args: &[String]) -> Result<(Name, bool), UsageError> {
    let name = name_arg(verb, args.first())?;
    Ok((name, flags_only(verb, rest(args, 1))?))
}

/// The arguments from the `n`th on (none if there are fewer).
pub fn rest(args: &[String], n: usize) -> &[String] {
    args.get(n..).unwrap_or_default()
}

/// Accepts only `--json`; returns whether it was given.
pub fn flags_only(verb: &str, args: &[String]) -> Result<bool, UsageError> {
    let mut json = false;
    for arg in args {
        match arg.as_str() {
            "--json" => json = true,
            other => return Err(usage(format!("{verb}: unexpected argument {other:?}"))),
        }
    }
    Ok(json)
}

/// A port in a box, 1 to 65535, required.
pub fn port_arg(what: &str, value: Option<&String>) -> Result<u16, UsageError> {
    let value = value.ok_or_else(|| usage(format!("{what}: missing PORT (see 'help')")))?;
    match value.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(usage(format!("{what}: {value:?} is not a port (1 to 65535)"))),
    }
}

/// Another account, as its key's fingerprint (`SHA256:` and 43 characters of
/// base64, as `ssh-keygen -l` and `whoami` show it), required.
pub fn fingerprint_arg(what: &str, value: Option<&String>) -> Result<moat_core::AccountId, UsageError> {
    let value = value.ok_or_else(|| usage(format!("{what}: missing KEY-FINGERPRINT (see 'help')")))?;
    let base64 = |b: u8| b.is_ascii_alphanumeric() || b == b'+' || b == b'/';
    match value.strip_prefix("SHA256:") {
        Some(hash) if hash.len() == 43 && hash.bytes().all(base64) => Ok(moat_core::AccountId(value.clone())),
        _ => Err(usage(format!(
            "{what}: {value:?} is not a key fingerprint (SHA256:..., as ssh-keygen -l and whoami show it)"
        ))),
    }
}

/// A number of seconds from 1 to 30 days (idle graces).
pub fn seconds(what: &str, value: &str) -> Result<u32, UsageError> {
    match value.parse::<u32>() {
        Ok(n) if (1..=30 * 86_400).contains(&n) => Ok(n),
        _ => Err(usage(format!("{what}: {value:?} is not a number of seconds from 1 to 2592000"))),
    }
}

/// `--since`: `1700000000` (seconds since the epoch) or an age: `90s`, `30m`, `2h`, `7d`.
pub fn parse_since(value: &str, now: u64) -> Result<u64, UsageError> {
    let bad = || {
        usage(format!(
            "usage: {value:?}: give a time as lists show it (2026-11-30T23:06:40Z), seconds since the epoch, \
             or an age like 30m, 2h, 7d"
        ))
    };
    if let Ok(epoch) = value.parse::<u64>() {
        return Ok(epoch);
    }
    if let Some(at) = crate::control::time::parse_utc(value) {
        return Ok(at);
    }
    let age = parse_duration(value).filter(|_| value.ends_with(|c: char| c.is_ascii_alphabetic())).ok_or_else(bad)?;
    Ok(now.saturating_sub(age))
}

/// A time in milliseconds since the epoch: what [`parse_since`] reads, or
/// seconds with milliseconds (`1796080000.123`, as `log` names a page's
/// start).
pub fn parse_time_ms(value: &str, now: u64) -> Result<u64, UsageError> {
    if let Some((secs, frac)) = value.split_once('.') {
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if digits(secs) && digits(frac) && frac.len() <= 3 {
            let secs: u64 = secs.parse().map_err(|_| usage(format!("usage: {value:?}: too large")))?;
            let ms: u64 = format!("{frac:0<3}").parse().unwrap_or(0);
            return Ok(secs.saturating_mul(1000).saturating_add(ms));
        }
    }
    Ok(parse_since(value, now)?.saturating_mul(1000))
}

/// A period in seconds: `90s`, `30m`, `2h`, `7d`, or a bare number of seconds.
pub fn parse_duration(value: &str) -> Option<u64> {
    if let Ok(n) = value.parse::<u64>() {
        return Some(n).filter(|n| *n > 0);
    }
    let split = value.len().checked_sub(1)?;
    let (n, unit) = (value.get(..split)?, value.get(split..)?);
    let n: u64 = n.parse().ok()?;
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    Some(n.saturating_mul(scale)).filter(|n| *n > 0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn times_to_the_millisecond() {
        assert_eq!(parse_time_ms("1796080000.123", 0).unwrap(), 1_796_080_000_123);
        assert_eq!(parse_time_ms("1796080000.5", 0).unwrap(), 1_796_080_000_500);
        assert_eq!(parse_time_ms("1796080000", 0).unwrap(), 1_796_080_000_000);
        assert_eq!(parse_time_ms("2026-11-30T23:06:40Z", 0).unwrap(), 1_796_080_000_000);
        assert!(parse_time_ms("1796080000.1234", 0).is_err() && parse_time_ms(".5", 0).is_err());
    }

    #[test]
    fn periods_and_ages() {
        assert_eq!(parse_duration("90s"), Some(90));
        assert_eq!(parse_duration("2h"), Some(7200));
        assert_eq!(parse_duration("0"), None);
        assert_eq!(parse_duration("5w"), None);
        assert_eq!(parse_since("30m", 10_000), Ok(10_000 - 1800));
        assert_eq!(parse_since("1700000000", 0), Ok(1_700_000_000));
        assert!(parse_since("30", 10_000).is_ok());
        assert!(parse_since("soon", 10_000).is_err());
    }
}
