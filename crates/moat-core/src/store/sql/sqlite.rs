//! The SQLite engine: the single host's store, one file in the state dir.

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{params_from_iter, Connection, ToSql};

use super::{Engine, Exec, Row, Value};
use crate::store::StoreError;

/// Statements on one connection (or on a transaction, which derefs to one).
pub(super) struct Sqlite<'c>(pub(super) &'c Connection);

impl Exec for Sqlite<'_> {
    fn engine(&self) -> Engine {
        Engine::Sqlite
    }

    fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64, StoreError> {
        let changed = self.0.prepare_cached(sql)?.execute(params_from_iter(args))?;
        Ok(changed as u64)
    }

    fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, StoreError> {
        let mut stmt = self.0.prepare_cached(sql)?;
        let width = stmt.column_count();
        let mut rows = stmt.query(params_from_iter(args))?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            let values = (0..width).map(|i| row.get_ref(i).map(value_of)).collect::<Result<_, _>>()?;
            out.push(Row(values));
        }
        Ok(out)
    }

    fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        Ok(self.0.execute_batch(sql)?)
    }
}

/// Runs `f` in a transaction on `conn` (deferred, as rusqlite's default).
pub(super) fn transaction<T>(
    conn: &mut Connection,
    f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let tx = conn.transaction()?;
    let out = f(&mut Sqlite(&tx))?;
    tx.commit()?;
    Ok(out)
}

/// Runs `f` in a transaction on `conn` whose commit is not flushed to disk
/// (in WAL mode: consistent, and made durable by the next commit that is).
pub(super) fn transaction_unsynced<T>(
    conn: &mut Connection,
    f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    let out = transaction(conn, f);
    // Every other write waits for the disk, as the store was opened.
    let restored = conn.pragma_update(None, "synchronous", "FULL");
    let out = out?;
    restored?;
    Ok(out)
}

fn value_of(v: ValueRef<'_>) -> Value {
    match v {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(i) => Value::Int(i),
        ValueRef::Real(f) => Value::Real(f),
        ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Blob(b) => Value::Blob(b.to_vec()),
    }
}

impl ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self {
            Value::Null => ValueRef::Null,
            Value::Int(i) => ValueRef::Integer(*i),
            Value::Real(f) => ValueRef::Real(*f),
            Value::Text(s) => ValueRef::Text(s.as_bytes()),
            Value::Blob(b) => ValueRef::Blob(b),
        }))
    }
}
