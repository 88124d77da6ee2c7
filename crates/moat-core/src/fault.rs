//! Fault injection for crash tests: with `MOAT_FAULT=<point>` in its
//! environment, the process aborts when it reaches that point, as a crash or a
//! `kill -9` would stop it there. Tests use it to check that every multi-step
//! operation is rolled back or completed by the next start.

/// Whether `MOAT_FAULT` names this point: for a point that must first see
/// what it cuts short under way.
pub fn armed(name: &str) -> bool {
    std::env::var("MOAT_FAULT").is_ok_and(|v| v == name)
}

/// Aborts the process if `MOAT_FAULT` names this point.
pub fn point(name: &str) {
    if armed(name) {
        eprintln!("moat: MOAT_FAULT={name}: aborting here");
        std::process::abort();
    }
}
