//! The state database's tables, in one place: every table each part of the
//! store keeps (boxes and their policies, the usage ledger, the egress log,
//! sealed secrets), and the columns added to them since, which an older
//! database gets when it is opened, so that a daemon upgrade finds every row.

use rusqlite::Connection;

/// Boxes, their policies, and the names they no longer have.
pub(crate) const BOXES: &str = "
CREATE TABLE IF NOT EXISTS boxes (
    id          TEXT PRIMARY KEY,
    account     TEXT NOT NULL,
    name        TEXT NOT NULL,
    image       TEXT NOT NULL,
    cpus        INTEGER NOT NULL,
    memory      INTEGER NOT NULL,
    pids        INTEGER NOT NULL,
    slot        INTEGER NOT NULL UNIQUE,
    state       TEXT NOT NULL,
    pid         INTEGER,
    created_at  INTEGER NOT NULL,
    UNIQUE (account, name)
);
-- Each box's egress policy (JSON); a box without a row reaches nothing.
CREATE TABLE IF NOT EXISTS policies (
    box_id      TEXT PRIMARY KEY,
    policy      TEXT NOT NULL
);
-- Names an account's boxes had and no longer have (removed, or renamed by
-- promote): an SSH user name that meant a box must never fall through to
-- the control plane.
CREATE TABLE IF NOT EXISTS retired_names (
    account     TEXT NOT NULL,
    name        TEXT NOT NULL,
    PRIMARY KEY (account, name)
);
";

/// Columns added to `boxes` after its first schema: (name, type).
pub(crate) const BOXES_ADDED: &[(&str, &str)] = &[
    ("disk", "INTEGER NOT NULL DEFAULT 17179869184"),
    ("parent", "TEXT"),
    ("idle", "INTEGER"),
    ("keep_running", "INTEGER NOT NULL DEFAULT 0"),
    ("state_since", "INTEGER NOT NULL DEFAULT 0"),
    ("backend", "TEXT NOT NULL DEFAULT 'ns'"),
];

/// The usage ledger: samples of each box's consumption, and where its meter stood.
pub(crate) const LEDGER: &str = "
CREATE TABLE IF NOT EXISTS usage_samples (
    at           INTEGER NOT NULL,
    box_id       TEXT NOT NULL,
    account      TEXT NOT NULL,
    name         TEXT NOT NULL,
    cpu_ns       INTEGER NOT NULL,
    mem_byte_ms  REAL NOT NULL,
    running_ms   INTEGER NOT NULL,
    suspended_ms INTEGER NOT NULL,
    egress_sent     INTEGER NOT NULL DEFAULT 0,
    egress_received INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_by_account ON usage_samples (account, at);
CREATE TABLE IF NOT EXISTS meter_state (
    box_id      TEXT PRIMARY KEY,
    last_cpu_ns INTEGER NOT NULL,
    last_at_ms  INTEGER NOT NULL
);
";

/// Columns added to `usage_samples` after its first schema.
pub(crate) const LEDGER_ADDED: &[(&str, &str)] =
    &[("egress_sent", "INTEGER NOT NULL DEFAULT 0"), ("egress_received", "INTEGER NOT NULL DEFAULT 0")];

/// The egress log: every DNS query, connection and request, per box.
pub(crate) const EGRESS_LOG: &str = "
CREATE TABLE IF NOT EXISTS egress_log (
    box_id  TEXT NOT NULL,
    at_ms   INTEGER NOT NULL,
    entry   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS egress_by_box ON egress_log (box_id, at_ms);
";

/// Secrets (sealed), their grants to boxes, their limits and their use.
pub(crate) const SECRETS: &str = "
-- AUTOINCREMENT: a removed secret's number is never given to another, whose
-- use would then include the old one's.
CREATE TABLE IF NOT EXISTS secrets (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    account     TEXT NOT NULL,
    name        TEXT NOT NULL,
    host        TEXT NOT NULL,
    header      TEXT NOT NULL,
    format      TEXT NOT NULL,
    env         TEXT NOT NULL,
    sealed      BLOB NOT NULL,
    killed      INTEGER NOT NULL DEFAULT 0,
    UNIQUE (account, name)
);
CREATE TABLE IF NOT EXISTS secret_grants (
    secret_id   INTEGER NOT NULL,
    box_id      TEXT NOT NULL,
    placeholder TEXT NOT NULL UNIQUE,
    PRIMARY KEY (secret_id, box_id)
);
-- box_id '' is a limit on every box's use together.
CREATE TABLE IF NOT EXISTS secret_limits (
    secret_id   INTEGER NOT NULL,
    box_id      TEXT NOT NULL,
    kind        TEXT NOT NULL,
    amount      INTEGER NOT NULL,
    per_secs    INTEGER,
    PRIMARY KEY (secret_id, box_id, kind)
);
CREATE TABLE IF NOT EXISTS secret_usage (
    secret_id   INTEGER NOT NULL,
    box_id      TEXT NOT NULL,
    box_name    TEXT NOT NULL,
    requests    INTEGER NOT NULL DEFAULT 0,
    tokens      INTEGER NOT NULL DEFAULT 0,
    bytes       INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (secret_id, box_id)
);
";

/// Makes every table that is missing, and adds every column an older
/// database lacks.
pub(crate) fn apply(conn: &Connection) -> rusqlite::Result<()> {
    for tables in [BOXES, LEDGER, EGRESS_LOG, SECRETS] {
        conn.execute_batch(tables)?;
    }
    add_missing_columns(conn, "boxes", BOXES_ADDED)?;
    add_missing_columns(conn, "usage_samples", LEDGER_ADDED)
}

/// Adds to `table` the columns a database made by an older moat lacks.
fn add_missing_columns(conn: &Connection, table: &str, columns: &[(&str, &str)]) -> rusqlite::Result<()> {
    let existing: Vec<String> = conn
        .prepare(&format!("SELECT name FROM pragma_table_info('{table}')"))?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for (column, ty) in columns {
        if !existing.iter().any(|c| c == column) {
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {ty}"))?;
        }
    }
    Ok(())
}
