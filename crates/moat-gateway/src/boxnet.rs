//! One box as the gateway sees it: its policy, the fake addresses it was
//! given, its secrets, what its owner said lately in ask mode, its logger, and
//! the switch that cuts its connections. (Its listeners' tasks are the
//! gateway's, in [`crate::gateway`].)

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use moat_core::egress::{Answer, LogEntry};
use moat_core::policy::{HostName, Policy, Rule, Verdict};
use moat_core::secrets::BoxSecret;
use moat_core::BoxId;
use tokio::sync::watch;

use crate::admission::Gate;
use crate::ask::{Asked, Asker, Recent};
use crate::fake::FakeAddrs;
use crate::log::{LogSink, Logger};
use crate::packages::Registries;
use crate::refusal::Refusal;
use crate::secrets::meter::{Armed, Meters};
use crate::upstream::Upstream;

/// What every attached box uses.
#[derive(Clone)]
pub struct Shared {
    /// Where log entries go.
    pub log: LogSink,
    /// The way out.
    pub upstream: Arc<Upstream>,
    /// Ask mode's questions.
    pub asker: Arc<Asker>,
    /// The package cache and OSV database.
    pub registries: Arc<Registries>,
    /// Turns to hold a push's body (see [`crate::proxy::push`]).
    pub holds: Arc<tokio::sync::Semaphore>,
    /// Each account's turns to hold a push's body.
    pub account_holds: Arc<moat_core::slots::Slots<moat_core::AccountId>>,
}

/// What let a connection through, and so what a change of policy does to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Grounds {
    /// The policy: the connection lives under the policy as it changes.
    Policy,
    /// Its owner's answer in ask mode, as this rule (it is not in the
    /// policy): only a rule that denies the name ends it.
    Owner(Rule),
}

/// One attached box.
pub struct BoxNet {
    /// The box's host-side id.
    pub id: BoxId,
    policy: RwLock<Arc<Policy>>,
    /// Bumped whenever the policy is replaced.
    policy_changed: watch::Sender<u64>,
    fakes: Mutex<FakeAddrs>,
    cut: watch::Sender<u64>,
    /// Its connections' count, its account's and the gateway's.
    pub gate: Gate,
    logger: Logger,
    /// The way out.
    pub upstream: Arc<Upstream>,
    /// The TLS the box is answered with where the gateway looks inside HTTPS
    /// (`None`: the box has no CA, and such hosts are refused).
    pub tls: Option<Arc<rustls::ServerConfig>>,
    asker: Arc<Asker>,
    recent: Recent,
    secrets: RwLock<Arc<Vec<Armed>>>,
    /// Bumped whenever the secrets are replaced.
    secrets_changed: watch::Sender<u64>,
    /// The package cache and OSV database every box shares.
    pub registries: Arc<Registries>,
    /// Turns to hold a push's body: this box's, its account's, everyone's.
    pub holds: crate::proxy::push::BoxTurns,
    /// The gateway's own connections to registries for this box's reads,
    /// kept between them (no connection carries two boxes' requests).
    pub registry_conns: Arc<crate::packages::fetch::Idle>,
}

impl BoxNet {
    /// A box with `policy`, its connections counted by `gate`.
    pub fn new(
        id: BoxId,
        policy: Policy,
        tls: Option<Arc<rustls::ServerConfig>>,
        gate: Gate,
        shared: &Shared,
    ) -> Arc<Self> {
        let Shared { log, upstream, asker, registries, holds, account_holds } = shared.clone();
        let holds = crate::proxy::push::BoxTurns::new(holds, account_holds, gate.account().clone());
        let logger = Logger::new(id.clone(), log);
        Arc::new(Self {
            id,
            policy: RwLock::new(Arc::new(policy)),
            policy_changed: watch::channel(0).0,
            fakes: Mutex::new(FakeAddrs::default()),
            cut: watch::channel(0).0,
            gate,
            logger,
            upstream,
            tls,
            asker,
            recent: Recent::default(),
            secrets: RwLock::new(Arc::new(Vec::new())),
            secrets_changed: watch::channel(0).0,
            registries,
            holds,
            registry_conns: Arc::default(),
        })
    }

    /// The policy now.
    pub fn policy(&self) -> Arc<Policy> {
        Arc::clone(&self.policy.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Replaces the policy: one swap, so every decision sees either the old
    /// one or the new one, never a mix. Open connections are judged again
    /// (see [`on_revoked`](Self::on_revoked)).
    pub fn set_policy(&self, policy: Policy) {
        *self.policy.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(policy);
        self.policy_changed.send_modify(|n| *n += 1);
    }

    /// The policy now and its verdict on a connection to `name:port` let
    /// through on `grounds`.
    pub fn standing(&self, name: &HostName, port: u16, grounds: &Grounds) -> (Arc<Policy>, Verdict) {
        let policy = self.policy();
        let verdict = match (policy.decide(name, port), grounds) {
            (Verdict::Deny(None), Grounds::Owner(rule)) => Verdict::Allow(rule.clone()),
            (verdict, _) => verdict,
        };
        (policy, verdict)
    }

    /// Resolves, with the refusal to log, once the policy is changed so that
    /// an open connection to `name:port` let through on `grounds` may not go
    /// on: its verdict is not one `stands` accepts (a connection passed
    /// through untouched needs [`Verdict::Allow`]; one read request by
    /// request only needs not to be denied).
    pub fn on_revoked<'a>(
        &'a self,
        name: &'a HostName,
        port: u16,
        grounds: &'a Grounds,
        stands: fn(&Verdict) -> bool,
    ) -> impl std::future::Future<Output = Refusal> + Send + 'a {
        let mut changes = self.policy_changed.subscribe();
        async move {
            loop {
                // Judged first as the policy is now: a change may have come
                // while the connection was being set up.
                match self.standing(name, port, grounds).1 {
                    verdict if stands(&verdict) => {}
                    Verdict::Deny(rule) => return Refusal::Revoked(rule),
                    _ => return Refusal::NowLookedInside,
                }
                if changes.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }

    /// The fake address for `name`.
    pub fn fake_addr(&self, name: &HostName) -> Option<Ipv4Addr> {
        self.fakes.lock().unwrap_or_else(PoisonError::into_inner).addr_for(name)
    }

    /// The name a fake address was given to.
    pub fn name_at(&self, addr: Ipv4Addr) -> Option<HostName> {
        self.fakes.lock().unwrap_or_else(PoisonError::into_inner).name_for(addr).cloned()
    }

    /// Replaces the box's secrets. A secret newly killed ends the
    /// connections that used it.
    pub fn set_secrets(&self, secrets: Vec<BoxSecret>, meters: &Meters) {
        let armed: Vec<Armed> = secrets
            .into_iter()
            .map(|s| {
                let meter = meters.of(s.id);
                if s.killed {
                    meter.kill();
                }
                Armed { secret: Arc::new(s), meter }
            })
            .collect();
        *self.secrets.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(armed);
        self.secrets_changed.send_modify(|n| *n += 1);
    }

    /// Resolves once a secret of the box's bound to `host` is killed that
    /// was not killed when this was called.
    pub fn on_secret_killed(&self, host: &HostName) -> impl std::future::Future<Output = ()> + Send + '_ {
        let mut changes = self.secrets_changed.subscribe();
        let host = host.clone();
        let killed_before: Vec<i64> =
            self.secrets_for(&host).iter().filter(|a| a.meter.is_killed()).map(|a| a.secret.id).collect();
        async move {
            loop {
                let bound = self.secrets_for(&host);
                if bound.iter().any(|a| a.meter.is_killed() && !killed_before.contains(&a.secret.id)) {
                    return;
                }
                if changes.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }

    /// The box's secrets bound to `host`.
    pub fn secrets_for(&self, host: &HostName) -> Vec<Armed> {
        let all = Arc::clone(&self.secrets.read().unwrap_or_else(PoisonError::into_inner));
        all.iter().filter(|a| a.secret.host == *host).cloned().collect()
    }

    /// Every value the box's secrets have (scrubbed from what it is sent).
    pub fn secret_values(&self) -> Vec<String> {
        let all = Arc::clone(&self.secrets.read().unwrap_or_else(PoisonError::into_inner));
        all.iter().map(|a| a.secret.value.expose().to_string()).collect()
    }

    /// Whether a name the policy does not allow may still be dialled, to be
    /// put to the owner then: the box is in ask mode, no rule denies the name,
    /// and the owner has not refused it in the last minute.
    pub fn may_ask(&self, policy: &Policy, name: &HostName) -> bool {
        policy.ask && !policy.denies_connections_to(name) && self.recent.said(name, None) != Some(false)
    }

    /// Whether `name` may be reached on `port` although the policy alone
    /// would refuse it: the box is in ask mode and its owner allows it (now,
    /// or once within the last minute). Waits for the answer.
    pub async fn asked(&self, policy: &Policy, name: &HostName, port: u16) -> Asked {
        match self.recent.said(name, Some(port)) {
            Some(true) => return Asked::Allowed("allowed once by the owner"),
            Some(false) => return Asked::Refused(Refusal::OwnerSaidNoLately),
            None => {}
        }
        if !self.may_ask(policy, name) {
            return Asked::NotAsked;
        }
        match self.asker.ask(&self.id, name, port).await {
            Ok(Answer::Once) => {
                self.recent.allow(name, port);
                Asked::Allowed("allowed once by the owner")
            }
            Ok(Answer::Always) => Asked::Allowed("allowed by the owner (added to the policy)"),
            Ok(Answer::Deny) => {
                self.recent.refuse(name);
                Asked::Refused(Refusal::OwnerSaidNo)
            }
            Err(why) => Asked::Refused(why),
        }
    }

    /// Ends every open connection of the box (its listeners stay).
    pub fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }

    /// Resolves once [`cut`](Self::cut) is called after this was made.
    pub fn on_cut(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            let _ = rx.changed().await;
        }
    }

    /// A logger for this box.
    pub fn logger(&self) -> Logger {
        self.logger.clone()
    }

    /// Records an entry; a full backlog loses it.
    pub fn log(&self, entry: LogEntry) {
        self.logger.log(entry);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use std::time::Duration;

    use tokio::sync::mpsc;

    use super::*;
    use crate::messages::FromGateway;
    use crate::upstream::UpstreamConfig;

    /// What the README promises an owner's answer is remembered for.
    const A_MINUTE: Duration = Duration::from_secs(60);

    /// A box in ask mode, the asker its questions go through, and where
    /// they come out.
    fn asking_box() -> (Arc<BoxNet>, Arc<Asker>, mpsc::UnboundedReceiver<FromGateway>, Policy) {
        let (tx, rx) = mpsc::unbounded_channel();
        let asker = Arc::new(Asker::new(tx));
        let (log, _) = mpsc::channel(16);
        let config = UpstreamConfig { dns: "127.0.0.1:9".parse().unwrap(), allow: Vec::new(), tls: None };
        let policy = Policy { ask: true, ..Policy::default() };
        let id = BoxId::parse("b1").unwrap();
        let shared = Shared {
            log,
            upstream: Arc::new(Upstream::new(config)),
            asker: Arc::clone(&asker),
            registries: Arc::new(crate::packages::Registries::new(Default::default())),
            holds: crate::proxy::push::holds(),
            account_holds: crate::proxy::push::account_holds(),
        };
        let gate = crate::admission::Admission::for_descriptors(1024).gate(&moat_core::AccountId("SHA256:a".into()));
        let net = BoxNet::new(id, policy.clone(), None, gate, &shared);
        (net, asker, rx, policy)
    }

    /// Box `net` dials `name` on `port`, and is asked about.
    fn dial(net: &Arc<BoxNet>, policy: &Policy, name: &HostName, port: u16) -> tokio::task::JoinHandle<Asked> {
        let (net, policy, name) = (Arc::clone(net), policy.clone(), name.clone());
        tokio::spawn(async move { net.asked(&policy, &name, port).await })
    }

    /// The number of the question that went out next (none in a second of
    /// the paused clock, which runs on at once when nothing else can: none).
    async fn question(rx: &mut mpsc::UnboundedReceiver<FromGateway>) -> u64 {
        match tokio::time::timeout(Duration::from_secs(1), rx.recv()).await {
            Ok(Some(FromGateway::Ask { id, .. })) => id,
            _ => panic!("no question went out"),
        }
    }

    fn rules(allow: &[&str], deny: &[&str]) -> Policy {
        let rule = |text: &&str| Rule::parse(&text.split(' ').collect::<Vec<_>>()).unwrap();
        Policy { allow: allow.iter().map(rule).collect(), deny: deny.iter().map(rule).collect(), ..Policy::default() }
    }

    /// Whether `revoked` has resolved, and with what.
    async fn settled(revoked: &mut std::pin::Pin<Box<impl std::future::Future<Output = Refusal>>>) -> Option<Refusal> {
        tokio::time::timeout(Duration::from_millis(50), revoked.as_mut()).await.ok()
    }

    #[tokio::test]
    async fn a_change_of_policy_ends_the_connections_it_no_longer_allows() {
        let (net, ..) = asking_box();
        let web = HostName::parse("web.test").unwrap();
        net.set_policy(rules(&["web.test"], &[]));
        let passed = |v: &Verdict| matches!(v, Verdict::Allow(_));
        let read = |v: &Verdict| !matches!(v, Verdict::Deny(_));
        let by_policy = Grounds::Policy;
        let mut passed_through = Box::pin(net.on_revoked(&web, 443, &by_policy, passed));
        let mut read_inside = Box::pin(net.on_revoked(&web, 80, &by_policy, read));
        // A change that leaves them allowed as they are ends neither.
        net.set_policy(rules(&["web.test", "other.test"], &["POST other.test"]));
        assert_eq!(settled(&mut passed_through).await, None);
        assert_eq!(settled(&mut read_inside).await, None);
        // Rules naming methods: what passes through untouched must be read.
        net.set_policy(rules(&["web.test"], &["POST web.test"]));
        assert_eq!(settled(&mut passed_through).await, Some(Refusal::NowLookedInside));
        assert_eq!(settled(&mut read_inside).await, None);
        // The host dropped from the policy (no rule denies it).
        net.set_policy(rules(&[], &[]));
        assert_eq!(settled(&mut read_inside).await, Some(Refusal::Revoked(None)));
        let (policy, verdict) = net.standing(&web, 80, &by_policy);
        assert_eq!((policy.allow.len(), verdict), (0, Verdict::Deny(None)));
    }

    #[tokio::test]
    async fn a_change_made_while_a_connection_was_set_up_ends_it() {
        let (net, ..) = asking_box();
        let web = HostName::parse("web.test").unwrap();
        net.set_policy(rules(&["web.test"], &[]));
        // Let through; then, before its copying began, the host was denied.
        let verdict = net.standing(&web, 443, &Grounds::Policy).1;
        assert!(matches!(verdict, Verdict::Allow(_)));
        net.set_policy(rules(&[], &[]));
        let mut revoked = Box::pin(net.on_revoked(&web, 443, &Grounds::Policy, |v| matches!(v, Verdict::Allow(_))));
        assert_eq!(settled(&mut revoked).await, Some(Refusal::Revoked(None)));
    }

    #[tokio::test]
    async fn what_the_owner_let_through_ends_only_by_a_rule_denying_it() {
        let (net, ..) = asking_box();
        let web = HostName::parse("web.test").unwrap();
        let once = Grounds::Owner(Rule::exact(web.clone(), 8080));
        assert_eq!(net.standing(&web, 8080, &once).1, Verdict::Allow(Rule::exact(web.clone(), 8080)));
        let mut revoked = Box::pin(net.on_revoked(&web, 8080, &once, |v| matches!(v, Verdict::Allow(_))));
        net.set_policy(rules(&["other.test"], &[]));
        assert_eq!(settled(&mut revoked).await, None);
        net.set_policy(rules(&[], &["web.test:*"]));
        assert_eq!(
            settled(&mut revoked).await,
            Some(Refusal::Revoked(Some(rules(&[], &["web.test:*"]).deny[0].clone())))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_name_the_owner_refused_is_not_asked_again_for_a_minute() {
        let (net, asker, mut rx, policy) = asking_box();
        let name = HostName::parse("pypi.org").unwrap();
        let asking = dial(&net, &policy, &name, 443);
        asker.answered(question(&mut rx).await, Answer::Deny);
        assert_eq!(asking.await.unwrap(), Asked::Refused(Refusal::OwnerSaidNo));
        // Within the minute: refused without a question, on any port, and
        // the name gets no fake address to dial.
        tokio::time::advance(A_MINUTE - Duration::from_millis(1)).await;
        for port in [443, 8080] {
            assert_eq!(dial(&net, &policy, &name, port).await.unwrap(), Asked::Refused(Refusal::OwnerSaidNoLately));
        }
        assert!(!net.may_ask(&policy, &name), "a refused name may be looked up");
        assert!(rx.try_recv().is_err(), "the owner was asked again within the minute");
        // Past it, the owner is asked anew.
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(net.may_ask(&policy, &name));
        let again = dial(&net, &policy, &name, 443);
        asker.answered(question(&mut rx).await, Answer::Once);
        assert_eq!(again.await.unwrap(), Asked::Allowed("allowed once by the owner"));
    }

    #[tokio::test(start_paused = true)]
    async fn once_lets_a_name_through_for_a_minute_on_its_port_and_80_443() {
        let (net, asker, mut rx, policy) = asking_box();
        let name = HostName::parse("pypi.org").unwrap();
        let asking = dial(&net, &policy, &name, 8443);
        asker.answered(question(&mut rx).await, Answer::Once);
        assert_eq!(asking.await.unwrap(), Asked::Allowed("allowed once by the owner"));
        tokio::time::advance(A_MINUTE - Duration::from_millis(1)).await;
        for port in [8443, 80, 443] {
            assert_eq!(dial(&net, &policy, &name, port).await.unwrap(), Asked::Allowed("allowed once by the owner"));
        }
        assert!(rx.try_recv().is_err(), "asked again within the minute");
        // Another port is a question of its own; past the minute, so is 443.
        let other = dial(&net, &policy, &name, 22);
        question(&mut rx).await;
        asker.withdraw(&net.id);
        assert_eq!(other.await.unwrap(), Asked::Refused(Refusal::Withdrawn));
        tokio::time::advance(Duration::from_millis(2)).await;
        let later = dial(&net, &policy, &name, 443);
        question(&mut rx).await;
        asker.withdraw(&net.id);
        assert_eq!(later.await.unwrap(), Asked::Refused(Refusal::Withdrawn));
    }
}
