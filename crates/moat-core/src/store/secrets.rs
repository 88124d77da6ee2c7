//! Secrets in the state store: each sealed value with what it is for, the
//! boxes it is granted to (each with its own placeholder), its limits, and
//! what it was used for, per box.

use rusqlite::{params, OptionalExtension};

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
        let added = self.conn().execute(
            "INSERT OR IGNORE INTO secrets (account, name, host, header, format, env, sealed) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![account.0, spec.name.as_str(), spec.host.as_str(), spec.header, spec.format, spec.env, sealed],
        )?;
        Ok(added == 1)
    }

    fn secrets_where(&self, clause: &str, args: &[&dyn rusqlite::ToSql]) -> Result<Vec<StoredSecret>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT id, account, name, host, header, format, env, sealed, killed FROM secrets WHERE {clause} ORDER BY name"
        ))?;
        let rows = stmt.query_map(args, |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                (r.get::<_, String>(4)?, r.get::<_, String>(5)?, r.get::<_, String>(6)?),
                r.get::<_, Vec<u8>>(7)?,
                r.get::<_, bool>(8)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, account, name, host, (header, format, env), sealed, killed) = row?;
            let corrupt = || StoreError::Corrupt(format!("secret {id}"));
            let spec = SecretSpec {
                name: Name::new(&name).map_err(|_| corrupt())?,
                host: HostName::parse(&host).map_err(|_| corrupt())?,
                header,
                format,
                env,
            };
            out.push(StoredSecret { id, account: AccountId(account), spec, sealed, killed });
        }
        Ok(out)
    }

    /// The account's secrets, by name.
    pub fn secrets(&self, account: &AccountId) -> Result<Vec<StoredSecret>, StoreError> {
        self.secrets_where("account = ?1", &[&account.0])
    }

    /// The account's secret `name`.
    pub fn secret(&self, account: &AccountId, name: &Name) -> Result<Option<StoredSecret>, StoreError> {
        Ok(self.secrets_where("account = ?1 AND name = ?2", &[&account.0, &name.as_str()])?.pop())
    }

    /// The secrets granted to a box, with its placeholder for each.
    pub fn secrets_of_box(&self, id: &BoxId) -> Result<Vec<(StoredSecret, String)>, StoreError> {
        let grants: Vec<(i64, String)> = {
            let conn = self.conn();
            let mut stmt = conn.prepare("SELECT secret_id, placeholder FROM secret_grants WHERE box_id = ?1")?;
            let rows = stmt.query_map(params![id.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<Result<_, _>>()?
        };
        let mut out = Vec::new();
        for (secret_id, placeholder) in grants {
            if let Some(secret) = self.secrets_where("id = ?1", &[&secret_id])?.pop() {
                out.push((secret, placeholder));
            }
        }
        Ok(out)
    }

    /// The boxes a secret is granted to.
    pub fn grants_of(&self, secret_id: i64) -> Result<Vec<BoxId>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT box_id FROM secret_grants WHERE secret_id = ?1 ORDER BY box_id")?;
        let rows = stmt.query_map(params![secret_id], |r| r.get::<_, String>(0))?;
        let ids: Vec<String> = rows.collect::<Result<_, _>>()?;
        Ok(ids.iter().filter_map(|id| BoxId::parse(id)).collect())
    }

    /// Grants a secret to a box with `placeholder` (false: it was already).
    pub fn grant(&self, secret_id: i64, box_id: &BoxId, placeholder: &str) -> Result<bool, StoreError> {
        let added = self.conn().execute(
            "INSERT OR IGNORE INTO secret_grants (secret_id, box_id, placeholder) VALUES (?1, ?2, ?3)",
            params![secret_id, box_id.as_str(), placeholder],
        )?;
        Ok(added == 1)
    }

    /// Revokes a secret from a box (false: it was not granted).
    pub fn revoke(&self, secret_id: i64, box_id: &BoxId) -> Result<bool, StoreError> {
        let removed = self.conn().execute(
            "DELETE FROM secret_grants WHERE secret_id = ?1 AND box_id = ?2",
            params![secret_id, box_id.as_str()],
        )?;
        Ok(removed == 1)
    }

    /// Removes a box's grants (it is gone).
    pub fn revoke_all_of_box(&self, box_id: &BoxId) -> Result<(), StoreError> {
        self.conn().execute("DELETE FROM secret_grants WHERE box_id = ?1", params![box_id.as_str()])?;
        Ok(())
    }

    /// Stops a secret for good.
    pub fn kill_secret(&self, secret_id: i64) -> Result<(), StoreError> {
        self.conn().execute("UPDATE secrets SET killed = 1 WHERE id = ?1", params![secret_id])?;
        Ok(())
    }

    /// Deletes a secret, its grants and limits (its use stays on record).
    pub fn delete_secret(&self, secret_id: i64) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        for table in ["secret_grants", "secret_limits"] {
            tx.execute(&format!("DELETE FROM {table} WHERE secret_id = ?1"), params![secret_id])?;
        }
        tx.execute("DELETE FROM secrets WHERE id = ?1", params![secret_id])?;
        tx.commit()?;
        Ok(())
    }

    /// Sets a limit on one box's use (`box_id`), or on all together (`None`).
    pub fn set_secret_limit(&self, secret_id: i64, box_id: Option<&BoxId>, limit: &Limit) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT INTO secret_limits (secret_id, box_id, kind, amount, per_secs) VALUES (?1, ?2, ?3, ?4, ?5) \
             ON CONFLICT (secret_id, box_id, kind) DO UPDATE SET amount = excluded.amount, per_secs = excluded.per_secs",
            params![
                secret_id,
                box_id.map_or("", |b| b.as_str()),
                limit.kind.as_str(),
                limit.amount as i64,
                limit.per_secs.map(|p| p as i64)
            ],
        )?;
        Ok(())
    }

    /// A secret's limits: (box, limit), `None` for all boxes together.
    pub fn secret_limits(&self, secret_id: i64) -> Result<Vec<(Option<BoxId>, Limit)>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT box_id, kind, amount, per_secs FROM secret_limits WHERE secret_id = ?1 ORDER BY box_id, kind",
        )?;
        let rows = stmt.query_map(params![secret_id], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?, r.get::<_, Option<i64>>(3)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (box_id, kind, amount, per) = row?;
            let Some(kind) = kind_from(&kind) else { continue };
            let limit = Limit { kind, amount: amount.max(0) as u64, per_secs: per.map(|p| p.max(1) as u64) };
            out.push((BoxId::parse(&box_id), limit));
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
        self.conn().execute(
            "INSERT INTO secret_usage (secret_id, box_id, box_name, requests, tokens, bytes) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (secret_id, box_id) DO UPDATE SET \
             requests = requests + excluded.requests, tokens = tokens + excluded.tokens, \
             bytes = bytes + excluded.bytes, box_name = excluded.box_name",
            params![
                secret_id,
                box_id.as_str(),
                box_name.as_str(),
                used.requests as i64,
                used.tokens as i64,
                used.bytes as i64
            ],
        )?;
        Ok(())
    }

    /// What a secret was used for, per box: (box id, box name, use).
    pub fn secret_uses(&self, secret_id: i64) -> Result<Vec<(BoxId, String, SecretUse)>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT box_id, box_name, requests, tokens, bytes FROM secret_usage WHERE secret_id = ?1 ORDER BY box_name",
        )?;
        let rows = stmt.query_map(params![secret_id], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                SecretUse {
                    requests: r.get::<_, i64>(2)?.max(0) as u64,
                    tokens: r.get::<_, i64>(3)?.max(0) as u64,
                    bytes: r.get::<_, i64>(4)?.max(0) as u64,
                },
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, name, used) = row?;
            if let Some(id) = BoxId::parse(&id) {
                out.push((id, name, used));
            }
        }
        Ok(out)
    }

    /// The secret an account has by this name, its number only.
    pub fn secret_id(&self, account: &AccountId, name: &str) -> Result<Option<i64>, StoreError> {
        Ok(self
            .conn()
            .query_row("SELECT id FROM secrets WHERE account = ?1 AND name = ?2", params![account.0, name], |r| {
                r.get(0)
            })
            .optional()?)
    }
}
