//! Numbers handed out once by the store, to every node sharing it: an ask
//! question's number is typed by its owner to answer it through any front
//! door of a fleet, so no two nodes may hand out the same one.

use super::sql::args;
use super::{Store, StoreError};

/// The table (schema version 15): each counter's last number.
pub(crate) const COUNTERS: &str = "
CREATE TABLE IF NOT EXISTS counters (
    name  TEXT PRIMARY KEY,
    last  INTEGER NOT NULL
);
";

impl Store {
    /// The next number of `counter` (1 the first time), never handed out
    /// before, whichever node asks.
    pub fn next_number(&self, counter: &str) -> Result<u64, StoreError> {
        let row = self.query_row(
            "INSERT INTO counters (name, last) VALUES (?1, 1) \
             ON CONFLICT (name) DO UPDATE SET last = counters.last + 1 RETURNING last",
            &args![counter],
        )?;
        let last = row.map(|r| r.get::<u64>(0)).transpose()?;
        last.ok_or_else(|| StoreError::Corrupt(format!("counter {counter}")))
    }
}

#[cfg(test)]
mod tests {
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(numbers_are_never_handed_out_twice);

    /// Two stores on one database (two nodes) draw from one sequence, each
    /// counter its own, and the sequence survives reopening.
    fn numbers_are_never_handed_out_twice(db: &TestDb) {
        let (n1, n2) = (db.open(), db.open());
        assert_eq!(n1.next_number("question").unwrap(), 1);
        assert_eq!(n2.next_number("question").unwrap(), 2);
        assert_eq!(n2.next_number("other").unwrap(), 1);
        fn draw(store: &crate::store::Store) -> Vec<u64> {
            (0..20).map(|_| store.next_number("question").unwrap()).collect()
        }
        let drawn: Vec<u64> = std::thread::scope(|s| {
            let a = s.spawn(|| draw(&n1));
            let mut all = draw(&n2);
            all.extend(a.join().unwrap());
            all
        });
        let mut unique = drawn.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 40, "{drawn:?}");
        drop((n1, n2));
        assert_eq!(db.open().next_number("question").unwrap(), 43);
    }
}
