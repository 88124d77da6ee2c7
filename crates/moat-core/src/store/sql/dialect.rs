//! The few words SQLite and PostgreSQL spell differently, so that the store's
//! statements and tables are written once, in SQLite's spelling, and
//! PostgreSQL is given its own.
//!
//! Statements: `?1` placeholders are `$1`. Everything else the store writes
//! is SQL both engines take as is (`ON CONFLICT ... DO UPDATE/NOTHING`,
//! `CAST(... AS BIGINT)` around sums, which PostgreSQL would make `numeric`).
//!
//! Tables: SQLite's `INTEGER` is 64 bits, PostgreSQL's is 32 (so `BIGINT`);
//! `AUTOINCREMENT` keys are `BIGSERIAL`; `REAL` is `DOUBLE PRECISION` and
//! `BLOB` is `BYTEA`.

/// A statement's placeholders as PostgreSQL numbers them (`?1` → `$1`).
pub(crate) fn to_postgres(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        let numbered = c == '?' && chars.peek().is_some_and(char::is_ascii_digit);
        out.push(if numbered { '$' } else { c });
    }
    out
}

/// Table definitions (written for SQLite) with PostgreSQL's type names.
pub(crate) fn ddl_for_postgres(ddl: &str) -> String {
    let ddl = ddl.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY");
    let mut out = String::with_capacity(ddl.len() + 64);
    let mut word = String::new();
    for c in ddl.chars().chain(std::iter::once('\n')) {
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
            continue;
        }
        out.push_str(match word.as_str() {
            "INTEGER" => "BIGINT",
            "REAL" => "DOUBLE PRECISION",
            "BLOB" => "BYTEA",
            w => w,
        });
        word.clear();
        out.push(c);
    }
    out.pop();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_with_dollars() {
        assert_eq!(
            to_postgres("SELECT a FROM t WHERE b = ?1 AND (?12 IS NULL OR c = ?12)"),
            "SELECT a FROM t WHERE b = $1 AND ($12 IS NULL OR c = $12)"
        );
        assert_eq!(to_postgres("a ? b"), "a ? b", "a lone ? is not a placeholder");
    }

    #[test]
    fn types_are_spelled_as_postgres_spells_them() {
        let ddl = "CREATE TABLE t (id INTEGER PRIMARY KEY AUTOINCREMENT, n INTEGER NOT NULL, \
                   integers TEXT, f REAL, b BLOB)";
        assert_eq!(
            ddl_for_postgres(ddl),
            "CREATE TABLE t (id BIGSERIAL PRIMARY KEY, n BIGINT NOT NULL, \
             integers TEXT, f DOUBLE PRECISION, b BYTEA)"
        );
    }
}
