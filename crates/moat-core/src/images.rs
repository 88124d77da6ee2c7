//! The images moat knows by name: one place for the names the grammar, the
//! manager and the image builder share.

/// Debian bookworm (minbase), built with debootstrap.
pub const DEBIAN: &str = "debian";
/// busybox-static and nothing else; built in seconds.
pub const BUSYBOX: &str = "busybox";
/// The image `new` uses unless told.
pub const DEFAULT: &str = DEBIAN;
/// Images a backend builds on first use, without the operator's help.
pub const BUILDABLE: &[&str] = &[DEBIAN, BUSYBOX];
/// How the pool's keys of pulled images start (`oci-` and the manifest's
/// digest): never a name `new --image` takes as such.
pub const PULLED_PREFIX: &str = "oci-";
