//! Who gets the server's attention before authenticating.
//!
//! Refusing at accept time punishes the wrong clients: an orchestrator opening
//! 30 connections at once from one address was reset, while 10 idle sockets
//! from that address locked it out. So admission has two stages:
//!
//! 1. **Pending**: every accepted connection that has not authenticated.
//!    Cheap (a socket and a parked task), bounded generously per source and in
//!    total. A source at its bound makes room by closing its own oldest
//!    connection that has not finished its key exchange (idle sockets of a
//!    NAT or a CI runner must not lock out the honest client beside them);
//!    only when every one of them is past its key exchange, or the total is
//!    reached, is the new connection dropped at once.
//! 2. **Active**: a connection that has sent bytes takes a handshake slot (per
//!    source and in total) before the server reads them; a full stage makes it
//!    *wait* for a slot, never reset (its time to authenticate starts once it
//!    has one). Sockets that send nothing never hold a slot, and are cut after
//!    a short grace; one that holds a slot must begin its key exchange in a
//!    few seconds, so that sockets which speak and then stall cannot keep the
//!    slots from the clients waiting behind them.
//!
//! Both are given back when the connection authenticates or ends. Sources
//! that misbehave share a few slots instead (see [`crate::penalty`]).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use crate::penalty::{Offence, Penalties, PENALIZED_SLOTS};
use crate::quickack::QuickAck;
use crate::source_slots::{SourcePermit, SourceSlots};

/// How many connections each stage holds.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    /// Unauthenticated connections from one address.
    pub pending_per_source: usize,
    /// Unauthenticated connections in all.
    pub pending_total: usize,
    /// Handshakes in progress from one address.
    pub active_per_source: usize,
    /// Handshakes in progress in all.
    pub active_total: usize,
}

struct Inner {
    limits: AdmissionLimits,
    penalties: Penalties,
    /// The few handshake slots a penalized source has.
    penalized_by_source: SourceSlots,
    pending: Mutex<PendingQueues>,
    active: Arc<FairSlots>,
    active_by_source: SourceSlots,
}

/// The pending stage: each source's unauthenticated connections, oldest first.
#[derive(Default)]
struct PendingQueues {
    by_source: HashMap<IpAddr, VecDeque<Arc<SlotHolder>>>,
    total: usize,
}

/// The listener's admission state.
#[derive(Clone)]
pub struct Admission(Arc<Inner>);

impl Admission {
    /// Admission with `limits`.
    pub fn new(limits: AdmissionLimits) -> Self {
        Self(Arc::new(Inner {
            limits,
            penalties: Penalties::default(),
            penalized_by_source: SourceSlots::new(PENALIZED_SLOTS),
            pending: Mutex::default(),
            active: FairSlots::new(limits.active_total),
            active_by_source: SourceSlots::new(limits.active_per_source),
        }))
    }

    /// A pending place for a new connection from `source` (whose state is
    /// `holder`), or `None` if the pending stage is full. A source at its own
    /// bound gets the place of its oldest connection that has not finished
    /// its key exchange, which is told to close ([`SlotHolder::evicted`]).
    pub fn pending(&self, source: IpAddr, holder: &Arc<SlotHolder>) -> Option<Pending> {
        let mut pending = self.0.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let PendingQueues { by_source, total } = &mut *pending;
        let mine = by_source.entry(source).or_default();
        if mine.len() >= self.0.limits.pending_per_source {
            let oldest = mine.iter().position(|h| !h.kex_done.load(Ordering::Acquire));
            let evicted = oldest.and_then(|i| mine.remove(i))?;
            evicted.evicted.notify_one();
        } else if *total >= self.0.limits.pending_total {
            if mine.is_empty() {
                by_source.remove(&source);
            }
            return None;
        } else {
            *total += 1;
        }
        mine.push_back(Arc::clone(holder));
        Some(Pending { admission: self.clone(), source, holder: Arc::clone(holder) })
    }

    /// Every source's penalty.
    pub fn penalties(&self) -> &Penalties {
        &self.0.penalties
    }

    /// Waits for a handshake slot for `source`'s connection that `holder`
    /// tracks (one that has begun its key exchange goes before its source's
    /// others that only spoke: see [`crate::source_slots`]).
    pub async fn active(&self, source: IpAddr, holder: &Arc<SlotHolder>) -> Active {
        // A penalized source waits for one of its few slots first, holding
        // none of the others meanwhile.
        let penalized = match self.0.penalties.is_penalized(source) {
            true => Some(self.0.penalized_by_source.acquire(source, holder).await),
            false => None,
        };
        let per_source = self.0.active_by_source.acquire(source, holder).await;
        let total = self.0.active.acquire(source).await;
        Active { _penalized: penalized, _per_source: per_source, _total: total }
    }

    /// Connections pending from `source`.
    #[cfg(test)]
    fn pending_from(&self, source: IpAddr) -> usize {
        let pending = self.0.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.by_source.get(&source).map_or(0, VecDeque::len)
    }
}

/// A place in the pending stage; given back on drop (unless it was given
/// to a newer connection already).
pub struct Pending {
    admission: Admission,
    source: IpAddr,
    holder: Arc<SlotHolder>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut pending = self.admission.0.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let PendingQueues { by_source, total } = &mut *pending;
        let Some(mine) = by_source.get_mut(&self.source) else { return };
        if let Some(i) = mine.iter().position(|h| Arc::ptr_eq(h, &self.holder)) {
            mine.remove(i);
            *total = total.saturating_sub(1);
        }
        if mine.is_empty() {
            by_source.remove(&self.source);
        }
    }
}

/// A handshake slot; given back on drop.
pub struct Active {
    _penalized: Option<SourcePermit>,
    _per_source: SourcePermit,
    _total: FairPermit,
}

/// The handshake slots of all sources together. One given back goes to the
/// waiting source that holds the fewest (its oldest waiter), not to the
/// first in line: a flood from many addresses, each re-queuing as it is cut,
/// cannot keep a slot from a source that holds none.
struct FairSlots {
    state: Mutex<FairState>,
}

#[derive(Default)]
struct FairState {
    free: usize,
    held: HashMap<IpAddr, usize>,
    waiting: VecDeque<(IpAddr, tokio::sync::oneshot::Sender<()>)>,
}

impl FairSlots {
    fn new(slots: usize) -> Arc<Self> {
        Arc::new(Self { state: Mutex::new(FairState { free: slots, ..FairState::default() }) })
    }

    async fn acquire(self: &Arc<Self>, source: IpAddr) -> FairPermit {
        let granted = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.free > 0 {
                state.free -= 1;
                *state.held.entry(source).or_default() += 1;
                None
            } else {
                let (tx, rx) = tokio::sync::oneshot::channel();
                state.waiting.push_back((source, tx));
                Some(rx)
            }
        };
        if let Some(rx) = granted {
            let mut waiting = Waiting { slots: Arc::clone(self), source, rx: Some(rx) };
            if let Some(rx) = waiting.rx.as_mut() {
                // The sender lives until it is sent on (a slot given).
                let _ = rx.await;
            }
            waiting.rx = None;
        }
        FairPermit { slots: Arc::clone(self), source }
    }

    /// Gives `source`'s slot to the waiter whose source holds the fewest.
    fn release(&self, source: IpAddr) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = state.held.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                state.held.remove(&source);
            }
        }
        loop {
            let held = |s: &IpAddr| state.held.get(s).copied().unwrap_or(0);
            let next = state.waiting.iter().enumerate().min_by_key(|(i, (s, _))| (held(s), *i)).map(|(i, _)| i);
            let Some((to, tx)) = next.and_then(|i| state.waiting.remove(i)) else {
                state.free += 1;
                return;
            };
            *state.held.entry(to).or_default() += 1;
            if tx.send(()).is_ok() {
                return;
            }
            // That waiter is gone: the slot goes on to the next.
            if let Some(n) = state.held.get_mut(&to) {
                *n -= 1;
                if *n == 0 {
                    state.held.remove(&to);
                }
            }
        }
    }
}

/// A wait for a slot: if it is dropped once given one, the slot goes back.
struct Waiting {
    slots: Arc<FairSlots>,
    source: IpAddr,
    rx: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.slots.release(self.source);
            }
        }
    }
}

/// One of the [`FairSlots`]; given back on drop.
struct FairPermit {
    slots: Arc<FairSlots>,
    source: IpAddr,
}

impl Drop for FairPermit {
    fn drop(&mut self) {
        self.slots.release(self.source);
    }
}

/// Where a connection's handshake slot is kept until it authenticates, and
/// how far it got.
#[derive(Default)]
pub struct SlotHolder {
    slot: Mutex<Option<Active>>,
    spoke: AtomicBool,
    slotted: AtomicBool,
    refused: AtomicBool,
    kex_done: AtomicBool,
    /// The client sent more than its version string (its key exchange).
    went_on: AtomicBool,
    evicted: Notify,
    /// Woken at each step above.
    stepped: Notify,
}

/// Resolves once `flag` is set (each setter wakes `stepped`).
async fn reached(flag: &AtomicBool, stepped: &Notify) {
    loop {
        let woken = stepped.notified();
        let mut woken = std::pin::pin!(woken);
        woken.as_mut().enable();
        if flag.load(Ordering::Acquire) {
            return;
        }
        woken.await;
    }
}

impl SlotHolder {
    /// Notes that the client has sent something.
    pub(crate) fn heard(&self) {
        self.spoke.store(true, Ordering::Release);
        self.stepped.notify_waiters();
    }

    /// Keeps the connection's handshake slot until it authenticates.
    pub(crate) fn hold(&self, slot: Active) {
        *self.slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(slot);
        self.slotted.store(true, Ordering::Release);
        self.stepped.notify_waiters();
    }

    /// Resolves once the client has sent something.
    pub async fn spoken(&self) {
        reached(&self.spoke, &self.stepped).await;
    }

    /// Resolves once the connection holds a handshake slot.
    pub async fn slotted(&self) {
        reached(&self.slotted, &self.stepped).await;
    }

    /// Notes that the client sent more than its version string.
    pub(crate) fn went_on(&self) {
        if !self.went_on.swap(true, Ordering::AcqRel) {
            self.stepped.notify_waiters();
        }
    }

    /// Whether the client has begun its key exchange.
    pub(crate) fn began_kex(&self) -> bool {
        self.went_on.load(Ordering::Acquire)
    }

    /// Resolves once the client has begun its key exchange (sent more than
    /// its version string: every client sends its KEXINIT at once, while a
    /// socket that stalls after its version never does).
    pub async fn kex_begun(&self) {
        reached(&self.went_on, &self.stepped).await;
    }

    /// Gives the slot back (on authentication).
    pub fn release(&self) {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// Whether the client has sent anything yet.
    pub fn spoke(&self) -> bool {
        self.spoke.load(Ordering::Acquire)
    }

    /// Notes that the key exchange is over (the client asked to authenticate):
    /// the connection is no longer one its source's newer ones may replace.
    pub fn kex_done(&self) {
        self.kex_done.store(true, Ordering::Release);
        self.stepped.notify_waiters();
    }

    /// Resolves when a newer connection from the same source took this one's
    /// pending place: the connection must close.
    pub async fn evicted(&self) {
        self.evicted.notified().await;
    }

    /// Notes that a key the client tried was refused.
    pub fn key_refused(&self) {
        self.refused.store(true, Ordering::Relaxed);
    }

    /// What the connection did wrong, if it ends now without authenticating.
    pub fn offence(&self) -> Offence {
        if self.refused.load(Ordering::Relaxed) {
            Offence::AuthFailed
        } else {
            Offence::NoAuth
        }
    }
}

type Acquire = Pin<Box<dyn Future<Output = Active> + Send>>;

/// A connection whose reads wait, once the client has spoken, for a
/// handshake slot. Writes (the server's banner) go out at once, so clients
/// that wait for the server's banner before sending theirs work too.
pub struct Gated {
    inner: QuickAck,
    acquire: Option<Acquire>,
    /// The client's first bytes, read to learn that it spoke, served once a
    /// slot is held.
    early: Vec<u8>,
    holder: Arc<SlotHolder>,
}

/// How much of the client's first bytes is read ahead (its version string
/// is at most 255 bytes).
const EARLY_BYTES: usize = 256;

impl Gated {
    /// Gates `inner`'s reads on a slot from `admission` for `source`.
    pub fn new(inner: QuickAck, admission: &Admission, source: IpAddr, holder: Arc<SlotHolder>) -> Self {
        let admission = admission.clone();
        let waiter = Arc::clone(&holder);
        let acquire: Acquire = Box::pin(async move { admission.active(source, &waiter).await });
        Self { inner, acquire: Some(acquire), early: Vec::new(), holder }
    }
}

impl AsyncRead for Gated {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(acquire) = this.acquire.as_mut() {
            // What the client sends while it waits is read ahead (its version,
            // then its KEXINIT): one that has begun its key exchange goes
            // before its source's sockets that only spoke.
            while !this.holder.began_kex() && this.early.len() < EARLY_BYTES {
                let mut more = [0u8; EARLY_BYTES];
                let mut more = ReadBuf::new(&mut more);
                match Pin::new(&mut this.inner).poll_read(cx, &mut more) {
                    Poll::Ready(Ok(())) if more.filled().is_empty() => {
                        if this.early.is_empty() {
                            return Poll::Ready(Ok(())); // end of stream before a word
                        }
                        break;
                    }
                    Poll::Ready(Ok(())) => {
                        this.early.extend_from_slice(more.filled());
                        this.holder.heard();
                        // The version line and more: the key exchange too.
                        if this.early.iter().position(|&b| b == b'\n').is_some_and(|i| i + 1 < this.early.len()) {
                            this.holder.went_on();
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => break,
                }
            }
            if this.early.is_empty() {
                return Poll::Pending; // nothing yet: the read wakes this
            }
            let active = ready!(acquire.as_mut().poll(cx));
            this.holder.hold(active);
            this.acquire = None;
        }
        if !this.early.is_empty() {
            let n = this.early.len().min(buf.remaining());
            buf.put_slice(this.early.get(..n).unwrap_or_default());
            this.early.drain(..n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.holder.went_on();
        }
        read
    }
}

impl AsyncWrite for Gated {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limits() -> AdmissionLimits {
        AdmissionLimits { pending_per_source: 3, pending_total: 5, active_per_source: 2, active_total: 3 }
    }

    fn holder() -> Arc<SlotHolder> {
        Arc::default()
    }

    /// Whether `holder` was told to close (without waiting).
    fn was_evicted(holder: &SlotHolder) -> bool {
        let evicted = std::pin::pin!(holder.evicted());
        evicted.poll(&mut Context::from_waker(std::task::Waker::noop())).is_ready()
    }

    #[test]
    fn pending_is_bounded_in_total_and_given_back() {
        let a = Admission::new(limits());
        let (x, y): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "127.0.0.3".parse().unwrap());
        let held: Vec<(Arc<SlotHolder>, Pending)> =
            (0..3).map(|_| holder()).map(|h| (Arc::clone(&h), a.pending(x, &h).unwrap())).collect();
        let more: Vec<Pending> = (0..2).map(|_| a.pending(y, &holder()).unwrap()).collect();
        assert!(a.pending(y, &holder()).is_none(), "in total");
        assert!(held.iter().all(|(h, _)| !was_evicted(h)), "another source's connection was closed");
        drop(held);
        assert_eq!(a.pending_from(x), 0);
        assert!(a.pending(x, &holder()).is_some());
        drop(more);
    }

    #[test]
    fn a_full_source_closes_its_oldest_connection_still_in_key_exchange() {
        let a = Admission::new(limits());
        let x: IpAddr = "127.0.0.2".parse().unwrap();
        let [first, second, third] = [holder(), holder(), holder()];
        let mut held: Vec<Pending> = [&first, &second, &third].map(|h| a.pending(x, h).unwrap()).into();
        // The oldest has finished its key exchange: the second goes.
        first.kex_done();
        let newest = holder();
        held.push(a.pending(x, &newest).expect("a full source makes room"));
        let evicted = [&first, &second, &third].map(|h| was_evicted(h));
        assert_eq!(evicted, [false, true, false]);
        assert_eq!(a.pending_from(x), 3);
        // The closed one's place is not given back twice when it ends.
        drop(held.remove(1));
        assert_eq!(a.pending_from(x), 3);
        // Every one past its key exchange: the newest is refused.
        third.kex_done();
        newest.kex_done();
        assert!(a.pending(x, &holder()).is_none());
        drop(held);
        assert_eq!(a.pending_from(x), 0);
        assert_eq!(a.0.pending.lock().unwrap().total, 0);
    }

    #[tokio::test]
    async fn a_slot_given_back_goes_to_the_source_holding_fewest() {
        let slots = FairSlots::new(2);
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "127.0.0.3".parse().unwrap());
        let mut held = vec![slots.acquire(a).await, slots.acquire(a).await];
        // A's third waits first, B's after it.
        let a3 = tokio::spawn({
            let slots = Arc::clone(&slots);
            async move { slots.acquire(a).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let b1 = tokio::spawn({
            let slots = Arc::clone(&slots);
            async move { slots.acquire(b).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        held.pop();
        let b1 = tokio::time::timeout(Duration::from_secs(5), b1).await.expect("B, holding none, waits on").unwrap();
        assert!(!a3.is_finished(), "A, holding one, went before B, holding none");
        // A waiter that gives up is passed over; its slot is not lost.
        a3.abort();
        let _ = a3.await;
        drop(b1);
        let _again = tokio::time::timeout(Duration::from_secs(5), slots.acquire(b)).await.expect("a slot was lost");
    }

    #[tokio::test]
    async fn a_full_active_stage_waits_instead_of_refusing() {
        let a = Admission::new(limits());
        let x: IpAddr = "127.0.0.2".parse().unwrap();
        let first = a.active(x, &holder()).await;
        let _second = a.active(x, &holder()).await;
        let third = tokio::time::timeout(Duration::from_millis(50), a.active(x, &holder())).await;
        assert!(third.is_err(), "a third handshake from one source must wait");
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.active(x, &holder()).await }
        });
        drop(first);
        let _third = tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("woken").unwrap();
    }
}
