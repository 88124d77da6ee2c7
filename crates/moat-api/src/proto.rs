//! What the front door may ask of the privileged side, and the answers.
//!
//! Every request names the account it acts for; the privileged side trusts the
//! front door on *which* listed key authenticated (it cannot check the SSH
//! signature itself), but nothing the front door says can reach past the
//! manager's rules: a name is validated on decode, another account's box looks
//! like no box, and every limit is checked again.

use moat_core::egress::{Answer, LogEntry, Question};
use moat_core::policy::Policy;
use moat_core::secrets::{Limit, SecretInfo, SecretSpec, SecretValue};
use moat_core::{AccountId, BoxRecord, Change, Limits, Name, UsageReport};
use serde::{Deserialize, Serialize};

/// Largest request the privileged side reads (requests are a few hundred bytes).
pub const MAX_REQUEST: usize = 16 << 10;
/// Largest event the front door reads (a diff of many paths is the big one).
pub const MAX_EVENT: usize = 64 << 20;

/// The first message on the dialer, from the privileged side: what the front
/// door needs to serve. The listening socket is attached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The SSH host key, in OpenSSH's private key format.
    pub host_key: String,
    /// Seconds a client has to authenticate.
    pub auth_timeout_secs: u64,
    /// Seconds of silence after which a connection is closed.
    pub idle_timeout_secs: u64,
}

/// One request; each travels on a connection of its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Which account a public key (OpenSSH `TYPE BASE64`) is, if it is listed.
    Authorize {
        /// The key.
        key: String,
    },
    /// What an SSH user name is for this account: a box, a former box, or neither.
    Route {
        /// The account.
        account: AccountId,
        /// The name (already a valid box name).
        name: Name,
    },
    /// The account's boxes.
    List {
        /// The account.
        account: AccountId,
    },
    /// One box.
    Get {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
    /// Makes a box (building its image first if needed; progress streams back).
    Create {
        /// The account.
        account: AccountId,
        /// The box's name.
        name: Name,
        /// Its image.
        image: Name,
        /// Its limits.
        limits: Limits,
        /// Its idle grace, if not the daemon's default.
        idle: Option<u32>,
        /// The preset its egress policy starts from, if not the operator's default.
        #[serde(default)]
        policy: Option<String>,
        /// Ask mode from the start.
        #[serde(default)]
        ask: bool,
        /// What isolates it, if not the operator's default.
        #[serde(default)]
        backend: Option<moat_core::BackendKind>,
    },
    /// Removes a box.
    Remove {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
    /// Copies `src` as `dst`.
    Dup {
        /// The account.
        account: AccountId,
        /// The box copied.
        src: Name,
        /// The copy's name.
        dst: Name,
    },
    /// What differs in `b` relative to `a`.
    Diff {
        /// The account.
        account: AccountId,
        /// The reference.
        a: Name,
        /// The box compared.
        b: Name,
    },
    /// Saves a box as a checkpoint.
    Checkpoint {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
        /// The label, if not the next `cN`.
        label: Option<Name>,
    },
    /// A box's checkpoints.
    Checkpoints {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
    /// Puts a box back to a checkpoint.
    Restore {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
        /// The checkpoint.
        label: Name,
    },
    /// Deletes a checkpoint.
    CheckpointRemove {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
        /// The checkpoint.
        label: Name,
    },
    /// `child` takes its parent's name.
    Promote {
        /// The account.
        account: AccountId,
        /// The duplicate.
        child: Name,
    },
    /// Ends a box's processes.
    Stop {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
    /// Boots a box.
    Start {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
    /// Freezes a box.
    Suspend {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
    /// Sets a box's idle grace.
    SetIdle {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
        /// Seconds.
        seconds: u32,
    },
    /// Keeps a box running without sessions, or not.
    SetKeepRunning {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
        /// On or off.
        on: bool,
    },
    /// Usage since `since` (seconds since the epoch), of one box or all.
    Usage {
        /// The account.
        account: AccountId,
        /// Start of the period.
        since: u64,
        /// One box, or every box.
        name: Option<Name>,
    },
    /// A box's egress policy.
    Policy {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
    /// Changes a box's egress policy; applies to its next connection.
    ChangePolicy {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
        /// The change.
        change: PolicyChange,
    },
    /// A box's egress log since `since_ms`, in batches; with `follow`, then
    /// every new entry until the connection closes.
    Log {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
        /// Milliseconds since the epoch.
        since_ms: u64,
        /// Keep sending new entries.
        follow: bool,
        /// With `follow`, the box's questions (ask mode) too.
        #[serde(default)]
        ask: bool,
    },
    /// Adds a secret (its value travels only in this request).
    SecretAdd {
        /// The account.
        account: AccountId,
        /// What it is.
        spec: SecretSpec,
        /// Its value.
        value: SecretValue,
    },
    /// The account's secrets (never their values).
    SecretList {
        /// The account.
        account: AccountId,
    },
    /// Removes a secret (revoked from every box first).
    SecretRemove {
        /// The account.
        account: AccountId,
        /// The secret.
        name: Name,
    },
    /// Grants a secret to a box.
    SecretGrant {
        /// The account.
        account: AccountId,
        /// The secret.
        name: Name,
        /// The box.
        box_name: Name,
    },
    /// Revokes a secret from a box.
    SecretRevoke {
        /// The account.
        account: AccountId,
        /// The secret.
        name: Name,
        /// The box.
        box_name: Name,
    },
    /// Limits a secret's use, by one box or by all together.
    SecretLimit {
        /// The account.
        account: AccountId,
        /// The secret.
        name: Name,
        /// The box (`None`: all together).
        box_name: Option<Name>,
        /// The limits.
        limits: Vec<Limit>,
    },
    /// Stops every use of a secret at once.
    SecretKill {
        /// The account.
        account: AccountId,
        /// The secret.
        name: Name,
    },
    /// The account's open questions (ask mode); with `follow`, then every
    /// new one until the connection closes.
    Questions {
        /// The account.
        account: AccountId,
        /// Keep sending new questions.
        follow: bool,
    },
    /// The owner's answer to a question.
    Answer {
        /// The account.
        account: AccountId,
        /// The question.
        id: u64,
        /// The answer.
        answer: Answer,
    },
    /// A session on a box: the answer carries a stream connected to its agent,
    /// and the box stays up until this request's connection closes.
    OpenSession {
        /// The account.
        account: AccountId,
        /// The box.
        name: Name,
    },
}

/// A change to a policy. Rules travel as the words the user typed and are
/// parsed by the privileged side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyChange {
    /// Add an allow rule.
    Allow(Vec<String>),
    /// Add a deny rule.
    Deny(Vec<String>),
    /// Remove a rule (allow or deny) equal to this one.
    Remove(Vec<String>),
    /// Replace the policy's rules with a preset's (ask mode stays as it was).
    Preset(String),
    /// Turn ask mode on or off.
    Ask(bool),
}

/// What a user name is, for one account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// One of the account's boxes.
    Box,
    /// A name that was one of the account's boxes (removed or renamed).
    Gone,
    /// Neither.
    None,
}

/// A box as the front door sees it: no host details (uids, pids, paths).
/// Its JSON is what `ls --json` and `info --json` print.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoxInfo {
    /// Host-side id.
    pub id: String,
    /// Name.
    pub name: Name,
    /// Image it was made from.
    pub image: Name,
    /// Limits.
    pub limits: Limits,
    /// Lifecycle state (`running`, `suspended`, ...).
    pub state: String,
    /// Creation time, seconds since the epoch.
    pub created_at: u64,
    /// The box it was duplicated from, if that box still exists.
    pub parent: Option<Name>,
    /// Whether it was duplicated from a box at all.
    #[serde(default)]
    pub duplicated: bool,
    /// Idle grace, if not the daemon's default.
    pub idle: Option<u32>,
    /// Never suspended for want of sessions.
    pub keep_running: bool,
    /// When it entered its state, seconds since the epoch.
    pub state_since: u64,
    /// What isolates it (`ns` or `vm`).
    #[serde(default)]
    pub backend: moat_core::BackendKind,
}

impl From<&BoxRecord> for BoxInfo {
    fn from(r: &BoxRecord) -> Self {
        Self {
            id: r.id.as_str().to_string(),
            name: r.name.clone(),
            image: r.image.clone(),
            limits: r.limits,
            state: r.state.as_str().to_string(),
            created_at: r.created_at,
            parent: r.parent_name.clone(),
            duplicated: r.parent.is_some(),
            idle: r.idle,
            keep_running: r.keep_running,
            state_since: r.state_since,
            backend: r.backend,
        }
    }
}

/// A successful answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// To `Authorize`.
    Account(Option<AccountId>),
    /// To `Route`.
    Route(Route),
    /// To `List`.
    Boxes(Vec<BoxInfo>),
    /// To `Get`, `Create` and `Dup`.
    Box(BoxInfo),
    /// To `Promote`: the name the parent now has; to `Checkpoint`, the
    /// label; to `Restore`, the label the state before it is kept under.
    Name(Name),
    /// To `Checkpoints`.
    Checkpoints(Vec<moat_core::Checkpoint>),
    /// To `Usage`.
    Usage(UsageReport),
    /// To `Policy` and `ChangePolicy`.
    Policy(Policy),
    /// To `Answer`: the question answered.
    Question(Question),
    /// To `SecretList`.
    Secrets(Vec<SecretInfo>),
    /// To `OpenSession`: the stream to the agent is attached.
    Session,
    /// Done, nothing to say.
    Done,
}

/// A failed request, as the user should read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// The exit status a control command reports (2: usage or limits, 1: else).
    pub status: u32,
    /// What went wrong, with its causes.
    pub message: String,
}

impl ApiError {
    /// An answer of the wrong kind for the request (a bug on one side or the other).
    pub fn unexpected(reply: &Reply) -> Self {
        Self { status: 255, message: format!("unexpected answer from moat's privileged side: {reply:?}") }
    }
}

/// What travels back on a request's connection: any number of progress
/// lines (and, for `Diff`, batches of changes as they are found), then one
/// outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A line of progress of long work (an image build).
    Progress(String),
    /// Some of what `Diff` found; its outcome is `Done`.
    Changes(Vec<Change>),
    /// Entries of `Log`; its outcome is `Done`.
    Log(Vec<LogEntry>),
    /// A question of `Questions` (or of `Log` with `ask`).
    Question(Question),
    /// How the request ended.
    Outcome(Result<Reply, ApiError>),
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Any bytes decode to a request or an error, never a panic, and a
        /// name that decodes is a valid one.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(Request::Route { name, .. }) = serde_json::from_slice::<Request>(&bytes) {
                prop_assert!(Name::new(name.as_str()).is_ok());
            }
        }

        /// Mutations of a valid request (one byte changed, inserted or cut)
        /// decode or fail cleanly; names stay valid whatever gets through.
        #[test]
        fn mutated_requests_stay_valid(pos in 0usize..200, byte in any::<u8>(), op in 0u8..3) {
            let req = Request::Create {
                account: AccountId("SHA256:abc".into()),
                name: Name::new("web").unwrap(),
                image: Name::new("debian").unwrap(),
                limits: Limits::default(),
                idle: Some(5),
                policy: None,
                ask: false,
                backend: Some(moat_core::BackendKind::Vm),
            };
            let mut bytes = serde_json::to_vec(&req).unwrap();
            let pos = pos % bytes.len();
            match op {
                0 => bytes[pos] = byte,
                1 => bytes.insert(pos, byte),
                _ => { bytes.truncate(pos); }
            }
            if let Ok(Request::Create { name, image, .. }) = serde_json::from_slice::<Request>(&bytes) {
                prop_assert!(Name::new(name.as_str()).is_ok());
                prop_assert!(Name::new(image.as_str()).is_ok());
            }
        }
    }

    #[test]
    fn invalid_names_do_not_decode() {
        let bad = r#"{"route":{"account":"SHA256:x","name":"../etc"}}"#;
        assert!(serde_json::from_str::<Request>(bad).is_err());
        let good = r#"{"route":{"account":"SHA256:x","name":"web"}}"#;
        assert!(serde_json::from_str::<Request>(good).is_ok());
    }
}
