//! The state database's tables, in one place: every table each part of the
//! store keeps (boxes and their policies, the usage ledger, the egress log,
//! sealed secrets), and the numbered versions of the schema since, applied
//! in order when a database is opened (the version reached is kept in
//! `schema_version`), so that a daemon upgrade finds every row.

use super::log_shares::Log;
use super::sql::dialect::ddl_for_postgres;
use super::sql::{args, Db, Engine, Exec};
use super::StoreError;

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

/// The fleet's tables: its nodes and what each offers, the account keys its
/// front doors accept, the members its join tokens admitted, and settings
/// (the sealed host key, the CA certificate).
pub(crate) const FLEET: &str = "
CREATE TABLE IF NOT EXISTS nodes (
    name            TEXT PRIMARY KEY,
    address         TEXT NOT NULL,
    cpus            INTEGER NOT NULL,
    memory          INTEGER NOT NULL,
    disk            INTEGER NOT NULL,
    max_boxes       INTEGER NOT NULL,
    cordoned        INTEGER NOT NULL DEFAULT 0,
    lease_until_ms  INTEGER NOT NULL,
    renewed_at_ms   INTEGER NOT NULL
);
-- An SSH public key (its type and base64) and the account it logs in to.
CREATE TABLE IF NOT EXISTS fleet_keys (
    key         TEXT PRIMARY KEY,
    account     TEXT NOT NULL,
    added_at    INTEGER NOT NULL
);
-- Certificates issued to nodes and front doors; joined once, by a token.
CREATE TABLE IF NOT EXISTS fleet_members (
    serial        TEXT PRIMARY KEY,
    role          TEXT NOT NULL,
    name          TEXT NOT NULL,
    issued_at_ms  INTEGER NOT NULL,
    joined_at_ms  INTEGER,
    revoked       INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS fleet_settings (
    name    TEXT PRIMARY KEY,
    value   BLOB NOT NULL
);
";

/// Durable boxes: each box's chain of streams in the object store (see
/// `store::durable`).
pub(crate) const DURABLE: &str = "
CREATE TABLE IF NOT EXISTS durable_links (
    box_id          TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    parent_seq      INTEGER,
    key             TEXT NOT NULL UNIQUE,
    snapshot        TEXT NOT NULL,
    sha256          TEXT NOT NULL,
    bytes           INTEGER NOT NULL,
    taken_at_ms     INTEGER NOT NULL,
    uploaded_at_ms  INTEGER NOT NULL,
    node            TEXT NOT NULL,
    PRIMARY KEY (box_id, seq)
);
";

/// Images kept in the object store (see `store::durable`).
pub(crate) const DURABLE_IMAGES: &str = "
CREATE TABLE IF NOT EXISTS durable_images (
    key             TEXT PRIMARY KEY,
    object          TEXT NOT NULL UNIQUE,
    sha256          TEXT NOT NULL,
    bytes           INTEGER NOT NULL,
    uploaded_at_ms  INTEGER NOT NULL,
    node            TEXT NOT NULL
);
";

/// Boxes changing node (see `store::moves`), and where each box came from.
pub(crate) const MOVES: &str = "
CREATE TABLE IF NOT EXISTS box_moves (
    box_id       TEXT PRIMARY KEY,
    from_node    TEXT NOT NULL,
    to_node      TEXT NOT NULL,
    epoch        INTEGER NOT NULL,
    reason       TEXT NOT NULL,
    ready        INTEGER NOT NULL DEFAULT 0,
    as_of_ms     INTEGER,
    asked_at_ms  INTEGER NOT NULL,
    error        TEXT
);
ALTER TABLE boxes ADD COLUMN moved_from TEXT;
ALTER TABLE boxes ADD COLUMN moved_reason TEXT;
ALTER TABLE boxes ADD COLUMN moved_as_of_ms INTEGER;
ALTER TABLE boxes ADD COLUMN moved_at_ms INTEGER;
";

/// Pulled images, per account (see `store::images`), and the accounts'
/// registry logins, sealed as secrets are.
pub(crate) const IMAGES: &str = "
CREATE TABLE IF NOT EXISTS images (
    account     TEXT NOT NULL,
    name        TEXT NOT NULL,
    key         TEXT NOT NULL,
    reference   TEXT NOT NULL,
    digest      TEXT NOT NULL,
    layers      TEXT NOT NULL,
    config      TEXT NOT NULL,
    bytes       INTEGER NOT NULL,
    created_ms  INTEGER NOT NULL,
    PRIMARY KEY (account, name)
);
CREATE TABLE IF NOT EXISTS registry_logins (
    account     TEXT NOT NULL,
    registry    TEXT NOT NULL,
    sealed      BLOB NOT NULL,
    PRIMARY KEY (account, registry)
);
";

/// The effects ledger (see `store::effects`): what each box did outside
/// that a restore does not undo.
pub(crate) const EFFECTS: &str = "
CREATE TABLE IF NOT EXISTS effects (
    box_id  TEXT NOT NULL,
    at_ms   INTEGER NOT NULL,
    effect  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS effects_by_box ON effects (box_id, at_ms);
";

/// The versions of the schema, oldest first: each brings a database at the
/// version before it to its own. Never edit one that has shipped: add another.
const MIGRATIONS: &[(u32, Migration)] = &[
    (1, tables),
    (2, fleet),
    (3, durable),
    (4, moves),
    (5, stored),
    (6, web),
    (7, images),
    (8, backlog),
    (9, effects),
    (10, retries),
    (11, created_ms),
    (12, services),
    (13, image_bases),
    (14, account_disk),
    (15, counters),
    (16, durable_checkpoints),
    (17, log_shares),
];

/// What brings a database from the version before to the next.
type Migration = fn(&mut dyn Exec) -> Result<(), StoreError>;

/// The version this moat brings every database to.
pub(crate) const LATEST: u32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// Any number, the same in every moat: held while a database is migrated,
/// so that nodes starting together migrate it once.
const MIGRATION_LOCK: i64 = 0x6d6f_6174_0001;

/// Brings the database to [`LATEST`], in one transaction.
pub(crate) fn migrate(db: &Db) -> Result<(), StoreError> {
    db.transaction(|tx| {
        if tx.engine() == Engine::Postgres {
            tx.execute("SELECT pg_advisory_xact_lock(?1)", &args![MIGRATION_LOCK])?;
        }
        create(tx, "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")?;
        let found = match tx.query_row("SELECT MAX(version) FROM schema_version", &[])? {
            Some(row) => row.get::<Option<u32>>(0)?.unwrap_or(0),
            None => 0,
        };
        if found > LATEST {
            return Err(StoreError::Newer { found, known: LATEST });
        }
        for (version, apply) in MIGRATIONS {
            if *version > found {
                apply(tx)?;
            }
        }
        if found < LATEST {
            tx.execute("DELETE FROM schema_version", &[])?;
            tx.execute("INSERT INTO schema_version (version) VALUES (?1)", &args![LATEST])?;
        }
        Ok(())
    })
}

/// Runs table definitions, spelled for the engine.
fn create(tx: &mut dyn Exec, ddl: &str) -> Result<(), StoreError> {
    match tx.engine() {
        Engine::Sqlite => tx.batch(ddl),
        Engine::Postgres => tx.batch(&ddl_for_postgres(ddl)),
    }
}

/// Version 1: every table moat kept before versions were counted. On SQLite
/// that is also every older moat's database, which gains the columns it lacks.
fn tables(tx: &mut dyn Exec) -> Result<(), StoreError> {
    for tables in [BOXES, LEDGER, EGRESS_LOG, SECRETS] {
        create(tx, tables)?;
    }
    add_missing_columns(tx, "boxes", BOXES_ADDED)?;
    add_missing_columns(tx, "usage_samples", LEDGER_ADDED)?;
    match tx.engine() {
        Engine::Sqlite => Ok(()),
        // The order rows were added in, which SQLite keeps as `rowid`.
        Engine::Postgres => tx.batch(
            "ALTER TABLE usage_samples ADD COLUMN rowid BIGSERIAL; \
             ALTER TABLE egress_log ADD COLUMN rowid BIGSERIAL PRIMARY KEY",
        ),
    }
}

/// Version 2: the fleet. Each box is on a node (`''` on a single host) and
/// has an epoch; uid slots are per node (SQLite, one node, keeps its
/// table-wide unique slot: changing a constraint there means a new table).
fn fleet(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(
        tx,
        "ALTER TABLE boxes ADD COLUMN node TEXT NOT NULL DEFAULT ''; \
         ALTER TABLE boxes ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0",
    )?;
    if tx.engine() == Engine::Postgres {
        tx.batch(
            "ALTER TABLE boxes DROP CONSTRAINT boxes_slot_key; \
             ALTER TABLE boxes ADD CONSTRAINT boxes_node_slot_key UNIQUE (node, slot)",
        )?;
    }
    create(tx, FLEET)
}

/// Version 3: durable boxes' chains (a new table: every older row stays).
fn durable(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, DURABLE)
}

/// Version 4: boxes that change node (a new table and new columns: every
/// older row stays, on no move and from nowhere).
fn moves(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, MOVES)
}

/// Version 5: the ledger bills what each box keeps in the object store
/// (older samples kept nothing there).
fn stored(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, "ALTER TABLE usage_samples ADD COLUMN stored_byte_ms REAL NOT NULL DEFAULT 0")
}

/// Version 6: web URLs' exposed ports and shares (new tables).
fn web(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, super::web::WEB)
}

/// Version 7: pulled images and registry logins (new tables).
fn images(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, IMAGES)
}

/// Version 8: each node says how many of its boxes wait for an upload.
fn backlog(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, "ALTER TABLE nodes ADD COLUMN upload_backlog INTEGER NOT NULL DEFAULT 0")
}

/// Version 9: the effects ledger (a new table: every older row stays; the
/// log's older entries are not turned into effects).
fn effects(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, EFFECTS)?;
    match tx.engine() {
        Engine::Sqlite => Ok(()),
        Engine::Postgres => tx.batch("ALTER TABLE effects ADD COLUMN rowid BIGSERIAL PRIMARY KEY"),
    }
}

/// Version 10: how often a move failed and when it last did, so that a lost
/// node's box whose receive keeps failing is tried again after a growing
/// wait (see `store::moves`), not fetched again every reconciler round.
fn retries(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(
        tx,
        "ALTER TABLE box_moves ADD COLUMN failures INTEGER NOT NULL DEFAULT 0; \
         ALTER TABLE box_moves ADD COLUMN failed_at_ms INTEGER",
    )
}

/// Version 11: when each box was made to the millisecond, so that two
/// copies' effects since they split are told apart when the parent acted in
/// the second the copy was made (older rows: their second's start).
fn created_ms(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, "ALTER TABLE boxes ADD COLUMN created_ms INTEGER")
}

/// Version 12: boxes' services, `new --run` (a new table).
fn services(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, super::services::SERVICES)
}

/// Version 13: each image's base manifest and where it came from, what a
/// push names and mounts (older images have none: their push says so).
fn image_bases(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(
        tx,
        "ALTER TABLE images ADD COLUMN base_manifest TEXT NOT NULL DEFAULT ''; \
         ALTER TABLE images ADD COLUMN base_source TEXT NOT NULL DEFAULT ''",
    )
}

/// Version 14: each node's measure of each account's disk use, for disk
/// budgets counted across a fleet (a new table).
fn account_disk(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, super::nodes::ACCOUNT_DISK)
}

/// Version 15: numbers the store hands out, one sequence for every node
/// (a new table).
fn counters(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, super::counters::COUNTERS)
}

/// Version 16: checkpoints and images kept in the object store too: a link
/// sent from a checkpoint names it (older links: none was), and images
/// have a table of their own.
fn durable_checkpoints(tx: &mut dyn Exec) -> Result<(), StoreError> {
    create(tx, "ALTER TABLE durable_links ADD COLUMN checkpoint TEXT")?;
    create(tx, DURABLE_IMAGES)
}

/// Version 17: the egress log and the effects ledger are bounded by account
/// (see `store::log_shares`): each entry names its account (older ones: that
/// of their box, if it is still there), and each account's share is counted.
fn log_shares(tx: &mut dyn Exec) -> Result<(), StoreError> {
    for log in Log::ALL {
        let (table, name) = (log.table(), log.name());
        create(tx, &format!("ALTER TABLE {table} ADD COLUMN account TEXT NOT NULL DEFAULT ''"))?;
        tx.execute(
            &format!(
                "UPDATE {table} SET account = COALESCE((SELECT account FROM boxes WHERE boxes.id = {table}.box_id), '')"
            ),
            &[],
        )?;
        // SQLite keeps an index's rows in rowid order within a key already.
        let columns = if tx.engine() == Engine::Postgres { "account, rowid" } else { "account" };
        create(tx, &format!("CREATE INDEX IF NOT EXISTS {name}_by_account ON {table} ({columns})"))?;
    }
    create(tx, super::log_shares::LOG_SHARES)?;
    for log in Log::ALL {
        tx.execute(
            &format!(
                "INSERT INTO log_shares (log, account, entries) SELECT ?1, account, COUNT(*) FROM {} GROUP BY account",
                log.table()
            ),
            &args![log.name()],
        )?;
    }
    Ok(())
}

/// Adds to `table` the columns a database made by an older moat lacks.
fn add_missing_columns(tx: &mut dyn Exec, table: &str, columns: &[(&str, &str)]) -> Result<(), StoreError> {
    let existing = match tx.engine() {
        Engine::Sqlite => tx.query(&format!("SELECT name FROM pragma_table_info('{table}')"), &[])?,
        Engine::Postgres => tx.query(
            "SELECT CAST(column_name AS TEXT) FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = ?1",
            &args![table],
        )?,
    };
    let existing: Vec<String> = existing.iter().map(|r| r.get(0)).collect::<Result<_, _>>()?;
    for (column, ty) in columns {
        if !existing.iter().any(|c| c == column) {
            create(tx, &format!("ALTER TABLE {table} ADD COLUMN {column} {ty}"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{AccountId, BoxId, Name};
    use crate::store::testing::{on_both_engines, TestDb};
    use crate::store::Store;

    on_both_engines!(
        versions_apply_once_and_a_newer_database_is_refused,
        a_version_8_database_gains_the_effects_ledger_and_keeps_its_log
    );

    fn versions_apply_once_and_a_newer_database_is_refused(db: &TestDb) {
        let store = db.open();
        let version =
            |s: &Store| s.query_row("SELECT version FROM schema_version", &[]).unwrap().unwrap().get::<u32>(0);
        assert_eq!(version(&store).unwrap(), LATEST);
        drop(store);
        let store = db.open();
        assert_eq!(store.query("SELECT version FROM schema_version", &[]).unwrap().len(), 1);
        store.execute("UPDATE schema_version SET version = ?1", &args![LATEST + 1]).unwrap();
        drop(store);
        let refused = match db {
            TestDb::Sqlite(dir) => Store::open(&dir.path().join("state.db")).err(),
            TestDb::Postgres { dsn, .. } => Store::connect(dsn).err(),
        };
        assert!(matches!(refused, Some(StoreError::Newer { found, known: LATEST }) if found == LATEST + 1));
    }

    /// A database as moat left it at version 8 (no effects table, no move
    /// retries, no services, no image bases), with a log entry, a move and
    /// an image: opened, it is at the latest version, the entry, the move
    /// (never failed) and the image (with no base known) are there, and
    /// effects are kept from then on.
    fn a_version_8_database_gains_the_effects_ledger_and_keeps_its_log(db: &TestDb) {
        let store = db.open();
        store.execute("DROP TABLE effects", &[]).unwrap();
        store.execute("ALTER TABLE box_moves DROP COLUMN failures", &[]).unwrap();
        store.execute("ALTER TABLE box_moves DROP COLUMN failed_at_ms", &[]).unwrap();
        store.execute("ALTER TABLE boxes DROP COLUMN created_ms", &[]).unwrap();
        store.execute("DROP TABLE box_services", &[]).unwrap();
        store.execute("DROP TABLE account_disk", &[]).unwrap();
        store.execute("ALTER TABLE images DROP COLUMN base_manifest", &[]).unwrap();
        store.execute("ALTER TABLE images DROP COLUMN base_source", &[]).unwrap();
        store.execute("ALTER TABLE durable_links DROP COLUMN checkpoint", &[]).unwrap();
        store.execute("DROP TABLE durable_images", &[]).unwrap();
        store.execute("DROP INDEX egress_by_account", &[]).unwrap();
        store.execute("ALTER TABLE egress_log DROP COLUMN account", &[]).unwrap();
        store.execute("DROP TABLE log_shares", &[]).unwrap();
        store.execute("UPDATE schema_version SET version = 8", &[]).unwrap();
        store
            .execute(
                "INSERT INTO images (account, name, key, reference, digest, layers, config, bytes, created_ms) \
                 VALUES ('a', 'py', 'oci-1', 'r/py:3', 'sha256:1', '[]', '{}', 5, 6)",
                &[],
            )
            .unwrap();
        let moving = BoxId::random();
        store
            .execute(
                "INSERT INTO box_moves (box_id, from_node, to_node, epoch, reason, ready, asked_at_ms, error) \
                 VALUES (?1, 'n1', 'n2', 3, 'lost', 1, 5, 'corrupt')",
                &args![moving.as_str()],
            )
            .unwrap();
        let id = BoxId::random();
        let old =
            r#"{"at_ms":9,"kind":"http","name":"x.org","port":443,"method":"POST","target":"/a","verdict":"allow"}"#;
        store
            .execute("INSERT INTO egress_log (box_id, at_ms, entry) VALUES (?1, 9, ?2)", &args![id.as_str(), old])
            .unwrap();
        drop(store);
        let store = db.open();
        let version = store.query_row("SELECT version FROM schema_version", &[]).unwrap().unwrap().get::<u32>(0);
        assert_eq!(version.unwrap(), LATEST);
        let log = store.egress_since(&id, 0).unwrap();
        assert_eq!((log.len(), log[0].status, log[0].opaque), (1, None, false));
        assert!(store.effects_since(&id, 0).unwrap().is_empty(), "older log entries are not made effects");
        // Its entry counted in a share (its box gone: of no account).
        let share = store.query_row("SELECT account, entries FROM log_shares WHERE log = 'egress'", &[]).unwrap();
        let share = share.map(|r| (r.get::<String>(0).unwrap(), r.get::<i64>(1).unwrap()));
        assert_eq!(share, Some((String::new(), 1)));
        let mv = store.box_move(&moving).unwrap().unwrap();
        assert_eq!((mv.epoch, mv.error.as_deref(), mv.failures, mv.failed_at_ms), (3, Some("corrupt"), 0, None));
        store.append_egress(&[(id.clone(), log[0].clone())]).unwrap();
        assert_eq!(store.effects_since(&id, 0).unwrap().len(), 1);
        let py = store.image(&AccountId("a".into()), &Name::new("py").unwrap()).unwrap().unwrap();
        assert_eq!((py.bytes, py.base_manifest.as_str(), py.base_source.as_str()), (5, "", ""));
        assert_eq!(store.service(&id).unwrap(), None);
    }

    /// A database as the last moat without schema versions made it (its
    /// tables, then its added columns), with a row in every table.
    #[test]
    fn a_database_made_before_versions_keeps_every_row() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moat.db");
        let old = rusqlite::Connection::open(&path).unwrap();
        for tables in [BOXES, LEDGER, EGRESS_LOG, SECRETS] {
            old.execute_batch(tables).unwrap();
        }
        for (column, ty) in BOXES_ADDED {
            old.execute_batch(&format!("ALTER TABLE boxes ADD COLUMN {column} {ty}")).unwrap();
        }
        let id = BoxId::random();
        let id = id.as_str();
        old.execute_batch(&format!(
            "INSERT INTO boxes (id, account, name, image, cpus, memory, pids, slot, state, pid, created_at, disk, \
                 parent, idle, keep_running, state_since, backend) \
                 VALUES ('{id}', 'a', 'web', 'debian', 2, 1024, 100, 7, 'running', 42, 5, 4096, NULL, 60, 1, 6, 'vm');
             INSERT INTO policies VALUES ('{id}', '{{\"allow\":[],\"deny\":[]}}');
             INSERT INTO retired_names VALUES ('a', 'gone');
             INSERT INTO usage_samples VALUES (10, '{id}', 'a', 'web', 3000000000, 0.5, 1000, 2000, 30, 40);
             INSERT INTO meter_state VALUES ('{id}', 77, 88);
             INSERT INTO egress_log VALUES ('{id}', 9, '{{\"at_ms\":9,\"kind\":\"dns\",\"name\":\"x.org\",\"port\":0,\"verdict\":\"allow\"}}');
             INSERT INTO secrets (account, name, host, header, format, env, sealed, killed) \
                 VALUES ('a', 'key', 'api.example.com', 'Authorization', 'Bearer {{}}', 'KEY', x'0102', 0);
             INSERT INTO secret_grants VALUES (1, '{id}', 'ph');
             INSERT INTO secret_limits VALUES (1, '', 'requests', 5, NULL);
             INSERT INTO secret_usage VALUES (1, '{id}', 'web', 1, 2, 3);"
        ))
        .unwrap();
        drop(old);

        let store = Store::open(&path).unwrap();
        let a = AccountId("a".into());
        let web = store.get(&a, &Name::new("web").unwrap()).unwrap().unwrap();
        assert_eq!((web.slot, web.pid, web.idle, web.keep_running), (7, Some(42), Some(60), true));
        assert_eq!((web.limits.cpus, web.limits.memory, web.limits.disk, web.backend.as_str()), (2, 1024, 4096, "vm"));
        assert_eq!((web.node.as_str(), web.epoch), ("", 0), "a single host's box, on no node");
        let id = web.id;
        assert_eq!(store.policy(&id).unwrap(), Default::default());
        assert!(store.is_retired(&a, &Name::new("gone").unwrap()).unwrap());
        let usage = store.usage(&a, 0, None).unwrap();
        assert_eq!((usage[0].cpu_seconds, usage[0].egress_received_bytes), (3.0, 40));
        assert_eq!(store.meter_state(&id).unwrap().map(|m| (m.last_cpu_ns, m.last_at_ms)), Some((77, 88)));
        assert_eq!(store.egress_since(&id, 0).unwrap()[0].name, "x.org");
        let secret = store.secret(&a, &Name::new("key").unwrap()).unwrap().unwrap();
        assert_eq!((secret.id, secret.sealed), (1, vec![1, 2]));
        assert_eq!(store.grants_of(1).unwrap(), vec![id.clone()]);
        assert_eq!(store.secret_limits(1).unwrap().len(), 1);
        assert_eq!(store.secret_uses(1).unwrap()[0].2.bytes, 3);
        drop(store);
        let again = Store::open(&path).unwrap();
        assert_eq!(again.list(None).unwrap().len(), 1, "and opens again");
    }
}
