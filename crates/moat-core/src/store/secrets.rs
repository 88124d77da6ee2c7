//! Secrets in the state store: each sealed value with what it is for, the
//! boxes it is granted to (each with its own placeholder), its limits, and
//! what it was used for, per box.

use super::sql::{args, Value};
use super::{Store, StoreError};
use crate::ids::{AccountId, BoxId, Name};
use crate::policy::HostName;
use crate::secrets::{Limit, LimitKind, SecretSpec, SecretUse};

/// A stored secret, sealed.
#[derive(Debug, Clone)]
pub struct StoredSecret {
    /// Its number.
    pub id: i64,
    /// Whose.
    pub account: AccountId,
    /// What it is.
    pub spec: SecretSpec,
    /// Its value, sealed.
    pub sealed: Vec<u8>,
    /// Stopped by `secret kill`.
    pub killed: bool,
}

fn kind_from(text: &str) -> Option<LimitKind> {
    [LimitKind::Requests, LimitKind::Tokens, LimitKind::Bytes].into_iter().find(|k| k.as_str() == text)
}

impl Store {
    /// Adds a secret; an account's names are unique.
    pub fn insert_secret(&self, account: &AccountId, spec: &SecretSpec, sealed: &[u8]) -> Result<bool, StoreError> {
        let added = self.execute(
            "INSERT INTO secrets (account, name, host, header, format, env, sealed) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT DO NOTHING",
            &args![&account.0, spec.name.as_str(), spec.host.as_str(), &spec.header, &spec.format, &spec.env, sealed],
        )?;
        Ok(added == 1)
    }

    fn secrets_where(&self, clause: &str, args: &[Value]) -> Result<Vec<StoredSecret>, StoreError> {
        let rows = self.query(
            &format!(
                "SELECT id, account, name, host, header, format, env, sealed, killed FROM secrets \
                 WHERE {clause} ORDER BY name"
            ),
            args,
        )?;
        let mut out = Vec::new();
        for r in rows {
            let id: i64 = r.get(0)?;
            let corrupt = || StoreError::Corrupt(format!("secret {id}"));
            let spec = SecretSpec {
                name: Name::new(&r.get::<String>(2)?).map_err(|_| corrupt())?,
                host: HostName::parse(&r.get::<String>(3)?).map_err(|_| corrupt())?,
                header: r.get(4)?,
                format: r.get(5)?,
                env: r.get(6)?,
            };
            out.push(StoredSecret { id, account: AccountId(r.get(1)?), spec, sealed: r.get(7)?, killed: r.get(8)? });
        }
        Ok(out)
    }

    /// The account's secrets, by name.
    pub fn secrets(&self, account: &AccountId) -> Result<Vec<StoredSecret>, StoreError> {
        self.secrets_where("account = ?1", &args![&account.0])
    }

    /// The account's secret `name`.
    pub fn secret(&self, account: &AccountId, name: &Name) -> Result<Option<StoredSecret>, StoreError> {
        Ok(self.secrets_where("account = ?1 AND name = ?2", &args![&account.0, name.as_str()])?.pop())
    }

    /// The secrets granted to a box, with its placeholder for each.
    pub fn secrets_of_box(&self, id: &BoxId) -> Result<Vec<(StoredSecret, String)>, StoreError> {
        let grants =
            self.query("SELECT secret_id, placeholder FROM secret_grants WHERE box_id = ?1", &args![id.as_str()])?;
        let mut out = Vec::new();
        for grant in grants {
            let (secret_id, placeholder): (i64, String) = (grant.get(0)?, grant.get(1)?);
            if let Some(secret) = self.secrets_where("id = ?1", &args![secret_id])?.pop() {
                out.push((secret, placeholder));
            }
        }
        Ok(out)
    }

    /// The boxes a secret is granted to.
    pub fn grants_of(&self, secret_id: i64) -> Result<Vec<BoxId>, StoreError> {
        let rows =
            self.query("SELECT box_id FROM secret_grants WHERE secret_id = ?1 ORDER BY box_id", &args![secret_id])?;
        let ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect::<Result<_, _>>()?;
        Ok(ids.iter().filter_map(|id| BoxId::parse(id)).collect())
    }

    /// Grants a secret to a box with `placeholder` (false: it was already).
    pub fn grant(&self, secret_id: i64, box_id: &BoxId, placeholder: &str) -> Result<bool, StoreError> {
        let added = self.execute(
            "INSERT INTO secret_grants (secret_id, box_id, placeholder) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
            &args![secret_id, box_id.as_str(), placeholder],
        )?;
        Ok(added == 1)
    }

    /// Revokes a secret from a box (false: it was not granted).
    pub fn revoke(&self, secret_id: i64, box_id: &BoxId) -> Result<bool, StoreError> {
        let removed = self.execute(
            "DELETE FROM secret_grants WHERE secret_id = ?1 AND box_id = ?2",
            &args![secret_id, box_id.as_str()],
        )?;
        Ok(removed == 1)
    }

    /// Removes a box's grants (it is gone).
    pub fn revoke_all_of_box(&self, box_id: &BoxId) -> Result<(), StoreError> {
        self.execute("DELETE FROM secret_grants WHERE box_id = ?1", &args![box_id.as_str()])?;
        Ok(())
    }

    /// Stops a secret for good.
    pub fn kill_secret(&self, secret_id: i64) -> Result<(), StoreError> {
        self.execute("UPDATE secrets SET killed = 1 WHERE id = ?1", &args![secret_id])?;
        Ok(())
    }

    /// Deletes a secret, its grants and limits (its use stays on record).
    pub fn delete_secret(&self, secret_id: i64) -> Result<(), StoreError> {
        let id = args![secret_id];
        self.transaction(|tx| {
            tx.execute("DELETE FROM secret_grants WHERE secret_id = ?1", &id)?;
            tx.execute("DELETE FROM secret_limits WHERE secret_id = ?1", &id)?;
            tx.execute("DELETE FROM secrets WHERE id = ?1", &id)?;
            Ok(())
        })
    }

    /// Sets a limit on one box's use (`box_id`), or on all together (`None`).
    pub fn set_secret_limit(&self, secret_id: i64, box_id: Option<&BoxId>, limit: &Limit) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO secret_limits (secret_id, box_id, kind, amount, per_secs) VALUES (?1, ?2, ?3, ?4, ?5) \
             ON CONFLICT (secret_id, box_id, kind) DO UPDATE SET amount = excluded.amount, per_secs = excluded.per_secs",
            &args![secret_id, box_id.map_or("", |b| b.as_str()), limit.kind.as_str(), limit.amount, limit.per_secs],
        )?;
        Ok(())
    }

    /// A secret's limits: (box, limit), `None` for all boxes together.
    pub fn secret_limits(&self, secret_id: i64) -> Result<Vec<(Option<BoxId>, Limit)>, StoreError> {
        let rows = self.query(
            "SELECT box_id, kind, amount, per_secs FROM secret_limits WHERE secret_id = ?1 ORDER BY box_id, kind",
            &args![secret_id],
        )?;
        let mut out = Vec::new();
        for r in rows {
            let Some(kind) = kind_from(&r.get::<String>(1)?) else { continue };
            let (amount, per): (i64, Option<i64>) = (r.get(2)?, r.get(3)?);
            let limit = Limit { kind, amount: amount.max(0) as u64, per_secs: per.map(|p| p.max(1) as u64) };
            out.push((BoxId::parse(&r.get::<String>(0)?), limit));
        }
        Ok(out)
    }

    /// Adds to what a box used a secret for.
    pub fn add_secret_use(
        &self,
        secret_id: i64,
        box_id: &BoxId,
        box_name: &Name,
        used: SecretUse,
    ) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO secret_usage (secret_id, box_id, box_name, requests, tokens, bytes) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (secret_id, box_id) DO UPDATE SET \
             requests = secret_usage.requests + excluded.requests, tokens = secret_usage.tokens + excluded.tokens, \
             bytes = secret_usage.bytes + excluded.bytes, box_name = excluded.box_name",
            &args![secret_id, box_id.as_str(), box_name.as_str(), used.requests, used.tokens, used.bytes],
        )?;
        Ok(())
    }

    /// What a secret was used for, per box: (box id, box name, use).
    pub fn secret_uses(&self, secret_id: i64) -> Result<Vec<(BoxId, String, SecretUse)>, StoreError> {
        let rows = self.query(
            "SELECT box_id, box_name, requests, tokens, bytes FROM secret_usage WHERE secret_id = ?1 ORDER BY box_name",
            &args![secret_id],
        )?;
        let mut out = Vec::new();
        for r in rows {
            let counts: (i64, i64, i64) = (r.get(2)?, r.get(3)?, r.get(4)?);
            let used = SecretUse {
                requests: counts.0.max(0) as u64,
                tokens: counts.1.max(0) as u64,
                bytes: counts.2.max(0) as u64,
            };
            if let Some(id) = BoxId::parse(&r.get::<String>(0)?) {
                out.push((id, r.get(1)?, used));
            }
        }
        Ok(out)
    }

    /// The secret an account has by this name, its number only.
    pub fn secret_id(&self, account: &AccountId, name: &str) -> Result<Option<i64>, StoreError> {
        let row =
            self.query_row("SELECT id FROM secrets WHERE account = ?1 AND name = ?2", &args![&account.0, name])?;
        row.map(|r| r.get(0)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(secrets_grants_limits_and_use_round_trip);

    fn secrets_grants_limits_and_use_round_trip(db: &TestDb) {
        let store = db.open();
        let a = AccountId("a".into());
        let spec = SecretSpec {
            name: Name::new("openai").unwrap(),
            host: HostName::parse("api.openai.com").unwrap(),
            header: "Authorization".into(),
            format: "Bearer {}".into(),
            env: "OPENAI_API_KEY".into(),
        };
        assert!(store.insert_secret(&a, &spec, b"\x00sealed\xff").unwrap());
        assert!(!store.insert_secret(&a, &spec, b"other").unwrap(), "names are unique per account");
        assert!(store.insert_secret(&AccountId("b".into()), &spec, b"b's").unwrap());
        let got = store.secret(&a, &spec.name).unwrap().unwrap();
        assert_eq!((&got.spec, got.sealed.as_slice(), got.killed), (&spec, &b"\x00sealed\xff"[..], false));
        assert_eq!(store.secret_id(&a, "openai").unwrap(), Some(got.id));
        assert_eq!(store.secrets(&a).unwrap().len(), 1);

        let (web, db_box) = (BoxId::random(), BoxId::random());
        assert!(store.grant(got.id, &web, "ph-web").unwrap());
        assert!(!store.grant(got.id, &web, "ph-again").unwrap(), "granted already");
        assert!(store.grant(got.id, &db_box, "ph-db").unwrap());
        let mut granted = vec![web.clone(), db_box.clone()];
        granted.sort_by(|x, y| x.as_str().cmp(y.as_str()));
        assert_eq!(store.grants_of(got.id).unwrap(), granted);
        let of_web = store.secrets_of_box(&web).unwrap();
        assert_eq!((of_web.len(), of_web[0].1.as_str()), (1, "ph-web"));
        assert!(store.revoke(got.id, &db_box).unwrap());
        assert!(!store.revoke(got.id, &db_box).unwrap());

        let per_box = Limit::new(LimitKind::Requests, 10, Some(60)).unwrap();
        store.set_secret_limit(got.id, Some(&web), &per_box).unwrap();
        let all = Limit::new(LimitKind::Tokens, 1000, None).unwrap();
        store.set_secret_limit(got.id, None, &Limit { amount: 5, ..all }).unwrap();
        store.set_secret_limit(got.id, None, &all).unwrap();
        assert_eq!(store.secret_limits(got.id).unwrap(), vec![(None, all), (Some(web.clone()), per_box)]);

        let name = Name::new("web").unwrap();
        let used = SecretUse { requests: 1, tokens: 20, bytes: 300 };
        store.add_secret_use(got.id, &web, &name, used).unwrap();
        store.add_secret_use(got.id, &web, &name, used).unwrap();
        let twice = SecretUse { requests: 2, tokens: 40, bytes: 600 };
        assert_eq!(store.secret_uses(got.id).unwrap(), vec![(web.clone(), "web".to_string(), twice)]);

        store.kill_secret(got.id).unwrap();
        assert!(store.secret(&a, &spec.name).unwrap().unwrap().killed);
        store.delete_secret(got.id).unwrap();
        assert!(store.secret(&a, &spec.name).unwrap().is_none());
        assert!(store.grants_of(got.id).unwrap().is_empty() && store.secret_limits(got.id).unwrap().is_empty());
        assert_eq!(store.secret_uses(got.id).unwrap().len(), 1, "its use stays on record");
        let again = store.insert_secret(&a, &spec, b"new").and_then(|_| store.secret_id(&a, "openai"));
        assert!(again.unwrap().unwrap() > got.id, "a removed secret's number is never reused");
    }
}
