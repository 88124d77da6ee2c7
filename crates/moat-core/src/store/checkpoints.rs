//! SQLite's write-ahead log copied into the database off the writers' path:
//! a thread with a connection of its own checkpoints it twice a second. Left
//! to SQLite, the commit that took the log past 1,000 pages did it, and
//! waited for the database file's flush: at 10,000 boxes that commit was a
//! resume's, and the slowest of them.

use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

/// How often the log is copied into the database.
const EVERY: Duration = Duration::from_millis(500);

/// Pages past which a commit still checkpoints the log itself (the thread
/// fell behind or is gone), so that the log stays bounded: 64 MiB.
pub(super) const FALLBACK_PAGES: u32 = 16_384;

/// The checkpointing thread; dropping this ends it.
pub(super) struct Checkpoints {
    _stop: mpsc::Sender<()>,
}

impl Checkpoints {
    /// Starts checkpointing the database at `path`; `None` (and a warning)
    /// where it cannot, and commits go on doing it as SQLite does.
    pub(super) fn start(path: &Path) -> Option<Self> {
        let conn = match rusqlite::Connection::open(path) {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "cannot open the state database to checkpoint it");
                return None;
            }
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let spawned = std::thread::Builder::new().name("moat-checkpoint".into()).spawn(move || {
            while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(EVERY) {
                // PASSIVE: copies what no reader needs, waits for nobody.
                if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                    tracing::warn!(error = %e, "cannot checkpoint the state database");
                }
            }
        });
        match spawned {
            Ok(_) => Some(Self { _stop: stop }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the state database's checkpoints");
                None
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::store::sql::args;
    use crate::store::Store;

    /// What a commit writes reaches the database file within a second or
    /// two, though it left the log far short of what SQLite copies itself.
    #[test]
    fn the_log_reaches_the_database_file_without_a_commit_copying_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moat.db");
        let store = Store::open(&path).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(700));
        let before = std::fs::metadata(&path).unwrap().len();
        // One commit of ~100 pages (SQLite's own threshold is 1,000).
        store
            .transaction(|tx| {
                for i in 0..3000u64 {
                    tx.execute(
                        "INSERT INTO meter_state (box_id, last_cpu_ns, last_at_ms) VALUES (?1, ?2, ?3)",
                        &args![format!("box-{i}").as_str(), i, i],
                    )?;
                }
                Ok(())
            })
            .unwrap();
        let grew = (0..40).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            std::fs::metadata(&path).unwrap().len() > before + 64 * 1024
        });
        assert!(grew, "the database file stayed at {before} bytes: nothing checkpointed the log");
    }
}
