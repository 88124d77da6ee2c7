use std::collections::VecDeque;
use std::sync::Arc;

use bytes::BytesMut;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

use super::taken::Taken;
use super::WindowSizeRef;
use crate::ChannelMsg;

/// moat: most messages a channel's backlog holds. Data runs are one entry
/// each (bounded by the window the peer was given; a run of one stream's
/// bytes alternating with the other's is an entry a packet, ~100 bytes
/// each); past this many entries, the peer is flooding a channel whose
/// reader stopped. A window change replaces one right before it.
pub(crate) const MAX_BACKLOG: usize = 1024;

/// A handle to the [`super::Channel`]'s to be able to transmit messages
/// to it and update it's `window_size`.
#[derive(Debug)]
pub struct ChannelRef {
    pub(super) sender: Sender<ChannelMsg>,
    pub(super) window_size: WindowSizeRef,
    /// moat: what the reader takes (a server's channels; `None`: the window
    /// is given back on arrival, as russh did).
    pub(crate) taken: Option<Arc<Taken>>,
    /// moat: messages the reader had no room for yet, in order.
    backlog: VecDeque<Held>,
}

/// moat: what became of a message handed to a channel's reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Queued for the reader, held back for it, or dropped with the reader gone.
    Handed,
    /// It took the place of the same request held right before it.
    Replaced,
    /// Dropped: the backlog is full (the peer floods a reader that does not read).
    Refused,
}

/// A message held back; consecutive data of one stream in one buffer.
#[derive(Debug)]
enum Held {
    Data { ext: Option<u32>, bytes: BytesMut },
    Other(ChannelMsg),
}

impl Held {
    fn into_msg(self) -> ChannelMsg {
        match self {
            Held::Data { ext: None, bytes } => ChannelMsg::Data { data: bytes.freeze() },
            Held::Data { ext: Some(ext), bytes } => ChannelMsg::ExtendedData { data: bytes.freeze(), ext },
            Held::Other(msg) => msg,
        }
    }
}

impl ChannelRef {
    pub fn new(sender: Sender<ChannelMsg>) -> Self {
        Self {
            sender,
            window_size: WindowSizeRef::new(0),
            taken: None,
            backlog: VecDeque::new(),
        }
    }

    pub(crate) fn with_taken(self, taken: Arc<Taken>) -> Self {
        self.with_taken_opt(Some(taken))
    }

    pub(crate) fn with_taken_opt(mut self, taken: Option<Arc<Taken>>) -> Self {
        self.taken = taken;
        self
    }

    pub(crate) fn with_window_size(mut self, window_size: WindowSizeRef) -> Self {
        self.window_size = window_size;
        self
    }

    pub(crate) fn window_size(&self) -> &WindowSizeRef {
        &self.window_size
    }

    /// moat: whether the reader is gone (what is sent to it is dropped).
    pub(crate) fn reader_gone(&self) -> bool {
        self.sender.is_closed()
    }

    /// moat: hands `msg` to the reader without waiting, behind what waits
    /// already (see [`Delivery`]).
    pub(crate) fn deliver(&mut self, msg: ChannelMsg) -> Delivery {
        let msg = if self.backlog.is_empty() {
            match self.sender.try_send(msg) {
                Ok(()) | Err(TrySendError::Closed(_)) => return Delivery::Handed,
                Err(TrySendError::Full(msg)) => msg,
            }
        } else {
            msg
        };
        let delivery = self.hold(msg);
        if let Some(taken) = &self.taken {
            taken.set_backlogged(true);
        }
        // The reader may have made room meanwhile: it saw no backlog then.
        self.drain();
        delivery
    }

    /// Keeps `msg` in the backlog (data joins the data before it).
    fn hold(&mut self, msg: ChannelMsg) -> Delivery {
        let (ext, data) = match msg {
            ChannelMsg::Data { data } => (None, data),
            ChannelMsg::ExtendedData { data, ext } => (Some(ext), data),
            // Only the last of a run of sizes matters (a window dragged
            // while the program reads nothing).
            size @ ChannelMsg::WindowChange { .. }
                if matches!(self.backlog.back(), Some(Held::Other(ChannelMsg::WindowChange { .. }))) =>
            {
                if let Some(last) = self.backlog.back_mut() {
                    *last = Held::Other(size);
                }
                return Delivery::Replaced;
            }
            other if self.backlog.len() < MAX_BACKLOG => {
                self.backlog.push_back(Held::Other(other));
                return Delivery::Handed;
            }
            _ => return Delivery::Refused,
        };
        if let Some(Held::Data { ext: last, bytes }) = self.backlog.back_mut() {
            if *last == ext {
                bytes.extend_from_slice(&data);
                return Delivery::Handed;
            }
        }
        if self.backlog.len() >= MAX_BACKLOG {
            return Delivery::Refused;
        }
        self.backlog.push_back(Held::Data { ext, bytes: BytesMut::from(&data[..]) });
        Delivery::Handed
    }

    /// moat: hands on what the reader has room for now.
    pub(crate) fn drain(&mut self) {
        while let Some(held) = self.backlog.pop_front() {
            match self.sender.try_send(held.into_msg()) {
                Ok(()) => {}
                Err(TrySendError::Closed(_)) => self.backlog.clear(),
                Err(TrySendError::Full(msg)) => {
                    self.backlog.push_front(Held::Other(msg));
                    break;
                }
            }
        }
        if self.backlog.is_empty() {
            if let Some(taken) = &self.taken {
                taken.set_backlogged(false);
            }
        }
    }
}

impl std::ops::Deref for ChannelRef {
    type Target = Sender<ChannelMsg>;

    fn deref(&self) -> &Self::Target {
        &self.sender
    }
}
