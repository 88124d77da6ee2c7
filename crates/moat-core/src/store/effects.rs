//! The effects ledger, kept by the privileged side (see [`crate::effects`]):
//! filled from the egress log as it is appended (one transaction), read per
//! box since a time, forgotten with the box. Bounded apart from the log (a
//! box flooding DNS queries does not push its POSTs out of the ledger):
//! past [`MAX_EFFECTS`] the oldest of the account holding the most go first
//! (see [`super::log_shares`]).

use super::log_shares::{self, Log};
use super::sql::{args, Exec};
use super::{Store, StoreError};
use crate::effects::Effect;
use crate::ids::BoxId;

/// Most effects kept (all accounts together).
pub const MAX_EFFECTS: i64 = 1_000_000;

/// Most effects one read returns (the newest).
pub const MAX_READ: usize = 10_000;

/// Records `effect` of box `id`, of `account`.
pub(crate) fn insert(tx: &mut dyn Exec, id: &BoxId, account: &str, effect: &Effect) -> Result<(), StoreError> {
    let text = serde_json::to_string(effect).map_err(|_| StoreError::Corrupt(id.to_string()))?;
    tx.execute(
        "INSERT INTO effects (box_id, account, at_ms, effect) VALUES (?1, ?2, ?3, ?4)",
        &args![id.as_str(), account, effect.at_ms, text],
    )?;
    Ok(())
}

impl Store {
    /// A box's effects since `since_ms`, oldest first (at most [`MAX_READ`], the newest).
    pub fn effects_since(&self, id: &BoxId, since_ms: u64) -> Result<Vec<Effect>, StoreError> {
        let sql =
            "SELECT effect FROM effects WHERE box_id = ?1 AND at_ms >= ?2 AND at_ms < ?4 ORDER BY rowid DESC LIMIT ?3";
        self.newest_json(sql, id, (since_ms, None), MAX_READ)
    }

    /// Forgets a removed box's effects.
    pub fn forget_effects(&self, id: &BoxId) -> Result<(), StoreError> {
        self.transaction(|tx| log_shares::forget_box(tx, Log::Effects, id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::{LogEntry, LogKind, LogVerdict};
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(effects_come_from_the_log_per_box);

    fn effects_come_from_the_log_per_box(db: &TestDb) {
        let store = db.open();
        let entry = |at_ms, kind, method: Option<&str>, opaque| LogEntry {
            method: method.map(str::to_string),
            target: Some("/x".into()),
            sent: 10,
            received: 20,
            status: Some(201),
            opaque,
            ..LogEntry::new(at_ms, kind, "api.example", 443, LogVerdict::Allow)
        };
        let (a, b) = (BoxId::random(), BoxId::random());
        store
            .append_egress(&[
                (a.clone(), entry(1, LogKind::Http, Some("GET"), false)),
                (a.clone(), entry(2, LogKind::Http, Some("POST"), false)),
                (b.clone(), entry(3, LogKind::Http, Some("DELETE"), false)),
                (a.clone(), entry(4, LogKind::Tcp, None, true)),
                (a.clone(), entry(5, LogKind::Dns, Some("A"), false)),
            ])
            .unwrap();
        let times = |got: Vec<Effect>| got.into_iter().map(|e| e.at_ms).collect::<Vec<_>>();
        assert_eq!(times(store.effects_since(&a, 0).unwrap()), [2, 4]);
        assert_eq!(times(store.effects_since(&a, 3).unwrap()), [4]);
        assert_eq!(store.effects_since(&b, 0).unwrap()[0].method.as_deref(), Some("DELETE"));
        // The log's own bound does not reach them; forgetting the box does.
        store.execute("DELETE FROM egress_log", &[]).unwrap();
        assert_eq!(times(store.effects_since(&a, 0).unwrap()), [2, 4]);
        store.forget_effects(&a).unwrap();
        assert!(store.effects_since(&a, 0).unwrap().is_empty());
        assert_eq!(times(store.effects_since(&b, 0).unwrap()), [3]);
    }
}
