//! Who may be on the other end of a fleet connection: a certificate from the
//! fleet's CA (the handshake checked that) whose serial the store lists as a
//! member of the expected role, not revoked. Answers are kept a few seconds,
//! so a request does not wait on the store and a revocation still takes
//! effect at once to a person's eye.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::CertificateDer;

use crate::pki::Role;

/// How long a member's standing is believed without asking again.
const FRESH: Duration = Duration::from_secs(5);

/// A member of the fleet, as the store lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its name (a node's is the one its boxes name).
    pub name: String,
    /// What it is.
    pub role: Role,
}

/// Where members are listed (the store's `fleet_members`).
pub trait Membership: Send + Sync + 'static {
    /// The member whose certificate has `serial`, if it is one and is not
    /// revoked. Blocking (it may ask PostgreSQL).
    fn member(&self, serial: &str) -> Result<Option<Member>, String>;
}

/// Why a peer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// It showed no certificate (or one we cannot read).
    #[error("the peer showed no fleet certificate")]
    NoCertificate,
    /// Its serial is not a member (never issued here, or revoked).
    #[error("certificate {0} is not a member of this fleet (revoked, or never joined)")]
    NotMember(String),
    /// A member, of another role or name than expected.
    #[error("certificate {serial} is {} {name}, not {expected}", role.as_str())]
    Unexpected {
        /// Its serial.
        serial: String,
        /// What it is.
        role: Role,
        /// Its name.
        name: String,
        /// What it should have been.
        expected: String,
    },
    /// The store did not answer.
    #[error("cannot check a fleet peer: {0}")]
    Store(String),
}

/// Checks peers against the membership, remembering recent answers.
pub struct Peers {
    members: Arc<dyn Membership>,
    known: Mutex<HashMap<String, (Instant, Member)>>,
}

impl Peers {
    /// Checks against `members`.
    pub fn new(members: Arc<dyn Membership>) -> Arc<Self> {
        Arc::new(Self { members, known: Mutex::new(HashMap::new()) })
    }

    /// The member that showed `certs` (the peer's chain, leaf first), if it
    /// is one of `role` (and named `name`, if given).
    pub async fn admit(
        &self,
        certs: Option<&[CertificateDer<'_>]>,
        role: Role,
        name: Option<&str>,
    ) -> Result<Member, PeerError> {
        let leaf = certs.and_then(<[_]>::first).ok_or(PeerError::NoCertificate)?;
        let serial = crate::serial::of(leaf).ok_or(PeerError::NoCertificate)?;
        let member = match self.remembered(&serial) {
            Some(member) => member,
            None => {
                let members = Arc::clone(&self.members);
                let asked = serial.clone();
                let found = tokio::task::spawn_blocking(move || members.member(&asked))
                    .await
                    .map_err(|e| PeerError::Store(e.to_string()))?
                    .map_err(PeerError::Store)?;
                let member = found.ok_or_else(|| PeerError::NotMember(serial.clone()))?;
                if let Ok(mut known) = self.known.lock() {
                    known.insert(serial.clone(), (Instant::now(), member.clone()));
                }
                member
            }
        };
        if member.role != role || name.is_some_and(|n| n != member.name) {
            let expected = match name {
                Some(n) => format!("{} {n}", role.as_str()),
                None => role.as_str().to_string(),
            };
            return Err(PeerError::Unexpected { serial, role: member.role, name: member.name, expected });
        }
        Ok(member)
    }

    fn remembered(&self, serial: &str) -> Option<Member> {
        let mut known = self.known.lock().ok()?;
        match known.get(serial) {
            Some((at, member)) if at.elapsed() < FRESH => Some(member.clone()),
            Some(_) => {
                known.remove(serial);
                None
            }
            None => None,
        }
    }
}
