//! `moat image-unpack TREE COMPRESSION MAX` (internal): applies the layer on
//! stdin onto TREE (a writable snapshot of its parent layer), confined by
//! [`moat_box::unpacker`] before it reads a byte of it; prints what it did
//! ([`moat_oci::unpack::Report`], JSON) on stdout, or why not on stderr.
//! Run by the daemon, one per layer, single-threaded.

use std::io::Write;
use std::path::Path;

use moat_oci::manifest::Compression;

/// Runs the unpacker; the process's exit status.
pub fn main(tree: &Path, compression: &str, max: u64) -> i32 {
    let compression = match compression {
        "none" => Compression::None,
        "gzip" => Compression::Gzip,
        "zstd" => Compression::Zstd,
        other => return fail(&format!("unknown compression {other:?}")),
    };
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
