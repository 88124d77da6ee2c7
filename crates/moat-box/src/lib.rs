//! moat-box: where boxes are actually made.
//!
//! - [`pool`]: the copy-on-write storage pool (btrfs, loop-backed where needed);
//! - [`checkpoint`]: a box's root saved by label, and restored in place;
//! - [`image`]: building the read-only images boxes start from;
//! - [`identity`]: what makes each box a machine of its own;
//! - [`trust`]: the box trusting its own TLS CA;
//! - [`diff`]: what changed between two boxes' filesystems;
//! - [`ns`]: the namespace backend, with its planner and its privileged enforcer;
//! - [`vm`]: the microVM backend's first parts (initramfs, a boot probe);
//! - [`sys`]: the raw kernel calls, the crate's only `unsafe`.
//!
//! [`AnyBackend`] is the enum the daemon holds; the microVM backend joins it as a
//! second variant.

pub mod bpf;
pub mod checkpoint;
pub mod confine;
pub mod diff;
pub mod environment;
pub mod identity;
pub mod image;
pub mod ns;
pub mod pool;
#[allow(unsafe_code)]
pub mod sys;
pub mod trust;
pub mod vm;

use moat_core::{AccountId, Backend, BackendError, BoxHandle, BoxRecord, ChangeSink, Checkpoint, MeterReading, Name};

/// Every backend moat has, behind one type.
pub enum AnyBackend {
    /// Linux namespaces, seccomp and cgroups.
    Ns(ns::NsBackend),
}

impl AnyBackend {
    fn inner(&self) -> &dyn Backend {
        match self {
            Self::Ns(b) => b,
        }
    }
}

impl Backend for AnyBackend {
    fn has_image(&self, image: &Name) -> bool {
        self.inner().has_image(image)
    }
    fn build_image(&self, image: &Name, progress: moat_core::backend::Progress<'_>) -> Result<(), BackendError> {
        self.inner().build_image(image, progress)
    }
    fn create(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.inner().create(rec)
    }
    fn start(&self, rec: &BoxRecord) -> Result<BoxHandle, BackendError> {
        self.inner().start(rec)
    }
    fn is_running(&self, rec: &BoxRecord) -> bool {
        self.inner().is_running(rec)
    }
    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.inner().stop(rec)
    }
    fn destroy(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.inner().destroy(rec)
    }
    fn handle(&self, rec: &BoxRecord) -> Option<BoxHandle> {
        self.inner().handle(rec)
    }
    fn dup(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<(), BackendError> {
        self.inner().dup(src, dst)
    }
    fn set_environment(&self, rec: &BoxRecord, vars: &[(String, Option<String>)]) -> Result<(), BackendError> {
        self.inner().set_environment(rec, vars)
    }
    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        self.inner().diff(a, b, out)
    }
    fn checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        self.inner().checkpoint(rec, label)
    }
    fn checkpoints(&self, rec: &BoxRecord, held: bool) -> Vec<Checkpoint> {
        self.inner().checkpoints(rec, held)
    }
    fn restore(&self, rec: &BoxRecord, label: &Name, before: &Name) -> Result<(), BackendError> {
        self.inner().restore(rec, label, before)
    }
    fn delete_checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        self.inner().delete_checkpoint(rec, label)
    }
    fn rename(&self, rec: &BoxRecord, name: &Name) -> Result<(), BackendError> {
        self.inner().rename(rec, name)
    }
    fn adopt(&self, rec: &BoxRecord, from: &AccountId) -> Result<(), BackendError> {
        self.inner().adopt(rec, from)
    }
    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.inner().thaw(rec)
    }
    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.inner().suspend(rec)
    }
    fn meter(&self, rec: &BoxRecord) -> Option<MeterReading> {
        self.inner().meter(rec)
    }
    fn disk_usage(&self, rec: &BoxRecord) -> Option<u64> {
        self.inner().disk_usage(rec)
    }
    fn account_disk_usage(&self, account: &AccountId) -> Option<u64> {
        self.inner().account_disk_usage(account)
    }
}
