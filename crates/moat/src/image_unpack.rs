//! `moat image-unpack TREE COMPRESSION MAX` (internal): applies the layer on
//! stdin onto TREE (a writable snapshot of its parent layer), confined by
//! [`moat_box::unpacker`] before it reads a byte of it; prints what it did
//! ([`moat_oci::unpack::Report`], JSON) on stdout, or why not on stderr.
//! Run by the daemon, one per layer, single-threaded.

use std::io::Write;
use std::path::Path;

use moat_oci::manifest::Compression;

/// The unpacker's heap at most: a zstd window (128 MiB at most by default)
/// and the tar's buffers, with room.
pub const MAX_DATA: u64 = 384 << 20;

/// Runs the unpacker; the process's exit status.
pub fn main(tree: &Path, compression: &str, max: u64) -> i32 {
    let compression = match compression {
        "none" => Compression::None,
        "gzip" => Compression::Gzip,
        "zstd" => Compression::Zstd,
        other => return fail(&format!("unknown compression {other:?}")),
    };
    // A tar's long names and PAX headers are read whole by the tar crate
    // before any check of ours: a 16 KB layer asked for 1 GiB so. Past this,
    // an allocation fails and the unpacker ends, as the layer does.
    if let Err(e) = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_DATA, MAX_DATA, MAX_DATA) {
        return fail(&format!("bound the unpacker's memory: {e}"));
    }
    let root = match moat_box::unpacker::enter(tree) {
        Ok(root) => root,
        Err(e) => return fail(&format!("confine the unpacker: {e}")),
    };
    let stdin = std::io::stdin().lock();
    match moat_oci::unpack::apply(&root, stdin, compression, max) {
        Ok(report) => {
            let Ok(json) = serde_json::to_vec(&report) else { return fail("cannot encode the report") };
            let mut out = std::io::stdout().lock();
            if out.write_all(&json).and_then(|()| out.flush()).is_err() {
                return 1;
            }
            0
        }
        Err(e) => fail(&e.to_string()),
    }
}

fn fail(why: &str) -> i32 {
    let _ = writeln!(std::io::stderr(), "{why}");
    1
}
