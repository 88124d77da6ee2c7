//! The router in front of two nodes (real TLS on loopback, stand-in cores,
//! the store in memory): requests naming a box reach its node, a new box the
//! node with room, a moved box is found again, and a lost node or an
//! unreachable store is one line to the user.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use moat_api::proto::{ApiError, Event, Op, Reply, Request, ELSEWHERE, MAX_REQUEST};
use moat_api::server::Answer;
use moat_api::{ApiClient, Packets};
use moat_core::egress::{self, Question};
use moat_core::{AccountId, Limits, Name};
use moat_fleet::dial::Dialer;
use moat_fleet::listen::NodeListener;
use moat_fleet::peer::{Member, Peers};
use moat_fleet::pki::{Ca, Role};
use moat_fleet::router::Router;
use moat_fleet::store::{FleetStore, NodeState, Place, StoreFailure, StoreMembers};
use moat_fleet::tls::Identity;

/// The store in memory; `down` makes every call fail as an outage does.
#[derive(Default)]
struct Store {
    keys: Mutex<HashMap<String, AccountId>>,
    places: Mutex<HashMap<Name, Place>>,
    nodes: Mutex<Vec<NodeState>>,
    members: Mutex<HashMap<String, Member>>,
    down: Mutex<bool>,
}

impl Store {
    fn up(&self) -> Result<(), StoreFailure> {
        match *self.down.lock().unwrap() {
            true => Err(StoreFailure("the state store (PostgreSQL at 127.0.0.1:5999) is unreachable: refused".into())),
            false => Ok(()),
        }
    }
}

impl FleetStore for Store {
    fn account_for_key(&self, key: &str) -> Result<Option<AccountId>, StoreFailure> {
        self.up()?;
        Ok(self.keys.lock().unwrap().get(key).cloned())
    }
    fn place(&self, _: &AccountId, name: &Name) -> Result<Option<Place>, StoreFailure> {
        self.up()?;
        Ok(self.places.lock().unwrap().get(name).cloned())
    }
    fn login_names(&self, _: &AccountId, name: &Name) -> Result<(Vec<(Name, String)>, bool), StoreFailure> {
        self.up()?;
        let places = self.places.lock().unwrap();
        Ok((places.iter().map(|(n, p)| (n.clone(), p.node.clone())).collect(), name.as_str() == "gone"))
    }
    fn nodes(&self) -> Result<Vec<NodeState>, StoreFailure> {
        self.up()?;
        Ok(self.nodes.lock().unwrap().clone())
    }
    fn member(&self, serial: &str) -> Result<Option<Member>, StoreFailure> {
        self.up()?;
        Ok(self.members.lock().unwrap().get(serial).cloned())
    }
}

/// A node's stand-in core: answers with its own name for the boxes it
/// holds and for account-wide requests, declines others' boxes, and
/// declines new boxes when full.
struct Core {
    node: &'static str,
    boxes: Mutex<HashSet<Name>>,
    full: Mutex<bool>,
    /// Its boxes' open questions (ask mode).
    questions: Mutex<Vec<Question>>,
    /// Never answers an answer (a node hung, its lease still live).
    hangs: Mutex<bool>,
}

impl Core {
    /// Sends its open questions; with `follow`, then each new one until the
    /// router closes the connection.
    async fn send_questions(&self, conn: &Packets, follow: bool) -> io::Result<()> {
        let mut sent = 0;
        loop {
            let new: Vec<Question> = self.questions.lock().unwrap().iter().skip(sent).cloned().collect();
            for q in new {
                conn.send(&serde_json::to_vec(&Event::Question(q)).unwrap(), &[]).await?;
                sent += 1;
            }
            if !follow {
                return Ok(());
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
                closed = conn.recv(1) => if !matches!(closed, Ok(Some(_))) { return Ok(()) },
            }
        }
    }
}

impl Answer for Core {
    async fn answer(self: Arc<Self>, conn: Packets) -> io::Result<()> {
        let Some(msg) = conn.recv(MAX_REQUEST).await? else { return Ok(()) };
        let Request::Act { op, .. } = serde_json::from_slice(&msg.bytes).unwrap() else {
            panic!("authorize reached a node")
        };
        let elsewhere = |what: String| Err(ApiError { status: ELSEWHERE, message: what });
        let outcome = match op {
            Op::Questions { follow } => {
                self.send_questions(&conn, follow).await?;
                Ok(Reply::Done)
            }
            Op::Answer { .. } if *self.hangs.lock().unwrap() => std::future::pending().await,
            Op::Answer { id, .. } => {
                let mut open = self.questions.lock().unwrap();
                match open.iter().position(|q| q.id == id) {
                    Some(at) => Ok(Reply::Question(open.remove(at))),
                    None => elsewhere(format!("no open question {id} on this node")),
                }
            }
            Op::Create { name, .. } if *self.full.lock().unwrap() => {
                elsewhere(format!("node {} is full ({name})", self.node))
            }
            Op::Create { name, .. } => {
                self.boxes.lock().unwrap().insert(name);
                Ok(Reply::Name(Name::new(self.node).unwrap()))
            }
            // (`Get` reads the store: any node answers it.)
            Op::Stop { name } if !self.boxes.lock().unwrap().contains(&name) => {
                elsewhere(format!("box {name} is not on node {}", self.node))
            }
            _ => Ok(Reply::Name(Name::new(self.node).unwrap())),
        };
        conn.send(&serde_json::to_vec(&Event::Outcome(outcome)).unwrap(), &[]).await
    }
}

struct Fleet {
    store: Arc<Store>,
    cores: Vec<Arc<Core>>,
    client: ApiClient,
}

fn node_state(name: &str, address: String, free_memory: u64) -> NodeState {
    NodeState {
        name: name.into(),
        address,
        lease_until_ms: moat_core::clock::now_ms() + 10_000,
        cordoned: false,
        free_memory,
        free_cpus: 4,
        free_boxes: 8,
    }
}

async fn fleet() -> Fleet {
    let ca = Ca::mint().unwrap();
    let store = Store::default();
    store.keys.lock().unwrap().insert("ssh-ed25519 AAAA".into(), AccountId("SHA256:ok".into()));
    let store = Arc::new(store);
    let front = ca.issue(Role::Front, "f1").unwrap();
    store.members.lock().unwrap().insert(front.serial.clone(), Member { name: "f1".into(), role: Role::Front });
    let peers = Peers::new(Arc::new(StoreMembers(Arc::clone(&store))));
    let mut cores = Vec::new();
    for (name, memory) in [("n1", 8 << 30), ("n2", 4 << 30)] {
        let leaf = ca.issue(Role::Node, name).unwrap();
        store.members.lock().unwrap().insert(leaf.serial.clone(), Member { name: name.into(), role: Role::Node });
        let identity = Identity::from_pem(ca.cert_pem(), &leaf.cert.pem(), &leaf.key.serialize_pem()).unwrap();
        let core = Arc::new(Core {
            node: name,
            boxes: Mutex::default(),
            full: Mutex::new(false),
            questions: Mutex::default(),
            hangs: Mutex::new(false),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        store.nodes.lock().unwrap().push(node_state(name, listener.local_addr().unwrap().to_string(), memory));
        let node = Arc::new(NodeListener {
            tls: identity.server_config().unwrap(),
            peers: Arc::clone(&peers),
            answerer: Arc::clone(&core),
            handshake_timeout: Duration::from_secs(2),
            boxes: None,
        });
        tokio::spawn(node.serve(listener));
        cores.push(core);
    }
    let identity = Identity::from_pem(ca.cert_pem(), &front.cert.pem(), &front.key.serialize_pem()).unwrap();
    let router = Router::new(Arc::clone(&store), Dialer::new(identity.client_config().unwrap(), peers));
    let (ours, theirs) = Packets::pair().unwrap();
    tokio::spawn(moat_api::server::serve(Packets::new(ours).unwrap(), router));
    Fleet { store, cores, client: ApiClient::new(Packets::new(theirs).unwrap()) }
}

fn act(op: Op) -> Request {
    Request::Act { account: AccountId("SHA256:ok".into()), op }
}

fn name(s: &str) -> Name {
    Name::new(s).unwrap()
}

fn create(box_name: &str) -> Request {
    act(Op::Create {
        name: name(box_name),
        image: name("debian"),
        limits: Limits::default(),
        idle: None,
        policy: None,
        ask: false,
        backend: None,
        node: None,
        run: false,
    })
}

impl Fleet {
    /// Makes `box_name` live on node `node` (index), as a placement would.
    fn place(&self, box_name: &str, node: usize) {
        self.cores[node].boxes.lock().unwrap().insert(name(box_name));
        let place = Place { node: self.cores[node].node.into(), epoch: 1 };
        self.store.places.lock().unwrap().insert(name(box_name), place);
    }

    async fn answered_by(&self, req: &Request) -> Result<String, ApiError> {
        match self.client.call(req).await? {
            Reply::Name(n) => Ok(n.to_string()),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn requests_reach_the_node_that_should_answer() {
    let f = fleet().await;
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), Some(AccountId("SHA256:ok".into())));
    assert_eq!(f.client.authorize("ssh-ed25519 BBBB").await.unwrap(), None);
    f.place("web", 1);
    f.place("db", 0);
    for _ in 0..3 {
        assert_eq!(f.answered_by(&act(Op::Get { name: name("web") })).await.unwrap(), "n2");
        assert_eq!(f.answered_by(&act(Op::Get { name: name("db") })).await.unwrap(), "n1");
    }
    // What a user name is comes from the store, with no hop to a node
    // (a stand-in node would answer with its name).
    let route = |n: &str| act(Op::Route { name: name(n), owner: None });
    assert_eq!(f.client.call(&route("web")).await.unwrap(), Reply::Route(moat_api::Route::Box));
    assert_eq!(f.client.call(&route("webb")).await.unwrap(), Reply::Route(moat_api::Route::Near(name("web"))));
    assert_eq!(f.client.call(&route("gone")).await.unwrap(), Reply::Route(moat_api::Route::Gone));
    assert_eq!(f.client.call(&route("root")).await.unwrap(), Reply::Route(moat_api::Route::None));
    // Account-wide requests go to either live node, in turn.
    let mut seen = HashSet::new();
    for _ in 0..4 {
        seen.insert(f.answered_by(&act(Op::List)).await.unwrap());
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    // A diff of boxes on two nodes is refused with both named.
    let diff = f.client.call(&act(Op::Diff { a: name("web"), b: name("db") })).await.unwrap_err();
    assert_eq!(diff.message, "diff compares boxes on one node: web is on node n2, db on node n1");
}

#[tokio::test]
async fn a_new_box_goes_to_the_node_with_room_and_past_a_full_one() {
    let f = fleet().await;
    assert_eq!(f.answered_by(&create("a")).await.unwrap(), "n1");
    *f.cores[0].full.lock().unwrap() = true;
    assert_eq!(f.answered_by(&create("b")).await.unwrap(), "n2");
    *f.cores[1].full.lock().unwrap() = true;
    let none = f.client.call(&create("c")).await.unwrap_err();
    assert_eq!(none.message, "no node can take a new box now (n1: node n1 is full (c); n2: node n2 is full (c))");
    // A cordoned node is not asked, once the router's view of the nodes
    // (a second old at most) has it cordoned; until then the node's own
    // refusal is what turns a new box away.
    *f.cores[1].full.lock().unwrap() = false;
    f.store.nodes.lock().unwrap()[1].cordoned = true;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(f.client.call(&create("d")).await.unwrap_err().message.starts_with("no node can take a new box now"));
}

#[tokio::test]
async fn a_moved_box_is_found_again() {
    let f = fleet().await;
    f.place("web", 0);
    assert_eq!(f.answered_by(&act(Op::Get { name: name("web") })).await.unwrap(), "n1");
    // It moves to n2: n1 declines it, and the router asks the store again.
    f.cores[0].boxes.lock().unwrap().clear();
    f.place("web", 1);
    assert_eq!(f.answered_by(&act(Op::Stop { name: name("web") })).await.unwrap(), "n2");
}

#[tokio::test]
async fn a_lost_node_and_an_unreachable_store_are_one_line() {
    let f = fleet().await;
    assert!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap().is_some());
    f.place("web", 1);
    f.place("db", 0);
    // Its lease lapsed 14 s ago.
    f.store.nodes.lock().unwrap()[1].lease_until_ms = moat_core::clock::now_ms() - 14_200;
    let lost = f.client.call(&act(Op::Stop { name: name("web") })).await.unwrap_err();
    assert_eq!(lost.message, "box web is on node n2, which is not answering (its lease lapsed 14 s ago)");
    // A user name that is a box routes to it from the store alone (then the
    // session is refused naming the node).
    let route = f.client.call(&act(Op::Route { name: name("web"), owner: None })).await.unwrap();
    assert_eq!(route, Reply::Route(moat_api::Route::Box));
    // What the store says of it (node-lost) any live node tells.
    assert_eq!(f.answered_by(&act(Op::Get { name: name("web") })).await.unwrap(), "n1");
    // Account-wide requests go to the live one only.
    for _ in 0..3 {
        assert_eq!(f.answered_by(&act(Op::List)).await.unwrap(), "n1");
    }
    // Its lease holds but nothing listens there.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    {
        let mut nodes = f.store.nodes.lock().unwrap();
        nodes[1] = node_state("n2", closed.to_string(), 1);
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let lost = f.client.call(&act(Op::Stop { name: name("web") })).await.unwrap_err();
    let refused =
        format!("box web is on node n2, which is not answering ({closed}: Connection refused (os error 111))");
    assert_eq!(lost.message, refused);
    assert!(!lost.message.contains('\n'));

    // The store goes away: one line saying so; back, and all is well.
    *f.store.down.lock().unwrap() = true;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let down = f.client.call(&create("x")).await.unwrap_err();
    assert_eq!(down.message, "the state store (PostgreSQL at 127.0.0.1:5999) is unreachable: refused");
    // A key that logged in before still does (its user then hears the
    // above); one never seen does not.
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), Some(AccountId("SHA256:ok".into())));
    assert!(f.client.authorize("ssh-ed25519 CCCC").await.is_err());
    *f.store.down.lock().unwrap() = false;
    assert_eq!(f.answered_by(&act(Op::Get { name: name("db") })).await.unwrap(), "n1");
}

fn question(id: u64, box_name: &str) -> Question {
    Question {
        id,
        box_name: box_name.into(),
        name: "pypi.org".into(),
        port: Some(443),
        running: Vec::new(),
        asked_ms: 1,
    }
}

/// Every node's questions reach their owner through one router (oldest
/// first; with `follow`, new ones from any node as they come), and an
/// answer reaches the node holding its question, whichever that is.
#[tokio::test]
async fn questions_are_gathered_from_every_node_and_answers_find_theirs() {
    let f = fleet().await;
    f.cores[0].questions.lock().unwrap().push(question(3, "db"));
    f.cores[1].questions.lock().unwrap().extend([question(1, "web"), question(2, "web")]);
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let done = f.client.call_streaming(&act(Op::Questions { follow: false }), &tx).await.unwrap();
    assert_eq!(done, Reply::Done);
    let mut ids = Vec::new();
    while let Ok(Event::Question(q)) = rx.try_recv() {
        ids.push(q.id);
    }
    assert_eq!(ids, [1, 2, 3]);

    // Following: what is open, then a question asked on n1 meanwhile.
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let client = f.client.clone();
    let follow = tokio::spawn(async move { client.call_streaming(&act(Op::Questions { follow: true }), &tx).await });
    let mut seen = HashSet::new();
    async fn next(rx: &mut tokio::sync::mpsc::Receiver<Event>) -> Event {
        tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap()
    }
    for _ in 0..3 {
        let Event::Question(q) = next(&mut rx).await else { panic!() };
        seen.insert(q.id);
    }
    assert_eq!(seen, HashSet::from([1, 2, 3]));
    f.cores[0].questions.lock().unwrap().push(question(4, "db"));
    let Event::Question(q) = next(&mut rx).await else { panic!() };
    assert_eq!((q.id, q.box_name.as_str()), (4, "db"));
    follow.abort();

    // Answers: n2 holds 2, n1 holds 4; a number nobody holds is one line.
    for (id, box_name) in [(2, "web"), (4, "db")] {
        match f.client.call(&act(Op::Answer { id, answer: egress::Answer::Once })).await.unwrap() {
            Reply::Question(q) => assert_eq!((q.id, q.box_name.as_str()), (id, box_name)),
            other => panic!("{other:?}"),
        }
    }
    let none = f.client.call(&act(Op::Answer { id: 2, answer: egress::Answer::Deny })).await.unwrap_err();
    assert_eq!(none.message, "no open question 2 (answered already, or lapsed)");
    assert_eq!(f.cores[1].questions.lock().unwrap().iter().map(|q| q.id).collect::<Vec<_>>(), [1]);

    // n1 hangs with its lease live: n2's question is still answered, and a
    // number nobody took names the node that did not answer.
    *f.cores[0].hangs.lock().unwrap() = true;
    match f.client.call(&act(Op::Answer { id: 1, answer: egress::Answer::Once })).await {
        Ok(Reply::Question(q)) => assert_eq!(q.id, 1),
        other => panic!("{other:?}"),
    }
    let hung = f.client.call(&act(Op::Answer { id: 9, answer: egress::Answer::Deny })).await.unwrap_err();
    assert_eq!(
        hung.message,
        "no open question 9 (answered already, or lapsed), unless node n1 holds it: it is not answering (no answer within 5 s)"
    );
}

/// A key's account is believed for two seconds (a login asks twice), so a
/// key removed from the fleet stops logging in within them.
#[tokio::test]
async fn a_removed_key_stops_logging_in_within_two_seconds() {
    let f = fleet().await;
    let ok = Some(AccountId("SHA256:ok".into()));
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), ok);
    f.store.keys.lock().unwrap().clear();
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), ok, "believed for a moment");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), None);
}
