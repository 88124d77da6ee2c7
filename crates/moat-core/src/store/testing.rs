//! The store's tests run on both engines: each is a function of a [`TestDb`],
//! and [`on_both_engines!`] makes a `#[test]` of it for each engine (SQLite
//! in a temp dir, PostgreSQL in a private cluster of moat-testkit's).

use std::sync::Arc;

use super::Store;

/// A database a test may open any number of stores on.
pub(crate) enum TestDb {
    /// A file in a temp dir.
    Sqlite(tempfile::TempDir),
    /// A database of its own (its DSN) on a cluster, kept running while in use.
    Postgres { dsn: String, _cluster: Arc<moat_testkit::Postgres> },
}

impl TestDb {
    /// A fresh SQLite database.
    pub(crate) fn sqlite() -> Self {
        Self::Sqlite(tempfile::tempdir().unwrap())
    }

    /// A fresh PostgreSQL database, on the cluster the tests share.
    pub(crate) fn postgres() -> Self {
        let cluster = moat_testkit::Postgres::shared();
        let dsn = cluster.create_db();
        Self::Postgres { dsn, _cluster: cluster }
    }

    /// A new store on this database (as a restarted daemon would open it).
    pub(crate) fn open(&self) -> Store {
        match self {
            Self::Sqlite(dir) => Store::open(&dir.path().join("state.db")).unwrap(),
            Self::Postgres { dsn, .. } => Store::connect(dsn).unwrap(),
        }
    }
}

/// `on_both_engines!(a, b)`: tests `a` and `b` (each `fn(&TestDb)` in the
/// module) in `mod sqlite` and `mod postgres`.
macro_rules! on_both_engines {
    ($($test:ident),+ $(,)?) => {
        mod sqlite {
            $(#[test]
            fn $test() {
                super::$test(&$crate::store::testing::TestDb::sqlite())
            })+
        }
        mod postgres {
            $(#[test]
            fn $test() {
                super::$test(&$crate::store::testing::TestDb::postgres())
            })+
        }
    };
}
pub(crate) use on_both_engines;
