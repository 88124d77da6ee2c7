//! The privileged side: answers the front door's requests with the box
//! manager. It reads only small, bounded JSON requests whose names are
//! validated on decode; it never sees SSH bytes.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use moat_core::effects::Since;
use moat_core::egress::Question;
use moat_core::policy::{HostName, Policy};
use moat_core::web::{WebHost, WebRefusal, WebVerdict};
use moat_core::{AccountId, AgentAddr, BoxManager, BoxSpec, Change, ChangeSink, ManagerError, WebOpenError};
use tokio::sync::Semaphore;

use crate::client::DIAL;
use crate::proto::{
    AccountLimits, ApiError, BoxInfo, Event, ImageInfo, Op, Reply, Request, Route, WebOp, WebSessionMsg, Whoami,
    MAX_REQUEST,
};
use crate::wire::Packets;

/// Most request connections open at once: every box session holds one, so
/// this is well above what the front door's own limits let through, and
/// keeps a misbehaving front door from exhausting our descriptors.
const MAX_CONNECTIONS: usize = 16 << 10;

/// Looks up the account of a public key (`TYPE BASE64`); the privileged side
/// compares it against the operator's list and never parses it.
pub type Authorizer = dyn Fn(&str) -> Option<AccountId> + Send + Sync;

/// What requests are answered with.
pub struct Privileged {
    /// The box manager.
    pub manager: Arc<BoxManager>,
    /// The operator's key list.
    pub authorize: Box<Authorizer>,
    /// The policy a new box gets unless it names a preset.
    pub default_policy: Policy,
    /// The registry hosts of the `registries` preset.
    pub registries: Vec<HostName>,
    /// Where the HTTP edge serves boxes' URLs, if it runs.
    pub web: Option<WebSite>,
}

/// Where the HTTP edge serves: boxes' URLs are `https://LABEL.DOMAIN[:PORT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebSite {
    /// The domain (every box port is a name right under it).
    pub domain: String,
    /// The port URLs name (443 is left out of them).
    pub port: u16,
}

/// Where a sign-in link points (its secret in the query).
pub const SIGN_IN_PATH: &str = "/.moat/sign-in";

impl WebSite {
    /// The URL of a box port.
    pub fn url(&self, host: &WebHost) -> String {
        match self.port {
            443 => format!("https://{}.{}/", host.label(), self.domain),
            port => format!("https://{}.{}:{port}/", host.label(), self.domain),
        }
    }
}

/// Something that answers the connections a front door dials: the
/// privileged side on one host, a fleet's router in front of many.
pub trait Answer: Send + Sync + 'static {
    /// Reads one request on `conn` and answers it; the request's life is the
    /// connection's (a session lasts until the front door closes it).
    fn answer(self: Arc<Self>, conn: Packets) -> impl std::future::Future<Output = io::Result<()>> + Send;
}

impl Answer for Privileged {
    async fn answer(self: Arc<Self>, conn: Packets) -> io::Result<()> {
        answer(&conn, &self).await
    }
}

/// Answers dials on `dialer` with `answerer` until the front door closes it.
pub async fn serve<A: Answer>(dialer: Packets, answerer: Arc<A>) -> io::Result<()> {
    let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = Arc::clone(&open).acquire_owned().await.map_err(io::Error::other)?;
        let Some(msg) = dialer.recv(1).await? else { return Ok(()) };
        if msg.bytes != [DIAL] || !msg.fds.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "front door sent a malformed dial"));
        }
        let (ours, theirs) = Packets::pair()?;
        dialer.send(&[DIAL], &[theirs.as_fd()]).await?;
        drop(theirs);
        let conn = Packets::new(ours)?;
        let answerer = Arc::clone(&answerer);
        tokio::spawn(async move {
            if let Err(e) = answerer.answer(conn).await {
                tracing::debug!(error = %e, "api connection failed");
            }
            drop(permit);
        });
    }
}

async fn send<'a>(conn: &Packets, event: &Event, fds: impl IntoIterator<Item = &'a OwnedFd>) -> io::Result<()> {
    let bytes = serde_json::to_vec(event).map_err(io::Error::other)?;
    let fds: Vec<_> = fds.into_iter().map(AsFd::as_fd).collect();
    conn.send(&bytes, &fds).await
}

/// Reads one request on `conn` and answers it.
async fn answer(conn: &Packets, ctx: &Arc<Privileged>) -> io::Result<()> {
    let Some(msg) = conn.recv(MAX_REQUEST).await? else { return Ok(()) };
    if !msg.fds.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "request carried descriptors"));
    }
    let req: Request = match serde_json::from_slice(&msg.bytes) {
        Ok(req) => req,
        Err(e) => {
            let err = ApiError { status: 255, message: format!("malformed request: {e}") };
            return send(conn, &Event::Outcome(Err(err)), None).await;
        }
    };
    let (account, op) = match req {
        Request::Authorize { key } => {
            return send(conn, &Event::Outcome(Ok(Reply::Account((ctx.authorize)(&key)))), None).await
        }
        Request::Web(op) => return answer_web(conn, ctx, op).await,
        Request::Act { account, op } => (account, op),
    };
    // A key taken out of the keys: its connections already open can do no more.
    if !ctx.manager.account_listed(&account) {
        let err = ApiError { status: 255, message: "your key is no longer listed on this server".into() };
        return send(conn, &Event::Outcome(Err(err)), None).await;
    }
    if let Op::OpenSession { name, owner } = op {
        let (fd, guard) = match open_session(&ctx.manager, &account, &name, owner.as_ref()).await {
            Ok(opened) => opened,
            Err(e) => return send(conn, &Event::Outcome(Err(e)), None).await,
        };
        send(conn, &Event::Outcome(Ok(Reply::Session)), Some(&fd)).await?;
        drop(fd);
        // The session lasts as long as the front door keeps this connection,
        // and the account its access: closing it tells the front door.
        tokio::select! {
            () = until_closed(conn) => {}
            () = guard.revoked() => tracing::info!(box_name = %name, %account, "session ended: access taken away"),
        }
        drop(guard);
        return Ok(());
    }
    if let Op::Log { name, since_ms, until_ms, follow, ask } = op {
        let outcome = send_log(conn, &ctx.manager, &account, &name, (since_ms, until_ms), follow, ask).await?;
        return send(conn, &Event::Outcome(outcome), None).await;
    }
    if let Op::Questions { follow } = op {
        send_questions(conn, &ctx.manager, &account, follow).await?;
        return send(conn, &Event::Outcome(Ok(Reply::Done)), None).await;
    }
    let (progress_tx, mut progress_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let progress: moat_core::ProgressSink = Box::new(move |line: &str| {
        let _ = progress_tx.send(line.to_string());
    });
    // The work runs on its own task: if the front door goes away mid-way (a
    // client disconnects during `new`), it still finishes or rolls back,
    // rather than stopping at whatever await it had reached.
    // A diff's batches wait for the front door (a few at most are held): a
    // slow reader slows the walk instead of growing memory.
    let (changes_tx, mut changes_rx) = tokio::sync::mpsc::channel::<Vec<Change>>(4);
    let changes = changes_sink(changes_tx, CHANGES_STALL);
    let ctx = Arc::clone(ctx);
    let mut work = tokio::spawn(async move { run(&account, op, &ctx, progress, changes).await });
    let outcome = loop {
        tokio::select! {
            Some(line) = progress_rx.recv() => send(conn, &Event::Progress(line), None).await?,
            Some(batch) = changes_rx.recv() => send(conn, &Event::Changes(batch), None).await?,
            outcome = &mut work => break outcome,
        }
    };
    while let Ok(line) = progress_rx.try_recv() {
        send(conn, &Event::Progress(line), None).await?;
    }
    while let Ok(batch) = changes_rx.try_recv() {
        send(conn, &Event::Changes(batch), None).await?;
    }
    let outcome = match outcome {
        Ok(outcome) => outcome.map_err(api_error),
        Err(e) => Err(ApiError { status: 255, message: format!("internal error: {e}") }),
    };
    send(conn, &Event::Outcome(outcome), None).await
}

/// How long a diff's batch may wait for the front door to take it. A client
/// that stops reading must not keep the walk (one of the server's few diff
/// turns, every account's, and the open directories of its boxes, removed
/// ones too) for good: past it the walk ends, "nobody is reading".
const CHANGES_STALL: Duration = Duration::from_secs(60);

/// Where a walk (on a blocking thread) sends its batches: to `tx`, each
/// within `stall`, or the walk is told to stop.
fn changes_sink(tx: tokio::sync::mpsc::Sender<Vec<Change>>, stall: Duration) -> Box<ChangeSink<'static>> {
    let runtime = tokio::runtime::Handle::current();
    Box::new(move |batch| matches!(runtime.block_on(tokio::time::timeout(stall, tx.send(batch))), Ok(Ok(()))))
}

/// Entries in a batch of `Log`.
const LOG_BATCH: usize = 512;

/// Sends the account's open questions and, with `follow`, every new one
/// until the front door closes the connection.
async fn send_questions(
    conn: &Packets,
    manager: &Arc<BoxManager>,
    account: &AccountId,
    follow: bool,
) -> io::Result<()> {
    let mut feed = QuestionFeed::start(conn, manager, account, None).await?;
    if !follow {
        return Ok(());
    }
    loop {
        tokio::select! {
            question = feed.next() => match question {
                Some(q) => send(conn, &Event::Question(q), None).await?,
                None => return Ok(()),
            },
            closed = conn.recv(1) => if !matches!(closed, Ok(Some(_))) { return Ok(()) },
        }
    }
}

/// Questions for one account (of one box, if named), as they come.
struct QuestionFeed {
    live: tokio::sync::broadcast::Receiver<(AccountId, Question)>,
    account: AccountId,
    name: Option<moat_core::Name>,
    /// Those sent at the start (they may come again on `live`).
    sent: Vec<u64>,
}

impl QuestionFeed {
    /// Sends the open questions now, and returns the feed of new ones.
    async fn start(
        conn: &Packets,
        manager: &BoxManager,
        account: &AccountId,
        name: Option<&moat_core::Name>,
    ) -> io::Result<Self> {
        // Subscribed before the open ones are read, so nothing falls between.
        let live = manager.follow_questions();
        let mut feed = Self { live, account: account.clone(), name: name.cloned(), sent: Vec::new() };
        let open: Vec<Question> = manager.questions(account).into_iter().filter(|q| feed.wants(q)).collect();
        for q in open {
            feed.sent.push(q.id);
            send(conn, &Event::Question(q), None).await?;
        }
        Ok(feed)
    }

    fn wants(&self, q: &Question) -> bool {
        self.name.as_ref().is_none_or(|n| n.as_str() == q.box_name)
    }

    /// The next new question (`None`: no more will come).
    async fn next(&mut self) -> Option<Question> {
        loop {
            match self.live.recv().await {
                Ok((owner, q)) if owner == self.account && self.wants(&q) && !self.sent.contains(&q.id) => {
                    return Some(q);
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// Sends a box's log from `since_ms` (to before `until_ms`) and, with
/// `follow`, every entry after it (and with `ask`, its questions) until the
/// front door closes the connection.
async fn send_log(
    conn: &Packets,
    manager: &Arc<BoxManager>,
    account: &AccountId,
    name: &moat_core::Name,
    (since_ms, until_ms): (u64, Option<u64>),
    follow: bool,
    ask: bool,
) -> io::Result<Result<Reply, ApiError>> {
    // Subscribed before the backlog is read, so nothing falls between.
    let mut live = manager.follow_egress();
    let id = match manager.get(account, name) {
        Ok(rec) => rec.id,
        Err(e) => return Ok(Err(api_error(e))),
    };
    let (backlog, cut) = match manager.egress_log(account, name, since_ms, until_ms) {
        Ok(read) => read,
        Err(e) => return Ok(Err(api_error(e))),
    };
    if let (true, Some(first)) = (cut, backlog.first()) {
        // To the millisecond, and including the first one's: a page repeats
        // that millisecond's entries rather than skip any.
        let until = first.at_ms + 1;
        let older = format!(
            "older entries are not shown (the newest {} are): see them with --until {}.{:03}",
            backlog.len(),
            until / 1000,
            until % 1000
        );
        send(conn, &Event::Progress(older), None).await?;
    }
    for batch in backlog.chunks(LOG_BATCH) {
        send(conn, &Event::Log(batch.to_vec()), None).await?;
    }
    if !follow {
        return Ok(Ok(Reply::Done));
    }
    let mut questions = match ask {
        true => Some(QuestionFeed::start(conn, manager, account, Some(name)).await?),
        false => None,
    };
    let horizon = backlog.last().map_or(0, |e| e.at_ms);
    // A box removed meanwhile logs nothing more: the follow ends, saying so
    // (one renamed by a promote is the same box, and is followed on).
    let mut still_there = tokio::time::interval(FOLLOW_CHECK);
    loop {
        tokio::select! {
            _ = still_there.tick() => if !box_remains(manager, account, name, &id) {
                return Ok(Err(ApiError { status: 1, message: format!("box {name} was removed: its log ends here") }));
            },
            Some(q) = async { questions.as_mut()?.next().await } => send(conn, &Event::Question(q), None).await?,
            entry = live.recv() => match entry {
                Ok((box_id, entry)) if box_id == id => {
                    // Entries read in the backlog may arrive here again once.
                    if entry.at_ms <= horizon && backlog.contains(&entry) {
                        continue;
                    }
                    let mut batch = vec![entry];
                    while let Ok((box_id, entry)) = live.try_recv() {
                        if box_id == id {
                            batch.push(entry);
                        }
                        if batch.len() >= LOG_BATCH {
                            break;
                        }
                    }
                    send(conn, &Event::Log(batch), None).await?;
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(lost = n, "a log follower fell behind");
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return Ok(Ok(Reply::Done)),
            },
            // The front door closes the connection when its client goes.
            closed = conn.recv(1) => if !matches!(closed, Ok(Some(_))) { return Ok(Ok(Reply::Done)) },
        }
    }
}

/// How often a log follower checks that its box is still there.
const FOLLOW_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the account still has box `id`, under `name` or another (a
/// promote renames; a store that cannot answer counts as yes).
fn box_remains(manager: &BoxManager, account: &AccountId, name: &moat_core::Name, id: &moat_core::BoxId) -> bool {
    match manager.get(account, name) {
        Ok(rec) if rec.id == *id => true,
        _ => manager.list(account).map_or(true, |boxes| boxes.iter().any(|b| b.id == *id)),
    }
}

/// Answers the HTTP edge: a check, a sign-in, or a web session (whose
/// connection then carries the log of the requests it serves).
async fn answer_web(conn: &Packets, ctx: &Arc<Privileged>, op: WebOp) -> io::Result<()> {
    let m = &ctx.manager;
    let refused = |r: WebRefusal| Event::Outcome(Ok(Reply::Web(WebVerdict::Refuse(r))));
    let (host, cookie, sockets) = match op {
        WebOp::Check { host, cookie } => {
            let verdict = match m.web_check(&host, cookie.as_ref()) {
                Ok((_, who)) => WebVerdict::Allow { who },
                Err(r) => WebVerdict::Refuse(r),
            };
            return send(conn, &Event::Outcome(Ok(Reply::Web(verdict))), None).await;
        }
        WebOp::SignIn { host, link } => {
            let event = match m.web_sign_in(&host, &link) {
                Ok(cookie) => Event::Outcome(Ok(Reply::WebCookie(cookie))),
                Err(r) => refused(r),
            };
            return send(conn, &event, None).await;
        }
        WebOp::Open { host, cookie, sockets } => (host, cookie, sockets),
    };
    let (handle, guard, id, who) = match m.web_open(&host, cookie.as_ref()).await {
        Ok(opened) => opened,
        Err(WebOpenError::Refused(r)) => return send(conn, &refused(r), None).await,
        Err(WebOpenError::Failed(e)) => return send(conn, &Event::Outcome(Err(api_error(e))), None).await,
    };
    // Sockets in the box's network for the edge to connect itself; a stream
    // to its agent where the agent must connect.
    let reach = match m.web_sockets(&id, usize::from(sockets).min(crate::wire::MAX_FDS)).await {
        Ok(Some(made)) => Ok((false, made)),
        Ok(None) => agent_stream(handle.clone(), &host.name).await.map(|fd| (true, vec![fd])),
        Err(e) => Err(api_error(e)),
    };
    // Its other end is held until the session ends, here.
    let (life_line, _life) = Packets::pair()?;
    match reach {
        Ok((through_agent, mut fds)) => {
            fds.push(life_line);
            let reply = Reply::WebSession { who: who.clone(), through_agent, life_line: true };
            send(conn, &Event::Outcome(Ok(reply)), &fds).await?;
        }
        Err(e) => return send(conn, &Event::Outcome(Err(e)), None).await,
    }
    // The session lasts as long as the edge keeps this connection (and the
    // visitor its access: closing it tells the edge); on it, the requests it
    // carried, and its asks for more streams to the box.
    loop {
        let msg = tokio::select! {
            msg = conn.recv(MAX_REQUEST) => msg?,
            () = guard.revoked() => {
                tracing::info!(box_name = %host.name, %who, "web session ended: access taken away");
                break;
            }
        };
        let Some(msg) = msg else { break };
        match serde_json::from_slice::<WebSessionMsg>(&msg.bytes) {
            Ok(WebSessionMsg::Log(entries)) => {
                for entry in entries {
                    m.record_web(&id, &host, entry);
                }
            }
            Ok(WebSessionMsg::Stream) => match wake_and_stream(m, &id, &handle, &host.name).await {
                Ok(fd) => send(conn, &Event::Outcome(Ok(Reply::Session)), Some(&fd)).await?,
                Err(e) => send(conn, &Event::Outcome(Err(e)), None).await?,
            },
            Ok(WebSessionMsg::Sockets { count }) => {
                let count = usize::from(count).min(crate::wire::MAX_FDS);
                match m.web_sockets(&id, count).await {
                    Ok(made) => send(conn, &Event::Outcome(Ok(Reply::WebSockets)), &made.unwrap_or_default()).await?,
                    Err(e) => send(conn, &Event::Outcome(Err(api_error(e))), None).await?,
                }
            }
            Ok(WebSessionMsg::Wake) => {
                let outcome = m.wake(&id).await.map(|()| Reply::Done).map_err(api_error);
                send(conn, &Event::Outcome(outcome), None).await?;
            }
            Err(_) => {}
        }
    }
    drop(guard);
    Ok(())
}

/// Another stream to the agent of a web session's box, resumed first if
/// it was suspended meanwhile.
async fn wake_and_stream(
    m: &BoxManager,
    id: &moat_core::BoxId,
    handle: &moat_core::BoxHandle,
    name: &moat_core::Name,
) -> Result<OwnedFd, ApiError> {
    m.wake(id).await.map_err(api_error)?;
    agent_stream(handle.clone(), name).await
}

/// The URLs of `exposures`, where the edge serves them.
fn with_urls(mut exposures: Vec<moat_core::web::Exposure>, web: Option<&WebSite>) -> Vec<moat_core::web::Exposure> {
    for e in &mut exposures {
        let host = WebHost { port: e.port, name: e.name.clone(), owner: e.owner.clone() };
        e.url = web.map(|w| w.url(&host));
    }
    exposures
}

/// Resolves when the other end closes `conn` (what it sends meanwhile is dropped).
async fn until_closed(conn: &Packets) {
    while let Ok(Some(_)) = conn.recv(1).await {}
}

async fn open_session(
    manager: &Arc<BoxManager>,
    account: &AccountId,
    name: &moat_core::Name,
    owner: Option<&moat_core::web::Owner>,
) -> Result<(OwnedFd, moat_core::SessionGuard), ApiError> {
    let (handle, guard) = manager.open_shared_session(account, name, owner).await.map_err(api_error)?;
    Ok((agent_stream(handle, name).await?, guard))
}

/// A stream connected to the agent of a box brought up as `handle`.
async fn agent_stream(handle: moat_core::BoxHandle, name: &moat_core::Name) -> Result<OwnedFd, ApiError> {
    let stream = match handle.agent {
        AgentAddr::Unix(path) => tokio::net::UnixStream::connect(&path).await,
    };
    let stream = stream
        .and_then(|s| s.into_std())
        .map_err(|e| ApiError { status: 255, message: format!("box {name} is not answering: {e}") })?;
    Ok(OwnedFd::from(stream))
}

/// The exit status a failure reports: 2 for limits the user asked for, else 1.
fn api_error(e: ManagerError) -> ApiError {
    let status = match e {
        ManagerError::Limits(_) | ManagerError::Policy(_) | ManagerError::Secret(_) => 2,
        // Not this node's to do: a fleet's router asks the right one.
        ManagerError::OnOtherNode { .. }
        | ManagerError::NoRoomHere(_)
        | ManagerError::NoSuchNode(_)
        | ManagerError::QuestionElsewhere(_) => crate::proto::ELSEWHERE,
        _ => 1,
    };
    ApiError { status, message: error_chain(&e) }
}

/// An error and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// What `name` is to `account`: a box; else close to one (a typo, or a name
/// `promote` took away: `web-try` once it is `web`); else a former box; else
/// nothing. A store that cannot be read is an error (the front door tells
/// it): never a route to the control plane for a box's command.
fn route(m: &BoxManager, account: &AccountId, name: &moat_core::Name) -> Result<Route, ManagerError> {
    let boxes: Vec<moat_core::Name> = m.list(account)?.into_iter().map(|b| b.name).collect();
    crate::route::route(name, &boxes, || m.was_box(account, name))
}

/// The nodes among `boxes`' whose lease lapsed (read only in a fleet, and
/// only when a box is on another node).
fn lost_nodes(m: &BoxManager, boxes: &[moat_core::BoxRecord]) -> Vec<String> {
    if boxes.iter().all(|b| b.node == m.node()) {
        return Vec::new();
    }
    m.lost_nodes().unwrap_or_default()
}

/// A box as `ls` and `info` show it: `node-lost` when its node is.
fn shown(b: &moat_core::BoxRecord, lost: &[String]) -> BoxInfo {
    let info = BoxInfo::from(b);
    if lost.contains(&b.node) {
        info.on_lost_node()
    } else {
        info
    }
}

/// Carries out one operation for `account`: each arm the core-side half of
/// a control verb (the front door's half is its file in `control/verbs/`).
async fn run(
    account: &AccountId,
    op: Op,
    ctx: &Privileged,
    progress: moat_core::ProgressSink,
    changes: Box<ChangeSink<'static>>,
) -> Result<Reply, ManagerError> {
    let m = &ctx.manager;
    Ok(match op {
        Op::Route { name, owner: None } => Reply::Route(route(m, account, &name)?),
        // Another account's box: it is one only if shared with this account.
        Op::Route { name, owner: Some(owner) } => Reply::Route(match m.reachable(account, &name, Some(&owner)) {
            Ok(_) => Route::Box,
            Err(ManagerError::NoSuchBox(_)) => Route::None,
            Err(e) => return Err(e),
        }),
        Op::List => {
            let boxes = m.list(account)?;
            let lost = lost_nodes(m, &boxes);
            Reply::Boxes(boxes.iter().map(|b| shown(b, &lost)).collect())
        }
        Op::Get { name } => {
            let b = m.get(account, &name)?;
            let mut info = shown(&b, &lost_nodes(m, std::slice::from_ref(&b)));
            info.durable = m.durability(&b.id).ok().flatten().map(|d| {
                Box::new(crate::proto::DurableInfo { as_of_ms: d.as_of_ms, bytes: d.bytes, pending: d.pending })
            });
            info.moved = m.arrival(&b.id).ok().flatten();
            info.moving = m.box_move(&b.id).ok().flatten().map(Box::new);
            info.shared_with = m.shared_with_whom(&b.id)?;
            Reply::Box(info)
        }
        Op::Create { name, image, limits, idle, policy, ask, backend, node, run } => {
            // The router sends `new --node N` to N; anywhere else it is a mistake.
            if let Some(node) = node.filter(|n| n != m.node()) {
                return Err(ManagerError::NoSuchNode(node));
            }
            let mut policy = match policy {
                Some(preset) => preset.policy(&ctx.registries)?,
                None => ctx.default_policy.clone(),
            };
            policy.ask |= ask;
            let rec = m.create(account, BoxSpec { name, image, limits, policy, backend, run }, progress).await?;
            if let Some(seconds) = idle {
                m.set_idle(account, &rec.name, seconds).await?;
            }
            Reply::Box(BoxInfo::from(&m.get(account, &rec.name)?))
        }
        Op::ImagePull { reference, name } => {
            Reply::Image((&m.pull_image(account, reference, name, progress).await?).into())
        }
        Op::ImageList => Reply::Images(m.images(account)?.iter().map(ImageInfo::from).collect()),
        Op::ImageSave { name, image } => Reply::Image((&m.save_image(account, &name, image).await?).into()),
        Op::ImageRemove { name } => m.remove_image(account, &name).map(|()| Reply::Done)?,
        Op::ImagePush { name, reference } => Reply::Text(m.push_image(account, &name, reference, progress).await?),
        Op::ImageLogin { registry, user, password } => {
            let login = moat_core::RegistryLogin { registry, user, password: password.expose().to_string() };
            m.login(account, login).map(|()| Reply::Done)?
        }
        Op::Remove { name } => m.remove(account, &name).await.map(|()| Reply::Done)?,
        Op::Dup { src, dst } => Reply::Box(BoxInfo::from(&m.dup(account, &src, &dst).await?)),
        Op::Diff { a, b } => {
            m.diff(account, &a, &b, changes).await?;
            let (a_packages, b_packages) = m.split_packages(account, &a, &b).await?;
            let (a, b) = m.split_effects(account, &a, &b).await?;
            Reply::Diffed { a, b, a_packages, b_packages }
        }
        Op::Promote { child } => Reply::Name(m.promote(account, &child).await?),
        Op::Checkpoint { name, label } => Reply::Name(m.checkpoint(account, &name, label).await?),
        Op::Checkpoints { name } => Reply::Checkpoints(m.checkpoints(account, &name).await?),
        Op::Restore { name, label } => {
            let kept = m.restore(account, &name, &label).await?;
            Reply::Restored { kept, effects: m.effects(account, &name, &Since::Checkpoint(label)).await? }
        }
        Op::Effects { name, since } => Reply::Effects(m.effects(account, &name, &since).await?),
        Op::Packages { name } => Reply::Packages(m.packages(account, &name).await?),
        Op::ServiceLog { name } => {
            Reply::Text(String::from_utf8_lossy(&m.service_log(account, &name).await?).into_owned())
        }
        Op::CheckpointRemove { name, label } => {
            m.remove_checkpoint(account, &name, &label).await.map(|()| Reply::Done)?
        }
        Op::Stop { name } => m.stop(account, &name).await.map(|()| Reply::Done)?,
        Op::Start { name } => m.start(account, &name).await.map(|()| Reply::Done)?,
        Op::Suspend { name } => m.suspend(account, &name).await.map(|()| Reply::Done)?,
        Op::Move { name, node } => {
            let mv = m.ask_move(account, &name, &node).await?;
            m.await_move(&mv, progress).await.map(|()| Reply::Done)?
        }
        Op::SetIdle { name, seconds } => m.set_idle(account, &name, seconds).await.map(|()| Reply::Done)?,
        Op::SetKeepRunning { name, on } => m.set_keep_running(account, &name, on).await.map(|()| Reply::Done)?,
        Op::Usage { since, name } => Reply::Usage(m.usage(account, since, name.as_ref()).await?),
        Op::Policy { name } => Reply::Policy(m.policy(account, &name)?),
        Op::ChangePolicy { name, change } => {
            Reply::Policy(m.change_policy(account, &name, |p| p.apply(change, &ctx.registries)).await??)
        }
        Op::Answer { id, answer } => Reply::Question(m.answer(account, id, answer).await?),
        Op::SecretAdd { spec, value } => m.add_secret(account, spec, &value).map(|()| Reply::Done)?,
        Op::SecretList => Reply::Secrets(m.secrets(account)?),
        Op::SecretRemove { name } => m.remove_secret(account, &name).await.map(|()| Reply::Done)?,
        Op::SecretGrant { name, box_name } => m.grant_secret(account, &name, &box_name).await.map(|()| Reply::Done)?,
        Op::SecretRevoke { name, box_name } => {
            m.revoke_secret(account, &name, &box_name).await.map(|()| Reply::Done)?
        }
        Op::SecretLimit { name, box_name, limits } => {
            for limit in limits {
                m.limit_secret(account, &name, box_name.as_ref(), limit).await?;
            }
            Reply::Done
        }
        Op::SecretKill { name } => m.kill_secret(account, &name).await.map(|()| Reply::Done)?,
        Op::Whoami => Reply::Whoami(Whoami {
            account: account.clone(),
            fingerprint: account.0.clone(),
            owner: moat_core::web::Owner::of(account).to_string(),
            boxes: m.count(account)?,
            limits: AccountLimits::from(m.config()),
        }),
        Op::Expose { name, port, public } => {
            Reply::Exposures(with_urls(vec![m.expose(account, &name, port, public)?], ctx.web.as_ref()))
        }
        Op::Unexpose { name, port } => m.unexpose(account, &name, port).map(|()| Reply::Done)?,
        Op::Urls { name } => Reply::Exposures(with_urls(m.exposures(account, name.as_ref())?, ctx.web.as_ref())),
        Op::Url { name, port, owner } => {
            let web = ctx.web.as_ref().ok_or(ManagerError::NoWebEdge)?;
            let (host, link) = m.sign_in_link(account, &name, port, owner.as_ref())?;
            let url = format!("{}{}?link={}", web.url(&host).trim_end_matches('/'), SIGN_IN_PATH, link.0);
            Reply::SignInLink { url, expires_in: moat_core::LINK_LIFETIME.as_secs() }
        }
        Op::Share { name, with } => m.share(account, &name, &with).map(|()| Reply::Done)?,
        Op::Unshare { name, with } => m.unshare(account, &name, &with).map(|()| Reply::Done)?,
        // Answered by `answer`, which keeps their connections.
        Op::OpenSession { .. } | Op::Log { .. } | Op::Questions { .. } => Reply::Done,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A front door that takes no batch (its client stopped reading): the
    /// walk is told to stop once the stall passes, not held for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_walk_whose_batches_nobody_takes_is_stopped() {
        let (tx, _held) = tokio::sync::mpsc::channel(1);
        let mut sink = changes_sink(tx, Duration::from_millis(100));
        let (first, second, waited) = tokio::task::spawn_blocking(move || {
            let first = sink(Vec::new());
            let started = std::time::Instant::now();
            let second = sink(Vec::new());
            (first, second, started.elapsed())
        })
        .await
        .unwrap();
        assert!(first && !second, "taken {first}, then {second}");
        assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(5), "{waited:?}");
    }
}
