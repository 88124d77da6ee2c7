//! The PostgreSQL engine: a fleet's shared store.
//!
//! The `postgres` client blocks by running a small tokio runtime of its own,
//! which panics when called from inside another runtime (the manager calls
//! the store directly on a current-thread runtime). So one thread of our own
//! owns the connection and runs every statement; callers hand it owned
//! statements over a channel and wait for the answer, as they would wait
//! for SQLite's disk.
//!
//! When the server cannot be reached, every call fails with
//! [`StoreError::Unreachable`], naming the server but never the password; the
//! next call connects again (a connection lost in the middle of a
//! transaction fails the rest of that transaction instead).
//!
//! TLS when the DSN says `sslmode=require` (see [`super::pg_tls`]: the
//! server's certificate is always verified); otherwise none, for a store on
//! loopback or a unix socket.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use bytes::BytesMut;
use postgres::config::{Host, SslMode};
use postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use postgres::{Client, Config, NoTls, Statement};

use super::dialect::to_postgres;
use super::pg_tls::{take_root_cert, PgTls};
use super::{Engine, Exec, Row, Value};
use crate::store::StoreError;

/// How long a connect may take before the store counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long sent data may go unacknowledged before the connection counts as lost.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// A PostgreSQL database, reached through the thread that owns its connection.
pub(crate) struct Postgres {
    link: Mutex<Link>,
}

/// The caller's end of the connection thread. One caller at a time holds
/// it, for one statement or one whole transaction.
struct Link {
    ops: Sender<Op>,
    answers: Receiver<Result<Answer, StoreError>>,
}

/// What the connection thread is asked to do.
#[derive(Clone)]
enum Op {
    Execute(String, Vec<Value>),
    Query(String, Vec<Value>),
    Batch(String),
    Begin,
    Commit,
    Rollback,
}

enum Answer {
    Changed(u64),
    Rows(Vec<Row>),
}

impl Postgres {
    /// Parses `dsn` (`postgres://USER[:PASSWORD]@HOST[:PORT]/DB` or `key=value`
    /// pairs) and starts the thread that will connect on the first call.
    pub(crate) fn new(dsn: &str) -> Result<Self, StoreError> {
        let (dsn, root_cert) = take_root_cert(dsn);
        let mut config: Config =
            dsn.parse().map_err(|e| StoreError::Dsn(format!("not a PostgreSQL connection string: {e}")))?;
        let tls = match config.get_ssl_mode() {
            SslMode::Require => Some(PgTls::new(root_cert.as_deref())?),
            _ if root_cert.is_some() => {
                return Err(StoreError::Dsn("sslrootcert is for sslmode=require (TLS, the server verified)".into()))
            }
            _ => None,
        };
        if config.get_hosts().is_empty() {
            return Err(StoreError::Dsn("a PostgreSQL connection string must name a host".into()));
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        config.tcp_user_timeout(TCP_USER_TIMEOUT).application_name("moat");
        let target = target_of(&config);
        let (ops, from_callers) = channel();
        let (to_callers, answers) = channel();
        let conn = Connection {
            config,
            tls,
            target,
            client: None,
            statements: HashMap::new(),
            in_tx: false,
            server_ended: false,
        };
        std::thread::Builder::new()
            .name("moat-postgres".into())
            .spawn(move || conn.serve(&from_callers, &to_callers))
            .map_err(|e| StoreError::Dsn(format!("start the store's connection thread: {e}")))?;
        Ok(Self { link: Mutex::new(Link { ops, answers }) })
    }

    /// Runs `f`, each statement committed on its own.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>) -> Result<T, StoreError> {
        f(&mut PgExec(&mut self.link()))
    }

    /// Runs `f` in one transaction: committed if it returns `Ok`, rolled back if not.
    pub(crate) fn transaction<T>(
        &self,
        f: impl FnOnce(&mut dyn Exec) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut link = self.link();
        link.call(Op::Begin)?;
        match f(&mut PgExec(&mut link)) {
            Ok(out) => link.call(Op::Commit).map(|_| out),
            Err(e) => {
                // The transaction's own error says what went wrong; a failed
                // rollback (the connection is gone) changes nothing.
                let _ = link.call(Op::Rollback);
                Err(e)
            }
        }
    }

    /// The link, rolling back what a caller that panicked left open.
    fn link(&self) -> MutexGuard<'_, Link> {
        match self.link.lock() {
            Ok(link) => link,
            Err(poisoned) => {
                let mut link = poisoned.into_inner();
                let _ = link.call(Op::Rollback);
                self.link.clear_poison();
                link
            }
        }
    }
}

impl Link {
    fn call(&mut self, op: Op) -> Result<Answer, StoreError> {
        let gone = || StoreError::Unreachable("the state store's connection thread is gone".into());
        self.ops.send(op).map_err(|_| gone())?;
        self.answers.recv().map_err(|_| gone())?
    }
}

struct PgExec<'l>(&'l mut Link);

impl Exec for PgExec<'_> {
    fn engine(&self) -> Engine {
        Engine::Postgres
    }

    fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64, StoreError> {
        match self.0.call(Op::Execute(to_postgres(sql), args.to_vec()))? {
            Answer::Changed(n) => Ok(n),
            Answer::Rows(rows) => Ok(rows.len() as u64),
        }
    }

    fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, StoreError> {
        match self.0.call(Op::Query(to_postgres(sql), args.to_vec()))? {
            Answer::Rows(rows) => Ok(rows),
            Answer::Changed(_) => Ok(Vec::new()),
        }
    }

    fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        self.0.call(Op::Batch(sql.to_owned())).map(drop)
    }
}

/// An error and its causes, in one line (a TLS failure's reason is a cause).
fn causes(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}

/// The connection thread's state.
struct Connection {
    config: Config,
    /// How connections make TLS, if they do.
    tls: Option<PgTls>,
    /// `HOST:PORT` (or the socket's directory), for messages.
    target: String,
    client: Option<Client>,
    /// Statements prepared on `client`, by their text.
    statements: HashMap<String, Statement>,
    /// Whether `client` is (or was, if it is gone) inside a transaction.
    in_tx: bool,
    /// Whether the last failure was the server ending the session before
    /// the call (see [`Connection::answer_once_more`]).
    server_ended: bool,
}

impl Connection {
    /// Answers ops until every caller's end is dropped.
    fn serve(mut self, ops: &Receiver<Op>, answers: &Sender<Result<Answer, StoreError>>) {
        for op in ops {
            if answers.send(self.answer_once_more(op)).is_err() {
                break;
            }
        }
    }

    /// Answers `op`, and once more on a new connection if the old one turned
    /// out to be gone (a restarted server: every first call after it would
    /// fail otherwise) when that cannot run it twice: a read, or a statement
    /// the server never ran (it had ended the session before it came).
    fn answer_once_more(&mut self, op: Op) -> Result<Answer, StoreError> {
        let had_client = self.client.is_some();
        self.server_ended = false;
        let again = matches!(op, Op::Query(..) | Op::Execute(..)) && !self.in_tx;
        let first = self.answer(op.clone());
        let lost = matches!(first, Err(StoreError::Unreachable(_))) && had_client && self.client.is_none();
        let harmless = matches!(op, Op::Query(..)) || self.server_ended;
        if again && lost && harmless {
            return self.answer(op);
        }
        first
    }

    fn answer(&mut self, op: Op) -> Result<Answer, StoreError> {
        match op {
            Op::Begin => {
                if self.in_tx {
                    self.answer(Op::Rollback)?;
                }
                self.batch("BEGIN")?;
                self.in_tx = true;
                Ok(Answer::Changed(0))
            }
            Op::Commit => {
                let done = self.batch("COMMIT");
                self.in_tx = false;
                done.map(|()| Answer::Changed(0))
            }
            Op::Rollback => {
                let was_open = self.client.is_some();
                self.in_tx = false;
                if was_open {
                    self.batch("ROLLBACK")?;
                }
                Ok(Answer::Changed(0))
            }
            Op::Batch(sql) => self.batch(&sql).map(|()| Answer::Changed(0)),
            Op::Execute(sql, args) => {
                let stmt = self.prepare(&sql)?;
                let params = params(&args);
                let done = self.client()?.execute(&stmt, &params);
                done.map(Answer::Changed).map_err(|e| self.failed(e))
            }
            Op::Query(sql, args) => {
                let stmt = self.prepare(&sql)?;
                let params = params(&args);
                let done = self.client()?.query(&stmt, &params);
                let rows = done.map_err(|e| self.failed(e))?;
                rows.iter().map(row_of).collect::<Result<_, _>>().map(Answer::Rows)
            }
        }
    }

    /// The connection, made now if there is none (but never in the middle of
    /// a transaction: the rest of it would run outside it).
    fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.client.is_none() {
            if self.in_tx {
                return Err(self.unreachable("the connection was lost in the middle of a transaction"));
            }
            let made = match &self.tls {
                Some(tls) => self.config.connect(tls.clone()),
                None => self.config.connect(NoTls),
            };
            let client = made.map_err(|e| self.unreachable(&causes(&e)))?;
            self.client = Some(client);
        }
        self.client.as_mut().ok_or_else(|| StoreError::Unreachable("no connection".into()))
    }

    fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        let done = self.client()?.batch_execute(sql);
        done.map_err(|e| self.failed(e))
    }

    fn prepare(&mut self, sql: &str) -> Result<Statement, StoreError> {
        if let Some(stmt) = self.statements.get(sql) {
            return Ok(stmt.clone());
        }
        let done = self.client()?.prepare(sql);
        let stmt = done.map_err(|e| self.failed(e))?;
        self.statements.insert(sql.to_owned(), stmt.clone());
        Ok(stmt)
    }

    /// The store's error for `e`; if the connection is gone, forgets it so
    /// that the next call (after this transaction) connects again.
    fn failed(&mut self, e: postgres::Error) -> StoreError {
        let io = std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>());
        let lost = e.is_closed()
            || io
            || self.client.as_ref().is_none_or(Client::is_closed)
            || e.as_db_error().is_some_and(is_outage);
        if !lost {
            return StoreError::Postgres(e);
        }
        // The server said it ended the session (shutdown, restart), or the
        // client knew the connection closed: nothing of this call ran.
        self.server_ended = e.is_closed() || e.as_db_error().is_some_and(is_outage);
        self.client = None;
        self.statements.clear();
        self.unreachable(&e.to_string())
    }

    fn unreachable(&self, why: &str) -> StoreError {
        StoreError::Unreachable(format!("the state store (PostgreSQL at {}) is unreachable: {why}", self.target))
    }
}

/// Errors the server sends as it goes away (SQLSTATE classes 08 and 57P).
fn is_outage(e: &postgres::error::DbError) -> bool {
    let code = e.code().code();
    code.starts_with("08") || code.starts_with("57P")
}

/// `HOST:PORT` of the first host, or the unix socket's directory.
fn target_of(config: &Config) -> String {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    match config.get_hosts().first() {
        Some(Host::Tcp(host)) if host.contains(':') => format!("[{host}]:{port}"),
        Some(Host::Tcp(host)) => format!("{host}:{port}"),
        Some(Host::Unix(dir)) => format!("{}", dir.display()),
        None => "no host".into(),
    }
}

fn params(args: &[Value]) -> Vec<&(dyn ToSql + Sync)> {
    args.iter().map(|a| a as &(dyn ToSql + Sync)).collect()
}

fn row_of(row: &postgres::Row) -> Result<Row, StoreError> {
    let bad = |e: postgres::Error| StoreError::Postgres(e);
    let mut values = Vec::with_capacity(row.len());
    for (i, column) in row.columns().iter().enumerate() {
        let ty = column.type_();
        let value = match *ty {
            Type::INT8 => row.try_get::<_, Option<i64>>(i).map_err(bad)?.map(Value::Int),
            Type::INT4 => row.try_get::<_, Option<i32>>(i).map_err(bad)?.map(|v| Value::Int(v.into())),
            Type::INT2 => row.try_get::<_, Option<i16>>(i).map_err(bad)?.map(|v| Value::Int(v.into())),
            Type::BOOL => row.try_get::<_, Option<bool>>(i).map_err(bad)?.map(|v| Value::Int(v.into())),
            Type::FLOAT8 => row.try_get::<_, Option<f64>>(i).map_err(bad)?.map(Value::Real),
            Type::FLOAT4 => row.try_get::<_, Option<f32>>(i).map_err(bad)?.map(|v| Value::Real(v.into())),
            Type::TEXT | Type::VARCHAR | Type::NAME | Type::BPCHAR => {
                row.try_get::<_, Option<String>>(i).map_err(bad)?.map(Value::Text)
            }
            Type::BYTEA => row.try_get::<_, Option<Vec<u8>>>(i).map_err(bad)?.map(Value::Blob),
            Type::VOID => None,
            _ => return Err(StoreError::Column(format!("column {} has type {ty}, which the store does not read", i))),
        };
        values.push(value.unwrap_or(Value::Null));
    }
    Ok(Row(values))
}

/// A [`Value`] as the parameter type the server inferred for it.
impl ToSql for Value {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(i) => match *ty {
                Type::INT4 => i32::try_from(*i)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*i)?.to_sql(ty, out),
                Type::BOOL => (*i != 0).to_sql(ty, out),
                Type::FLOAT8 => (*i as f64).to_sql(ty, out),
                Type::INT8 => i.to_sql(ty, out),
                _ => Err(format!("an integer for a parameter of type {ty}").into()),
            },
            Value::Real(f) => match *ty {
                Type::FLOAT4 => (*f as f32).to_sql(ty, out),
                Type::FLOAT8 => f.to_sql(ty, out),
                _ => Err(format!("a number for a parameter of type {ty}").into()),
            },
            Value::Text(s) if <&str as ToSql>::accepts(ty) => s.as_str().to_sql(ty, out),
            Value::Blob(b) if *ty == Type::BYTEA => b.as_slice().to_sql(ty, out),
            Value::Text(_) | Value::Blob(_) => Err(format!("{self:?} for a parameter of type {ty}").into()),
        }
    }

    fn accepts(ty: &Type) -> bool {
        [Type::INT8, Type::INT4, Type::INT2, Type::BOOL, Type::FLOAT8, Type::FLOAT4, Type::BYTEA].contains(ty)
            || <&str as ToSql>::accepts(ty)
    }

    to_sql_checked!();
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::store::{Store, StoreError};

    #[test]
    fn an_outage_fails_calls_clearly_and_the_next_call_after_it_reconnects() {
        let pg = moat_testkit::Postgres::start();
        // Trust authentication ignores the password; it must still never be shown.
        let dsn = pg.create_db().replace("postgres@", "postgres:hunter2@");
        let store = Store::connect(&dsn).unwrap();
        assert!(store.list(None).unwrap().is_empty());

        pg.stop();
        let started = Instant::now();
        for _ in 0..2 {
            let err = store.list(None).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, StoreError::Unreachable(_)), "{err:?}");
            let port = pg.port();
            assert!(
                msg.starts_with(&format!("the state store (PostgreSQL at 127.0.0.1:{port}) is unreachable: ")),
                "{msg}"
            );
            assert!(!msg.contains("hunter2"), "{msg}");
        }
        let err = Store::connect(&dsn).err().unwrap();
        assert!(matches!(&err, StoreError::Unreachable(m) if !m.contains("hunter2")), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "refused connects fail fast");

        pg.start_again();
        assert!(store.list(None).unwrap().is_empty(), "the next call connects again");
        store.set_policy(&crate::ids::BoxId::random(), &Default::default()).unwrap();
    }

    #[test]
    fn the_first_call_after_a_restart_succeeds() {
        let pg = moat_testkit::Postgres::start();
        let store = Store::connect(&pg.create_db()).unwrap();
        let id = crate::ids::BoxId::random();
        store.set_policy(&id, &Default::default()).unwrap();
        // A restart between two calls, none during it: the connection the
        // store holds is gone, and neither a read nor a write may fail for it.
        pg.stop();
        pg.start_again();
        assert!(store.list(None).unwrap().is_empty());
        pg.stop();
        pg.start_again();
        store.set_policy(&id, &Default::default()).unwrap();
    }

    #[test]
    fn a_unix_socket_is_a_host_too() {
        let pg = moat_testkit::Postgres::shared();
        let name = pg.create_db().rsplit('/').next().unwrap().to_owned();
        let dir = pg.socket_dir().display().to_string();
        let store = Store::connect(&format!("host={dir} port={} user=postgres dbname={name}", pg.port())).unwrap();
        assert!(store.list(None).unwrap().is_empty());
    }

    #[test]
    fn nodes_starting_together_migrate_once() {
        let pg = moat_testkit::Postgres::shared();
        let dsn = pg.create_db();
        let start = std::sync::Barrier::new(4);
        std::thread::scope(|s| {
            let opened: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        Store::connect(&dsn).map(drop)
                    })
                })
                .collect();
            for store in opened {
                store.join().unwrap().unwrap();
            }
        });
    }

    #[test]
    fn calls_work_inside_either_tokio_runtime() {
        let pg = moat_testkit::Postgres::shared();
        let store = Store::connect(&pg.create_db()).unwrap();
        // The manager calls the store directly on a current-thread runtime,
        // and through block_in_place on a multi-thread one.
        let current = tokio::runtime::Builder::new_current_thread().build().unwrap();
        current.block_on(async { store.list(None).unwrap() });
        let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
        multi.block_on(async { tokio::task::block_in_place(|| store.list(None).unwrap()) });
    }
}
