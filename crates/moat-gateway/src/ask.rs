//! Ask mode, the gateway's half: a box in ask mode that wants a name its
//! policy does not allow waits while the privileged side puts the question
//! to the box's owner. Nothing is let through while it is open; no answer in
//! [`ASK_TIMEOUT`] is a refusal. The same name and port dialled again while
//! its question is open waits for the same answer.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use moat_core::egress::{Answer, ASK_TIMEOUT};
use moat_core::policy::{HostName, DEFAULT_PORTS};
use moat_core::BoxId;
use tokio::sync::{mpsc, watch};
// The runtime's clock, so that tests can pause and advance it past a minute.
use tokio::time::Instant;

use crate::messages::FromGateway;
use crate::refusal::Refusal;

/// Most questions one box may have open at once.
const MAX_OPEN_PER_BOX: usize = 16;
/// How long "allow once" lets a name through.
const ONCE_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// Questions to the privileged side, and their answers, for every box.
pub struct Asker {
    out: mpsc::UnboundedSender<FromGateway>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Open questions by number: whose, about what, and where the answer goes.
    by_id: HashMap<u64, Question>,
}

/// One open question: box `box_id` dialled `name` on `port`.
struct Question {
    box_id: BoxId,
    name: HostName,
    port: u16,
    answer: watch::Sender<Option<Answer>>,
}

impl Question {
    fn is(&self, box_id: &BoxId, name: &HostName, port: u16) -> bool {
        self.box_id == *box_id && self.name == *name && self.port == port
    }
}

impl Asker {
    /// Questions go out on `out`.
    pub fn new(out: mpsc::UnboundedSender<FromGateway>) -> Self {
        Self { out, state: Mutex::new(State::default()) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Asks whether box `box_id` may reach `name` (dialling `port`), and waits
    /// for the answer.
    pub async fn ask(&self, box_id: &BoxId, name: &HostName, port: u16) -> Result<Answer, Refusal> {
        let mut answer = {
            let mut state = self.state();
            // The same name on another port is another question: an answer
            // covers only the port it was asked about.
            let same = state.by_id.values().find(|q| q.is(box_id, name, port));
            match same {
                Some(q) => q.answer.subscribe(),
                None => {
                    if state.by_id.values().filter(|q| q.box_id == *box_id).count() >= MAX_OPEN_PER_BOX {
                        return Err(Refusal::TooManyQuestions);
                    }
                    state.next += 1;
                    let id = state.next;
                    let (tx, rx) = watch::channel(None);
                    let question = Question { box_id: box_id.clone(), name: name.clone(), port, answer: tx };
                    state.by_id.insert(id, question);
                    let ask = FromGateway::Ask { box_id: box_id.clone(), id, name: name.clone(), port: Some(port) };
                    if self.out.send(ask).is_err() {
                        state.by_id.remove(&id);
                        return Err(Refusal::CannotAsk);
                    }
                    rx
                }
            }
        };
        let waited = tokio::time::timeout(ASK_TIMEOUT, answer.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(answer)) => Ok(answer.unwrap_or(Answer::Deny)),
            Ok(Err(_)) => Err(Refusal::Withdrawn),
            Err(_) => {
                // Lapsed: whoever asks next asks anew.
                self.state().by_id.retain(|_, q| !q.is(box_id, name, port));
                Err(Refusal::NoAnswer)
            }
        }
    }

    /// The owner's answer to question `id`.
    pub fn answered(&self, id: u64, answer: Answer) {
        if let Some(q) = self.state().by_id.remove(&id) {
            q.answer.send_replace(Some(answer));
        }
    }

    /// Withdraws box `box_id`'s questions (it was detached): they are refused.
    pub fn withdraw(&self, box_id: &BoxId) {
        self.state().by_id.retain(|_, q| q.box_id != *box_id);
    }
}

/// What the owner of a box in ask mode said about a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    /// The box is not in ask mode (or a deny rule names the name): refuse.
    NotAsked,
    /// Let it through, for this reason.
    Allowed(&'static str),
    /// Refused, for this reason.
    Refused(Refusal),
}

/// What a box's owner said in the last minute: names allowed once (on the
/// usual ports and the one dialled), and names refused (not asked again
/// meanwhile, so a box cannot flood its owner with one name).
#[derive(Default)]
pub struct Recent(Mutex<HashMap<HostName, Said>>);

/// Until when, and the ports allowed (`None`: refused).
type Said = (Instant, Option<Vec<u16>>);

impl Recent {
    fn put(&self, name: &HostName, ports: Option<Vec<u16>>) {
        let mut said = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        said.retain(|_, (until, _)| *until > now);
        said.insert(name.clone(), (now + ONCE_FOR, ports));
    }

    /// Lets `name` through for a while on the usual ports and `port`.
    pub fn allow(&self, name: &HostName, port: u16) {
        let mut ports = DEFAULT_PORTS.to_vec();
        if !ports.contains(&port) {
            ports.push(port);
        }
        self.put(name, Some(ports));
    }

    /// Refuses `name` for a while without asking.
    pub fn refuse(&self, name: &HostName) {
        self.put(name, None);
    }

    /// What the owner said of `name` (on `port`, if given): `Some(true)`
    /// allowed, `Some(false)` refused, `None` nothing (or not for that port).
    pub fn said(&self, name: &HostName, port: Option<u16>) -> Option<bool> {
        let said = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (_, ports) = said.get(name).filter(|(until, _)| *until > Instant::now())?;
        match ports {
            None => Some(false),
            Some(ports) => port.is_none_or(|p| ports.contains(&p)).then_some(true),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The id of the box that asks.
    fn b1() -> BoxId {
        BoxId::parse("b1").unwrap()
    }

    #[tokio::test]
    async fn one_question_per_name_and_its_answer_reaches_every_waiter() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let asker = Arc::new(Asker::new(tx));
        let name = HostName::parse("pypi.org").unwrap();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let (asker, name) = (Arc::clone(&asker), name.clone());
                tokio::spawn(async move { asker.ask(&b1(), &name, 443).await })
            })
            .collect();
        let Some(FromGateway::Ask { id, box_id, port, .. }) = rx.recv().await else { panic!("no question") };
        assert_eq!((box_id.as_str(), port), ("b1", Some(443)));
        tokio::task::yield_now().await;
        assert!(rx.try_recv().is_err(), "the same name was asked twice");
        asker.answered(id, Answer::Once);
        for w in waiters {
            assert_eq!(w.await.unwrap(), Ok(Answer::Once));
        }
        // The same name on another port is a question of its own.
        let (asker3, name3) = (Arc::clone(&asker), name.clone());
        let on_22 = tokio::spawn(async move { asker3.ask(&b1(), &name3, 22).await });
        let (asker4, name4) = (Arc::clone(&asker), name.clone());
        let on_443 = tokio::spawn(async move { asker4.ask(&b1(), &name4, 443).await });
        let mut asked = Vec::new();
        for _ in 0..2 {
            let Some(FromGateway::Ask { id, port, .. }) = rx.recv().await else { panic!("no question") };
            asked.push((port, id));
        }
        asked.sort();
        asker.answered(asked[1].1, Answer::Once);
        assert_eq!(on_443.await.unwrap(), Ok(Answer::Once));
        assert!(!on_22.is_finished(), "an answer about 443 let 22 through");
        asker.answered(asked[0].1, Answer::Deny);
        assert_eq!(on_22.await.unwrap(), Ok(Answer::Deny));
        // Withdrawn questions are refusals.
        let (asker2, name2) = (Arc::clone(&asker), name.clone());
        let waiting = tokio::spawn(async move { asker2.ask(&b1(), &name2, 443).await });
        let _ = rx.recv().await;
        asker.withdraw(&b1());
        assert_eq!(waiting.await.unwrap(), Err(Refusal::Withdrawn));
    }

    #[tokio::test(start_paused = true)]
    async fn a_question_unanswered_for_a_minute_is_refused_and_asked_anew() {
        assert_eq!(ASK_TIMEOUT, std::time::Duration::from_secs(60), "the README says a minute");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let asker = Arc::new(Asker::new(tx));
        let ask = || {
            let asker = Arc::clone(&asker);
            tokio::spawn(async move { asker.ask(&b1(), &HostName::parse("pypi.org").unwrap(), 443).await })
        };
        let waiting = ask();
        assert!(matches!(rx.recv().await, Some(FromGateway::Ask { .. })));
        tokio::time::advance(ASK_TIMEOUT - std::time::Duration::from_millis(1)).await;
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "refused before its minute was up");
        tokio::time::advance(std::time::Duration::from_millis(2)).await;
        // Refused now, not whenever the paused clock would run on to.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(waiting.is_finished(), "not refused once its minute was up");
        assert_eq!(waiting.await.unwrap(), Err(Refusal::NoAnswer));
        let again = ask();
        assert!(matches!(rx.recv().await, Some(FromGateway::Ask { .. })), "not asked anew");
        asker.withdraw(&b1());
        assert!(again.await.unwrap().is_err());
    }

    // Paused: a 17th question that went out would wait its minute at once.
    #[tokio::test(start_paused = true)]
    async fn at_most_16_questions_are_open_per_box() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let asker = Arc::new(Asker::new(tx));
        let ask = |n: usize, box_id: &str| {
            let (asker, box_id) = (Arc::clone(&asker), BoxId::parse(box_id).unwrap());
            let name = HostName::parse(&format!("n{n}.example")).unwrap();
            tokio::spawn(async move { asker.ask(&box_id, &name, 443).await })
        };
        let open: Vec<_> = (0..16).map(|n| ask(n, "b1")).collect();
        for _ in 0..16 {
            assert!(matches!(rx.recv().await, Some(FromGateway::Ask { .. })));
        }
        // The 17th is refused at once, without asking; another box's is asked.
        assert_eq!(ask(16, "b1").await.unwrap(), Err(Refusal::TooManyQuestions));
        assert!(rx.try_recv().is_err(), "a 17th question went out");
        let other = ask(16, "b2");
        assert!(matches!(rx.recv().await, Some(FromGateway::Ask { .. })));
        asker.withdraw(&b1());
        asker.withdraw(&BoxId::parse("b2").unwrap());
        for q in open.into_iter().chain([other]) {
            assert!(q.await.unwrap().is_err());
        }
    }

    #[test]
    fn once_covers_the_name_on_the_usual_ports_and_the_one_dialled() {
        let recent = Recent::default();
        let (a, b) = (HostName::parse("a.example").unwrap(), HostName::parse("b.example").unwrap());
        assert_eq!(recent.said(&a, None), None);
        recent.allow(&a, 8443);
        for port in [None, Some(443), Some(8443)] {
            assert_eq!(recent.said(&a, port), Some(true), "{port:?}");
        }
        assert_eq!(recent.said(&a, Some(22)), None);
        recent.refuse(&b);
        assert_eq!(recent.said(&b, Some(443)), Some(false));
    }
}
