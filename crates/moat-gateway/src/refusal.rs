//! Every reason the gateway gives for refusing a connection or a request, or
//! for ending one: one enum, so that what the log says (and what a box is
//! answered, where it gets an answer of the gateway's own) is decided in one
//! place. The texts are what the audit log has always said: tests and users
//! search the log for them.

use moat_core::policy::{HostName, Rule};

use tokio::io::AsyncWrite;

use crate::git::report;
use crate::http::response::{answer_git, answer_own, answer_package};

/// Why a connection or a request does not go through (or ended early).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    // Where the box dialled.
    /// The box has [`crate::admission::PER_BOX`] open.
    #[error("too many open connections")]
    TooManyConnections,
    /// The box's account has its share of the gateway's connections open.
    #[error("its account's boxes have too many open connections")]
    AccountConnections,
    /// The gateway carries as many connections as its descriptors allow.
    #[error("the gateway carries as many connections as it can")]
    GatewayFull,
    /// A fake address the box was never given.
    #[error("an address the gateway gave no name")]
    NoName,
    /// An address that is not fake (the box did not look the name up here).
    #[error("a raw address (only names the policy allows are reachable)")]
    RawAddress,
    /// Ask mode: the owner said no.
    #[error("the owner said no")]
    OwnerSaidNo,
    /// Ask mode: the owner said no to the name a minute ago, and is not
    /// asked again yet.
    #[error("the owner said no (a minute ago)")]
    OwnerSaidNoLately,
    /// Ask mode: the box has as many questions open as it may.
    #[error("too many questions open for this box")]
    TooManyQuestions,
    /// Ask mode: the question cannot reach the privileged side.
    #[error("the owner cannot be asked")]
    CannotAsk,
    /// Ask mode: the question was withdrawn (the box was detached).
    #[error("the question was withdrawn")]
    Withdrawn,
    /// Ask mode: no answer in time.
    #[error("the owner did not answer in time")]
    NoAnswer,

    // What the connection says of itself.
    /// Closed before its first byte.
    #[error("closed before sending anything")]
    ClosedAtOnce,
    /// Sent nothing in time, where only TLS or HTTP may go.
    #[error("sent nothing")]
    Silent,
    /// Neither TLS nor HTTP, where only those may go.
    #[error("not TLS or HTTP")]
    NotTlsOrHttp,
    /// A ClientHello that cannot be read one way only.
    #[error("{0}")]
    BadHello(&'static str),
    /// The ClientHello did not arrive whole in time.
    #[error("incomplete ClientHello")]
    IncompleteHello,
    /// The SNI names another host than the one dialled.
    #[error("SNI {0} differs from the dialled name")]
    SniDiffers(HostName),
    /// The host must be looked inside, and the box has no CA to do it with.
    #[error(
        "this host must be looked inside (its rules name methods or paths, or a secret is bound to it), and this \
         box has no CA to do it with (made before boxes had one: dup it)"
    )]
    NoCa,
    /// The TLS handshake with the box failed.
    #[error("TLS with the box: {0}")]
    BoxTls(String),
    /// A secret bound to the host was killed while the connection was open.
    #[error("a secret bound to this host was killed")]
    SecretKilledMidway,
    /// The policy was changed while the connection was open, and no longer
    /// allows it (by this deny rule, or by default).
    #[error("the policy changed and no longer allows it{}", .0.as_ref().map(|r| format!(" (rule {r})")).unwrap_or_default())]
    Revoked(Option<Rule>),
    /// The policy was changed while the connection was passed through
    /// untouched, and now names methods or paths for its host.
    #[error("the policy changed and now checks each request to this host (reconnect)")]
    NowLookedInside,

    // One request.
    /// A request head that cannot be read one way only.
    #[error("{0}")]
    BadRequest(&'static str),
    /// The box closed the connection inside a request head.
    #[error("closed inside a request head")]
    ClosedInHead,
    /// A request head that took too long.
    #[error("request head too slow")]
    SlowHead,
    /// A protocol switch, after which the gateway could read nothing.
    #[error("protocol switches (Upgrade) are not passed through the gateway")]
    Upgrade,
    /// The Host header names another host (or port) than the one dialled.
    #[error("Host {0} differs from the dialled name")]
    HostDiffers(HostName),
    /// A deny rule covers the request.
    #[error("refused by rule")]
    ByRule(Rule),
    /// No allow rule covers the request.
    #[error("no rule allows this request")]
    NoRule,
    /// The box closed the connection inside a request body.
    #[error("closed inside a request body")]
    ClosedInBody,
    /// The box closed the connection inside a chunked request body.
    #[error("closed inside a chunked body")]
    ClosedInChunkedBody,
    /// A chunked request body that breaks its framing.
    #[error("{0}")]
    BadChunk(&'static str),

    // Pushes (see [`crate::git`]).
    /// A push (or its ref advertisement) refused: answered on git's own
    /// channel, so that `git push` prints the reason.
    #[error("{reason}")]
    Git {
        /// What the log says.
        reason: String,
        /// The answer's content type.
        content_type: &'static str,
        /// The answer's body (git's report-status, or an `ERR` line).
        body: Vec<u8>,
    },

    // Packages.
    /// A package or file the box's package rules refuse, or one the
    /// gateway cannot check against its index.
    #[error("{why} ({rule})")]
    Package {
        /// The rule, as `policy NAME` shows it.
        rule: String,
        /// Why, for the client's output.
        why: String,
    },
    /// A registry's index the gateway cannot read (refused, not guessed at).
    #[error("{0}")]
    BadIndex(String),
    /// A package file whose bytes were going to the box as they came, and
    /// whose hash turned out wrong: the box has all but its last piece, and
    /// the connection ends there (nothing more is written: any bytes would
    /// be read as the file's).
    #[error("{0}")]
    PackageCut(String),

    // Secrets.
    /// A head with bytes that are not text, where secrets are written in.
    #[error("a head that is not text")]
    NotText,
    /// A secret's header twice (which one a server reads is anyone's guess).
    #[error("two {0} headers")]
    TwoHeaders(String),
    /// Another box's placeholder in a secret's header.
    #[error("a placeholder that is not this box's in {0}")]
    OthersPlaceholder(String),
    /// The secret was killed.
    #[error("secret {0} was killed")]
    SecretKilled(String),
    /// The box has as many requests with the secret in flight as it may.
    #[error(
        "secret {secret}: {max} requests with it are still being answered (its tokens or bytes are limited, and \
         counted as answers finish)"
    )]
    SecretBusy {
        /// The secret's name.
        secret: String,
        /// Requests a box may have in flight with it.
        max: usize,
    },
    /// A limit of the secret is reached.
    #[error("secret {secret}: {whose} limit of {limit} reached")]
    SecretLimit {
        /// The secret's name.
        secret: String,
        /// "this box's" or "all boxes'".
        whose: &'static str,
        /// The limit, described.
        limit: String,
    },
    /// The host's answer could not be checked for the box's secrets.
    #[error("the host's answer cannot be checked for secrets: {0}")]
    Uncheckable(&'static str),

    // The way out.
    /// The host could not be reached.
    #[error("{0}")]
    Unreachable(String),
    /// The host's side of a connection that carries secrets ended.
    #[error("the host's answers ended")]
    AnswersEnded,
    /// A request was to go out before its host was dialled.
    #[error("no upstream")]
    NoUpstream,
    /// Reading or writing failed.
    #[error("{0}")]
    Io(String),
}

impl Refusal {
    /// The HTTP status a box is answered with, where the gateway answers.
    pub fn status(&self) -> u16 {
        match self {
            Self::BadRequest(_)
            | Self::ClosedInHead
            | Self::SlowHead
            | Self::Io(_)
            | Self::NotText
            | Self::TwoHeaders(_)
            | Self::BadChunk(_)
            | Self::ClosedInBody
            | Self::ClosedInChunkedBody => 400,
            Self::SecretBusy { .. } | Self::SecretLimit { .. } => 429,
            Self::Unreachable(_) | Self::Uncheckable(_) | Self::AnswersEnded | Self::NoUpstream => 502,
            // git reads a refusal only in a successful answer.
            Self::Git { .. } => 200,
            _ => 403,
        }
    }

    /// Answers the box with this refusal, as an HTTP response of the
    /// gateway's own (the connection ends after it).
    pub async fn answer<W: AsyncWrite + Unpin>(&self, w: &mut W) {
        match self {
            Self::Git { content_type, body, .. } => answer_git(w, content_type, body).await,
            // The reason phrase too: pip prints it, npm and cargo the body.
            Self::Package { .. } | Self::BadIndex(_) => answer_package(w, &self.to_string()).await,
            Self::PackageCut(_) => {}
            _ => answer_own(w, self.status(), &self.to_string()).await,
        }
    }

    /// A push refused with an `ERR` line, for the ref advertisement
    /// (`advertise`) or a push whose commands cannot be read.
    pub fn git_error(advertise: bool, reason: String) -> Self {
        let content_type = if advertise { report::ADVERTISEMENT_TYPE } else { report::RESULT_TYPE };
        Self::Git { body: report::error(&reason), content_type, reason }
    }

    /// The rule that refused, if a rule did.
    pub fn rule(&self) -> Option<&Rule> {
        match self {
            Self::ByRule(rule) => Some(rule),
            _ => None,
        }
    }
}

impl From<std::io::Error> for Refusal {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e.to_string())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_the_logs_and_statuses_the_answers() {
        let host = HostName::parse("other.test").unwrap();
        let rule = Rule::parse(&["POST", "a.test/x"]).unwrap();
        for (refusal, text, status) in [
            (Refusal::SniDiffers(host.clone()), "SNI other.test differs from the dialled name", 403),
            (Refusal::HostDiffers(host), "Host other.test differs from the dialled name", 403),
            (Refusal::ByRule(rule.clone()), "refused by rule", 403),
            (Refusal::NoRule, "no rule allows this request", 403),
            (Refusal::OwnerSaidNo, "the owner said no", 403),
            (Refusal::OwnerSaidNoLately, "the owner said no (a minute ago)", 403),
            (Refusal::BadRequest("two Host headers"), "two Host headers", 400),
            (Refusal::TwoHeaders("Authorization".into()), "two Authorization headers", 400),
            (Refusal::SecretKilled("llm".into()), "secret llm was killed", 403),
            (
                Refusal::Revoked(Some(rule.clone())),
                "the policy changed and no longer allows it (rule POST a.test/x)",
                403,
            ),
            (Refusal::Revoked(None), "the policy changed and no longer allows it", 403),
            (
                Refusal::SecretLimit {
                    secret: "llm".into(),
                    whose: "this box's",
                    limit: "2 requests per 3600 s".into(),
                },
                "secret llm: this box's limit of 2 requests per 3600 s reached",
                429,
            ),
            (
                Refusal::SecretBusy { secret: "llm".into(), max: 4 },
                "secret llm: 4 requests with it are still being answered (its tokens or bytes are limited, and \
                 counted as answers finish)",
                429,
            ),
            (Refusal::Unreachable("no address".into()), "no address", 502),
        ] {
            assert_eq!((refusal.to_string().as_str(), refusal.status()), (text, status));
        }
        assert_eq!(Refusal::ByRule(rule.clone()).rule(), Some(&rule));
        assert!(Refusal::NoCa.to_string().ends_with("(made before boxes had one: dup it)"));
    }
}
