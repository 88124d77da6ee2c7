//! Ask mode across a fleet: a box's question is held by the box's node, so
//! the router gathers an owner's questions from every live node (and, with
//! `follow`, each new one from any of them) and takes an answer to each node
//! in turn until the one holding that question takes it. Question numbers
//! come from the shared store, so no two nodes hold the same one.

use moat_api::proto::{Event, Reply, ELSEWHERE};
use moat_api::Packets;
use moat_core::egress::Question;
use tokio::sync::mpsc;

use crate::dial::Forwarded;
use crate::router::{RouteError, Router};
use crate::store::FleetStore;

/// How long a node has to take or decline an answer.
const ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// What one node said, as it came.
enum Heard {
    Question(Question),
    /// Its outcome: `Err` is the node's refusal, or why it stopped answering.
    Ended(Result<(), String>),
}

impl<S: FleetStore> Router<S> {
    /// The account's open questions on every live node, oldest first, then,
    /// with `follow`, each new one until the front door closes. A node that
    /// cannot be reached is left out (its boxes' questions lapse unanswered).
    pub(crate) async fn questions(&self, conn: &Packets, request: &[u8], follow: bool) -> Result<(), RouteError> {
        let (tx, mut heard) = mpsc::channel::<Heard>(64);
        // Dropped when this returns: a follow's readers end with the front door.
        let mut readers = tokio::task::JoinSet::new();
        for node in self.live().await? {
            let link = match self.dial(&node).await {
                Ok(link) => link,
                Err(why) => {
                    tracing::debug!(node = %node.name, %why, "questions: a node is left out");
                    continue;
                }
            };
            let (tx, request) = (tx.clone(), request.to_vec());
            readers.spawn(async move {
                let ended = read_questions(link, &request, &tx).await;
                let _ = tx.send(Heard::Ended(ended)).await;
            });
        }
        drop(tx);
        if readers.is_empty() {
            return Err(RouteError::NoNode);
        }
        let (mut open, mut answered, mut refusal) = (Vec::new(), 0, None);
        loop {
            let next = tokio::select! {
                next = heard.recv() => next,
                closed = conn.recv(1) => match closed {
                    Ok(Some(_)) => continue,
                    // The front door went away: so does the follow.
                    _ => return Ok(()),
                },
            };
            match next {
                Some(Heard::Question(q)) if follow => send(conn, &Event::Question(q)).await?,
                Some(Heard::Question(q)) => open.push(q),
                Some(Heard::Ended(Ok(()))) => answered += 1,
                Some(Heard::Ended(Err(why))) => {
                    refusal.get_or_insert(why);
                }
                None => break,
            }
        }
        if answered == 0 {
            return Err(RouteError::Unanswered(refusal.unwrap_or_else(|| "no node answered".into())));
        }
        open.sort_by_key(|q| q.id);
        for q in open {
            send(conn, &Event::Question(q)).await?;
        }
        send(conn, &Event::Outcome(Ok(Reply::Done))).await
    }

    /// An answer to question `id`: to each live node in turn, until the one
    /// that holds it takes it (the others decline it as not theirs). A node
    /// that cannot be reached or does not answer within [`ANSWER_WAIT`] is
    /// passed over, and named if no other node takes the answer (it may hold
    /// the question, or not: nobody can tell).
    pub(crate) async fn answer_question(&self, conn: &Packets, request: &[u8], id: u64) -> Result<(), RouteError> {
        let mut unanswered = None;
        for node in self.live().await? {
            let forwarded = match self.dial(&node).await {
                Ok(link) => tokio::time::timeout(ANSWER_WAIT, link.forward(conn, request, |e| e.status == ELSEWHERE))
                    .await
                    .unwrap_or_else(|_| {
                        Err(std::io::Error::other(format!("no answer within {} s", ANSWER_WAIT.as_secs())))
                    }),
                Err(why) => Err(std::io::Error::other(why)),
            };
            match forwarded {
                Ok(Forwarded::Answered) => return Ok(()),
                Ok(Forwarded::Declined(_)) => {}
                Err(e) => {
                    unanswered.get_or_insert(RouteError::NoQuestionHeard { id, node: node.name, why: e.to_string() });
                }
            }
        }
        Err(unanswered.unwrap_or(RouteError::NoQuestion(id)))
    }
}

/// Passes on one node's questions until its outcome.
async fn read_questions(link: crate::dial::Link, request: &[u8], tx: &mpsc::Sender<Heard>) -> Result<(), String> {
    let mut events = link.request(request).await.map_err(|e| e.to_string())?;
    loop {
        match events.next().await.map_err(|e| e.to_string())? {
            Some(Event::Question(q)) => {
                if tx.send(Heard::Question(q)).await.is_err() {
                    return Ok(());
                }
            }
            Some(Event::Outcome(outcome)) => return outcome.map(|_| ()).map_err(|e| e.message),
            Some(_) => {}
            None => return Err("it closed the connection".into()),
        }
    }
}

async fn send(conn: &Packets, event: &Event) -> Result<(), RouteError> {
    let bytes = serde_json::to_vec(event).map_err(|e| RouteError::Unanswered(e.to_string()))?;
    conn.send(&bytes, &[]).await.map_err(|_| RouteError::Gone)
}
