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

use moat_core::{
    AccountId, Backend, BackendError, BackendKind, BoxHandle, BoxRecord, ChangeSink, Checkpoint, Copied, MeterReading,
    Name,
};

/// Every backend moat has, behind one type: each box is run by the one its
/// record names.
pub struct AnyBackend {
    /// Linux namespaces, seccomp and cgroups.
    pub ns: ns::NsBackend,
    /// MicroVMs, or why this server runs none.
    pub vm: Result<vm::backend::VmBackend, String>,
}

impl AnyBackend {
    /// Namespaces only.
    pub fn ns(ns: ns::NsBackend) -> Self {
        Self { ns, vm: Err("this server was started without microVMs".into()) }
    }

    fn of(&self, rec: &BoxRecord) -> Result<&dyn Backend, BackendError> {
        match rec.backend {
            BackendKind::Ns => Ok(&self.ns),
            BackendKind::Vm => match &self.vm {
                Ok(vm) => Ok(vm),
                Err(why) => Err(BackendError::msg(format!("this server runs no microVM boxes: {why}"))),
            },
        }
    }

    fn inner(&self) -> &dyn Backend {
        &self.ns
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
        self.of(rec)?.create(rec)
    }
    fn start(&self, rec: &BoxRecord) -> Result<BoxHandle, BackendError> {
        self.of(rec)?.start(rec)
    }
    fn is_running(&self, rec: &BoxRecord) -> bool {
        self.of(rec).is_ok_and(|b| b.is_running(rec))
    }
    fn stop(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.of(rec)?.stop(rec)
    }
    fn park(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.of(rec)?.park(rec)
    }
    fn destroy(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.of(rec)?.destroy(rec)
    }
    fn handle(&self, rec: &BoxRecord) -> Option<BoxHandle> {
        self.of(rec).ok()?.handle(rec)
    }
    fn dup(&self, src: &BoxRecord, dst: &BoxRecord) -> Result<Copied, BackendError> {
        self.of(src)?.dup(src, dst)
    }
    fn set_environment(&self, rec: &BoxRecord, vars: &[(String, Option<String>)]) -> Result<(), BackendError> {
        self.of(rec)?.set_environment(rec, vars)
    }
    fn diff(&self, a: &BoxRecord, b: &BoxRecord, out: &mut ChangeSink<'_>) -> Result<(), BackendError> {
        if a.backend != b.backend {
            return Err(BackendError::msg(format!(
                "{} is a {} box and {} a {} box: only boxes of one backend are compared",
                a.name, a.backend, b.name, b.backend
            )));
        }
        self.of(a)?.diff(a, b, out)
    }
    fn checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        self.of(rec)?.checkpoint(rec, label)
    }
    fn checkpoints(&self, rec: &BoxRecord, held: bool) -> Vec<Checkpoint> {
        self.of(rec).map(|b| b.checkpoints(rec, held)).unwrap_or_default()
    }
    fn restore(&self, rec: &BoxRecord, label: &Name, before: &Name) -> Result<(), BackendError> {
        self.of(rec)?.restore(rec, label, before)
    }
    fn delete_checkpoint(&self, rec: &BoxRecord, label: &Name) -> Result<(), BackendError> {
        self.of(rec)?.delete_checkpoint(rec, label)
    }
    fn rename(&self, rec: &BoxRecord, name: &Name) -> Result<(), BackendError> {
        self.of(rec)?.rename(rec, name)
    }
    fn adopt(&self, rec: &BoxRecord, from: &AccountId) -> Result<(), BackendError> {
        self.of(rec)?.adopt(rec, from)
    }
    fn thaw(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.of(rec)?.thaw(rec)
    }
    fn suspend(&self, rec: &BoxRecord) -> Result<(), BackendError> {
        self.of(rec)?.suspend(rec)
    }
    fn meter(&self, rec: &BoxRecord) -> Option<MeterReading> {
        self.of(rec).ok()?.meter(rec)
    }
    fn disk_usage(&self, rec: &BoxRecord) -> Option<u64> {
        self.of(rec).ok()?.disk_usage(rec)
    }
    fn account_disk_usage(&self, account: &AccountId) -> Option<u64> {
        self.inner().account_disk_usage(account)
    }
}
