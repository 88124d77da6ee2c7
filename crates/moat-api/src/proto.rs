//! What the front door may ask of the privileged side, and the answers.
//!
//! Every request names the account it acts for; the privileged side trusts the
//! front door on *which* listed key authenticated (it cannot check the SSH
//! signature itself), but nothing the front door says can reach past the
//! manager's rules: a name is validated on decode, another account's box looks
//! like no box, and every limit is checked again.

use moat_core::effects::{Effect, Since};
use moat_core::egress::{Answer, LogEntry, Question};
use moat_core::policy::{Policy, PolicyChange, Preset};
use moat_core::secrets::{Limit, SecretInfo, SecretSpec, SecretValue};
use moat_core::web::{Exposure, Owner, WebHost, WebSecret, WebVerdict};
use moat_core::{AccountId, BoxRecord, Change, Limits, ManagerConfig, Name, UsageReport};
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
    /// Which account a public key (OpenSSH `TYPE BASE64`) is, if it is listed:
    /// the one question asked before an account is known.
    Authorize {
        /// The key.
        key: String,
    },
    /// A request of the HTTP edge, which acts for no account: the
    /// privileged side decides from the URL and the visitor's cookie.
    Web(WebOp),
    /// An operation for an account (the envelope every other request is).
    Act {
        /// The account it acts for.
        account: AccountId,
        /// What it does.
        op: Op,
    },
}

/// What the front door may ask for an account: one variant per operation of
/// the core. The control grammar yields these directly; the core checks
/// everything in them again (names and rules on decode, limits and
/// ownership in the manager).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// What an SSH user name is for this account: a box, a former box, or neither.
    Route {
        /// The name (already a valid box name).
        name: Name,
        /// Whose box, if another account's that shared it (`ssh NAME.OWNER@HOST`).
        #[serde(default)]
        owner: Option<Owner>,
    },
    /// The account's boxes.
    List,
    /// One box.
    Get {
        /// The box.
        name: Name,
    },
    /// Makes a box (building its image first if needed; progress streams back).
    Create {
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
        policy: Option<Preset>,
        /// Ask mode from the start.
        #[serde(default)]
        ask: bool,
        /// What isolates it, if not the operator's default.
        #[serde(default)]
        backend: Option<moat_core::BackendKind>,
        /// The fleet node to make it on, if not where placement puts it.
        #[serde(default)]
        node: Option<String>,
        /// Keep its image's Entrypoint and Cmd running as its service.
        #[serde(default)]
        run: bool,
    },
    /// Pulls an image from a registry as one of the account's.
    ImagePull {
        /// What to pull (`[REGISTRY/]REPO[:TAG][@DIGEST]`).
        reference: String,
        /// The name it gets, if not the one the reference suggests.
        #[serde(default)]
        name: Option<Name>,
    },
    /// The account's pulled images.
    ImageList,
    /// Removes one of the account's images.
    ImageRemove {
        /// The image.
        name: Name,
    },
    /// Makes a box's files as of now one of the account's images (a template).
    ImageSave {
        /// The box.
        name: Name,
        /// The image's name.
        image: Name,
    },
    /// Pushes one of the account's images (a template: its base's layers
    /// and one of what it adds) to a registry.
    ImagePush {
        /// The image.
        name: Name,
        /// Where to (`REGISTRY/REPO[:TAG]`).
        reference: String,
    },
    /// Keeps the account's login for a registry (sealed).
    ImageLogin {
        /// `HOST[:PORT]`.
        registry: String,
        /// The user.
        user: String,
        /// The password or token (from stdin).
        password: Password,
    },
    /// Removes a box.
    Remove {
        /// The box.
        name: Name,
    },
    /// Copies `src` as `dst`.
    Dup {
        /// The box copied.
        src: Name,
        /// The copy's name.
        dst: Name,
    },
    /// What differs in `b` relative to `a`.
    Diff {
        /// The reference.
        a: Name,
        /// The box compared.
        b: Name,
    },
    /// Saves a box as a checkpoint.
    Checkpoint {
        /// The box.
        name: Name,
        /// The label, if not the next `cN`.
        label: Option<Name>,
    },
    /// A box's checkpoints.
    Checkpoints {
        /// The box.
        name: Name,
    },
    /// Puts a box back to a checkpoint.
    Restore {
        /// The box.
        name: Name,
        /// The checkpoint.
        label: Name,
    },
    /// Deletes a checkpoint.
    CheckpointRemove {
        /// The box.
        name: Name,
        /// The checkpoint.
        label: Name,
    },
    /// `child` takes its parent's name.
    Promote {
        /// The duplicate.
        child: Name,
    },
    /// Ends a box's processes.
    Stop {
        /// The box.
        name: Name,
    },
    /// Boots a box.
    Start {
        /// The box.
        name: Name,
    },
    /// Freezes a box.
    Suspend {
        /// The box.
        name: Name,
    },
    /// Moves a box to another node of the fleet, through the object store.
    Move {
        /// The box.
        name: Name,
        /// The node it goes to.
        node: String,
    },
    /// Sets a box's idle grace.
    SetIdle {
        /// The box.
        name: Name,
        /// Seconds.
        seconds: u32,
    },
    /// Keeps a box running without sessions, or not.
    SetKeepRunning {
        /// The box.
        name: Name,
        /// On or off.
        on: bool,
    },
    /// Usage since `since` (seconds since the epoch), of one box or all.
    Usage {
        /// Start of the period.
        since: u64,
        /// One box, or every box.
        name: Option<Name>,
    },
    /// A box's egress policy.
    Policy {
        /// The box.
        name: Name,
    },
    /// Changes a box's egress policy; applies to its next connection.
    ChangePolicy {
        /// The box.
        name: Name,
        /// The change.
        change: PolicyChange,
    },
    /// A box's egress log since `since_ms`, in batches; with `follow`, then
    /// every new entry until the connection closes.
    Log {
        /// The box.
        name: Name,
        /// Milliseconds since the epoch.
        since_ms: u64,
        /// Entries before this only (milliseconds since the epoch).
        #[serde(default)]
        until_ms: Option<u64>,
        /// Keep sending new entries.
        follow: bool,
        /// With `follow`, the box's questions (ask mode) too.
        #[serde(default)]
        ask: bool,
    },
    /// The recent output of a box's service (`new --run`).
    ServiceLog {
        /// The box.
        name: Name,
    },
    /// The package files a box asked registries for.
    Packages {
        /// The box.
        name: Name,
    },
    /// A box's effects (what it did outside that a restore does not undo).
    Effects {
        /// The box.
        name: Name,
        /// From when.
        since: Since,
    },
    /// Adds a secret (its value travels only in this request).
    SecretAdd {
        /// What it is.
        spec: SecretSpec,
        /// Its value.
        value: SecretValue,
    },
    /// The account's secrets (never their values).
    SecretList,
    /// Removes a secret (revoked from every box first).
    SecretRemove {
        /// The secret.
        name: Name,
    },
    /// Grants a secret to a box.
    SecretGrant {
        /// The secret.
        name: Name,
        /// The box.
        box_name: Name,
    },
    /// Revokes a secret from a box.
    SecretRevoke {
        /// The secret.
        name: Name,
        /// The box.
        box_name: Name,
    },
    /// Limits a secret's use, by one box or by all together.
    SecretLimit {
        /// The secret.
        name: Name,
        /// The box (`None`: all together).
        box_name: Option<Name>,
        /// The limits.
        limits: Vec<Limit>,
    },
    /// Stops every use of a secret at once.
    SecretKill {
        /// The secret.
        name: Name,
    },
    /// The account's open questions (ask mode); with `follow`, then every
    /// new one until the connection closes.
    Questions {
        /// Keep sending new questions.
        follow: bool,
    },
    /// The owner's answer to a question.
    Answer {
        /// The question.
        id: u64,
        /// The answer.
        answer: Answer,
    },
    /// Who the account is and what it may use (`whoami`).
    Whoami,
    /// A session on a box: the answer carries a stream connected to its agent,
    /// and the box stays up until this request's connection closes.
    OpenSession {
        /// The box.
        name: Name,
        /// Whose box, if another account's that shared it.
        #[serde(default)]
        owner: Option<Owner>,
    },
    /// Gives a box's port a web URL.
    Expose {
        /// The box.
        name: Name,
        /// The port in the box.
        port: u16,
        /// Reached without signing in.
        public: bool,
    },
    /// Takes a port's web URL away.
    Unexpose {
        /// The box.
        name: Name,
        /// The port.
        port: u16,
    },
    /// The exposed ports of the account's boxes (or of one), and of those
    /// shared with it.
    Urls {
        /// One box, or every box.
        name: Option<Name>,
    },
    /// A one-time sign-in link to a box's port.
    Url {
        /// The box.
        name: Name,
        /// The port.
        port: u16,
        /// Whose box, if another account's that shared it.
        #[serde(default)]
        owner: Option<Owner>,
    },
    /// Lets another account's key reach a box (its URLs and its ssh).
    Share {
        /// The box.
        name: Name,
        /// The other account (its key's fingerprint).
        with: AccountId,
    },
    /// Takes back a share.
    Unshare {
        /// The box.
        name: Name,
        /// The other account.
        with: AccountId,
    },
}

/// What the HTTP edge may ask. Each names the URL's box port; none names an
/// account (the edge has none to name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum WebOp {
    /// Whether a request with this cookie may reach the box port.
    Check {
        /// The URL's box port.
        host: WebHost,
        /// The visitor's session cookie, if it sent one.
        cookie: Option<WebSecret>,
    },
    /// Spends a sign-in link: the answer is the session cookie it becomes.
    SignIn {
        /// The URL's box port.
        host: WebHost,
        /// The link's secret.
        link: WebSecret,
    },
    /// As `Check`, then a session on the box (resuming it if suspended):
    /// the answer carries up to `sockets` sockets in the box's own network
    /// (as `WebSessionMsg::Sockets` would), or, where its agent must connect
    /// (a microVM guest), a stream to the agent; the box stays up until this
    /// request's connection closes. Meanwhile the edge sends
    /// [`WebSessionMsg`]s on it.
    Open {
        /// The URL's box port.
        host: WebHost,
        /// The visitor's session cookie, if it sent one.
        cookie: Option<WebSecret>,
        /// How many sockets in the box's network to attach.
        sockets: u8,
    },
}

impl Op {
    /// The name of the box this operation would create, if it creates one.
    pub fn creates(&self) -> Option<&Name> {
        match self {
            Op::Create { name, .. } => Some(name),
            Op::Dup { dst, .. } => Some(dst),
            _ => None,
        }
    }
}

/// What a user name is, for one account.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// One of the account's boxes.
    Box,
    /// A name that was one of the account's boxes (removed or renamed).
    Gone,
    /// Not a box, but close to this one of the account's boxes: a typo.
    Near(Name),
    /// None of these.
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
    /// The fleet node that holds it (none on a single host).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// How durable it is (only where boxes are kept in an object store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable: Option<Box<DurableInfo>>,
    /// Where it came from, if it moved to its node from another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved: Option<moat_core::store::moves::Arrival>,
    /// Its move to another node, if one is asked or the last one failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving: Option<Box<moat_core::store::moves::BoxMove>>,
    /// The keys (accounts) it is shared with (`info` only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_with: Vec<AccountId>,
}

/// How durable a box is: when it was last kept in the object store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurableInfo {
    /// The object store holds the box as it was then (ms since the epoch), if at all.
    pub as_of_ms: Option<u64>,
    /// Bytes it keeps there.
    pub bytes: u64,
    /// An upload is queued or under way.
    pub pending: bool,
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
            node: r.node.clone(),
            durable: None,
            moved: None,
            moving: None,
            shared_with: Vec::new(),
        }
    }
}

impl BoxInfo {
    /// The box as `ls` and `info` show it when its node's lease lapsed: its
    /// last known state no longer holds.
    pub fn on_lost_node(mut self) -> Self {
        self.state = NODE_LOST.to_string();
        self
    }
}

/// The state shown for a box whose node stopped renewing its lease.
pub const NODE_LOST: &str = "node-lost";

/// Who an account is and what the operator lets it use: `whoami`. Its JSON
/// is what `whoami --json` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Whoami {
    /// The account.
    pub account: AccountId,
    /// Its key's SHA-256 fingerprint, as `ssh-keygen -l` shows it (an
    /// account is its key, so today this is the account's id too).
    pub fingerprint: String,
    /// The slug that names its boxes to accounts they are shared with
    /// (`ssh NAME.OWNER@HOST`, `url NAME PORT --owner OWNER`).
    #[serde(default)]
    pub owner: String,
    /// How many boxes it has.
    pub boxes: usize,
    /// The operator's caps (`moat serve --max-boxes` and the like).
    pub limits: AccountLimits,
}

/// The operator's caps on one account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountLimits {
    /// Most boxes (`--max-boxes`).
    pub max_boxes: usize,
    /// The largest limits one box may ask for (`--max-cpus`, `--max-memory`, `--max-disk`).
    pub per_box: Limits,
    /// Most memory the limits of its boxes may add up to (`--max-memory-per-account`).
    pub max_memory: u64,
    /// Most disk its boxes may hold together (`--max-disk-per-account`).
    pub max_disk: u64,
    /// Most checkpoints per box (`--max-checkpoints`).
    pub max_checkpoints: usize,
    /// Most images, pulled and saved (`--max-images`).
    #[serde(default)]
    pub max_images: usize,
}

impl From<&ManagerConfig> for AccountLimits {
    fn from(c: &ManagerConfig) -> Self {
        Self {
            max_boxes: c.max_boxes,
            per_box: c.max_limits,
            max_memory: c.max_memory_per_account,
            max_disk: c.max_disk_per_account,
            max_checkpoints: c.max_checkpoints,
            max_images: c.max_images,
        }
    }
}

/// What the edge sends on a web session's connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum WebSessionMsg {
    /// Requests it carried, for the box's log.
    Log(Vec<moat_core::web::WebRequestLog>),
    /// Another stream to the same box's agent (for another connection to the
    /// port): answered with `Reply::Session` and the stream, or an error.
    Stream,
    /// Sockets in the box's own network, at most [`crate::wire::MAX_FDS`],
    /// which the edge connects to the port itself: answered with
    /// `Reply::WebSockets` and them (none: the box's agent must connect, a
    /// microVM guest's loopback not being the host kernel's), or an error.
    Sockets {
        /// How many.
        count: u8,
    },
    /// Resume the box if it is suspended (`suspend` freezes a box whatever
    /// its sessions; the edge asks when a box it holds is slow to answer):
    /// answered with `Reply::Done`, or an error.
    Wake,
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
    /// To `Effects`.
    Effects(Vec<Effect>),
    /// Package file requests (log entries that name one), oldest first.
    Packages(Vec<moat_core::egress::LogEntry>),
    /// To `Restore`: the label the state before it is kept under, and what
    /// the box did since the checkpoint that the restore does not undo.
    Restored {
        /// The label of the state before.
        kept: Name,
        /// Effects since the checkpoint.
        effects: Vec<Effect>,
    },
    /// To `Diff` (after its changes): each box's effects, and the package
    /// files each let in, since they split.
    Diffed {
        /// `a`'s.
        a: Vec<Effect>,
        /// `b`'s.
        b: Vec<Effect>,
        /// `a`'s package files.
        #[serde(default)]
        a_packages: Vec<moat_core::egress::LogEntry>,
        /// `b`'s package files.
        #[serde(default)]
        b_packages: Vec<moat_core::egress::LogEntry>,
    },
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
    /// To `Whoami`.
    Whoami(Whoami),
    /// To `ImageList`.
    Images(Vec<ImageInfo>),
    /// To `ImagePull`.
    Image(ImageInfo),
    /// To `OpenSession`: the stream to the agent is attached.
    Session,
    /// To `WebOp::Check`, and to `WebOp::SignIn` and `WebOp::Open` when refused.
    Web(WebVerdict),
    /// To `WebSessionMsg::Sockets`: the sockets are attached.
    WebSockets,
    /// To `WebOp::SignIn`: the session cookie's value.
    WebCookie(WebSecret),
    /// To `WebOp::Open`: sockets in the box's network are attached, or a
    /// stream to its agent; the visitor is `who`.
    WebSession {
        /// Who the visitor is (an account, or `public`).
        who: String,
        /// The attached descriptor is a stream to the box's agent, which
        /// connects to its ports (a microVM guest's loopback is its own).
        through_agent: bool,
        /// The last descriptor attached is the session's life line: one end
        /// of a socket pair whose other end the privileged side closes when
        /// the session ends (the visitor's access taken away), so the edge ends
        /// its requests in flight then.
        #[serde(default)]
        life_line: bool,
    },
    /// To `Urls` (and `Expose`: the one port).
    Exposures(Vec<Exposure>),
    /// To `Url`: the sign-in link, and how many seconds it works.
    SignInLink {
        /// The link.
        url: String,
        /// Seconds until it expires.
        expires_in: u64,
    },
    /// To `ServiceLog`: the output, as text.
    Text(String),
    /// Done, nothing to say.
    Done,
}

/// A registry password or token: 1 to 1024 printable ASCII characters,
/// never printed.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Password(String);

impl Password {
    /// Checks `text` (surrounding whitespace dropped).
    pub fn new(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() || text.len() > 1024 || !text.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return Err("a password is 1 to 1024 printable ASCII characters, on stdin".into());
        }
        Ok(Self(text.to_string()))
    }

    /// The password itself, for the one place that seals it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Password {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Self::new(&s)
    }
}

impl From<Password> for String {
    fn from(p: Password) -> String {
        p.0
    }
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(..)")
    }
}

/// A pulled image, as `image ls` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// The account's name for it.
    pub name: Name,
    /// What was pulled.
    pub reference: String,
    /// The manifest's digest.
    pub digest: String,
    /// Its blobs' size (compressed).
    pub bytes: u64,
    /// How many layers.
    pub layers: usize,
    /// When it was pulled (ms since the epoch).
    pub created_ms: u64,
}

impl From<&moat_core::store::images::StoredImage> for ImageInfo {
    fn from(i: &moat_core::store::images::StoredImage) -> Self {
        Self {
            name: i.name.clone(),
            reference: i.reference.clone(),
            digest: i.digest.clone(),
            bytes: i.bytes,
            layers: i.layers.len(),
            created_ms: i.created_ms,
        }
    }
}

/// The status of a failure that means "not on this node": the box named is
/// another node's (it moved, or its epoch is not this node's), or this node
/// has no room for a new box. A fleet's router then asks the store again or
/// tries another node; it never reaches a user as such. One host never
/// answers with it.
pub const ELSEWHERE: u32 = 3;

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
    use moat_core::policy::{PushRule, Rule};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Any bytes decode to a request or an error, never a panic, and a
        /// name that decodes is a valid one.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            match serde_json::from_slice::<Request>(&bytes) {
                Ok(Request::Act { op: Op::Route { name, .. }, .. }) => prop_assert!(Name::new(name.as_str()).is_ok()),
                Ok(Request::Act { op: Op::ChangePolicy { change, .. }, .. }) => prop_assert!(rule_is_parsed(&change)),
                _ => {}
            }
        }

        /// Mutations of a valid request (one byte changed, inserted or cut)
        /// decode or fail cleanly; names stay valid whatever gets through.
        #[test]
        fn mutated_requests_stay_valid(pos in 0usize..200, byte in any::<u8>(), op in 0u8..3) {
            let create = Op::Create {
                name: Name::new("web").unwrap(),
                image: Name::new("debian").unwrap(),
                limits: Limits::default(),
                idle: Some(5),
                policy: Some(Preset::GithubRead),
                ask: false,
                backend: Some(moat_core::BackendKind::Vm),
                node: Some("n1".into()),
                run: true,
            };
            let bytes = mutated(create, pos, byte, op);
            if let Ok(Request::Act { op: Op::Create { name, image, .. }, .. }) = serde_json::from_slice::<Request>(&bytes) {
                prop_assert!(Name::new(name.as_str()).is_ok());
                prop_assert!(Name::new(image.as_str()).is_ok());
            }
        }

        /// Mutations of a rule change decode only to rules the parser could
        /// have made: the core applies what it decodes without parsing again.
        #[test]
        fn mutated_rules_stay_parsed(pos in 0usize..200, byte in any::<u8>(), op in 0u8..3, which in 0usize..4) {
            let text = ["GET,HEAD deb.debian.org/debian/", "*.example.com:443", "x.org:*", "github.com/*git-receive-pack"][which];
            let rule = Rule::parse(&text.split(' ').collect::<Vec<_>>()).unwrap();
            let change = Op::ChangePolicy { name: Name::new("web").unwrap(), change: PolicyChange::Deny(rule) };
            let bytes = mutated(change, pos, byte, op);
            if let Ok(Request::Act { op: Op::ChangePolicy { change, .. }, .. }) = serde_json::from_slice::<Request>(&bytes) {
                prop_assert!(rule_is_parsed(&change));
            }
        }

        /// The same for push rules.
        #[test]
        fn mutated_push_rules_stay_parsed(pos in 0usize..200, byte in any::<u8>(), op in 0u8..3, which in 0usize..2) {
            let text = ["github.com/moat/repo refs/heads/agent/*", "git.example/a/* refs/tags/v* --fast-forward --delete"][which];
            let rule = PushRule::parse(&text.split(' ').collect::<Vec<_>>()).unwrap();
            let change = Op::ChangePolicy { name: Name::new("web").unwrap(), change: PolicyChange::AllowPush(rule) };
            let bytes = mutated(change, pos, byte, op);
            if let Ok(Request::Act { op: Op::ChangePolicy { change, .. }, .. }) = serde_json::from_slice::<Request>(&bytes) {
                prop_assert!(rule_is_parsed(&change));
            }
        }
    }

    proptest! {
        /// Rules built field by field (methods of any letters, ports with 0
        /// or none, paths with spaces, escapes and dot segments) decode only
        /// if they are rules the parser makes.
        #[test]
        fn decoded_rules_are_ones_the_parser_makes(
            methods in proptest::collection::vec("[A-Za-z]{0,3}", 0..3),
            ports in proptest::option::of(proptest::collection::vec(0u16..3, 0..3)),
            path in proptest::option::of("[/a. %#*]{0,6}"),
            below in any::<bool>(),
        ) {
            let host = if below { serde_json::json!({ "below": "x.org" }) } else { serde_json::json!({ "exact": "x.org" }) };
            let rule = serde_json::json!({ "host": host, "ports": ports, "methods": methods, "path": path });
            let change = serde_json::json!({ "change_policy": { "name": "web", "change": { "deny": rule } } });
            let req = serde_json::json!({ "act": { "account": "SHA256:abc", "op": change } });
            if let Ok(Request::Act { op: Op::ChangePolicy { change, .. }, .. }) = serde_json::from_value::<Request>(req) {
                prop_assert!(rule_is_parsed(&change), "{change:?}");
            }
        }
    }

    /// The request of `op`, one byte changed (`how` 0), inserted (1) or the
    /// rest cut (2) at `pos`.
    fn mutated(op: Op, pos: usize, byte: u8, how: u8) -> Vec<u8> {
        let mut bytes = serde_json::to_vec(&Request::Act { account: AccountId("SHA256:abc".into()), op }).unwrap();
        let pos = pos % bytes.len();
        match how {
            0 => bytes[pos] = byte,
            1 => bytes.insert(pos, byte),
            _ => bytes.truncate(pos),
        }
        bytes
    }

    /// Whether the rule in a change is one `Rule::parse` makes from its text.
    fn rule_is_parsed(change: &PolicyChange) -> bool {
        match change {
            PolicyChange::Allow(rule) | PolicyChange::Deny(rule) | PolicyChange::Remove(rule) => {
                let text = rule.to_string();
                Rule::parse(&text.split(' ').collect::<Vec<_>>()).as_ref() == Ok(rule)
            }
            PolicyChange::AllowPush(rule) | PolicyChange::RemovePush(rule) => {
                let text = rule.to_string();
                let words: Vec<&str> = text.split(' ').skip(1).collect();
                PushRule::parse(&words).as_ref() == Ok(rule)
            }
            PolicyChange::Preset(_) | PolicyChange::Ask(_) | PolicyChange::Packages(_) => true,
        }
    }

    #[test]
    fn invalid_names_do_not_decode() {
        let bad = r#"{"act":{"account":"SHA256:x","op":{"route":{"name":"../etc"}}}}"#;
        assert!(serde_json::from_str::<Request>(bad).is_err());
        let good = r#"{"act":{"account":"SHA256:x","op":{"route":{"name":"web"}}}}"#;
        assert!(serde_json::from_str::<Request>(good).is_ok());
    }
}
