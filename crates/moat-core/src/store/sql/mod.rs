//! The store's data-access layer: the one seam between the store's SQL and
//! the engine that runs it, SQLite (one file, the single host) or PostgreSQL
//! (a fleet's shared store).
//!
//! Statements are written once, in the SQL both engines speak, with `?1`
//! placeholders ([`dialect`] spells them `$1` for PostgreSQL). Arguments and
//! results travel as a small [`Value`]/[`Row`] pair, so no engine's types leak
//! into the store's methods.

pub(crate) mod dialect;
mod pg_tls;
mod postgres;
mod sqlite;

use std::sync::{Mutex, MutexGuard, PoisonError};

use super::StoreError;

pub(crate) use self::postgres::Postgres;

/// One argument or column value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    /// SQL `NULL`.
    Null,
    /// Any integer (and booleans, as 0 and 1).
    Int(i64),
    /// A floating-point number.
    Real(f64),
    /// Text.
    Text(String),
    /// Bytes.
    Blob(Vec<u8>),
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Self::Int(v)
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Self::Int(v.into())
    }
}

/// Stored as the same bits (the store's columns are signed 64-bit).
impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Self::Int(v as i64)
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Self::Int(v.into())
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Self::Real(v)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Self::Text(v.to_owned())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}

impl From<&String> for Value {
    fn from(v: &String) -> Self {
        Self::Text(v.clone())
    }
}

impl From<&[u8]> for Value {
    fn from(v: &[u8]) -> Self {
        Self::Blob(v.to_vec())
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Self::Null, Into::into)
    }
}

/// The arguments of a statement: `args![a, b]` is `[Value::from(a), Value::from(b)]`.
macro_rules! args {
    ($($v:expr),* $(,)?) => { [$($crate::store::sql::Value::from($v)),*] };
}
pub(crate) use args;

/// A value read back as a Rust type.
pub(crate) trait FromValue: Sized {
    /// `None` when the value is not of this type.
    fn from_value(v: &Value) -> Option<Self>;
}

impl FromValue for i64 {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
}

/// The same bits as stored (see `From<u64> for Value`).
impl FromValue for u64 {
    fn from_value(v: &Value) -> Option<Self> {
        i64::from_value(v).map(|i| i as u64)
    }
}

impl FromValue for u32 {
    fn from_value(v: &Value) -> Option<Self> {
        i64::from_value(v).and_then(|i| u32::try_from(i).ok())
    }
}

impl FromValue for bool {
    fn from_value(v: &Value) -> Option<Self> {
        i64::from_value(v).map(|i| i != 0)
    }
}

impl FromValue for f64 {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Real(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
}

impl FromValue for String {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Text(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl FromValue for Vec<u8> {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Blob(b) => Some(b.clone()),
            _ => None,
        }
    }
}

impl<T: FromValue> FromValue for Option<T> {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Null => Some(None),
            v => T::from_value(v).map(Some),
        }
    }
}

/// One result row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row(pub(crate) Vec<Value>);

impl Row {
    /// Column `i` as a `T`.
    pub(crate) fn get<T: FromValue>(&self, i: usize) -> Result<T, StoreError> {
        let v = self.0.get(i).unwrap_or(&Value::Null);
        T::from_value(v)
            .ok_or_else(|| StoreError::Column(format!("column {i} holds {v:?}, not a {}", std::any::type_name::<T>())))
    }
}

/// Which engine runs the statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    /// SQLite, a file on this host.
    Sqlite,
    /// PostgreSQL, the fleet's store.
    Postgres,
}

/// What statements run on: a connection, or a transaction on one.
pub(crate) trait Exec {
    /// Which engine this is (for the few statements the engines spell apart).
    fn engine(&self) -> Engine;
    /// Runs one statement; how many rows it changed.
    fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64, StoreError>;
    /// Runs one query; every row it returns.
    fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, StoreError>;
    /// Runs several statements without arguments (schema changes).
    fn batch(&mut self, sql: &str) -> Result<(), StoreError>;

    /// The first row a query returns, if any.
    fn query_row(&mut self, sql: &str, args: &[Value]) -> Result<Option<Row>, StoreError> {
        Ok(self.query(sql, args)?.into_iter().next())
    }
}

/// An open database, of either engine.
pub(crate) enum Db {
    /// One SQLite connection; calls are short, so a mutex serializes them.
    Sqlite(Mutex<rusqlite::Connection>),
    /// A PostgreSQL connection, run by a thread of its own.
    Postgres(Postgres),
}

impl Db {
    /// Runs `f` on the connection, each statement committed on its own.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>) -> Result<T, StoreError> {
        match self {
            Self::Sqlite(conn) => f(&mut sqlite::Sqlite(&lock(conn))),
            Self::Postgres(pg) => pg.with(f),
        }
    }

    /// Runs `f` in one transaction: committed if it returns `Ok`, rolled back if not.
    pub(crate) fn transaction<T>(
        &self,
        f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        match self {
            Self::Sqlite(conn) => sqlite::transaction(&mut lock(conn), f),
            Self::Postgres(pg) => pg.transaction(f),
        }
    }

    /// As [`Db::transaction`], but its commit does not wait for the disk: a
    /// crash (of the machine; not of the process) may lose it, never half of
    /// it, and never what was committed before it. For writes whose loss the
    /// next one makes good (the meter's samples: the next sample bills the
    /// lost interval too), on paths that should not wait for a flush.
    pub(crate) fn transaction_unsynced<T>(
        &self,
        f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        match self {
            Self::Sqlite(conn) => sqlite::transaction_unsynced(&mut lock(conn), f),
            Self::Postgres(pg) => pg.transaction(|tx| {
                tx.batch("SET LOCAL synchronous_commit = off")?;
                f(tx)
            }),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_back_as_what_was_written() {
        let row = Row(vec![
            Value::from(u64::MAX),
            Value::from(Some(7u32)),
            Value::from(None::<u32>),
            Value::from(true),
            Value::from("t"),
            Value::from(&b"b"[..]),
            Value::from(1.5),
        ]);
        assert_eq!(row.get::<u64>(0).unwrap(), u64::MAX);
        assert_eq!(row.get::<Option<u32>>(1).unwrap(), Some(7));
        assert_eq!(row.get::<Option<u32>>(2).unwrap(), None);
        assert!(row.get::<bool>(3).unwrap());
        assert_eq!(row.get::<String>(4).unwrap(), "t");
        assert_eq!(row.get::<Vec<u8>>(5).unwrap(), b"b");
        assert_eq!(row.get::<f64>(6).unwrap(), 1.5);
        assert!(matches!(row.get::<String>(0), Err(StoreError::Column(_))), "an integer is not text");
        assert!(matches!(row.get::<u32>(0), Err(StoreError::Column(_))), "out of range");
        assert!(matches!(row.get::<i64>(9), Err(StoreError::Column(_))), "no such column");
    }
}
