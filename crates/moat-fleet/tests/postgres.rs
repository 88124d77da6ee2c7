//! The fleet's pieces on a real PostgreSQL (a private cluster the test
//! starts): `init`, `token` and `join` through the store (a token joins
//! once, a revoked member is no peer), and a router reading keys, nodes and
//! boxes' places from it, in front of a node over real TLS.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use moat_api::proto::{ApiError, Event, Op, Reply, Request, MAX_REQUEST};
use moat_api::server::Answer;
use moat_api::{ApiClient, Packets};
use moat_core::store::nodes::NodeOffer;
use moat_core::{AccountId, BackendKind, Limits, Name, Store};
use moat_fleet::dial::Dialer;
use moat_fleet::join::{self, FleetDir, JoinError, Token};
use moat_fleet::listen::NodeListener;
use moat_fleet::peer::{Member, Peers};
use moat_fleet::pki::Role;
use moat_fleet::router::Router;
use moat_fleet::store::{FleetStore, StoreMembers};

const HOST_KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nstand-in\n-----END OPENSSH PRIVATE KEY-----\n";

/// A node's stand-in core: says which node it is.
struct Core(&'static str);

impl Answer for Core {
    async fn answer(self: Arc<Self>, conn: Packets) -> std::io::Result<()> {
        let _ = conn.recv(MAX_REQUEST).await?;
        let outcome: Result<Reply, ApiError> = Ok(Reply::Name(Name::new(self.0).unwrap()));
        conn.send(&serde_json::to_vec(&Event::Outcome(outcome)).unwrap(), &[]).await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fleet_made_joined_and_routed_through_postgres() {
    let pg = moat_testkit::postgres::Postgres::shared();
    let dsn = pg.create_db();
    let store = Arc::new(Store::connect(&dsn).unwrap());
    let admin = tempfile::tempdir().unwrap();
    join::init(&*store, &dsn, admin.path(), HOST_KEY).unwrap();
    assert!(matches!(
        join::init(&*store, &dsn, tempfile::tempdir().unwrap().path(), HOST_KEY),
        Err(JoinError::Already(_))
    ));

    // A node and a front door join; a token joins once.
    let mut dirs = Vec::new();
    for (role, name) in [(Role::Node, "n1"), (Role::Front, "f1")] {
        let token = Token::decode(&join::token(&*store, admin.path(), role, name).unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        join::join(&*store, &token, dir.path()).unwrap();
        let again = join::join(&*store, &token, tempfile::tempdir().unwrap().path()).unwrap_err();
        assert!(again.to_string().starts_with(&format!("this token cannot join {} {name}", role.as_str())), "{again}");
        let member = FleetStore::member(&*store, &token.member.serial).unwrap();
        assert_eq!(member, Some(Member { name: name.into(), role }));
        dirs.push((FleetDir::load(dir.path()).unwrap(), dir));
    }
    let (node, front) = (&dirs[0].0, &dirs[1].0);
    assert_eq!(front.host_key(&*store).unwrap(), HOST_KEY);

    // The node listens; the store knows it and one box on it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let offer = NodeOffer {
        name: "n1".into(),
        address: listener.local_addr().unwrap().to_string(),
        cpus: 8,
        memory: 16 << 30,
        disk: 100 << 30,
        max_boxes: 10,
    };
    store.renew_lease(&offer).unwrap();
    let alice = AccountId("SHA256:alice".into());
    let on_node = Store::connect(&dsn).unwrap().for_node("n1");
    let made = (&Name::new("debian").unwrap(), Limits::default(), BackendKind::Ns);
    let web = on_node.insert_new(&alice, &Name::new("web").unwrap(), made, 1, &Default::default()).unwrap();
    let nodes = FleetStore::nodes(&*store).unwrap();
    assert_eq!((nodes.len(), nodes[0].free_boxes, nodes[0].free_cpus), (1, 9, 8 - u64::from(web.limits.cpus)));
    let place = store.place(&alice, &Name::new("web").unwrap()).unwrap().unwrap();
    assert_eq!((place.node.as_str(), place.epoch), ("n1", web.epoch));

    let peers = Peers::new(Arc::new(StoreMembers(Arc::clone(&store))));
    let listen = Arc::new(NodeListener {
        tls: node.identity.server_config().unwrap(),
        peers: Arc::clone(&peers),
        answerer: Arc::new(Core("n1")),
        handshake_timeout: Duration::from_secs(5),
        boxes: None,
    });
    tokio::spawn(listen.serve(listener));
    let router = Router::new(Arc::clone(&store), Dialer::new(front.identity.client_config().unwrap(), peers));
    let (ours, theirs) = Packets::pair().unwrap();
    tokio::spawn(moat_api::server::serve(Packets::new(ours).unwrap(), router));
    let client = ApiClient::new(Packets::new(theirs).unwrap());

    // Keys imported into the store are accounts at every front door.
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl";
    assert_eq!(client.authorize(key).await.unwrap(), None);
    assert!(store.add_fleet_key(&alice, key).unwrap());
    assert_eq!(client.authorize(key).await.unwrap(), Some(alice.clone()));
    let get = Request::Act { account: alice.clone(), op: Op::Get { name: Name::new("web").unwrap() } };
    assert_eq!(client.call(&get).await.unwrap(), Reply::Name(Name::new("n1").unwrap()));

    // A revoked node is no peer (once what was known of it is stale).
    assert!(store.revoke_member(&node.member.serial).unwrap());
    assert_eq!(FleetStore::member(&*store, &node.member.serial).unwrap(), None);
    tokio::time::sleep(Duration::from_millis(5100)).await;
    let refused = client.call(&get).await.unwrap_err();
    assert!(refused.message.contains("is not a member of this fleet"), "{}", refused.message);
}
