//! What moat's tests start beside them, shared by every crate's tests. Not
//! part of moat: a dev-dependency only.
//!
//! - [`postgres`]: a private PostgreSQL 15 cluster in a temp dir.
//! - [`seaweedfs`]: a SeaweedFS S3 server on loopback.

pub mod postgres;
pub mod seaweedfs;

pub use postgres::Postgres;
pub use seaweedfs::SeaweedFs;
