//! Times for people and for scripts. Text shows every time one way: ISO 8601
//! in UTC to the second (`2026-11-30T23:06:40Z`), with an age (`3m ago`) in
//! lists read by eye. JSON keeps the numbers (seconds or milliseconds since
//! the epoch) and adds each as an RFC 3339 string beside it.

use serde_json::Value;

/// Seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc(secs: u64) -> String {
    let (date, rem) = civil(secs);
    format!("{date}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SSZ` (as [`utc`] writes it).
pub fn parse_utc(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    let shape = b"dddd-dd-ddTdd:dd:ddZ";
    let fits = b.len() == shape.len()
        && b.iter().zip(shape).all(|(c, want)| if *want == b'd' { c.is_ascii_digit() } else { c == want });
    if !fits {
        return None;
    }
    let num = |range: std::ops::Range<usize>| text.get(range)?.parse::<i64>().ok();
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    // Days from a civil date (Howard Hinnant's algorithm, the inverse of `civil`).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + hour * 3600 + minute * 60 + second).ok()
}

/// Milliseconds since the epoch, as text shows them ([`utc`]).
pub fn utc_ms(ms: u64) -> String {
    utc(ms / 1000)
}

/// Milliseconds since the epoch as RFC 3339, to the millisecond.
fn rfc3339_ms(ms: u64) -> String {
    let (date, rem) = civil(ms / 1000);
    format!("{date}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem % 3600 / 60, rem % 60, ms % 1000)
}

/// How long before `now` `then` was (both seconds since the epoch): `12s ago`,
/// `3m ago`, `5h ago`, `4d ago`.
pub fn age(then: u64, now: u64) -> String {
    let secs = now.saturating_sub(then);
    match secs {
        0..60 => format!("{secs}s ago"),
        60..3600 => format!("{}m ago", secs / 60),
        3600..86_400 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86_400),
    }
}

/// The date (`YYYY-MM-DD`) of seconds since the epoch, and the seconds into it.
fn civil(secs: u64) -> (String, u64) {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (format!("{year:04}-{month:02}-{day:02}"), rem)
}

/// The fields JSON output holds times in, and the milliseconds in their unit.
const TIMES: &[(&str, u64)] =
    &[("created_at", 1000), ("state_since", 1000), ("created_ms", 1), ("at_ms", 1), ("asked_ms", 1)];

/// Adds beside every time field in `value` (at any depth) its RFC 3339 string,
/// named as the field without `_ms` and with `_utc`: `created_at_utc`,
/// `at_utc`.
pub fn add_times(value: &mut Value) {
    match value {
        Value::Object(fields) => {
            for (key, scale) in TIMES {
                if let Some(n) = fields.get(*key).and_then(Value::as_u64) {
                    let name = format!("{}_utc", key.trim_end_matches("_ms"));
                    fields.insert(name, Value::String(rfc3339_ms(n.saturating_mul(*scale))));
                }
            }
            fields.values_mut().for_each(add_times);
        }
        Value::Array(items) => items.iter_mut().for_each(add_times),
        _ => {}
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn times_print_in_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_ms(1_796_080_000_123), "2026-11-30T23:06:40Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_ms(1_796_080_000_123), "2026-11-30T23:06:40.123Z");
    }

    #[test]
    fn times_as_printed_read_back() {
        for secs in [0, 951_782_400, 1_796_080_000, 4_102_444_799] {
            assert_eq!(parse_utc(&utc(secs)), Some(secs), "{}", utc(secs));
        }
        for bad in ["2026-13-01T00:00:00Z", "2026-11-30 23:06:40Z", "2026-11-30T23:06:40", "2026-11-30T24:00:00Z", ""] {
            assert_eq!(parse_utc(bad), None, "{bad}");
        }
    }

    #[test]
    fn ages_are_short() {
        assert_eq!(age(100, 112), "12s ago");
        assert_eq!(age(0, 200), "3m ago");
        assert_eq!(age(0, 5 * 3600 + 59), "5h ago");
        assert_eq!(age(0, 4 * 86_400), "4d ago");
        assert_eq!(age(500, 100), "0s ago");
    }

    #[test]
    fn json_keeps_numbers_and_adds_strings() {
        let mut v = serde_json::json!({
            "created_at": 1_796_080_000u64,
            "boxes": [{ "state_since": 0 }],
            "question": { "asked_ms": 1_796_080_000_123u64 },
            "name": "web",
        });
        add_times(&mut v);
        assert_eq!(v["created_at"], 1_796_080_000u64);
        assert_eq!(v["created_at_utc"], "2026-11-30T23:06:40.000Z");
        assert_eq!(v["boxes"][0]["state_since_utc"], "1970-01-01T00:00:00.000Z");
        assert_eq!(v["question"]["asked_utc"], "2026-11-30T23:06:40.123Z");
        assert_eq!(v["name"], "web");
    }
}
