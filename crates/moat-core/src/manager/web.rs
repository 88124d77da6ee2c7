//! Web URLs, the privileged side's half: which ports are exposed and to whom,
//! one-time sign-in links and the session cookies they turn into, and web
//! sessions that wake a suspended box (the HTTP edge holds one while a
//! request is in flight). Links and cookies live in memory only: a restart
//! signs every visitor out, and nothing of them is on disk to steal.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use super::{BoxManager, ManagerError, SessionGuard};

/// Whether an account's key is listed now.
pub type AccountCheck = Arc<dyn Fn(&AccountId) -> bool + Send + Sync>;
use crate::backend::BoxHandle;
use crate::egress::{LogEntry, LogKind, LogVerdict};
use crate::ids::{AccountId, BoxId, Name};
use crate::record::{BoxRecord, BoxState};
use crate::web::{Exposure, Owner, WebHost, WebRefusal, WebRequestLog, WebSecret};

/// How long a sign-in link works (once).
pub const LINK_LIFETIME: Duration = Duration::from_secs(5 * 60);
/// How long a session cookie works.
pub const COOKIE_LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Most links and cookies held at once (each kind): past it, the oldest go.
const MAX_HELD: usize = 100_000;
/// How long a web request's log entry waits for others to be written with.
const LOG_BATCH_DELAY: Duration = Duration::from_millis(200);
/// Who a public URL's visitor is, in the log.
pub const PUBLIC: &str = "public";

/// A link's or a cookie's grant: this account, to this box's port, until then.
#[derive(Debug, Clone)]
struct Grant {
    box_id: BoxId,
    port: u16,
    account: AccountId,
    until: Instant,
}

/// Links not yet used, and the cookies used links became.
#[derive(Debug, Default)]
pub(super) struct WebGrants {
    links: HashMap<WebSecret, Grant>,
    cookies: HashMap<WebSecret, Grant>,
}

fn hold(map: &mut HashMap<WebSecret, Grant>, secret: WebSecret, grant: Grant) {
    let now = Instant::now();
    if map.len() >= MAX_HELD {
        map.retain(|_, g| g.until > now);
    }
    if map.len() >= MAX_HELD {
        let oldest = map.iter().min_by_key(|(_, g)| g.until).map(|(s, _)| s.clone());
        if let Some(oldest) = oldest {
            map.remove(&oldest);
        }
    }
    map.insert(secret, grant);
}

/// A web session could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum WebOpenError {
    /// Refused: a page for the visitor.
    #[error(transparent)]
    Refused(#[from] WebRefusal),
    /// The box could not be brought up.
    #[error(transparent)]
    Failed(#[from] ManagerError),
}

impl BoxManager {
    fn grants(&self) -> std::sync::MutexGuard<'_, WebGrants> {
        self.web.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Exposes `port` of the account's box (public: without sign-in).
    pub fn expose(&self, account: &AccountId, name: &Name, port: u16, public: bool) -> Result<Exposure, ManagerError> {
        if port == 0 {
            return Err(ManagerError::PortZero);
        }
        let rec = self.get(account, name)?;
        let host = WebHost { port, name: name.clone(), owner: Owner::of(account) };
        host.label_fits().map_err(|e| ManagerError::LabelTooLong(host.label(), e.to_string()))?;
        let before = self.db(|s| s.exposed(&rec.id))?.into_iter().find(|(p, _)| *p == port);
        self.db(|s| s.expose(&rec.id, port, public))?;
        if before.is_some_and(|(_, was_public)| was_public != public) {
            // Public no more (or now public): who may visit changed.
            self.end_web_sessions(&rec.id, port);
        }
        tracing::info!(box_id = %rec.id, name = %rec.name, port, public, "port exposed");
        Ok(Exposure { name: name.clone(), owner: host.owner, port, public, url: None, shared: false })
    }

    /// Stops exposing `port` of the account's box; visitors signed in to it are
    /// signed out, and every visitor's web sessions on it end.
    pub fn unexpose(&self, account: &AccountId, name: &Name, port: u16) -> Result<(), ManagerError> {
        let rec = self.get(account, name)?;
        if !self.db(|s| s.unexpose(&rec.id, port))? {
            return Err(ManagerError::NotExposed { name: name.clone(), port });
        }
        let mut grants = self.grants();
        grants.cookies.retain(|_, g| !(g.box_id == rec.id && g.port == port));
        grants.links.retain(|_, g| !(g.box_id == rec.id && g.port == port));
        drop(grants);
        // The tunnels open through it (WebSockets, event streams) end too.
        self.end_web_sessions(&rec.id, port);
        Ok(())
    }

    /// The exposed ports of the account's boxes (of `name` only, if given),
    /// then of the boxes shared with it.
    pub fn exposures(&self, account: &AccountId, name: Option<&Name>) -> Result<Vec<Exposure>, ManagerError> {
        let own = match name {
            Some(name) => vec![self.get(account, name)?],
            None => self.list(account)?,
        };
        let shared = self.db(|s| s.shared_with(account))?;
        let shared = shared.into_iter().filter(|b| name.is_none_or(|n| *n == b.name));
        let mut out = Vec::new();
        for (rec, is_shared) in own.into_iter().map(|b| (b, false)).chain(shared.map(|b| (b, true))) {
            for (port, public) in self.db(|s| s.exposed(&rec.id))? {
                let owner = Owner::of(&rec.account);
                out.push(Exposure { name: rec.name.clone(), owner, port, public, url: None, shared: is_shared });
            }
        }
        Ok(out)
    }

    /// Lets `other` (an account: a key's fingerprint) reach the account's box.
    pub fn share(&self, account: &AccountId, name: &Name, other: &AccountId) -> Result<(), ManagerError> {
        let rec = self.get(account, name)?;
        if other == account {
            return Err(ManagerError::ShareWithSelf { name: name.clone() });
        }
        self.db(|s| s.share(&rec.id, other))?;
        tracing::info!(box_id = %rec.id, name = %rec.name, with = %other, "box shared");
        Ok(())
    }

    /// The accounts the box of id `id` is shared with (its owner's view).
    pub fn shared_with_whom(&self, id: &BoxId) -> Result<Vec<AccountId>, ManagerError> {
        Ok(self.db(|s| s.shares(id))?)
    }

    /// Takes back what [`BoxManager::share`] gave; that account's cookies for
    /// the box stop working at once.
    pub fn unshare(&self, account: &AccountId, name: &Name, other: &AccountId) -> Result<(), ManagerError> {
        let rec = self.get(account, name)?;
        if !self.db(|s| s.unshare(&rec.id, other))? {
            return Err(ManagerError::NotShared { name: name.clone(), with: other.clone() });
        }
        // Its ssh sessions and forwards end now (and its web sessions, below).
        self.end_sessions_of(&rec.id, other);
        let mut grants = self.grants();
        grants.cookies.retain(|_, g| !(g.box_id == rec.id && g.account == *other));
        grants.links.retain(|_, g| !(g.box_id == rec.id && g.account == *other));
        Ok(())
    }

    /// The box `account` may sign in to: its own `name`, or the box of that
    /// name `owner` shared with it.
    pub fn reachable(
        &self,
        account: &AccountId,
        name: &Name,
        owner: Option<&Owner>,
    ) -> Result<BoxRecord, ManagerError> {
        let Some(owner) = owner.filter(|o| **o != Owner::of(account)) else {
            return self.get(account, name);
        };
        let rec = self.db(|s| s.box_of_owner(owner, name))?;
        match rec {
            Some(rec) if self.db(|s| s.shares(&rec.id))?.contains(account) => Ok(rec),
            _ => Err(ManagerError::NoSuchBox(name.clone())),
        }
    }

    /// A session on box `name` of `owner` (the account's own if `None`, or
    /// if `owner` is the account), for `account`: the SSH side of a share.
    pub async fn open_shared_session(
        self: &Arc<Self>,
        account: &AccountId,
        name: &Name,
        owner: Option<&Owner>,
    ) -> Result<(BoxHandle, SessionGuard), ManagerError> {
        let rec = self.reachable(account, name, owner)?;
        let (handle, guard) = self.open_session_of(&rec).await?;
        Ok((handle, guard.held_by(account)))
    }

    /// A one-time sign-in link's host and secret, for `account`, to port
    /// `port` of its box `name` (or of `owner`'s, shared with it).
    pub fn sign_in_link(
        &self,
        account: &AccountId,
        name: &Name,
        port: u16,
        owner: Option<&Owner>,
    ) -> Result<(WebHost, WebSecret), ManagerError> {
        let rec = self.reachable(account, name, owner)?;
        if !self.db(|s| s.exposed(&rec.id))?.iter().any(|(p, _)| *p == port) {
            return Err(ManagerError::NotExposed { name: name.clone(), port });
        }
        let secret = WebSecret::random();
        let grant =
            Grant { box_id: rec.id.clone(), port, account: account.clone(), until: Instant::now() + LINK_LIFETIME };
        hold(&mut self.grants().links, secret.clone(), grant);
        Ok((WebHost { port, name: rec.name, owner: Owner::of(&rec.account) }, secret))
    }

    /// Spends a sign-in link for `host`: the session cookie it becomes.
    pub fn web_sign_in(&self, host: &WebHost, link: &WebSecret) -> Result<WebSecret, WebRefusal> {
        let rec = self.web_box(host)?;
        let mut grants = self.grants();
        // Taken out whatever follows: a link is tried once.
        let grant = grants.links.remove(link).ok_or(WebRefusal::LinkSpent)?;
        if grant.box_id != rec.id || grant.port != host.port || grant.until < Instant::now() {
            return Err(WebRefusal::LinkSpent);
        }
        let cookie = WebSecret::random();
        hold(&mut grants.cookies, cookie.clone(), Grant { until: Instant::now() + COOKIE_LIFETIME, ..grant });
        Ok(cookie)
    }

    /// The box `host` names, if its port is exposed: and whether publicly.
    fn web_box(&self, host: &WebHost) -> Result<BoxRecord, WebRefusal> {
        let rec = self.db(|s| s.box_of_owner(&host.owner, &host.name)).ok().flatten();
        let rec = rec.filter(|r| r.node == self.node).ok_or(WebRefusal::NotFound)?;
        Ok(rec)
    }

    /// Tells the manager how to know whether an account's key is still
    /// listed: web sessions of one that is not are refused.
    pub fn set_account_check(&self, listed: AccountCheck) {
        let _ = self.accounts.set(listed);
    }

    /// Whether a request to `host` with `cookie` may reach the box, and as
    /// whom; with the box.
    ///
    /// A box or port that is not there is told as a private one (sign in):
    /// the owner slug comes from the account's public key, so a 404 beside a
    /// 401 told anyone who has that key which boxes and ports it exposes.
    pub fn web_check(&self, host: &WebHost, cookie: Option<&WebSecret>) -> Result<(BoxRecord, String), WebRefusal> {
        let hidden = |_| WebRefusal::SignIn;
        let rec = self.web_box(host).map_err(hidden)?;
        let exposed = self.db(|s| s.exposed(&rec.id)).map_err(|_| WebRefusal::Busy)?;
        let public = exposed.iter().find(|(p, _)| *p == host.port).ok_or(WebRefusal::SignIn)?.1;
        let grant = cookie.and_then(|c| self.grants().cookies.get(c).cloned());
        let grant = grant.filter(|g| g.box_id == rec.id && g.port == host.port && g.until > Instant::now());
        // A key taken out of the keys ends its account's web sessions too.
        let grant = grant.filter(|g| self.account_listed(&g.account));
        match grant {
            Some(g) if g.account == rec.account => Ok((rec, g.account.0)),
            Some(g) if self.db(|s| s.shares(&rec.id)).map_err(|_| WebRefusal::Busy)?.contains(&g.account) => {
                Ok((rec, g.account.0))
            }
            _ if public => Ok((rec, PUBLIC.to_string())),
            Some(_) => Err(WebRefusal::NotShared),
            None => Err(WebRefusal::SignIn),
        }
    }

    /// A web session on the box `host` names, for a request [`BoxManager::web_check`]
    /// lets through: resumes a suspended box; a stopped one is refused (the
    /// owner starts it). The box stays up while the guard lives.
    pub async fn web_open(
        self: &Arc<Self>,
        host: &WebHost,
        cookie: Option<&WebSecret>,
    ) -> Result<(BoxHandle, SessionGuard, BoxId, String), WebOpenError> {
        let (rec, who) = self.web_check(host, cookie)?;
        match rec.state {
            BoxState::Stopped => return Err(WebRefusal::Stopped.into()),
            BoxState::Creating => return Err(WebRefusal::Busy.into()),
            BoxState::Running | BoxState::Suspended => {}
        }
        let (handle, guard) = self.open_session_of(&rec).await?;
        // A visitor signed in holds the session: taking its access away ends
        // it, as taking the port's exposure away ends anyone's.
        let account = (who != PUBLIC).then(|| AccountId(who.clone()));
        let guard = guard.held_for_web(account.as_ref(), host.port);
        Ok((handle, guard, rec.id, who))
    }

    /// Resumes box `id` if it is suspended: a web session's next stream, or
    /// its ask when the box is slow to answer (the session keeps the box from
    /// the idle rule, but `suspend` freezes it anyway). One store read when
    /// it runs.
    pub async fn wake(&self, id: &BoxId) -> Result<(), ManagerError> {
        let Some(rec) = self.db(|s| s.get_by_id(id))? else { return Ok(()) };
        if rec.state != BoxState::Suspended {
            return Ok(());
        }
        let (rec, _guard) = self.locked(&rec.account, &rec.name).await?;
        self.bring_up(&rec).await.map(|_| ())
    }

    /// `count` sockets in the network of a web session's box `id`, for the
    /// edge to connect to its port (see [`crate::Backend::box_sockets`]);
    /// `None` where its agent must connect instead. One store read.
    pub async fn web_sockets(&self, id: &BoxId, count: usize) -> Result<Option<Vec<OwnedFd>>, ManagerError> {
        let gone = || ManagerError::Backend(crate::BackendError::msg("the box is gone"));
        let rec = self.db(|s| s.get_by_id(id))?.ok_or_else(gone)?;
        Ok(self.blocking(move |b| b.box_sockets(&rec, count)).await??)
    }

    /// Logs a request the edge carried to box `id` (as `web` entries of its
    /// log), in batches: a store write per request would cost more than the
    /// request.
    pub fn record_web(self: &Arc<Self>, id: &BoxId, host: &WebHost, r: WebRequestLog) {
        let verdict = if r.status < 500 { LogVerdict::Allow } else { LogVerdict::Error };
        let entry = LogEntry {
            method: Some(r.method),
            target: Some(r.path),
            reason: Some(format!("{} in {} ms, by {}", r.status, r.ms, r.who)),
            sent: r.sent,
            received: r.received,
            status: Some(r.status),
            ..LogEntry::new(r.at_ms, LogKind::Web, host.label(), 0, verdict)
        };
        let first = {
            let mut pending = self.web_log.lock().unwrap_or_else(PoisonError::into_inner);
            pending.push((id.clone(), entry));
            pending.len() == 1
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return self.flush_web_log() };
        if first {
            let manager = Arc::clone(self);
            runtime.spawn(async move {
                tokio::time::sleep(LOG_BATCH_DELAY).await;
                manager.flush_web_log();
            });
        }
    }

    fn flush_web_log(&self) {
        let batch = std::mem::take(&mut *self.web_log.lock().unwrap_or_else(PoisonError::into_inner));
        self.record_egress(batch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_grants_are_bounded() {
        let mut map = HashMap::new();
        let grant = |secs| Grant {
            box_id: BoxId::random(),
            port: 1,
            account: AccountId("a".into()),
            until: Instant::now() + Duration::from_secs(secs),
        };
        for i in 0..MAX_HELD as u64 + 10 {
            hold(&mut map, WebSecret(i.to_string()), grant(1000 + i));
        }
        assert_eq!(map.len(), MAX_HELD);
        assert!(!map.contains_key(&WebSecret("0".into())), "the oldest went first");
    }
}
