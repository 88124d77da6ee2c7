//! The gateway as a whole: the boxes attached to it, and the messages the
//! privileged side sends it (attach a box with its listeners, change its
//! policy, cut its connections, detach it) and gets back (log entries).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, PoisonError};

use moat_core::egress::{Answer, LogEntry};
use moat_core::policy::Policy;
use moat_core::secrets::BoxSecret;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::ask::Asker;
use crate::boxnet::{BoxNet, LogSink};
use crate::ca::{CaKey, LeafSigner};
use crate::inject::Meters;
use crate::upstream::{Cidr, Upstream, UpstreamConfig};
use crate::{dnsd, dropped, intercept, proxy};

/// Largest message either side reads.
pub const MAX_MESSAGE: usize = 1 << 20;

/// The first message to the gateway: how it reaches the internet.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GatewayHello {
    /// The resolver it asks.
    pub upstream_dns: std::net::SocketAddr,
    /// Ranges it may dial although they are not public (`ADDR/PREFIX`).
    pub upstream_allow: Vec<String>,
    /// The roots (PEM) it verifies hosts with where it looks inside HTTPS.
    pub upstream_roots: String,
}

impl GatewayHello {
    /// The upstream configuration it describes.
    pub fn upstream(&self) -> Result<UpstreamConfig, String> {
        let allow = self.upstream_allow.iter().map(|c| c.parse::<Cidr>()).collect::<Result<_, _>>()?;
        let tls = match intercept::upstream_config(&self.upstream_roots) {
            Ok(tls) => Some(tls),
            Err(e) => {
                tracing::warn!(error = %e, "HTTPS the gateway looks inside will fail");
                None
            }
        };
        Ok(UpstreamConfig { dns: self.upstream_dns, allow, tls })
    }
}

/// What a listener handed over with [`ToGateway::Attach`] is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// DNS over UDP (a bound UDP socket).
    DnsUdp,
    /// DNS over TCP (a listening socket).
    DnsTcp,
    /// Every other TCP connection (a listening socket).
    Proxy,
    /// Reports of the UDP and ICMP the box's namespace drops (a netlink log
    /// socket bound to its group).
    Dropped,
}

/// From the privileged side.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ToGateway {
    /// Serve a box on the attached sockets, one per role listed, in order.
    Attach {
        /// The box's host-side id.
        box_id: String,
        /// Its policy.
        policy: Policy,
        /// The private key of the TLS CA the box trusts, if it has one.
        ca_key: Option<CaKey>,
        /// What each attached socket is.
        roles: Vec<Role>,
    },
    /// A box's new policy; connections open keep the one they started with.
    Policy {
        /// The box.
        box_id: String,
        /// The policy.
        policy: Policy,
    },
    /// A box's secrets (all it has now), opened.
    Secrets {
        /// The box.
        box_id: String,
        /// The secrets.
        secrets: Vec<BoxSecret>,
    },
    /// End a box's open connections (it was suspended).
    Cut {
        /// The box.
        box_id: String,
    },
    /// Stop serving a box and close its sockets.
    Detach {
        /// The box.
        box_id: String,
    },
    /// The owner's answer to question `id` (see [`FromGateway::Ask`]).
    Answer {
        /// The question.
        id: u64,
        /// The answer.
        answer: Answer,
    },
}

/// To the privileged side.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FromGateway {
    /// Audit log entries: (box id, entry).
    Log {
        /// The entries, oldest first.
        entries: Vec<(String, LogEntry)>,
    },
    /// A box in ask mode wants a name its policy does not allow: ask its
    /// owner, and send the answer back with this `id`.
    Ask {
        /// The box.
        box_id: String,
        /// The question's number.
        id: u64,
        /// The name.
        name: String,
        /// The port dialled (`None`: a DNS query).
        port: Option<u16>,
    },
}

struct Attached {
    net: Arc<BoxNet>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.net.cut();
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The boxes being served.
pub struct Gateway {
    boxes: Mutex<HashMap<String, Attached>>,
    upstream: Arc<Upstream>,
    log: LogSink,
    asker: Arc<Asker>,
    meters: Meters,
}

impl Gateway {
    /// A gateway reaching out through `upstream`, logging to `log`, asking
    /// boxes' owners through `questions`.
    pub fn new(upstream: UpstreamConfig, log: LogSink, questions: mpsc::UnboundedSender<FromGateway>) -> Self {
        Self {
            boxes: Mutex::new(HashMap::new()),
            upstream: Arc::new(Upstream::new(upstream)),
            log,
            asker: Arc::new(Asker::new(questions)),
            meters: Meters::default(),
        }
    }

    /// Acts on one message (`fds`: the sockets attached to it). Must run
    /// inside a tokio runtime.
    pub fn handle(&self, msg: ToGateway, fds: Vec<OwnedFd>) -> std::io::Result<()> {
        let mut boxes = self.boxes.lock().unwrap_or_else(PoisonError::into_inner);
        match msg {
            ToGateway::Attach { box_id, policy, ca_key, roles } => {
                if roles.len() != fds.len() {
                    return Err(std::io::Error::other("attach: sockets and roles differ in number"));
                }
                // Without its CA a box still gets everything but the hosts
                // whose rules need HTTPS looked inside.
                let tls = ca_key.map(|key| LeafSigner::new(&key.0).and_then(intercept::box_config)).transpose();
                let tls = tls.unwrap_or_else(|e| {
                    tracing::error!(box_id, error = %e, "cannot use the box's CA");
                    None
                });
                let net = BoxNet::new(
                    box_id.clone(),
                    policy,
                    tls,
                    self.log.clone(),
                    Arc::clone(&self.upstream),
                    Arc::clone(&self.asker),
                );
                let mut tasks = Vec::new();
                for (role, fd) in roles.into_iter().zip(fds) {
                    tasks.push(spawn_listener(&net, role, fd)?);
                }
                // A box attached again (a gateway restart, a reboot) replaces the old.
                boxes.insert(box_id, Attached { net, tasks });
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
            ToGateway::Cut { box_id } => {
                if let Some(b) = boxes.get(&box_id) {
                    b.net.cut();
                }
            }
            ToGateway::Detach { box_id } => {
                boxes.remove(&box_id);
                self.asker.withdraw(&box_id);
            }
            ToGateway::Answer { id, answer } => self.asker.answered(id, answer),
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
            tokio::spawn(dnsd::serve_udp(net, tokio::net::UdpSocket::from_std(socket)?))
        }
        Role::DnsTcp => tokio::spawn(dnsd::serve_tcp(net, tcp(fd)?)),
        Role::Proxy => tokio::spawn(proxy::serve(net, tcp(fd)?)),
        Role::Dropped => tokio::spawn(dropped::serve(net, fd)),
    })
}
