//! moat-core: the vocabulary every other crate shares (ids, box specs and records,
//! resource limits), the SQLite state store, the backend trait, and the box
//! lifecycle that ties them together.

pub mod async_fd;
pub mod backend;
pub mod box_ca;
pub mod clock;
pub mod effects;
pub mod egress;
pub mod fault;
pub mod ids;
pub mod images;
pub mod keyed_locks;
pub mod limits;
pub mod manager;
pub mod near;
pub mod policy;
pub mod record;
pub mod rewind;
pub mod secrets;
pub mod slots;
pub mod splice;
pub mod store;
pub mod web;

pub use backend::{
    AgentAddr, Backend, BackendError, BackendKind, BoxHandle, Change, ChangeKind, ChangeSink, Checkpoint, Copied,
    MeterReading, NetAttach, Received,
};
pub use ids::{AccountId, BoxId, BoxIdError, Name, NameError};
pub use limits::{Limits, LimitsError};
pub use manager::{
    BoxManager, BoxSpec, ImagePuller, ManagerConfig, ManagerError, NetworkHooks, ProgressSink, Pulled, RegistryLogin,
    SessionGuard, UsageReport, Wait, WebOpenError, COOKIE_LIFETIME, LINK_LIFETIME,
};
pub use record::{BoxRecord, BoxState};
pub use store::{Store, StoreError};
