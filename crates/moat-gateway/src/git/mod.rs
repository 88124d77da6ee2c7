//! Git's smart HTTP protocol, as far as the gateway reads it to apply push
//! rules ([`moat_core::policy::PushRule`]): which requests are pushes and to
//! which repository ([`target`]), the pkt-line framing ([`pktline`]), the
//! command list a `git-receive-pack` request opens with ([`commands`]), the
//! pack after it, for the commits a fast-forward is decided from
//! ([`pack`], [`delta`]), the decision itself ([`verdict`]), and git's own
//! error channel for a refusal ([`report`]).
//!
//! Every byte here is the box's: nothing may panic, and every size is bounded
//! before it is allocated.

pub mod commands;
pub mod delta;
pub mod pack;
pub mod pktline;
pub mod report;
pub mod target;
pub mod verdict;

/// Why a push's bytes cannot be read one way only (the push is refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GitError {
    /// A pkt-line whose length is not four hex digits, or out of range.
    #[error("a malformed pkt-line length")]
    BadLength,
    /// A command that is not `OLD NEW REF`.
    #[error("a malformed push command")]
    BadCommand,
    /// An object id that is not hex of the push's hash.
    #[error("a malformed object id")]
    BadId,
    /// A ref name git would not take.
    #[error("a malformed ref name")]
    BadRef,
    /// The command list is larger than the gateway reads.
    #[error("the push's command list is too large")]
    TooManyCommands,
    /// A signed push (its certificate is not read by the gateway).
    #[error("signed pushes are not read by the gateway")]
    Signed,
    /// The body ended inside the command list.
    #[error("the push's command list is cut short")]
    Cut,
    /// The pack is not one git wrote.
    #[error("a malformed pack: {0}")]
    BadPack(&'static str),
}
