//! `policy NAME packages ...`: the words of a package rule (see
//! `moat_core::policy::packages`). A lock comes on stdin, read whole and
//! parsed here, so that the core receives exact versions.

use moat_api::{ApiError, Op};
use moat_core::policy::packages::{NamePattern, Severity, UnknownAge};
use moat_core::policy::{read_lock, Ecosystem, PackagesChange, PolicyChange, MAX_LOCK_FILE};
use moat_core::Name;

use super::{Call, Plan};
use crate::control::args::{parse_duration, usage, UsageError};

const USAGE: &str = "policy: usage: policy NAME packages min-age AGE|off [--unknown-age allow|deny], \
deny|allow-only|rm ECOSYSTEM:PATTERN, lock (file on stdin), unlock ECOSYSTEM, \
advisories [--severity LEVEL]|off, or clear";

/// The plan for `policy NAME packages WORDS`.
pub fn parse(name: Name, words: &[String], render: super::Render) -> Result<Plan, UsageError> {
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let pattern = |p: &str| NamePattern::parse(p).map_err(|e| usage(format!("policy: {e}")));
    let change = match words.as_slice() {
        ["min-age", "off"] => PackagesChange::MinAge { secs: None, unknown: UnknownAge::Allow },
        ["min-age", age, rest @ ..] => {
            let secs =
                parse_duration(age).ok_or_else(|| usage(format!("policy: {age:?} is not an age (e.g. 7d, 12h)")))?;
            let unknown = match rest {
                [] => UnknownAge::Allow,
                ["--unknown-age", "allow"] => UnknownAge::Allow,
                ["--unknown-age", "deny"] => UnknownAge::Deny,
                _ => return Err(usage(USAGE)),
            };
            PackagesChange::MinAge { secs: Some(secs), unknown }
        }
        ["deny", p] => PackagesChange::Deny(pattern(p)?),
        ["allow-only", p] => PackagesChange::AllowOnly(pattern(p)?),
        ["rm", p] => PackagesChange::Remove(pattern(p)?),
        ["unlock", eco] => PackagesChange::Unlock(
            Ecosystem::parse(eco).ok_or_else(|| usage(format!("policy: {eco:?} is not pypi, npm or crates")))?,
        ),
        ["advisories", "off"] => PackagesChange::Advisories(None),
        ["advisories"] => PackagesChange::Advisories(Some(Severity::Malicious)),
        ["advisories", "--severity", level] => PackagesChange::Advisories(Some(
            Severity::parse(level)
                .ok_or_else(|| usage(format!("policy: {level:?} is not low, medium, high, critical or malicious")))?,
        )),
        ["clear"] => PackagesChange::Clear,
        ["lock"] => {
            return Ok(Plan::ReadText(
                MAX_LOCK_FILE,
                Box::new(move |text| {
                    let entries =
                        read_lock(&text).map_err(|e| ApiError { status: 2, message: format!("policy: {e}") })?;
                    let change = PolicyChange::Packages(PackagesChange::Lock(entries));
                    Ok(Call::new(Op::ChangePolicy { name, change }, render))
                }),
            ))
        }
        _ => return Err(usage(USAGE)),
    };
    Ok(Plan::Call(Call::new(Op::ChangePolicy { name, change: PolicyChange::Packages(change) }, render)))
}
