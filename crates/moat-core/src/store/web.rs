//! Web URLs' records: which ports of a box are exposed (and whether without
//! sign-in), and which other accounts a box is shared with.

use super::sql::{args, Exec};
use super::{from_row, Store, StoreError, COLUMNS, FROM};
use crate::ids::{AccountId, BoxId, Name};
use crate::record::BoxRecord;
use crate::web::Owner;

/// The tables (schema version 4).
pub(crate) const WEB: &str = "
CREATE TABLE IF NOT EXISTS web_ports (
    box_id   TEXT NOT NULL,
    port     INTEGER NOT NULL,
    public   INTEGER NOT NULL,
    PRIMARY KEY (box_id, port)
);
-- Accounts (their key's fingerprint) a box's owner let in: its URLs and its ssh.
CREATE TABLE IF NOT EXISTS web_shares (
    box_id   TEXT NOT NULL,
    account  TEXT NOT NULL,
    PRIMARY KEY (box_id, account)
);
";

/// Forgets a removed box's rows (inside its deletion's transaction).
pub(crate) fn forget(tx: &mut dyn Exec, id: &BoxId) -> Result<(), StoreError> {
    tx.execute("DELETE FROM web_ports WHERE box_id = ?1", &args![id.as_str()])?;
    tx.execute("DELETE FROM web_shares WHERE box_id = ?1", &args![id.as_str()])?;
    Ok(())
}

impl Store {
    /// Exposes `port` of box `id` (public or not), or changes whether it is public.
    pub fn expose(&self, id: &BoxId, port: u16, public: bool) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO web_ports (box_id, port, public) VALUES (?1, ?2, ?3) \
             ON CONFLICT (box_id, port) DO UPDATE SET public = excluded.public",
            &args![id.as_str(), u32::from(port), public],
        )?;
        Ok(())
    }

    /// Stops exposing `port` of box `id`; whether it was.
    pub fn unexpose(&self, id: &BoxId, port: u16) -> Result<bool, StoreError> {
        Ok(self
            .execute("DELETE FROM web_ports WHERE box_id = ?1 AND port = ?2", &args![id.as_str(), u32::from(port)])?
            > 0)
    }

    /// Box `id`'s exposed ports: (port, public), by port.
    pub fn exposed(&self, id: &BoxId) -> Result<Vec<(u16, bool)>, StoreError> {
        let rows =
            self.query("SELECT port, public FROM web_ports WHERE box_id = ?1 ORDER BY port", &args![id.as_str()])?;
        let port = |r: &super::sql::Row| {
            let port: u32 = r.get(0)?;
            u16::try_from(port).map_err(|_| StoreError::Column(format!("web port {port}")))
        };
        rows.iter().map(|r| Ok((port(r)?, r.get(1)?))).collect()
    }

    /// Lets `account` reach box `id`.
    pub fn share(&self, id: &BoxId, account: &AccountId) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO web_shares (box_id, account) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
            &args![id.as_str(), &account.0],
        )?;
        Ok(())
    }

    /// Takes back `account`'s access to box `id`; whether it had it.
    pub fn unshare(&self, id: &BoxId, account: &AccountId) -> Result<bool, StoreError> {
        let sql = "DELETE FROM web_shares WHERE box_id = ?1 AND account = ?2";
        Ok(self.execute(sql, &args![id.as_str(), &account.0])? > 0)
    }

    /// The accounts box `id` is shared with.
    pub fn shares(&self, id: &BoxId) -> Result<Vec<AccountId>, StoreError> {
        let rows =
            self.query("SELECT account FROM web_shares WHERE box_id = ?1 ORDER BY account", &args![id.as_str()])?;
        rows.iter().map(|r| Ok(AccountId(r.get(0)?))).collect()
    }

    /// The boxes shared with `account`.
    pub fn shared_with(&self, account: &AccountId) -> Result<Vec<BoxRecord>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {FROM} JOIN web_shares s ON s.box_id = b.id WHERE s.account = ?1 \
             ORDER BY b.name, b.account"
        );
        self.query(&sql, &args![&account.0])?.iter().map(from_row).collect()
    }

    /// The box called `name` of the account whose slug is `owner` (slugs are
    /// not stored: every box of that name is a candidate, and one must match).
    ///
    /// A slug is 40 bits of the account's hash: a key made to match
    /// another's slug (2^40 tries) and a box of the same name would make one
    /// URL two boxes'. Such a URL names neither (rather than whichever
    /// account sorts first, which let the later one take the URL over).
    pub fn box_of_owner(&self, owner: &Owner, name: &Name) -> Result<Option<BoxRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM {FROM} WHERE b.name = ?1");
        let rows = self.query(&sql, &args![name.as_str()])?;
        let mut found = None;
        for row in rows {
            let rec = from_row(&row)?;
            if Owner::of(&rec.account) == *owner {
                if found.is_some() {
                    tracing::warn!(%owner, %name, "two accounts' boxes share one web address: it names neither");
                    return Ok(None);
                }
                found = Some(rec);
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use crate::ids::{AccountId, Name};
    use crate::store::testing::{on_both_engines, TestDb};
    use crate::web::Owner;
    use crate::{BackendKind, Limits};

    on_both_engines!(ports_and_shares_follow_their_box, a_slug_two_accounts_share_names_neither_box);

    fn ports_and_shares_follow_their_box(db: &TestDb) {
        let store = db.open();
        let (alice, bob) = (AccountId("SHA256:alice".into()), AccountId("SHA256:bob".into()));
        let web = Name::new("web").unwrap();
        let made = (&Name::new("debian").unwrap(), Limits::default(), BackendKind::Ns);
        let a = store.insert_new(&alice, &web, made, 1, &Default::default()).unwrap();
        let b = store.insert_new(&bob, &web, made, 1, &Default::default()).unwrap();
        store.expose(&a.id, 3000, false).unwrap();
        store.expose(&a.id, 3000, true).unwrap();
        store.expose(&a.id, 80, false).unwrap();
        assert_eq!(store.exposed(&a.id).unwrap(), [(80, false), (3000, true)]);
        assert!(store.exposed(&b.id).unwrap().is_empty());
        assert!(store.unexpose(&a.id, 80).unwrap());
        assert!(!store.unexpose(&a.id, 80).unwrap());
        // Two accounts' boxes of one name: the slug picks.
        assert_eq!(store.box_of_owner(&Owner::of(&alice), &web).unwrap().unwrap().id, a.id);
        assert_eq!(store.box_of_owner(&Owner::of(&bob), &web).unwrap().unwrap().id, b.id);
        let stranger = Owner::of(&AccountId("SHA256:carol".into()));
        assert!(store.box_of_owner(&stranger, &web).unwrap().is_none());
        store.share(&a.id, &bob).unwrap();
        store.share(&a.id, &bob).unwrap();
        assert_eq!(store.shares(&a.id).unwrap(), std::slice::from_ref(&bob));
        assert_eq!(store.shared_with(&bob).unwrap().len(), 1);
        store.delete(&a.id).unwrap();
        assert!(store.exposed(&a.id).unwrap().is_empty() && store.shares(&a.id).unwrap().is_empty());
        assert!(!store.unshare(&a.id, &bob).unwrap());
    }

    fn a_slug_two_accounts_share_names_neither_box(db: &TestDb) {
        let store = db.open();
        // Two account ids of one slug (found by a birthday search over the
        // slug's 40 bits: 1.7 million hashes).
        let (first, second) = (AccountId("SHA256:122835".into()), AccountId("SHA256:1732799".into()));
        assert_eq!(Owner::of(&first), Owner::of(&second));
        let web = Name::new("web").unwrap();
        let made = (&Name::new("debian").unwrap(), Limits::default(), BackendKind::Ns);
        let a = store.insert_new(&first, &web, made, 1, &Default::default()).unwrap();
        assert_eq!(store.box_of_owner(&Owner::of(&first), &web).unwrap().unwrap().id, a.id);
        store.insert_new(&second, &web, made, 1, &Default::default()).unwrap();
        assert!(store.box_of_owner(&Owner::of(&first), &web).unwrap().is_none());
    }
}
