//! The state store: one SQLite database under the state dir.
//!
//! Every change is one transaction, so a crash leaves either the old or the new
//! row; the manager rolls back boxes left in `creating`.

use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};

use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::ids::{AccountId, BoxId, Name};
use crate::limits::Limits;
use crate::record::{BoxRecord, BoxState, MAX_SLOTS};

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database itself failed.
    #[error("state database")]
    Sqlite(#[from] rusqlite::Error),
    /// The account already has a box by this name.
    #[error("a box named {0} already exists")]
    NameTaken(Name),
    /// Every uid range is in use.
    #[error("no free uid range left for another box")]
    NoSlot,
    /// A row that does not parse (the database was edited by hand).
    #[error("corrupt row for box {0}")]
    Corrupt(String),
}

/// The SQLite-backed store. Calls are short; a mutex serializes them.
pub struct Store {
    conn: Mutex<Connection>,
}

const SCHEMA: &str = "
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
";

const COLUMNS: &str = "id, account, name, image, cpus, memory, pids, slot, state, pid, created_at";

impl Store {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a box in state `creating`, giving it the lowest free uid slot.
    pub fn insert_new(
        &self,
        account: &AccountId,
        name: &Name,
        image: &Name,
        limits: Limits,
        created_at: u64,
    ) -> Result<BoxRecord, StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let taken: bool = tx
            .query_row(
                "SELECT 1 FROM boxes WHERE account = ?1 AND name = ?2",
                params![account.0, name.as_str()],
                |_| Ok(true),
            )
            .optional()?
            .unwrap_or(false);
        if taken {
            return Err(StoreError::NameTaken(name.clone()));
        }
        let slot = {
            let mut stmt = tx.prepare("SELECT slot FROM boxes ORDER BY slot")?;
            let used = stmt.query_map([], |r| r.get::<_, u32>(0))?;
            let mut next = 0u32;
            for s in used {
                if s? != next {
                    break;
                }
                next += 1;
            }
            next
        };
        if slot >= MAX_SLOTS {
            return Err(StoreError::NoSlot);
        }
        let rec = BoxRecord {
            id: BoxId::random(),
            account: account.clone(),
            name: name.clone(),
            image: image.clone(),
            limits,
            slot,
            state: BoxState::Creating,
            pid: None,
            created_at,
        };
        tx.execute(
            &format!("INSERT INTO boxes ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"),
            params![
                rec.id.as_str(),
                account.0,
                name.as_str(),
                image.as_str(),
                limits.cpus,
                limits.memory as i64,
                limits.pids,
                slot,
                rec.state.as_str(),
                None::<u32>,
                created_at as i64,
            ],
        )?;
        tx.commit()?;
        Ok(rec)
    }

    /// The account's box called `name`.
    pub fn get(&self, account: &AccountId, name: &Name) -> Result<Option<BoxRecord>, StoreError> {
        let conn = self.conn();
        let row = conn
            .query_row(
                &format!("SELECT {COLUMNS} FROM boxes WHERE account = ?1 AND name = ?2"),
                params![account.0, name.as_str()],
                |r| Ok(from_row(r)),
            )
            .optional()?;
        row.transpose()
    }

    /// The account's boxes, by name; every box when `account` is `None`.
    pub fn list(&self, account: Option<&AccountId>) -> Result<Vec<BoxRecord>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM boxes WHERE ?1 IS NULL OR account = ?1 ORDER BY name, account"
        ))?;
        let rows = stmt.query_map(params![account.map(|a| a.0.as_str())], |r| Ok(from_row(r)))?;
        rows.map(|r| r?).collect()
    }

    /// Records a state change, with the PID 1 of a running box.
    pub fn set_state(
        &self,
        id: &BoxId,
        state: BoxState,
        pid: Option<u32>,
    ) -> Result<(), StoreError> {
        self.conn().execute(
            "UPDATE boxes SET state = ?2, pid = ?3 WHERE id = ?1",
            params![id.as_str(), state.as_str(), pid],
        )?;
        Ok(())
    }

    /// Forgets a box.
    pub fn delete(&self, id: &BoxId) -> Result<(), StoreError> {
        self.conn()
            .execute("DELETE FROM boxes WHERE id = ?1", params![id.as_str()])?;
        Ok(())
    }
}

fn from_row(r: &Row<'_>) -> Result<BoxRecord, StoreError> {
    let id: String = r.get(0)?;
    let corrupt = || StoreError::Corrupt(id.clone());
    Ok(BoxRecord {
        id: BoxId::parse(&id).ok_or_else(corrupt)?,
        account: AccountId(r.get(1)?),
        name: Name::new(&r.get::<_, String>(2)?).map_err(|_| corrupt())?,
        image: Name::new(&r.get::<_, String>(3)?).map_err(|_| corrupt())?,
        limits: Limits {
            cpus: r.get(4)?,
            memory: r.get::<_, i64>(5)? as u64,
            pids: r.get(6)?,
        },
        slot: r.get(7)?,
        state: BoxState::parse(&r.get::<_, String>(8)?).ok_or_else(corrupt)?,
        pid: r.get(9)?,
        created_at: r.get::<_, i64>(10)? as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(s: &str) -> Name {
        Name::new(s).unwrap()
    }

    #[test]
    fn insert_get_list_delete_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let alice = AccountId("SHA256:alice".into());
        let bob = AccountId("SHA256:bob".into());
        let web = {
            let store = Store::open(&path).unwrap();
            let web = store
                .insert_new(
                    &alice,
                    &names("web"),
                    &names("debian"),
                    Limits::default(),
                    1,
                )
                .unwrap();
            let db = store
                .insert_new(&alice, &names("db"), &names("debian"), Limits::default(), 2)
                .unwrap();
            assert_ne!(web.slot, db.slot);
            // Names are per account.
            store
                .insert_new(&bob, &names("web"), &names("busybox"), Limits::default(), 3)
                .unwrap();
            assert!(matches!(
                store.insert_new(
                    &alice,
                    &names("web"),
                    &names("debian"),
                    Limits::default(),
                    4
                ),
                Err(StoreError::NameTaken(_))
            ));
            store
                .set_state(&web.id, BoxState::Running, Some(42))
                .unwrap();
            web
        };
        let store = Store::open(&path).unwrap();
        let got = store.get(&alice, &names("web")).unwrap().unwrap();
        assert_eq!(
            (got.id, got.state, got.pid),
            (web.id.clone(), BoxState::Running, Some(42))
        );
        assert_eq!(store.list(Some(&alice)).unwrap().len(), 2);
        assert_eq!(store.list(None).unwrap().len(), 3);
        store.delete(&web.id).unwrap();
        assert!(store.get(&alice, &names("web")).unwrap().is_none());
    }

    #[test]
    fn freed_slots_are_reused_lowest_first() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let a = AccountId("a".into());
        let b0 = store
            .insert_new(&a, &names("b0"), &names("i"), Limits::default(), 0)
            .unwrap();
        let b1 = store
            .insert_new(&a, &names("b1"), &names("i"), Limits::default(), 0)
            .unwrap();
        assert_eq!((b0.slot, b1.slot), (0, 1));
        store.delete(&b0.id).unwrap();
        let b2 = store
            .insert_new(&a, &names("b2"), &names("i"), Limits::default(), 0)
            .unwrap();
        assert_eq!(b2.slot, 0);
    }
}
