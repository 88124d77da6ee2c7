//! The privileged side facing a front door that misbehaves: malformed,
//! oversized or fd-carrying requests get an error or a closed connection,
//! never a panic, and a malformed dial ends the serving (the supervisor then
//! kills that front door).

#![allow(missing_docs, clippy::unwrap_used)]

use std::os::fd::AsFd;
use std::sync::Arc;

use moat_api::proto::{Event, Op, Reply, Request};
use moat_api::server::{serve, Privileged};
use moat_api::Packets;
use moat_core::backend::Progress;
use moat_core::{
    AccountId, Backend, BackendError, BoxHandle, BoxManager, BoxRecord, ChangeSink, ManagerConfig, MeterReading, Name,
    Store,
};

/// A backend with no images: enough for requests that never make a box.
struct NoBoxes;

impl Backend for NoBoxes {
    fn has_image(&self, _: &Name) -> bool {
        false
    }
    fn build_image(&self, _: &Name, _: Progress<'_>) -> Result<(), BackendError> {
        Err(BackendError::msg("no"))
    }
    fn create(&self, _: &BoxRecord) -> Result<(), BackendError> {
        Err(BackendError::msg("no"))
    }
    fn start(&self, _: &BoxRecord) -> Result<BoxHandle, BackendError> {
        Err(BackendError::msg("no"))
    }
    fn is_running(&self, _: &BoxRecord) -> bool {
        false
    }
    fn stop(&self, _: &BoxRecord) -> Result<(), BackendError> {
        Ok(())
    }
    fn destroy(&self, _: &BoxRecord) -> Result<(), BackendError> {
        Ok(())
    }
    fn handle(&self, _: &BoxRecord) -> Option<BoxHandle> {
        None
    }
    fn dup(&self, _: &BoxRecord, _: &BoxRecord) -> Result<moat_core::Copied, BackendError> {
        Err(BackendError::msg("no"))
    }
    fn set_environment(&self, _: &BoxRecord, _: &[(String, Option<String>)]) -> Result<(), BackendError> {
        Err(BackendError::msg("no"))
    }
    fn diff(&self, _: &BoxRecord, _: &BoxRecord, _: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        Ok(())
    }
    fn rename(&self, _: &BoxRecord, _: &Name) -> Result<(), BackendError> {
        Ok(())
    }
    fn adopt(&self, _: &BoxRecord, _: &moat_core::AccountId) -> Result<(), BackendError> {
        Err(BackendError::msg("no boxes"))
    }
    fn checkpoint(&self, _: &BoxRecord, _: &Name) -> Result<(), BackendError> {
        Err(BackendError::msg("no boxes"))
    }
    fn checkpoints(&self, _: &BoxRecord, _: bool) -> Vec<moat_core::Checkpoint> {
        Vec::new()
    }
    fn restore(&self, _: &BoxRecord, _: &Name, _: &Name) -> Result<(), BackendError> {
        Err(BackendError::msg("no boxes"))
    }
    fn delete_checkpoint(&self, _: &BoxRecord, _: &Name) -> Result<(), BackendError> {
        Err(BackendError::msg("no boxes"))
    }
    fn thaw(&self, _: &BoxRecord) -> Result<(), BackendError> {
        Ok(())
    }
    fn suspend(&self, _: &BoxRecord) -> Result<(), BackendError> {
        Ok(())
    }
    fn meter(&self, _: &BoxRecord) -> Option<MeterReading> {
        None
    }
    fn disk_usage(&self, _: &BoxRecord) -> Option<u64> {
        None
    }
    fn account_disk_usage(&self, _: &AccountId) -> Option<u64> {
        None
    }
}

/// A served dialer and the front door's end of it.
fn start() -> (Packets, tokio::task::JoinHandle<std::io::Result<()>>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("moat.db")).unwrap();
    let manager = BoxManager::new(store, Arc::new(NoBoxes), ManagerConfig::default());
    let authorize = Box::new(|key: &str| (key == "ssh-ed25519 AAAA").then(|| AccountId("SHA256:ok".into())));
    let privileged = Arc::new(Privileged {
        manager,
        authorize,
        default_policy: Default::default(),
        registries: Vec::new(),
        web: None,
    });
    let (ours, theirs) = Packets::pair().unwrap();
    let server = tokio::spawn(serve(Packets::new(ours).unwrap(), privileged));
    (Packets::new(theirs).unwrap(), server, dir)
}

async fn dial(dialer: &Packets) -> Packets {
    dialer.send(b"d", &[]).await.unwrap();
    let msg = dialer.recv(1).await.unwrap().unwrap();
    Packets::new(msg.fds.into_iter().next().unwrap()).unwrap()
}

async fn outcome(conn: &Packets) -> Option<Event> {
    let msg = conn.recv(1 << 20).await.ok()??;
    Some(serde_json::from_slice(&msg.bytes).unwrap())
}

#[tokio::test]
async fn bad_requests_get_errors_or_a_closed_connection() {
    let (dialer, server, _dir) = start();

    let conn = dial(&dialer).await;
    conn.send(b"{\"list\":{\"account\":", &[]).await.unwrap();
    match outcome(&conn).await {
        Some(Event::Outcome(Err(e))) => assert!(e.message.contains("malformed request"), "{e:?}"),
        other => panic!("{other:?}"),
    }

    // An invalid name is refused at decoding, before the manager sees it.
    let conn = dial(&dialer).await;
    conn.send(br#"{"act":{"account":"SHA256:ok","op":{"get":{"name":"../../etc"}}}}"#, &[]).await.unwrap();
    assert!(matches!(outcome(&conn).await, Some(Event::Outcome(Err(_)))));
    // So is a rule the front door's parser would not have made (the core
    // applies rules as they decode), a secret value that would break out of
    // its header, and a limit of nothing.
    for bad in [
        r#"{"change_policy":{"name":"web","change":{"allow":{"host":{"exact":"x.org"},"ports":[0]}}}}"#,
        r#"{"change_policy":{"name":"web","change":{"deny":{"host":{"exact":"x.org"},"ports":null,"path":"/a/../b"}}}}"#,
        r#"{"change_policy":{"name":"web","change":{"allow":{"host":{"exact":"x.org"},"ports":null,"methods":["get"]}}}}"#,
        r#"{"change_policy":{"name":"web","change":{"preset":"everything"}}}"#,
        r#"{"secret_add":{"spec":{"name":"k","host":"x.org","header":"x-k","format":"{}","env":"K"},"value":"0123456789abcdef
x-evil: 1"}}"#,
        r#"{"secret_limit":{"name":"k","box_name":null,"limits":[{"kind":"requests","amount":0,"per_secs":60}]}}"#,
    ] {
        let conn = dial(&dialer).await;
        let req = format!(r#"{{"act":{{"account":"SHA256:ok","op":{bad}}}}}"#);
        conn.send(req.as_bytes(), &[]).await.unwrap();
        match outcome(&conn).await {
            Some(Event::Outcome(Err(e))) => assert!(e.message.contains("malformed request"), "{bad}: {e:?}"),
            other => panic!("{bad}: {other:?}"),
        }
    }

    // Too big, or carrying a descriptor: no answer, the connection is dropped.
    let conn = dial(&dialer).await;
    conn.send(&vec![b' '; 64 << 10], &[]).await.unwrap();
    assert!(outcome(&conn).await.is_none());
    let conn = dial(&dialer).await;
    let (a, _b) = Packets::pair().unwrap();
    conn.send(br#"{"act":{"account":"SHA256:ok","op":"list"}}"#, &[a.as_fd()]).await.unwrap();
    assert!(outcome(&conn).await.is_none());

    // Good requests still work on the same dialer.
    let conn = dial(&dialer).await;
    let list = serde_json::to_vec(&Request::Act { account: AccountId("SHA256:ok".into()), op: Op::List }).unwrap();
    conn.send(&list, &[]).await.unwrap();
    assert!(matches!(outcome(&conn).await, Some(Event::Outcome(Ok(Reply::Boxes(b)))) if b.is_empty()));
    let conn = dial(&dialer).await;
    conn.send(&serde_json::to_vec(&Request::Authorize { key: "ssh-rsa AAAA".into() }).unwrap(), &[]).await.unwrap();
    assert!(matches!(outcome(&conn).await, Some(Event::Outcome(Ok(Reply::Account(None))))));
    // `whoami` answers with the operator's caps.
    let conn = dial(&dialer).await;
    let whoami = Request::Act { account: AccountId("SHA256:ok".into()), op: Op::Whoami };
    conn.send(&serde_json::to_vec(&whoami).unwrap(), &[]).await.unwrap();
    match outcome(&conn).await {
        Some(Event::Outcome(Ok(Reply::Whoami(me)))) => {
            assert_eq!((me.account.0.as_str(), me.fingerprint.as_str(), me.boxes), ("SHA256:ok", "SHA256:ok", 0));
            assert_eq!(me.limits.max_boxes, ManagerConfig::default().max_boxes);
        }
        other => panic!("{other:?}"),
    }
    // A session on a box that does not exist is an error, with no descriptor.
    let conn = dial(&dialer).await;
    let open = Request::Act {
        account: AccountId("SHA256:ok".into()),
        op: Op::OpenSession { name: Name::new("web").unwrap(), owner: None },
    };
    conn.send(&serde_json::to_vec(&open).unwrap(), &[]).await.unwrap();
    let msg = conn.recv(1 << 20).await.unwrap().unwrap();
    assert!(msg.fds.is_empty());
    assert!(matches!(serde_json::from_slice(&msg.bytes).unwrap(), Event::Outcome(Err(_))));

    // A dial that is not one ends the serving.
    dialer.send(b"x", &[]).await.unwrap();
    assert!(server.await.unwrap().is_err());
}
