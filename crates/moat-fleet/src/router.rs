//! The router: what answers a front door's dials in a fleet. It reads each
//! request (small, bounded, decoded as the core decodes it), picks the node
//! that should answer it, and forwards the connection there:
//!
//! - `Authorize` is answered here, from the keys imported into the store;
//! - a request naming a box goes to that box's node (looked up in the store
//!   and remembered; forgotten when the node declines it, as it does for a
//!   box that is no longer its own); when that node is lost, what the store
//!   alone answers (`info`, the route of a user name, usage) goes to any
//!   live node, and the rest is refused naming the node;
//! - `Create` goes to the live, uncordoned node with the most room, then the
//!   next when a node answers that it is full;
//! - the account's questions (ask mode) from every live node, and an answer
//!   to the node holding its question ([`crate::ask`]);
//! - anything else (the account's list, usage, secrets, whoami) to any live node.
//!
//! A lost node or an unreachable store is one line to the user.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moat_api::proto::{ApiError, Event, Op, Reply, Request, ELSEWHERE, MAX_REQUEST};
use moat_api::server::Answer;
use moat_api::Packets;
use moat_core::{AccountId, Name};

use crate::dial::{Dialer, Forwarded};
use crate::store::{FleetStore, NodeState, Place, StoreFailure};

/// How long a box's place is believed without asking the store (a node
/// declines a box that moved, which makes the router ask at once).
const PLACE_FRESH: Duration = Duration::from_secs(10);
/// How long the list of nodes and their leases is believed.
const NODES_FRESH: Duration = Duration::from_secs(1);
/// How long a key's account is believed without asking the store: a key
/// removed from the fleet stops logging in within this.
const KEY_FRESH: Duration = Duration::from_secs(2);

/// Routes a front door's requests to the fleet's nodes.
pub struct Router<S> {
    store: Arc<S>,
    dialer: Dialer,
    places: Mutex<HashMap<(AccountId, Name), (Instant, Place)>>,
    nodes: Mutex<Option<(Instant, Arc<Vec<NodeState>>)>>,
    /// The accounts of keys that logged in, and when the store said so: for
    /// a login's second question (a client asks about its key, then signs)
    /// and the next few, and for when the store is away (only keys that are
    /// accounts: the front door asks about any key a client shows).
    accounts: Mutex<HashMap<String, (Instant, AccountId)>>,
    turn: AtomicUsize,
}

/// Why a request could not be routed: one line for the user.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RouteError {
    #[error("{0}")]
    Store(#[from] StoreFailure),
    #[error("box {name} is on node {node}, which is not answering ({why})")]
    Lost { name: Name, node: String, why: String },
    #[error("box {name} is on node {node}, which is not in the fleet")]
    UnknownNode { name: Name, node: String },
    #[error("diff compares boxes on one node: {a} is on node {a_node}, {b} on node {b_node}")]
    Apart { a: Name, a_node: String, b: Name, b_node: String },
    #[error("box {0} moved while it was asked for; try again")]
    Moving(Name),
    #[error("node {node} stopped answering ({why})")]
    Failed { node: String, why: String },
    #[error("no node of the fleet is answering")]
    NoNode,
    #[error("no node can take a new box now ({0})")]
    NoRoom(String),
    #[error("no node answered ({0})")]
    Unanswered(String),
    #[error("no open question {0} (answered already, or lapsed)")]
    NoQuestion(u64),
    #[error(
        "no open question {id} (answered already, or lapsed), unless node {node} holds it: it is not answering ({why})"
    )]
    NoQuestionHeard { id: u64, node: String, why: String },
    #[error("the front door went away")]
    Gone,
}

fn now_ms() -> u64 {
    moat_core::clock::now_ms()
}

impl<S: FleetStore> Router<S> {
    /// Routes with `store`, dialing with `dialer`.
    pub fn new(store: Arc<S>, dialer: Dialer) -> Arc<Self> {
        Arc::new(Self {
            store,
            dialer,
            places: Mutex::new(HashMap::new()),
            nodes: Mutex::new(None),
            accounts: Mutex::new(HashMap::new()),
            turn: AtomicUsize::new(0),
        })
    }

    /// Runs a store call (a read) off the async workers, twice if it fails:
    /// the first call after PostgreSQL restarts finds its connection gone,
    /// and the next reconnects.
    async fn ask<T: Send + 'static>(
        &self,
        call: impl Fn(&S) -> Result<T, StoreFailure> + Send + 'static,
    ) -> Result<T, StoreFailure> {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || call(&store).or_else(|_| call(&store)))
            .await
            .unwrap_or_else(|e| Err(StoreFailure(format!("internal error: {e}"))))
    }

    async fn nodes(&self, fresh: bool) -> Result<Arc<Vec<NodeState>>, StoreFailure> {
        if !fresh {
            if let Some((at, nodes)) = self.nodes.lock().ok().and_then(|n| n.clone()) {
                if at.elapsed() < NODES_FRESH {
                    return Ok(nodes);
                }
            }
        }
        let nodes = Arc::new(self.ask(|s| s.nodes()).await?);
        if let Ok(mut cached) = self.nodes.lock() {
            *cached = Some((Instant::now(), Arc::clone(&nodes)));
        }
        Ok(nodes)
    }

    /// Where a box lives, if it was looked up lately.
    fn cached_place(&self, account: &AccountId, name: &Name) -> Option<Place> {
        let key = (account.clone(), name.clone());
        let (at, place) = self.places.lock().ok()?.get(&key).cloned()?;
        Some(place).filter(|_| at.elapsed() < PLACE_FRESH)
    }

    async fn place(&self, account: &AccountId, name: &Name) -> Result<Option<Place>, StoreFailure> {
        if let Some(place) = self.cached_place(account, name) {
            return Ok(Some(place));
        }
        let key = (account.clone(), name.clone());
        let (account, asked) = key.clone();
        let place = self.ask(move |s| s.place(&account, &asked)).await?;
        if let (Some(place), Ok(mut places)) = (&place, self.places.lock()) {
            places.insert(key, (Instant::now(), place.clone()));
        }
        Ok(place)
    }

    /// The account of `key`; when the store is away, the one it last had,
    /// so that its user logs in and hears from its requests what is wrong.
    async fn authorize(&self, key: String) -> Result<Option<AccountId>, StoreFailure> {
        let known = self.accounts.lock().ok().and_then(|a| a.get(&key).cloned());
        if let Some((_, account)) = known.as_ref().filter(|(at, _)| at.elapsed() < KEY_FRESH) {
            return Ok(Some(account.clone()));
        }
        let asked = key.clone();
        let answer = self.ask(move |s| s.account_for_key(&asked)).await;
        let Ok(mut accounts) = self.accounts.lock() else { return answer };
        match &answer {
            Ok(Some(account)) => {
                accounts.insert(key, (Instant::now(), account.clone()));
            }
            Ok(None) => {
                accounts.remove(&key);
            }
            Err(e) => {
                if let Some((_, account)) = known {
                    // (Not a warning: every login while the store is away would log one.)
                    tracing::debug!(error = %e, "the store is away: a key is taken for the account it last was");
                    return Ok(Some(account));
                }
            }
        }
        answer
    }

    /// The route of a user name, which the store says (a node answers the
    /// same from it, by the same rule): every login asks it first (every
    /// control command too, under a name that is no box), and this saves
    /// each a hop to a node. `None`: a node is to answer.
    async fn known_box(&self, account: &AccountId, op: &Op) -> Option<Reply> {
        let Op::Route { name, owner: None } = op else { return None };
        let boxed = |node: &str| Some(Reply::Route(moat_api::Route::Box)).filter(|_| !node.is_empty());
        if let Some(place) = self.cached_place(account, name) {
            return boxed(&place.node);
        }
        let (who, asked) = (account.clone(), name.clone());
        let (boxes, retired) = self.ask(move |s| s.login_names(&who, &asked)).await.ok()?;
        if let Some((_, node)) = boxes.iter().find(|(b, _)| b == name) {
            return boxed(node);
        }
        let boxes: Vec<Name> = boxes.into_iter().map(|(b, _)| b).collect();
        let route = moat_api::route::route(name, &boxes, || Ok::<_, StoreFailure>(retired)).ok()?;
        Some(Reply::Route(route))
    }

    fn forget(&self, account: &AccountId, name: &Name) {
        if let Ok(mut places) = self.places.lock() {
            places.remove(&(account.clone(), name.clone()));
        }
    }

    /// Live nodes, starting at the next in turn (so requests spread).
    pub(crate) async fn live(&self) -> Result<Vec<NodeState>, StoreFailure> {
        let now = now_ms();
        let mut live: Vec<NodeState> = self.nodes(false).await?.iter().filter(|n| n.live(now)).cloned().collect();
        if !live.is_empty() {
            let turn = self.turn.fetch_add(1, Ordering::Relaxed) % live.len();
            live.rotate_left(turn);
        }
        Ok(live)
    }

    async fn act(&self, conn: &Packets, request: &[u8], account: &AccountId, op: &Op) -> Result<(), RouteError> {
        match op {
            Op::Create { node, .. } => return self.create(conn, request, node.as_deref()).await,
            Op::Questions { follow } => return self.questions(conn, request, *follow).await,
            Op::Answer { id, .. } => return self.answer_question(conn, request, *id).await,
            _ => {}
        }
        let Some(name) = named_box(op) else { return self.to_any(conn, request).await };
        // Twice at most: a node that declines the box makes us ask the store again.
        for _ in 0..2 {
            let Some(place) = self.place(account, name).await? else {
                // No such box: any node says so as its own node would.
                return self.to_any(conn, request).await;
            };
            if let Op::Diff { a, b } = op {
                if let Some(other) = self.place(account, b).await?.filter(|p| p.node != place.node) {
                    let (a, b) = (a.clone(), b.clone());
                    return Err(RouteError::Apart { a, a_node: place.node, b, b_node: other.node });
                }
            }
            let nodes = self.nodes(false).await?;
            let Some(node) = nodes.iter().find(|n| n.name == place.node) else {
                self.forget(account, name);
                return Err(RouteError::UnknownNode { name: name.clone(), node: place.node });
            };
            let now = now_ms();
            if !node.live(now) {
                // Perhaps it moved since: ask the store once more before saying so.
                let fresh = self.nodes(true).await?;
                if fresh.iter().find(|n| n.name == place.node).is_none_or(|n| !n.live(now_ms())) {
                    self.forget(account, name);
                    // What the store knows of it any node tells (`info` shows it node-lost).
                    if reads_store(op) {
                        return self.to_any(conn, request).await;
                    }
                    let lapsed = now.saturating_sub(node.lease_until_ms) / 1000;
                    let why = format!("its lease lapsed {lapsed} s ago");
                    return Err(RouteError::Lost { name: name.clone(), node: place.node, why });
                }
            }
            let link = match self.dial(node).await {
                Ok(link) => link,
                Err(why) => {
                    self.forget(account, name);
                    return Err(RouteError::Lost { name: name.clone(), node: place.node, why });
                }
            };
            match link.forward(conn, request, |e| e.status == ELSEWHERE).await {
                Ok(Forwarded::Answered) => {
                    if matches!(op, Op::Remove { .. } | Op::Promote { .. }) {
                        self.forget(account, name);
                    }
                    return Ok(());
                }
                Ok(Forwarded::Declined(_)) => self.forget(account, name),
                Err(e) => {
                    self.forget(account, name);
                    let why = e.to_string();
                    return Err(RouteError::Lost { name: name.clone(), node: place.node, why });
                }
            }
        }
        Err(RouteError::Moving(name.clone()))
    }

    pub(crate) async fn dial(&self, node: &NodeState) -> Result<crate::dial::Link, String> {
        self.dialer.dial(&node.name, &node.address).await.map_err(|e| e.reason())
    }

    /// A new box: on the node `new --node` named, else the nodes with the
    /// most room first, the next when one is full. The nodes' room is first
    /// taken as last read (a second old at most: each node's own transaction
    /// decides, and a full one declines), and read again only if that finds
    /// no node, so a `new` usually costs the store nothing here.
    async fn create(&self, conn: &Packets, request: &[u8], asked: Option<&str>) -> Result<(), RouteError> {
        match self.create_with(conn, request, asked, false).await {
            Err(RouteError::NoRoom(_)) => self.create_with(conn, request, asked, true).await,
            done => done,
        }
    }

    async fn create_with(
        &self,
        conn: &Packets,
        request: &[u8],
        asked: Option<&str>,
        fresh: bool,
    ) -> Result<(), RouteError> {
        let now = now_ms();
        let nodes = self.nodes(fresh).await?;
        if let Some(asked) = asked.filter(|a| !nodes.iter().any(|n| n.name == *a)) {
            return Err(RouteError::NoRoom(format!("no node named {asked} in the fleet (see: moat nodes)")));
        }
        // The node `--node` named is asked whatever the store says of its
        // room, so that its own refusal (full, cordoned) is what the user reads.
        let mut candidates: Vec<NodeState> = nodes
            .iter()
            .filter(|n| match asked {
                Some(asked) => n.name == asked,
                None => n.live(now) && !n.cordoned && n.free_boxes > 0,
            })
            .cloned()
            .collect();
        candidates.sort_by_key(|n| std::cmp::Reverse((n.free_memory, n.free_cpus)));
        let mut refusals = Vec::new();
        for node in &candidates {
            let link = match self.dial(node).await {
                Ok(link) => link,
                Err(why) => {
                    refusals.push(format!("{}: {why}", node.name));
                    continue;
                }
            };
            match link.forward(conn, request, |e| e.status == ELSEWHERE).await {
                Ok(Forwarded::Answered) => return Ok(()),
                Ok(Forwarded::Declined(e)) => refusals.push(format!("{}: {}", node.name, e.message)),
                Err(e) => refusals.push(format!("{}: {e}", node.name)),
            }
        }
        if refusals.is_empty() {
            refusals.push("no live node has room".into());
        }
        Err(RouteError::NoRoom(refusals.join("; ")))
    }

    /// A request any node answers alike.
    async fn to_any(&self, conn: &Packets, request: &[u8]) -> Result<(), RouteError> {
        for node in self.live().await? {
            if let Ok(link) = self.dial(&node).await {
                return match link.forward(conn, request, |_| false).await {
                    Ok(_) => Ok(()),
                    Err(e) => Err(RouteError::Failed { node: node.name, why: e.to_string() }),
                };
            }
        }
        Err(RouteError::NoNode)
    }
}

impl<S: FleetStore> Answer for Router<S> {
    async fn answer(self: Arc<Self>, conn: Packets) -> io::Result<()> {
        let Some(msg) = conn.recv(MAX_REQUEST).await? else { return Ok(()) };
        if !msg.fds.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "request carried descriptors"));
        }
        let outcome = match serde_json::from_slice::<Request>(&msg.bytes) {
            Err(e) => Err(ApiError { status: 255, message: format!("malformed request: {e}") }),
            Ok(Request::Authorize { key }) => match self.authorize(key).await {
                Ok(account) => Ok(Reply::Account(account)),
                Err(e) => Err(ApiError { status: 255, message: e.0 }),
            },
            // A fleet's front doors have no HTTP edge yet.
            Ok(Request::Web(_)) => {
                Err(ApiError { status: 1, message: "web URLs are served by a single host's edge only".into() })
            }
            Ok(Request::Act { account, op }) => match self.known_box(&account, &op).await {
                Some(reply) => Ok(reply),
                None => match self.act(&conn, &msg.bytes, &account, &op).await {
                    Ok(()) => return Ok(()),
                    Err(e) => Err(ApiError { status: 1, message: e.to_string() }),
                },
            },
        };
        let bytes = serde_json::to_vec(&Event::Outcome(outcome)).map_err(io::Error::other)?;
        conn.send(&bytes, &[]).await
    }
}

/// Whether a request about a box is answered from the store alone, so that
/// any node answers it when the box's node is lost.
fn reads_store(op: &Op) -> bool {
    matches!(op, Op::Route { .. } | Op::Get { .. } | Op::Usage { .. })
}

/// The box a request acts on, if it names one: the node holding it answers.
fn named_box(op: &Op) -> Option<&Name> {
    match op {
        Op::Route { name, .. }
        | Op::Get { name }
        | Op::Remove { name }
        | Op::Checkpoint { name, .. }
        | Op::Checkpoints { name }
        | Op::Restore { name, .. }
        | Op::CheckpointRemove { name, .. }
        | Op::Stop { name }
        | Op::Start { name }
        | Op::Suspend { name }
        | Op::Move { name, .. }
        | Op::SetIdle { name, .. }
        | Op::SetKeepRunning { name, .. }
        | Op::Policy { name }
        | Op::ChangePolicy { name, .. }
        | Op::Log { name, .. }
        | Op::ServiceLog { name }
        | Op::Effects { name, .. }
        | Op::Packages { name }
        | Op::OpenSession { name, .. }
        | Op::Expose { name, .. }
        | Op::Unexpose { name, .. }
        | Op::Url { name, .. }
        | Op::Share { name, .. }
        | Op::Unshare { name, .. } => Some(name),
        Op::Urls { name } => name.as_ref(),
        Op::Dup { src, .. } => Some(src),
        Op::Diff { a, .. } => Some(a),
        Op::Promote { child } => Some(child),
        Op::ImageSave { name, .. } => Some(name),
        Op::Usage { name, .. } => name.as_ref(),
        Op::SecretGrant { box_name, .. } | Op::SecretRevoke { box_name, .. } => Some(box_name),
        Op::SecretLimit { box_name, .. } => box_name.as_ref(),
        Op::List
        | Op::Create { .. }
        | Op::SecretAdd { .. }
        | Op::SecretList
        | Op::SecretRemove { .. }
        | Op::SecretKill { .. }
        | Op::Questions { .. }
        | Op::Answer { .. }
        | Op::Whoami
        // Images are each node's own (not yet kept in the fleet): whichever node answers.
        | Op::ImagePull { .. }
        | Op::ImageList
        | Op::ImageRemove { .. }
        | Op::ImagePush { .. }
        | Op::ImageLogin { .. } => None,
    }
}
