//! Secrets, the manager's half: kept sealed in the store, granted to boxes
//! (each grant a placeholder of its own in the box's `/etc/environment`, and
//! the bound host allowed by its policy), limited, killed; handed opened to
//! whoever serves the boxes' egress, for the boxes they are granted to only.

use super::{BoxManager, ManagerError};
use crate::ids::{AccountId, BoxId, Name};
use crate::policy::Rule;
use crate::record::BoxRecord;
use crate::secrets::{
    new_placeholder, BoxSecret, Limit, ScopedLimit, Sealer, SecretInfo, SecretSpec, SecretUse, SecretValue,
};
use crate::store::secrets::StoredSecret;

impl BoxManager {
    /// Sets the key secrets are sealed with (once, at start); without one,
    /// this server keeps no secrets.
    pub fn set_sealer(&self, sealer: Sealer) {
        let _ = self.sealer.set(sealer);
    }

    pub(super) fn sealer(&self) -> Result<&Sealer, ManagerError> {
        self.sealer.get().ok_or(ManagerError::NoSecretKey)
    }

    fn stored_secret(&self, account: &AccountId, name: &Name) -> Result<StoredSecret, ManagerError> {
        self.db(|s| s.secret(account, name))?.ok_or_else(|| ManagerError::NoSuchSecret(name.clone()))
    }

    /// Adds a secret.
    pub fn add_secret(&self, account: &AccountId, spec: SecretSpec, value: &SecretValue) -> Result<(), ManagerError> {
        spec.validate()?;
        let sealed = self.sealer()?.seal(account, &spec.name, value);
        if !self.db(|s| s.insert_secret(account, &spec, &sealed))? {
            return Err(ManagerError::SecretExists(spec.name));
        }
        tracing::info!(secret = %spec.name, host = %spec.host, "secret added");
        Ok(())
    }

    /// The account's secrets (never their values).
    pub fn secrets(&self, account: &AccountId) -> Result<Vec<SecretInfo>, ManagerError> {
        let mut out = Vec::new();
        for secret in self.db(|s| s.secrets(account))? {
            let name_of = |id: &BoxId| self.db(|s| s.get_by_id(id)).ok().flatten().map(|r| r.name);
            let boxes = self.db(|s| s.grants_of(secret.id))?.iter().filter_map(name_of).collect();
            let limits = self
                .db(|s| s.secret_limits(secret.id))?
                .into_iter()
                .map(|(id, limit)| ScopedLimit { box_name: id.as_ref().and_then(name_of), limit })
                .collect();
            let used = self.db(|s| s.secret_uses(secret.id))?.into_iter().map(|(_, name, u)| (name, u)).collect();
            out.push(SecretInfo { spec: secret.spec, killed: secret.killed, boxes, limits, used });
        }
        Ok(out)
    }

    /// Removes a secret: revoked from every box first, its use kept on record.
    pub async fn remove_secret(&self, account: &AccountId, name: &Name) -> Result<(), ManagerError> {
        let secret = self.stored_secret(account, name)?;
        for id in self.db(|s| s.grants_of(secret.id))? {
            if let Some(rec) = self.db(|s| s.get_by_id(&id))? {
                self.revoke_from(&secret, &rec).await?;
            }
        }
        self.db(|s| s.delete_secret(secret.id))?;
        Ok(())
    }

    /// Grants a secret to a box: a placeholder of its own in its environment,
    /// and the bound host allowed (HTTPS) by its policy.
    pub async fn grant_secret(&self, account: &AccountId, name: &Name, box_name: &Name) -> Result<(), ManagerError> {
        let secret = self.stored_secret(account, name)?;
        let host = secret.spec.host.clone();
        // One secret per header of a host, and per variable, in a box: two
        // would overwrite each other.
        let rec = self.get(account, box_name)?;
        for (other, _) in self.db(|s| s.secrets_of_box(&rec.id))? {
            let (a, b) = (&other.spec, &secret.spec);
            let same_header = a.host == b.host && crate::secrets::same_header(&a.header, &b.header);
            if other.id != secret.id && (same_header || a.env == b.env) {
                return Err(ManagerError::SecretClash { box_name: rec.name, other: a.name.clone() });
            }
        }
        self.change_policy(account, box_name, |p| -> Result<(), ManagerError> {
            if !matches!(p.decide(&host, 443), crate::policy::Verdict::Allow(_) | crate::policy::Verdict::PerRequest) {
                p.allow(Rule::exact(host.clone(), 443));
            }
            Ok(())
        })
        .await??;
        let (rec, _guard) = self.locked(account, box_name).await?;
        let placeholder = new_placeholder();
        if self.db(|s| s.grant(secret.id, &rec.id, &placeholder))? {
            let vars = vec![(secret.spec.env.clone(), Some(placeholder))];
            let r = rec.clone();
            if let Err(e) = self.blocking(move |b| b.set_environment(&r, &vars)).await? {
                self.db(|s| s.revoke(secret.id, &rec.id))?;
                return Err(e.into());
            }
        }
        self.tell_secrets(&rec.id);
        Ok(())
    }

    /// Revokes a secret from a box.
    pub async fn revoke_secret(&self, account: &AccountId, name: &Name, box_name: &Name) -> Result<(), ManagerError> {
        let secret = self.stored_secret(account, name)?;
        let rec = self.get(account, box_name)?;
        self.revoke_from(&secret, &rec).await
    }

    async fn revoke_from(&self, secret: &StoredSecret, rec: &BoxRecord) -> Result<(), ManagerError> {
        let _guard = self.lock_for(&rec.id).lock_owned().await;
        if self.db(|s| s.revoke(secret.id, &rec.id))? {
            // The gateway first: the value stops before the placeholder goes.
            self.tell_secrets(&rec.id);
            let vars = vec![(secret.spec.env.clone(), None)];
            let r = rec.clone();
            self.blocking(move |b| b.set_environment(&r, &vars)).await??;
        }
        Ok(())
    }

    /// Limits a secret's use by one box, or by all its boxes together.
    pub async fn limit_secret(
        &self,
        account: &AccountId,
        name: &Name,
        box_name: Option<&Name>,
        limit: Limit,
    ) -> Result<(), ManagerError> {
        let secret = self.stored_secret(account, name)?;
        let box_id = box_name.map(|n| self.get(account, n)).transpose()?.map(|r| r.id);
        self.db(|s| s.set_secret_limit(secret.id, box_id.as_ref(), &limit))?;
        self.tell_secret_boxes(secret.id)
    }

    /// Stops every use of a secret at once, open connections included.
    pub async fn kill_secret(&self, account: &AccountId, name: &Name) -> Result<(), ManagerError> {
        let secret = self.stored_secret(account, name)?;
        self.db(|s| s.kill_secret(secret.id))?;
        tracing::warn!(secret = %name, "secret killed");
        self.tell_secret_boxes(secret.id)
    }

    fn tell_secret_boxes(&self, secret_id: i64) -> Result<(), ManagerError> {
        for id in self.db(|s| s.grants_of(secret_id))? {
            self.tell_secrets(&id);
        }
        Ok(())
    }

    /// Tells whoever serves egress the secrets box `id` has now.
    pub(super) fn tell_secrets(&self, id: &BoxId) {
        if self.network.get().is_none() {
            return;
        }
        let secrets = self.box_secrets(id);
        self.tell_network(|hooks| hooks.secrets_changed(id, &secrets));
    }

    /// Box `id`'s secrets, opened, with their limits and use so far. A secret
    /// that does not open is left out (and said so).
    pub(super) fn box_secrets(&self, id: &BoxId) -> Vec<BoxSecret> {
        let Ok(sealer) = self.sealer() else { return Vec::new() };
        let granted = match self.db(|s| s.secrets_of_box(id)) {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(box_id = %id, error = %e, "cannot read the box's secrets");
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for (secret, placeholder) in granted {
            let value = match sealer.open(&secret.account, &secret.spec.name, &secret.sealed) {
                Ok(v) => v,
                Err(e) => {
                    tracing::error!(secret = %secret.spec.name, error = %e, "secret left out");
                    continue;
                }
            };
            let limits = self.db(|s| s.secret_limits(secret.id)).unwrap_or_default();
            let uses = self.db(|s| s.secret_uses(secret.id)).unwrap_or_default();
            let mut used_by_all = SecretUse::default();
            let mut used_by_box = SecretUse::default();
            for (box_id, _, u) in &uses {
                used_by_all.requests += u.requests;
                used_by_all.tokens += u.tokens;
                used_by_all.bytes += u.bytes;
                if box_id == id {
                    used_by_box = *u;
                }
            }
            out.push(BoxSecret {
                id: secret.id,
                name: secret.spec.name.to_string(),
                host: secret.spec.host,
                header: secret.spec.header,
                format: secret.spec.format,
                placeholder,
                value,
                killed: secret.killed,
                shared_limits: limits.iter().filter(|(b, _)| b.is_none()).map(|(_, l)| *l).collect(),
                own_limits: limits.iter().filter(|(b, _)| b.as_ref() == Some(id)).map(|(_, l)| *l).collect(),
                used_by_all,
                used_by_box,
            });
        }
        out
    }

    /// New placeholders for a duplicate of `src` (as `dst`), stored: the
    /// variables to write into the duplicate's environment.
    pub(super) fn regrant_for_dup(
        &self,
        src: &BoxId,
        dst: &BoxId,
    ) -> Result<Vec<(String, Option<String>)>, ManagerError> {
        let mut vars = Vec::new();
        for (secret, _) in self.db(|s| s.secrets_of_box(src))? {
            let placeholder = new_placeholder();
            self.db(|s| s.grant(secret.id, dst, &placeholder))?;
            vars.push((secret.spec.env, Some(placeholder)));
        }
        Ok(vars)
    }

    /// The variables the box's granted secrets put in its environment (their
    /// placeholders).
    pub(super) fn secret_environment(&self, id: &BoxId) -> Result<Vec<(String, Option<String>)>, ManagerError> {
        let granted = self.db(|s| s.secrets_of_box(id))?;
        Ok(granted.into_iter().map(|(secret, placeholder)| (secret.spec.env, Some(placeholder))).collect())
    }

    /// Adds what the gateway reported a box used a secret for.
    pub(super) fn record_secret_use(&self, box_id: &BoxId, secret: &str, used: SecretUse) {
        let Ok(Some(rec)) = self.db(|s| s.get_by_id(box_id)) else { return };
        let Ok(Some(id)) = self.db(|s| s.secret_id(&rec.account, secret)) else { return };
        if let Err(e) = self.db(|s| s.add_secret_use(id, box_id, &rec.name, used)) {
            tracing::error!(error = %e, "cannot record a secret's use");
        }
    }
}
