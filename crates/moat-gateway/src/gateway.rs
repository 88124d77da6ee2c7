//! The gateway as a whole: the boxes attached to it, and what it does with
//! each message from the privileged side (see [`crate::messages`]).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, PoisonError};

use moat_core::BoxId;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::admission::Admission;
use crate::ask::Asker;
use crate::boxnet::{BoxNet, Shared};
use crate::log::LogSink;
use crate::messages::{FromGateway, Role, ToGateway};
use crate::packages::Registries;
use crate::secrets::meter::Meters;
use crate::tls::intercept;
use crate::tls::leaves::LeafSigner;
use crate::upstream::{Upstream, UpstreamConfig};
use crate::{dns, dropped, proxy};

struct Attached {
    net: Arc<BoxNet>,
    tasks: Vec<JoinHandle<()>>,
}

impl Attached {
    /// Serves the box on `sockets` too.
    fn listen(&mut self, roles: Vec<Role>, sockets: Vec<OwnedFd>) -> std::io::Result<()> {
        if roles.len() != sockets.len() {
            return Err(std::io::Error::other("sockets and roles differ in number"));
        }
        for (role, fd) in roles.into_iter().zip(sockets) {
            self.tasks.push(spawn_listener(&self.net, role, fd)?);
        }
        Ok(())
    }

    /// Ends the box's connections and closes its sockets.
    fn close(&mut self) {
        self.net.cut();
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.close();
    }
}

/// The boxes being served.
pub struct Gateway {
    boxes: Mutex<HashMap<BoxId, Attached>>,
    shared: Shared,
    admission: Admission,
    meters: Meters,
}

impl Gateway {
    /// A gateway reaching out through `upstream`, taking connections as
    /// `admission` allows, logging to `log`, asking boxes' owners through
    /// `questions`.
    pub fn new(
        upstream: UpstreamConfig,
        registries: Registries,
        admission: Admission,
        log: LogSink,
        questions: mpsc::UnboundedSender<FromGateway>,
    ) -> Self {
        let shared = Shared {
            log,
            upstream: Arc::new(Upstream::new(upstream)),
            asker: Arc::new(Asker::new(questions)),
            registries: Arc::new(registries),
            holds: crate::proxy::push::holds(),
            account_holds: crate::proxy::push::account_holds(),
        };
        Self { boxes: Mutex::new(HashMap::new()), shared, admission, meters: Meters::default() }
    }

    /// Acts on one message (`fds`: the sockets attached to it). Must run
    /// inside a tokio runtime.
    pub fn handle(&self, msg: ToGateway, fds: Vec<OwnedFd>) -> std::io::Result<()> {
        let mut boxes = self.boxes.lock().unwrap_or_else(PoisonError::into_inner);
        match msg {
            ToGateway::Attach { box_id, account, policy, ca_key, roles } => {
                // Without its CA a box still gets everything but the hosts
                // whose rules need HTTPS looked inside.
                let tls = ca_key.map(|key| LeafSigner::new(&key.0).and_then(intercept::box_config)).transpose();
                let tls = tls.unwrap_or_else(|e| {
                    tracing::error!(box_id = %box_id, error = %e, "cannot use the box's CA");
                    None
                });
                let gate = self.admission.gate(&account);
                let net = BoxNet::new(box_id.clone(), policy, tls, gate, &self.shared);
                let mut attached = Attached { net, tasks: Vec::new() };
                attached.listen(roles, fds).map_err(|e| std::io::Error::new(e.kind(), format!("attach: {e}")))?;
                // A box attached again (a gateway restart, a reboot) replaces the old.
                boxes.insert(box_id, attached);
            }
            ToGateway::Listen { box_id, roles } => {
                if let Some(b) = boxes.get_mut(&box_id) {
                    b.listen(roles, fds).map_err(|e| std::io::Error::new(e.kind(), format!("listen: {e}")))?;
                }
            }
            ToGateway::Policy { box_id, policy } => {
                if let Some(b) = boxes.get(&box_id) {
                    b.net.set_policy(policy);
                }
            }
            ToGateway::Secrets { box_id, secrets } => {
                if let Some(b) = boxes.get(&box_id) {
                    b.net.set_secrets(secrets, &self.meters);
                }
            }
            ToGateway::Suspend { box_id } => {
                if let Some(b) = boxes.get_mut(&box_id) {
                    b.close();
                    tracing::debug!(%box_id, "a suspended box's sockets closed");
                }
            }
            ToGateway::Detach { box_id } => {
                boxes.remove(&box_id);
                self.shared.asker.withdraw(&box_id);
            }
            ToGateway::Answer { id, answer } => self.shared.asker.answered(id, answer),
        }
        Ok(())
    }
}

fn spawn_listener(net: &Arc<BoxNet>, role: Role, fd: OwnedFd) -> std::io::Result<JoinHandle<()>> {
    let net = Arc::clone(net);
    let tcp = |fd: OwnedFd| {
        let listener = std::net::TcpListener::from(fd);
        listener.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(listener)
    };
    Ok(match role {
        Role::DnsUdp => {
            let socket = std::net::UdpSocket::from(fd);
            socket.set_nonblocking(true)?;
            tokio::spawn(dns::server::serve_udp(net, tokio::net::UdpSocket::from_std(socket)?))
        }
        Role::DnsTcp => tokio::spawn(dns::server::serve_tcp(net, tcp(fd)?)),
        Role::Proxy => tokio::spawn(proxy::serve(net, tcp(fd)?)),
        Role::Dropped => tokio::spawn(dropped::serve(net, fd)),
    })
}
