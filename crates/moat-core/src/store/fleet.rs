//! What a fleet's front doors and nodes share besides boxes and nodes: the
//! account keys front doors accept, the members (nodes and front doors)
//! admitted by join tokens, and the fleet's settings (its sealed host key,
//! its CA certificate).

use serde::{Deserialize, Serialize};

use super::sql::{args, Row};
use super::{Store, StoreError};
use crate::ids::AccountId;

/// An SSH public key a front door accepts, and the account it logs in to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetKey {
    /// The key as its type and base64 (`ssh-ed25519 AAAA...`), no comment.
    pub key: String,
    /// The account it is.
    pub account: AccountId,
    /// When it was added, seconds since the epoch.
    pub added_at: u64,
}

/// What a fleet member is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberRole {
    /// A node: runs boxes.
    Node,
    /// A front door: answers SSH and routes to nodes.
    Front,
}

impl MemberRole {
    /// The role as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Front => "front",
        }
    }

    /// Parses a stored role.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "node" => Some(Self::Node),
            "front" => Some(Self::Front),
            _ => None,
        }
    }
}

/// A certificate the fleet's CA issued, and what became of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetMember {
    /// The certificate's serial number (hex).
    pub serial: String,
    /// What it may act as.
    pub role: MemberRole,
    /// The node's or front door's name.
    pub name: String,
    /// When it was issued, milliseconds since the epoch.
    pub issued_at_ms: u64,
    /// When its join token was used, if it was.
    pub joined_at_ms: Option<u64>,
    /// Revoked: peers refuse it.
    pub revoked: bool,
}

impl Store {
    /// Lets `key` log in to `account` through every front door (false: the
    /// key is there already, for this or another account).
    pub fn add_fleet_key(&self, account: &AccountId, key: &str) -> Result<bool, StoreError> {
        let sql = "INSERT INTO fleet_keys (key, account, added_at) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING";
        Ok(self.execute(sql, &args![key, &account.0, crate::clock::now()])? == 1)
    }

    /// Removes `key` (false: it was not there).
    pub fn remove_fleet_key(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.execute("DELETE FROM fleet_keys WHERE key = ?1", &args![key])? == 1)
    }

    /// Every key, by account then key.
    pub fn fleet_keys(&self) -> Result<Vec<FleetKey>, StoreError> {
        let rows = self.query("SELECT key, account, added_at FROM fleet_keys ORDER BY account, key", &[])?;
        rows.iter()
            .map(|r| Ok(FleetKey { key: r.get(0)?, account: AccountId(r.get(1)?), added_at: r.get(2)? }))
            .collect()
    }

    /// The account `key` logs in to, if any.
    pub fn account_for_fleet_key(&self, key: &str) -> Result<Option<AccountId>, StoreError> {
        let row = self.query_row("SELECT account FROM fleet_keys WHERE key = ?1", &args![key])?;
        Ok(row.map(|r| r.get(0)).transpose()?.map(AccountId))
    }

    /// Records a certificate just issued (not joined yet).
    pub fn register_member(&self, serial: &str, role: MemberRole, name: &str) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO fleet_members (serial, role, name, issued_at_ms) VALUES (?1, ?2, ?3, ?4)",
            &args![serial, role.as_str(), name, crate::clock::now_ms()],
        )?;
        Ok(())
    }

    /// Uses member `serial`'s join token: once only, and never for a revoked
    /// member.
    pub fn claim_member(&self, serial: &str) -> Result<FleetMember, StoreError> {
        let at_ms = crate::clock::now_ms();
        self.transaction(|tx| {
            let claimed = tx.execute(
                "UPDATE fleet_members SET joined_at_ms = ?2 \
                 WHERE serial = ?1 AND joined_at_ms IS NULL AND revoked = 0",
                &args![serial, at_ms],
            )?;
            let member = tx.query_row(&format!("{MEMBER} WHERE serial = ?1"), &args![serial])?;
            match member.as_ref().map(member_from_row).transpose()? {
                Some(member) if claimed == 1 => Ok(member),
                Some(member) if !member.revoked => Err(StoreError::AlreadyJoined(serial.to_owned())),
                _ => Err(StoreError::NoMember(serial.to_owned())),
            }
        })
    }

    /// Member `serial`, whatever became of it.
    pub fn member(&self, serial: &str) -> Result<Option<FleetMember>, StoreError> {
        let row = self.query_row(&format!("{MEMBER} WHERE serial = ?1"), &args![serial])?;
        row.as_ref().map(member_from_row).transpose()
    }

    /// Revokes member `serial` (false: no such member).
    pub fn revoke_member(&self, serial: &str) -> Result<bool, StoreError> {
        Ok(self.execute("UPDATE fleet_members SET revoked = 1 WHERE serial = ?1", &args![serial])? == 1)
    }

    /// Fleet setting `name`, if set.
    pub fn setting(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let row = self.query_row("SELECT value FROM fleet_settings WHERE name = ?1", &args![name])?;
        row.map(|r| r.get(0)).transpose()
    }

    /// Sets fleet setting `name` to `value`.
    pub fn set_setting(&self, name: &str, value: &[u8]) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO fleet_settings (name, value) VALUES (?1, ?2) \
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            &args![name, value],
        )?;
        Ok(())
    }
}

const MEMBER: &str = "SELECT serial, role, name, issued_at_ms, joined_at_ms, revoked FROM fleet_members";

fn member_from_row(r: &Row) -> Result<FleetMember, StoreError> {
    let role: String = r.get(1)?;
    Ok(FleetMember {
        serial: r.get(0)?,
        role: MemberRole::parse(&role).ok_or_else(|| StoreError::Column(format!("fleet member role {role:?}")))?,
        name: r.get(2)?,
        issued_at_ms: r.get(3)?,
        joined_at_ms: r.get(4)?,
        revoked: r.get(5)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(
        keys_map_to_one_account_each,
        members_join_once_and_revoked_ones_never,
        settings_are_bytes_by_name
    );

    fn keys_map_to_one_account_each(db: &TestDb) {
        let store = db.open();
        let (a, b) = (AccountId("SHA256:a".into()), AccountId("SHA256:b".into()));
        assert!(store.add_fleet_key(&a, "ssh-ed25519 AAAAa").unwrap());
        assert!(!store.add_fleet_key(&b, "ssh-ed25519 AAAAa").unwrap(), "a key is one account's");
        assert!(store.add_fleet_key(&b, "ssh-ed25519 AAAAb").unwrap());
        assert_eq!(store.account_for_fleet_key("ssh-ed25519 AAAAa").unwrap(), Some(a.clone()));
        assert_eq!(store.account_for_fleet_key("ssh-ed25519 AAAAz").unwrap(), None);
        let keys = store.fleet_keys().unwrap();
        assert_eq!(
            keys.iter().map(|k| (k.account.0.as_str(), k.key.as_str())).collect::<Vec<_>>(),
            [("SHA256:a", "ssh-ed25519 AAAAa"), ("SHA256:b", "ssh-ed25519 AAAAb")]
        );
        assert!(keys[0].added_at > 0);
        assert!(store.remove_fleet_key("ssh-ed25519 AAAAa").unwrap());
        assert!(!store.remove_fleet_key("ssh-ed25519 AAAAa").unwrap());
        assert_eq!(store.account_for_fleet_key("ssh-ed25519 AAAAa").unwrap(), None);
    }

    fn members_join_once_and_revoked_ones_never(db: &TestDb) {
        let store = db.open();
        let before = crate::clock::now_ms();
        store.register_member("0a", MemberRole::Node, "n1").unwrap();
        store.register_member("0b", MemberRole::Front, "f1").unwrap();
        assert!(store.register_member("0a", MemberRole::Front, "x").is_err(), "a serial is issued once");
        let issued = store.member("0a").unwrap().unwrap();
        assert_eq!(issued.joined_at_ms, None);
        let joined = store.claim_member("0a").unwrap();
        let at = joined.joined_at_ms.unwrap();
        assert!(before <= issued.issued_at_ms && issued.issued_at_ms <= at, "{issued:?} {joined:?}");
        assert_eq!(joined, FleetMember { joined_at_ms: Some(at), ..issued });
        assert_eq!((joined.role, joined.name.as_str(), joined.revoked), (MemberRole::Node, "n1", false));
        assert!(matches!(store.claim_member("0a"), Err(StoreError::AlreadyJoined(s)) if s == "0a"));
        assert_eq!(store.member("0a").unwrap().unwrap().joined_at_ms, Some(at), "a refused claim changes nothing");
        assert!(store.revoke_member("0b").unwrap());
        assert!(matches!(store.claim_member("0b"), Err(StoreError::NoMember(_))));
        assert!(matches!(store.claim_member("0c"), Err(StoreError::NoMember(_))));
        assert!(store.member("0b").unwrap().unwrap().revoked);
        assert!(store.member("0c").unwrap().is_none());
    }

    fn settings_are_bytes_by_name(db: &TestDb) {
        let store = db.open();
        assert_eq!(store.setting("host_key").unwrap(), None);
        store.set_setting("host_key", b"\x00sealed\xff").unwrap();
        store.set_setting("ca_cert", b"PEM").unwrap();
        store.set_setting("host_key", b"\x01again").unwrap();
        assert_eq!(store.setting("host_key").unwrap().as_deref(), Some(&b"\x01again"[..]));
        assert_eq!(store.setting("ca_cert").unwrap().as_deref(), Some(&b"PEM"[..]));
    }
}
