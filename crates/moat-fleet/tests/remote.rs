//! The core API between hosts, in one process with real TLS on loopback: a
//! front door's client, a router forwarding its dials (moat-api's dialer
//! served by an `Answer` that dials the node), and a node's listener
//! answering with a stand-in core. Requests, streamed requests and sessions
//! cross as they do on one host; peers without a member's certificate, and
//! hostile ones, are refused without a panic or a hang.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moat_api::proto::{Event, Op, Reply, Request, MAX_REQUEST};
use moat_api::server::Answer;
use moat_api::{ApiClient, Packets};
use moat_core::{AccountId, Name};
use moat_fleet::dial::{DialError, Dialer, Forwarded};
use moat_fleet::frame::{self, Kind};
use moat_fleet::listen::NodeListener;
use moat_fleet::peer::{Member, Membership, PeerError, Peers};
use moat_fleet::pki::{Ca, Leaf, Role};
use moat_fleet::tls::Identity;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// The members the store would list.
#[derive(Default)]
struct Members(Mutex<HashMap<String, Member>>);

impl Membership for Members {
    fn member(&self, serial: &str) -> Result<Option<Member>, String> {
        Ok(self.0.lock().unwrap().get(serial).cloned())
    }
}

impl Members {
    fn add(&self, leaf: &Leaf, role: Role, name: &str) {
        self.0.lock().unwrap().insert(leaf.serial.clone(), Member { name: name.into(), role });
    }
}

fn identity(ca: &Ca, leaf: &Leaf) -> Identity {
    Identity::from_pem(ca.cert_pem(), &leaf.cert.pem(), &leaf.key.serialize_pem()).unwrap()
}

/// A stand-in core: `Authorize` answers at once, `List` streams two
/// progress lines first, `OpenSession` hands over an echoing stream (that
/// closes on "bye") and reports on `leases` when its connection closes.
struct Core {
    leases: mpsc::UnboundedSender<&'static str>,
}

async fn send(conn: &Packets, event: &Event, fds: &[std::os::fd::BorrowedFd<'_>]) -> io::Result<()> {
    conn.send(&serde_json::to_vec(event).unwrap(), fds).await
}

impl Answer for Core {
    async fn answer(self: Arc<Self>, conn: Packets) -> io::Result<()> {
        let Some(msg) = conn.recv(MAX_REQUEST).await? else { return Ok(()) };
        match serde_json::from_slice::<Request>(&msg.bytes).unwrap() {
            Request::Authorize { key } => {
                let account = (key == "ssh-ed25519 AAAA").then(|| AccountId("SHA256:ok".into()));
                send(&conn, &Event::Outcome(Ok(Reply::Account(account))), &[]).await
            }
            Request::Act { op: Op::List, .. } => {
                for line in ["one", "two"] {
                    send(&conn, &Event::Progress(line.into()), &[]).await?;
                }
                send(&conn, &Event::Outcome(Ok(Reply::Boxes(Vec::new()))), &[]).await
            }
            Request::Act { op: Op::OpenSession { .. }, .. } => {
                let (agent, theirs) = std::os::unix::net::UnixStream::pair()?;
                std::thread::spawn(move || echo(agent));
                send(&conn, &Event::Outcome(Ok(Reply::Session)), &[theirs.as_fd()]).await?;
                drop(theirs);
                while conn.recv(1).await?.is_some() {}
                let _ = self.leases.send("lease dropped");
                Ok(())
            }
            Request::Act { .. } | Request::Web(_) => {
                let err = moat_api::ApiError { status: 3, message: "node n1 is full".into() };
                send(&conn, &Event::Outcome(Err(err)), &[]).await
            }
        }
    }
}

/// The agent stand-in: echoes until its peer ends or it reads "bye".
fn echo(mut agent: std::os::unix::net::UnixStream) {
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = agent.read(&mut buf) {
        if &buf[..n] == b"bye" {
            return;
        }
        if agent.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

/// The router stand-in: every dial goes to node n1.
struct Router {
    dialer: Dialer,
    node: SocketAddr,
    declined: mpsc::UnboundedSender<moat_api::ApiError>,
}

impl Answer for Router {
    async fn answer(self: Arc<Self>, conn: Packets) -> io::Result<()> {
        let Some(msg) = conn.recv(MAX_REQUEST).await? else { return Ok(()) };
        let link = self.dialer.dial("n1", &self.node.to_string()).await.map_err(io::Error::other)?;
        if let Forwarded::Declined(err) = link.forward(&conn, &msg.bytes, |e| e.status == 3).await? {
            self.declined.send(err).unwrap();
        }
        Ok(())
    }
}

struct Fleet {
    ca: Ca,
    members: Arc<Members>,
    node: SocketAddr,
    front: Identity,
    client: ApiClient,
    leases: mpsc::UnboundedReceiver<&'static str>,
    declined: mpsc::UnboundedReceiver<moat_api::ApiError>,
}

async fn fleet() -> Fleet {
    let ca = Ca::mint().unwrap();
    let members = Arc::new(Members::default());
    let n1 = ca.issue(Role::Node, "n1").unwrap();
    let f1 = ca.issue(Role::Front, "f1").unwrap();
    members.add(&n1, Role::Node, "n1");
    members.add(&f1, Role::Front, "f1");
    let peers = Peers::new(members.clone());
    let (leases_tx, leases) = mpsc::unbounded_channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node_addr = listener.local_addr().unwrap();
    let node = Arc::new(NodeListener {
        tls: identity(&ca, &n1).server_config().unwrap(),
        peers: Arc::clone(&peers),
        answerer: Arc::new(Core { leases: leases_tx }),
        handshake_timeout: Duration::from_millis(300),
        boxes: None,
    });
    tokio::spawn(node.serve(listener));
    let front = identity(&ca, &f1);
    let (declined_tx, declined) = mpsc::unbounded_channel();
    let router = Arc::new(Router {
        dialer: Dialer::new(front.client_config().unwrap(), peers),
        node: node_addr,
        declined: declined_tx,
    });
    let (ours, theirs) = Packets::pair().unwrap();
    tokio::spawn(moat_api::server::serve(Packets::new(ours).unwrap(), router));
    let client = ApiClient::new(Packets::new(theirs).unwrap());
    Fleet { ca, members, node: node_addr, front, client, leases, declined }
}

fn account() -> AccountId {
    AccountId("SHA256:ok".into())
}

#[tokio::test]
async fn requests_and_streamed_requests_cross() {
    let mut f = fleet().await;
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), Some(account()));
    assert_eq!(f.client.authorize("ssh-rsa BBBB").await.unwrap(), None);

    let (tx, mut rx) = mpsc::channel(8);
    let reply = f.client.call_streaming(&Request::Act { account: account(), op: Op::List }, &tx).await.unwrap();
    assert_eq!(reply, Reply::Boxes(Vec::new()));
    assert_eq!(rx.recv().await, Some(Event::Progress("one".into())));
    assert_eq!(rx.recv().await, Some(Event::Progress("two".into())));

    // An outcome the router declines does not reach the front door.
    let whoami = Request::Act { account: account(), op: Op::Whoami };
    let refused = tokio::time::timeout(Duration::from_secs(5), f.client.call(&whoami)).await.unwrap();
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(f.declined.recv().await.unwrap().message, "node n1 is full");
}

#[tokio::test]
async fn a_session_carries_bytes_both_ways_and_ends_from_either_side() {
    let mut f = fleet().await;
    let name = Name::new("web").unwrap();

    // The front door ends it: the node's lease goes.
    let (fd, lease) = f.client.open_session(&account(), &name).await.unwrap();
    let mut stream = moat_fleet::relay::unix_stream(fd).unwrap();
    let big: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
    let (mut r, mut w) = stream.split();
    let (_, back) = tokio::join!(async { w.write_all(&big).await.unwrap() }, async {
        let mut back = vec![0u8; big.len()];
        r.read_exact(&mut back).await.unwrap();
        back
    });
    assert!(back == big, "the echo came back changed");
    drop(lease);
    drop(stream);
    let ended = tokio::time::timeout(Duration::from_secs(5), f.leases.recv()).await.unwrap();
    assert_eq!(ended, Some("lease dropped"));

    // The box's side ends it: the front door reads the end and lets its
    // stream go (as the front door does once a session's channel ends), the
    // lease goes. (A front door holding its stream after the end would hold
    // the node's relay up to its 5 s of silence: the end is passed on as a
    // half close, and a port forward's other direction may still be moving.)
    let (fd, _lease) = f.client.open_session(&account(), &name).await.unwrap();
    let mut stream = moat_fleet::relay::unix_stream(fd).unwrap();
    stream.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"ping");
    stream.write_all(b"bye").await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await.unwrap();
    assert_eq!(read.unwrap(), 0);
    drop(stream);
    let ended = tokio::time::timeout(Duration::from_secs(3), f.leases.recv()).await.unwrap();
    assert_eq!(ended, Some("lease dropped"));
}

/// Connects to the node with `config` and sends a request; what it hears back.
async fn try_node(node: SocketAddr, config: Arc<rustls::ClientConfig>) -> io::Result<Option<(Kind, Vec<u8>)>> {
    let tcp = TcpStream::connect(node).await?;
    let mut tls = tokio_rustls::TlsConnector::from(config).connect("n1".try_into().unwrap(), tcp).await?;
    let req = serde_json::to_vec(&Request::Authorize { key: "ssh-ed25519 AAAA".into() }).unwrap();
    frame::write(&mut tls, Kind::Message, &req).await?;
    tokio::time::timeout(Duration::from_secs(5), frame::read(&mut tls, 1 << 20)).await.expect("the node hung")
}

#[tokio::test]
async fn only_members_of_the_right_role_are_answered() {
    let f = fleet().await;
    assert!(matches!(try_node(f.node, f.front.client_config().unwrap()).await, Ok(Some((Kind::Message, _)))));

    // From another CA; a fleet certificate never registered (or revoked); a
    // node's certificate where a front door's is expected.
    let other = Ca::mint().unwrap();
    let stranger = identity(&other, &other.issue(Role::Front, "f1").unwrap());
    let unregistered = identity(&f.ca, &f.ca.issue(Role::Front, "f9").unwrap());
    let n2 = f.ca.issue(Role::Node, "n2").unwrap();
    f.members.add(&n2, Role::Node, "n2");
    let wrong_role = identity(&f.ca, &n2);
    for who in [stranger, unregistered, wrong_role] {
        let heard = try_node(f.node, who.client_config().unwrap()).await;
        assert!(!matches!(heard, Ok(Some(_))), "{heard:?}");
    }
    // No certificate at all.
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(rustls::pki_types::CertificateDer::from_pem_slice(f.ca.cert_pem().as_bytes()));
    let bare = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let heard = try_node(f.node, Arc::new(bare)).await;
    assert!(!matches!(heard, Ok(Some(_))), "{heard:?}");

    // The router refuses a node whose certificate is not the node it dialed,
    // or not a member's.
    let dialer = Dialer::new(f.front.client_config().unwrap(), Peers::new(f.members.clone()));
    assert!(matches!(dialer.dial("n2", &f.node.to_string()).await, Err(DialError::Handshake { .. })));
    let mut revoked = f.members.0.lock().unwrap().clone();
    revoked.retain(|_, m| m.role != Role::Node);
    let dialer = Dialer::new(f.front.client_config().unwrap(), Peers::new(Arc::new(Members(Mutex::new(revoked)))));
    match dialer.dial("n1", &f.node.to_string()).await {
        Err(DialError::Peer { source: PeerError::NotMember(_), .. }) => {}
        other => panic!("{:?}", other.err()),
    }
}

use rustls::pki_types::pem::PemObject;

#[tokio::test]
async fn hostile_peers_are_refused_without_a_panic_or_a_hang() {
    let f = fleet().await;
    let config = f.front.client_config().unwrap();
    let connect = || async {
        let tcp = TcpStream::connect(f.node).await.unwrap();
        tokio_rustls::TlsConnector::from(Arc::clone(&config)).connect("n1".try_into().unwrap(), tcp).await.unwrap()
    };
    let closed = |mut tls: tokio_rustls::client::TlsStream<TcpStream>| async move {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest)).await;
        assert!(rest.is_empty(), "the node answered: {rest:?}");
        read.expect("the node hung")
    };

    // A frame announcing 4 GiB; a frame of an unknown kind; a request cut short.
    for bytes in [&[b'm', 0xff, 0xff, 0xff, 0xff, b'{'][..], b"GET / HTTP/1.1\r\n\r\n", &[b'm', 0, 0, 1, 0, b'{']] {
        let mut tls = connect().await;
        tls.write_all(bytes).await.unwrap();
        tls.flush().await.unwrap();
        let _ = closed(tls).await;
    }
    // Garbage instead of a handshake.
    let mut tcp = TcpStream::connect(f.node).await.unwrap();
    tcp.write_all(&[0x16, 0x03, 0x01, 0xff, 0xff, 1, 2, 3]).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut rest)).await.expect("the node hung");

    // A handshake that stalls, and a peer that never asks: dropped after
    // the handshake timeout, while others are answered meanwhile.
    let mut stalled = TcpStream::connect(f.node).await.unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
    let silent = connect().await;
    let started = Instant::now();
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), Some(account()));
    let mut rest = Vec::new();
    let stalled_end = tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut rest)).await;
    assert!(stalled_end.is_ok(), "a stalled handshake was kept");
    let _ = closed(silent).await;
    assert!(started.elapsed() < Duration::from_secs(3));

    // The node still answers.
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), Some(account()));
}

/// A node that answers with what no node sends: the front door hears an
/// error, at once, and the router goes on.
#[tokio::test]
async fn a_hostile_node_is_an_error_not_a_panic_or_a_hang() {
    let f = fleet().await;
    let n1 = f.ca.issue(Role::Node, "n1").unwrap();
    f.members.add(&n1, Role::Node, "n1");
    let acceptor = tokio_rustls::TlsAcceptor::from(identity(&f.ca, &n1).server_config().unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hostile = listener.local_addr().unwrap();
    let answers: [&[u8]; 4] = [
        &[b'm', 0xff, 0xff, 0xff, 0xff, b'{'],
        &[b'z', 0, 0, 0, 2, b'{', b'}'],
        &[b'm', 0, 0, 0, 9, b'{'],
        &[b'm', 0, 0, 0, 5, b'h', b'e', b'l', b'l', b'o'],
    ];
    tokio::spawn(async move {
        for answer in answers {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut tls = acceptor.accept(tcp).await.unwrap();
            frame::read(&mut tls, MAX_REQUEST).await.unwrap();
            tls.write_all(answer).await.unwrap();
            tls.flush().await.unwrap();
            // Then the connection ends (cut frames end here).
        }
    });
    let (declined, _) = mpsc::unbounded_channel();
    let router = Arc::new(Router {
        dialer: Dialer::new(f.front.client_config().unwrap(), Peers::new(f.members.clone())),
        node: hostile,
        declined,
    });
    let (ours, theirs) = Packets::pair().unwrap();
    tokio::spawn(moat_api::server::serve(Packets::new(ours).unwrap(), router));
    let client = ApiClient::new(Packets::new(theirs).unwrap());
    for _ in 0..4 {
        let heard = tokio::time::timeout(Duration::from_secs(5), client.authorize("ssh-ed25519 AAAA")).await;
        assert!(heard.expect("the router hung").is_err());
    }
    // The router and the fleet still work.
    assert_eq!(f.client.authorize("ssh-ed25519 AAAA").await.unwrap(), Some(account()));
}

/// The added latency of one request through router and node over TLS,
/// against the same request on a unix dialer: `cargo test --release -p
/// moat-fleet --test remote -- --ignored --nocapture latency`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; prints a table"]
async fn latency() {
    const N: usize = 2000;
    let f = fleet().await;
    let (ours, theirs) = Packets::pair().unwrap();
    let (leases, _) = mpsc::unbounded_channel();
    tokio::spawn(moat_api::server::serve(Packets::new(ours).unwrap(), Arc::new(Core { leases })));
    let local = ApiClient::new(Packets::new(theirs).unwrap());
    let mut rows = Vec::new();
    for (what, client) in [("unix socket (one host)", &local), ("router + node (mTLS TCP)", &f.client)] {
        let mut times = Vec::with_capacity(N);
        for _ in 0..N {
            let t = Instant::now();
            client.authorize("ssh-ed25519 AAAA").await.unwrap();
            times.push(t.elapsed());
        }
        times.sort();
        rows.push((what, times[N / 2], times[N * 99 / 100]));
        // A session: opened, one echo both ways, closed (what `ssh box true` adds up).
        let name = Name::new("web").unwrap();
        let mut times = Vec::with_capacity(N / 4);
        for _ in 0..N / 4 {
            let t = Instant::now();
            let (fd, lease) = client.open_session(&account(), &name).await.unwrap();
            let mut stream = moat_fleet::relay::unix_stream(fd).unwrap();
            stream.write_all(b"x").await.unwrap();
            stream.read_exact(&mut [0u8; 1]).await.unwrap();
            drop((stream, lease));
            times.push(t.elapsed());
        }
        times.sort();
        rows.push((what, times[N / 8], times[N / 4 * 99 / 100]));
    }
    println!("{:<50} {:>10} {:>10}", "", "p50", "p99");
    for ((what, p50, p99), kind) in rows.iter().zip(["one request", "a session and one echo"].iter().cycle()) {
        let what = format!("{kind}, {what}");
        println!("{what:<50} {:>8.3}ms {:>8.3}ms", p50.as_secs_f64() * 1e3, p99.as_secs_f64() * 1e3);
    }
    let added = |a: usize, b: usize| (rows[b].1.as_secs_f64() - rows[a].1.as_secs_f64()) * 1e3;
    println!("added p50: {:.3}ms a request, {:.3}ms a session", added(0, 2), added(1, 3));
}
