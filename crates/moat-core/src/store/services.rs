//! Boxes' services (`new --run`): the program each box's agent keeps
//! running, told to the agent whenever the box boots. A copy has its
//! parent's; a removed box's is forgotten with it.

use super::sql::{args, Exec};
use super::{Store, StoreError};
use crate::ids::BoxId;

/// The table (schema version 12).
pub(crate) const SERVICES: &str = "
CREATE TABLE IF NOT EXISTS box_services (
    box_id  TEXT PRIMARY KEY,
    argv    TEXT NOT NULL
);
";

/// Gives box `to` the service of box `from`, if it has one (inside the
/// copy's insertion).
pub(crate) fn copy(tx: &mut dyn Exec, from: &BoxId, to: &BoxId) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO box_services (box_id, argv) SELECT ?2, argv FROM box_services WHERE box_id = ?1",
        &args![from.as_str(), to.as_str()],
    )?;
    Ok(())
}

/// Forgets a removed box's service (inside its deletion's transaction).
pub(crate) fn forget(tx: &mut dyn Exec, id: &BoxId) -> Result<(), StoreError> {
    tx.execute("DELETE FROM box_services WHERE box_id = ?1", &args![id.as_str()])?;
    Ok(())
}

impl Store {
    /// Sets box `id`'s service (`None`: it has none).
    pub fn set_service(&self, id: &BoxId, argv: Option<&[String]>) -> Result<(), StoreError> {
        let Some(argv) = argv else {
            self.execute("DELETE FROM box_services WHERE box_id = ?1", &args![id.as_str()])?;
            return Ok(());
        };
        let text = serde_json::to_string(argv).map_err(|_| StoreError::Corrupt(id.to_string()))?;
        self.execute(
            "INSERT INTO box_services (box_id, argv) VALUES (?1, ?2) \
             ON CONFLICT (box_id) DO UPDATE SET argv = excluded.argv",
            &args![id.as_str(), text],
        )?;
        Ok(())
    }

    /// Box `id`'s service, if it has one.
    pub fn service(&self, id: &BoxId) -> Result<Option<Vec<String>>, StoreError> {
        let row = self.query_row("SELECT argv FROM box_services WHERE box_id = ?1", &args![id.as_str()])?;
        match row.map(|r| r.get::<String>(0)).transpose()? {
            None => Ok(None),
            Some(text) => serde_json::from_str(&text).map(Some).map_err(|_| StoreError::Corrupt(id.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::BackendKind;
    use crate::ids::{AccountId, Name};
    use crate::limits::Limits;
    use crate::policy::Policy;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(a_service_is_kept_copied_and_forgotten);

    fn a_service_is_kept_copied_and_forgotten(db: &TestDb) {
        let store = db.open();
        let alice = AccountId("SHA256:alice".into());
        let made = (&Name::new("oci-x").unwrap(), Limits::default(), BackendKind::Ns);
        let web = store.insert_new(&alice, &Name::new("web").unwrap(), made, 1, &Policy::default()).unwrap();
        assert_eq!(store.service(&web.id).unwrap(), None);
        let argv: Vec<String> = vec!["python3".into(), "-m".into(), "http.server".into(), "a b".into()];
        store.set_service(&web.id, Some(&argv)).unwrap();
        assert_eq!(store.service(&web.id).unwrap(), Some(argv.clone()));
        let copy = store.insert_dup(&web, &Name::new("web2").unwrap(), 2).unwrap();
        assert_eq!(store.service(&copy.id).unwrap(), Some(argv.clone()), "a copy runs its parent's service");
        store.set_service(&web.id, Some(&["sleep".to_string()])).unwrap();
        assert_eq!(store.service(&web.id).unwrap(), Some(vec!["sleep".to_string()]));
        assert_eq!(store.service(&copy.id).unwrap(), Some(argv), "the copy's is its own");
        store.delete(&web.id).unwrap();
        assert_eq!(store.service(&web.id).unwrap(), None);
        store.set_service(&copy.id, None).unwrap();
        assert_eq!(store.service(&copy.id).unwrap(), None);
    }
}
