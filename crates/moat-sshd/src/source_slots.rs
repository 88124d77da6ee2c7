//! Each source's handshake slots: at most `limit` held at once per address,
//! and one given back goes to the oldest waiter that has begun its key
//! exchange, before older ones that have only sent a version string.
//!
//! Every real client sends its KEXINIT right after its version; a socket
//! that sends a version and stalls never does. Given back in line, a source's
//! slots went to such sockets first: 50 of them from one address (an attacker
//! behind the same NAT, or on the same host, as every test is) kept an honest
//! client waiting up to a minute, each holding a slot until its deadline.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use crate::admission::SlotHolder;

type Waiter = (Arc<SlotHolder>, oneshot::Sender<()>);

#[derive(Default)]
struct Source {
    held: usize,
    waiting: VecDeque<Waiter>,
}

type Sources = Arc<Mutex<HashMap<IpAddr, Source>>>;

/// Slots of `limit` per source, kept only while held or waited for.
pub struct SourceSlots {
    limit: usize,
    sources: Sources,
}

fn lock(sources: &Sources) -> MutexGuard<'_, HashMap<IpAddr, Source>> {
    sources.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SourceSlots {
    /// `limit` slots for each source.
    pub fn new(limit: usize) -> Self {
        Self { limit, sources: Arc::default() }
    }

    /// Waits for one of `source`'s slots for the connection `holder` tracks.
    pub async fn acquire(&self, source: IpAddr, holder: &Arc<SlotHolder>) -> SourcePermit {
        let waiting = {
            let mut sources = lock(&self.sources);
            let mine = sources.entry(source).or_default();
            if mine.held < self.limit {
                mine.held += 1;
                None
            } else {
                // Waiters that gave up are let go here too, not only when a
                // slot comes back.
                mine.waiting.retain(|(_, tx)| !tx.is_closed());
                let (tx, rx) = oneshot::channel();
                mine.waiting.push_back((Arc::clone(holder), tx));
                Some(rx)
            }
        };
        if let Some(rx) = waiting {
            let mut wait = Waiting { sources: Arc::clone(&self.sources), source, rx: Some(rx) };
            if let Some(rx) = wait.rx.as_mut() {
                // The sender lives until a slot is sent on it.
                let _ = rx.await;
            }
            wait.rx = None;
        }
        SourcePermit { sources: Arc::clone(&self.sources), source }
    }
}

/// Gives one of `source`'s slots back: to its oldest waiter that has begun
/// its key exchange, or else to its oldest.
fn release(sources: &Sources, source: IpAddr) {
    let mut sources = lock(sources);
    let Some(mine) = sources.get_mut(&source) else { return };
    mine.held = mine.held.saturating_sub(1);
    loop {
        let next = mine.waiting.iter().position(|(h, _)| h.began_kex()).or((!mine.waiting.is_empty()).then_some(0));
        let Some((_, tx)) = next.and_then(|i| mine.waiting.remove(i)) else { break };
        mine.held += 1;
        if tx.send(()).is_ok() {
            break;
        }
        // That waiter is gone: the slot goes on to the next.
        mine.held -= 1;
    }
    if mine.held == 0 && mine.waiting.is_empty() {
        sources.remove(&source);
    }
}

/// One of a source's slots; given back on drop.
pub struct SourcePermit {
    sources: Sources,
    source: IpAddr,
}

impl Drop for SourcePermit {
    fn drop(&mut self) {
        release(&self.sources, self.source);
    }
}

/// A wait for a slot: dropped once given one (its connection cut at that
/// moment), the slot goes back; dropped before, it is passed over.
struct Waiting {
    sources: Sources,
    source: IpAddr,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        rx.close();
        if rx.try_recv().is_ok() {
            release(&self.sources, self.source);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn spawn_acquire(
        slots: &Arc<SourceSlots>,
        source: IpAddr,
        holder: &Arc<SlotHolder>,
    ) -> tokio::task::JoinHandle<SourcePermit> {
        let (slots, holder) = (Arc::clone(slots), Arc::clone(holder));
        tokio::spawn(async move { slots.acquire(source, &holder).await })
    }

    /// A slot given back goes to a waiter that has begun its key exchange,
    /// before older waiters that only spoke; with none such, to the oldest.
    #[tokio::test]
    async fn a_slot_goes_first_to_a_waiter_past_its_version() {
        let slots = Arc::new(SourceSlots::new(1));
        let x: IpAddr = "127.0.0.2".parse().unwrap();
        let held = slots.acquire(x, &Arc::default()).await;
        let stallers: Vec<_> = (0..3)
            .map(|_| {
                let h: Arc<SlotHolder> = Arc::default();
                (spawn_acquire(&slots, x, &h), h)
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let honest: Arc<SlotHolder> = Arc::default();
        let asked = spawn_acquire(&slots, x, &honest);
        tokio::time::sleep(Duration::from_millis(20)).await;
        // It sends its KEXINIT while it waits.
        honest.went_on();
        drop(held);
        let got = tokio::time::timeout(Duration::from_secs(5), asked).await.expect("passed over").unwrap();
        assert!(stallers.iter().all(|(s, _)| !s.is_finished()), "a staller went first");
        // Then in line: the oldest staller.
        drop(got);
        let first = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let Some(i) = stallers.iter().position(|(s, _)| s.is_finished()) {
                    return i;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
        assert_eq!(first, 0);
        for (s, _) in &stallers {
            s.abort();
        }
    }

    /// A waiter that gives up is passed over, and no slot is lost; a source
    /// that holds none is forgotten.
    #[tokio::test]
    async fn waiters_that_give_up_lose_no_slot() {
        let slots = Arc::new(SourceSlots::new(1));
        let x: IpAddr = "127.0.0.2".parse().unwrap();
        let held = slots.acquire(x, &Arc::default()).await;
        let gone = spawn_acquire(&slots, x, &Arc::default());
        tokio::time::sleep(Duration::from_millis(20)).await;
        gone.abort();
        let _ = gone.await;
        drop(held);
        let again = tokio::time::timeout(Duration::from_secs(5), slots.acquire(x, &Arc::default())).await;
        drop(again.expect("a slot was lost"));
        assert!(lock(&slots.sources).is_empty());
    }
}
