//! moat: a server channel's window is given back as its reader takes the
//! data, not as the data arrives, and the session never waits for a reader.
//!
//! russh granted window on arrival and then awaited room in the channel's
//! queue inside the session loop: one channel whose reader stopped (a
//! program not reading its stdin) stalled every channel of the connection
//! once its queue filled. Now what a reader has no room for waits in the
//! channel's backlog (bounded by the window the peer was given), the reader
//! counts what it takes and wakes the session, which hands the backlog on
//! and gives the window back, as OpenSSH's sshd does when it writes to the
//! program.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tokio::sync::Notify;

use crate::{ChannelId, ChannelMsg, Sig};

/// moat: the memory a request for a channel's reader (anything the peer
/// sends it but data) takes while it waits to be taken, as charged to the
/// channel's window budget (see `WindowHold::charge`): data is bounded by
/// the window already. `None` for data and for what is not the peer's.
pub(crate) fn request_size(msg: &ChannelMsg) -> Option<usize> {
    let heap = match msg {
        ChannelMsg::Eof
        | ChannelMsg::Close
        | ChannelMsg::Eow
        | ChannelMsg::RequestShell { .. }
        | ChannelMsg::WindowChange { .. }
        | ChannelMsg::AgentForward { .. } => 0,
        ChannelMsg::Signal { signal: Sig::Custom(name) } => name.len(),
        ChannelMsg::Signal { .. } => 0,
        ChannelMsg::RequestPty { term, terminal_modes, .. } => {
            term.len() + std::mem::size_of_val(terminal_modes.as_slice())
        }
        ChannelMsg::Exec { command, .. } => command.len(),
        ChannelMsg::RequestSubsystem { name, .. } => name.len(),
        ChannelMsg::RequestX11 { x11_authentication_protocol, x11_authentication_cookie, .. } => {
            x11_authentication_protocol.len() + x11_authentication_cookie.len()
        }
        ChannelMsg::SetEnv { variable_name, variable_value, .. } => variable_name.len() + variable_value.len(),
        _ => return None,
    };
    Some(std::mem::size_of::<ChannelMsg>() + heap)
}

/// Shared by a session and the readers of its channels.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    pub(crate) notify: Notify,
    dirty: Mutex<Vec<Arc<Taken>>>,
}

impl Wake {
    /// The channels whose readers took something since the last call.
    pub(crate) fn dirty(&self) -> Vec<Arc<Taken>> {
        std::mem::take(&mut *self.dirty.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// What one channel's reader took.
#[derive(Debug)]
pub(crate) struct Taken {
    /// The channel (set once the session numbered it).
    id: OnceLock<ChannelId>,
    /// Data bytes taken and not yet given back as window.
    bytes: AtomicUsize,
    /// Bytes of requests taken (see [`request_size`]) and not yet given
    /// back to the budget.
    requests: AtomicUsize,
    /// In the session's dirty list already.
    queued: AtomicBool,
    /// The session holds messages back for want of room in the queue.
    backlogged: AtomicBool,
    wake: Arc<Wake>,
}

impl Taken {
    pub(crate) fn new(wake: &Arc<Wake>) -> Arc<Self> {
        Arc::new(Self {
            id: OnceLock::new(),
            bytes: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
            queued: AtomicBool::new(false),
            backlogged: AtomicBool::new(false),
            wake: Arc::clone(wake),
        })
    }

    pub(crate) fn set_id(&self, id: ChannelId) {
        let _ = self.id.set(id);
    }

    pub(crate) fn id(&self) -> Option<ChannelId> {
        self.id.get().copied()
    }

    /// The reader took `msg` off the queue.
    pub(crate) fn took(self: &Arc<Self>, msg: &ChannelMsg) {
        let n = match msg {
            ChannelMsg::Data { data } | ChannelMsg::ExtendedData { data, .. } => data.len(),
            _ => 0,
        };
        if n > 0 {
            self.bytes.fetch_add(n, Ordering::SeqCst);
        }
        let request = request_size(msg).unwrap_or(0);
        if request > 0 {
            self.requests.fetch_add(request, Ordering::SeqCst);
        }
        let wake = n > 0 || request > 0 || self.backlogged.load(Ordering::SeqCst);
        if wake && !self.queued.swap(true, Ordering::SeqCst) {
            self.wake.dirty.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::clone(self));
            self.wake.notify.notify_one();
        }
    }

    /// The session is about to look at this channel again.
    pub(crate) fn seen(&self) {
        self.queued.store(false, Ordering::SeqCst);
    }

    pub(crate) fn set_backlogged(&self, backlogged: bool) {
        self.backlogged.store(backlogged, Ordering::SeqCst);
    }

    /// The bytes taken since the last call.
    pub(crate) fn take_bytes(&self) -> usize {
        self.bytes.swap(0, Ordering::SeqCst)
    }

    /// The bytes of requests taken since the last call.
    pub(crate) fn take_requests(&self) -> usize {
        self.requests.swap(0, Ordering::SeqCst)
    }
}
