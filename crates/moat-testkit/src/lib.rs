//! What moat's tests start beside them, shared by every crate's tests. Not
//! part of moat: a dev-dependency only.
//!
//! - [`postgres`]: a private PostgreSQL 15 cluster in a temp dir.

pub mod postgres;

pub use postgres::Postgres;
