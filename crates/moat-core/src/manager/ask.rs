//! Ask mode: a box's gateway puts a name the policy does not allow to the
//! box's owner; the owner answers from a session of their own (`ssh HOST
//! ask`), never from the box. Questions live in memory only: one nobody
//! answers lapses after [`ASK_TIMEOUT`], when the gateway has refused it.
//!
//! Each question is held by the node of the box that asked, under a number
//! the store hands out, so that a fleet's router can gather every node's
//! questions for their owner and take an answer to the one node holding it.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use super::{BoxManager, ManagerError};
use crate::clock::now_ms;
use crate::egress::{Answer, Question, ASK_TIMEOUT};
use crate::ids::{AccountId, BoxId};
use crate::policy::{HostName, Rule, DEFAULT_PORTS};

/// Most questions open at once, over all boxes (a box that asks for
/// thousands of names gets its gateway's refusals, not our memory).
const MAX_OPEN: usize = 4096;
/// Most of them one account's: one account's boxes asking without end fill
/// this, not the table every account's questions share (they filled it).
const MAX_OPEN_PER_ACCOUNT: usize = 256;

/// The questions open now, and who is told of new ones.
pub(super) struct Questions {
    open: Mutex<HashMap<u64, Open>>,
    news: tokio::sync::broadcast::Sender<(AccountId, Question)>,
}

struct Open {
    account: AccountId,
    box_id: BoxId,
    /// The gateway's own number for it.
    gateway_id: u64,
    question: Question,
    lapses: Instant,
}

impl Default for Questions {
    fn default() -> Self {
        Self { open: Mutex::new(HashMap::new()), news: tokio::sync::broadcast::channel(256).0 }
    }
}

impl Questions {
    fn open(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Open>> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        open.retain(|_, q| q.lapses > now);
        open
    }
}

impl BoxManager {
    /// Box `box_id`'s gateway asks (its number for the question:
    /// `gateway_id`) whether the box may reach `name` (on `port`, if it
    /// dialled). Returns false if the question cannot be put (the box is
    /// gone, too many are open): the gateway refuses at once.
    pub fn ask(&self, box_id: &BoxId, gateway_id: u64, name: String, port: Option<u16>, running: Vec<String>) -> bool {
        let Ok(Some(rec)) = self.db(|s| s.get_by_id(box_id)) else { return false };
        if self.questions.open().len() >= MAX_OPEN {
            return false;
        }
        let id = match self.db(|s| s.next_number("question")) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(error = %e, "no number for a question: it is refused");
                return false;
            }
        };
        let mut open = self.questions.open();
        if open.len() >= MAX_OPEN || open.values().filter(|q| q.account == rec.account).count() >= MAX_OPEN_PER_ACCOUNT
        {
            return false;
        }
        let question = Question { id, box_name: rec.name.to_string(), name, port, running, asked_ms: now_ms() };
        let lapses = Instant::now() + ASK_TIMEOUT;
        open.insert(
            id,
            Open {
                account: rec.account.clone(),
                box_id: box_id.clone(),
                gateway_id,
                question: question.clone(),
                lapses,
            },
        );
        // Nobody watching is fine: the question lapses.
        let _ = self.questions.news.send((rec.account, question));
        true
    }

    /// The account's open questions, oldest first.
    pub fn questions(&self, account: &AccountId) -> Vec<Question> {
        let mut out: Vec<Question> =
            self.questions.open().values().filter(|q| &q.account == account).map(|q| q.question.clone()).collect();
        out.sort_by_key(|q| q.id);
        out
    }

    /// New questions as they are asked: (owner, question).
    pub fn follow_questions(&self) -> tokio::sync::broadcast::Receiver<(AccountId, Question)> {
        self.questions.news.subscribe()
    }

    /// The owner answers question `id`. `Always` adds an allow rule for the
    /// name (the port it dialled, or the usual ones) to the box's policy
    /// before the gateway hears the answer.
    pub async fn answer(&self, account: &AccountId, id: u64, answer: Answer) -> Result<Question, ManagerError> {
        let open = {
            let mut open = self.questions.open();
            match open.get(&id) {
                Some(q) if &q.account == account => open.remove(&id),
                // Another account's question is no question of yours.
                _ => None,
            }
        };
        let Some(open) = open else {
            // In a fleet another node may hold it: the router asks each.
            return Err(match self.node.is_empty() {
                true => ManagerError::NoSuchQuestion(id),
                false => ManagerError::QuestionElsewhere(id),
            });
        };
        let mut answer = answer;
        if answer == Answer::Always {
            let host = HostName::parse(&open.question.name)?;
            let rule = Rule {
                host: crate::policy::HostPattern::Exact(host),
                ports: Some(match open.question.port {
                    Some(port) if !DEFAULT_PORTS.contains(&port) => vec![port],
                    _ => DEFAULT_PORTS.to_vec(),
                }),
                methods: Vec::new(),
                path: None,
            };
            let name = crate::ids::Name::new(&open.question.box_name).map_err(|_| ManagerError::NoSuchQuestion(id))?;
            match self
                .change_policy(account, &name, |p| -> Result<(), ManagerError> {
                    p.allow(rule);
                    Ok(())
                })
                .await
            {
                Ok(Ok(_)) => {}
                // The box went away meanwhile: nothing is waiting.
                Ok(Err(e)) | Err(e) => {
                    answer = Answer::Deny;
                    tracing::warn!(error = %e, "could not add the answer to the policy");
                }
            }
        }
        self.tell_network(|hooks| hooks.answered(&open.box_id, open.gateway_id, answer));
        Ok(open.question)
    }
}
