//! What a router asks of the state store, as a trait: moat-core's `Store`
//! (on PostgreSQL) answers it in a fleet, and the router's tests answer it
//! from memory. Every call may block on the network: callers run them off
//! the async workers.

use moat_core::{AccountId, Name};

use crate::peer::Member;
use crate::pki::Role;

/// A store call that failed, as the user should read it (for an outage:
/// "the state store (PostgreSQL at HOST:PORT) is unreachable: ...").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StoreFailure(pub String);

impl From<moat_core::store::StoreError> for StoreFailure {
    fn from(e: moat_core::store::StoreError) -> Self {
        let mut msg = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            source = s.source();
        }
        Self(msg)
    }
}

/// Where a box lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// Its node.
    pub node: String,
    /// Its epoch (changes whenever its node does).
    pub epoch: u64,
}

/// A node as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// Its name.
    pub name: String,
    /// Where its fleet listener is (`HOST:PORT`).
    pub address: String,
    /// When its lease lapses, milliseconds since the epoch.
    pub lease_until_ms: u64,
    /// Taking no new boxes.
    pub cordoned: bool,
    /// Memory its boxes' limits leave free, in bytes.
    pub free_memory: u64,
    /// CPUs its boxes' limits leave free.
    pub free_cpus: u64,
    /// Boxes it may still take.
    pub free_boxes: u64,
}

impl NodeState {
    /// Whether its lease holds at `now_ms`.
    pub fn live(&self, now_ms: u64) -> bool {
        self.lease_until_ms > now_ms
    }
}

/// The store, as a router uses it.
pub trait FleetStore: Send + Sync + 'static {
    /// The account of an imported key (`TYPE BASE64`), if it is one.
    fn account_for_key(&self, key: &str) -> Result<Option<AccountId>, StoreFailure>;
    /// Where `account`'s box `name` lives, if it exists.
    fn place(&self, account: &AccountId, name: &Name) -> Result<Option<Place>, StoreFailure>;
    /// What a login under `name` needs, in one call: `account`'s boxes
    /// (name, node), and whether `name` was one of them (removed, or renamed
    /// by promote).
    fn login_names(&self, account: &AccountId, name: &Name) -> Result<(Vec<(Name, String)>, bool), StoreFailure>;
    /// Every node.
    fn nodes(&self) -> Result<Vec<NodeState>, StoreFailure>;
    /// The member whose certificate has `serial`, unless revoked.
    fn member(&self, serial: &str) -> Result<Option<Member>, StoreFailure>;
}

/// A store's members, for [`crate::peer::Peers`].
pub struct StoreMembers<S>(pub std::sync::Arc<S>);

impl<S: FleetStore> crate::peer::Membership for StoreMembers<S> {
    fn member(&self, serial: &str) -> Result<Option<Member>, String> {
        self.0.member(serial).map_err(|e| e.0)
    }
}

/// The store, as `moat fleet init|token|join` use it.
pub trait FleetAdmin {
    /// A fleet-wide setting (the CA's certificate, the sealed host key).
    fn setting(&self, name: &str) -> Result<Option<Vec<u8>>, StoreFailure>;
    /// Sets a fleet-wide setting.
    fn set_setting(&self, name: &str, value: &[u8]) -> Result<(), StoreFailure>;
    /// Registers an issued certificate's serial as member `name` of `role`.
    fn register_member(&self, serial: &str, role: Role, name: &str) -> Result<(), StoreFailure>;
    /// Marks the member `serial` as joined; fails if it already has (a
    /// token is good once) or was never issued.
    fn claim_member(&self, serial: &str) -> Result<(), StoreFailure>;
}

impl FleetStore for moat_core::Store {
    fn account_for_key(&self, key: &str) -> Result<Option<AccountId>, StoreFailure> {
        Ok(self.account_for_fleet_key(key)?)
    }

    fn place(&self, account: &AccountId, name: &Name) -> Result<Option<Place>, StoreFailure> {
        Ok(self.get(account, name)?.map(|b| Place { node: b.node, epoch: b.epoch }))
    }

    fn login_names(&self, account: &AccountId, name: &Name) -> Result<(Vec<(Name, String)>, bool), StoreFailure> {
        Ok(moat_core::Store::login_names(self, account, name)?)
    }

    fn nodes(&self) -> Result<Vec<NodeState>, StoreFailure> {
        let rows = moat_core::Store::nodes(self)?;
        Ok(rows
            .into_iter()
            .map(|n| NodeState {
                free_memory: n.offer.memory.saturating_sub(n.memory_used),
                free_cpus: u64::from(n.offer.cpus).saturating_sub(n.cpus_used),
                free_boxes: u64::from(n.offer.max_boxes.saturating_sub(n.boxes)),
                name: n.offer.name,
                address: n.offer.address,
                lease_until_ms: n.lease_until_ms,
                cordoned: n.cordoned,
            })
            .collect())
    }

    fn member(&self, serial: &str) -> Result<Option<Member>, StoreFailure> {
        let member = moat_core::Store::member(self, serial)?.filter(|m| !m.revoked);
        Ok(member.map(|m| Member { name: m.name, role: m.role }))
    }
}

impl FleetAdmin for moat_core::Store {
    fn setting(&self, name: &str) -> Result<Option<Vec<u8>>, StoreFailure> {
        Ok(moat_core::Store::setting(self, name)?)
    }

    fn set_setting(&self, name: &str, value: &[u8]) -> Result<(), StoreFailure> {
        Ok(moat_core::Store::set_setting(self, name, value)?)
    }

    fn register_member(&self, serial: &str, role: Role, name: &str) -> Result<(), StoreFailure> {
        Ok(moat_core::Store::register_member(self, serial, role, name)?)
    }

    fn claim_member(&self, serial: &str) -> Result<(), StoreFailure> {
        moat_core::Store::claim_member(self, serial)?;
        Ok(())
    }
}
