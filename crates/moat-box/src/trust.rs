//! Puts a box's TLS CA (see `moat_core::box_ca`) where the box's tools look for
//! trusted roots: the system bundle (OpenSSL, curl, git, apt), Debian's local
//! certificate directory (so `update-ca-certificates` keeps it), and, through
//! `/etc/environment` (which every session reads), the variables with which
//! Python, pip, Node, curl, git and cargo name a bundle of their own.
//!
//! The root may be the box's own (a duplicate's is): every path is resolved
//! inside it, files it planted are replaced rather than followed, and what is
//! read from it is bounded.

use std::io;
use std::os::fd::OwnedFd;

use crate::in_root::{dir_in_root, read_in_root, write_in_root};

/// The box's CA alone.
pub const CA_FILE: &str = "etc/moat/ca.pem";
/// Debian's (and Ubuntu's) bundle of every trusted root.
const SYSTEM_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";
/// Where `update-ca-certificates` finds local roots.
const LOCAL_ROOTS: &str = "usr/local/share/ca-certificates";
/// The line before the CA in the system bundle (a duplicate's is replaced).
const MARK: &str = "# moat box CA\n";
/// Variables that name a whole bundle (they replace the tool's own roots).
const BUNDLE_VARIABLES: &[&str] =
    &["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "CARGO_HTTP_CAINFO"];
/// Node adds the roots this names to its own.
const EXTRA_VARIABLE: &str = "NODE_EXTRA_CA_CERTS";
/// Larger files than this in a box's root are not read.
const MAX_READ: u64 = 8 << 20;

/// Installs `ca_pem` into the box whose root is `root`, replacing any CA
/// installed before.
pub fn install(root: &OwnedFd, ca_pem: &str) -> io::Result<()> {
    dir_in_root(root, "etc/moat")?;
    write_in_root(root, CA_FILE, ca_pem.as_bytes(), 0o644)?;
    match write_in_root(root, &format!("{LOCAL_ROOTS}/moat-box-ca.crt"), ca_pem.as_bytes(), 0o644) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        other => other?,
    }
    let bundle = match read_in_root(root, SYSTEM_BUNDLE, MAX_READ)? {
        Some(text) => {
            let mut text = without_ca(&String::from_utf8_lossy(&text));
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(MARK);
            text.push_str(ca_pem);
            write_in_root(root, SYSTEM_BUNDLE, text.as_bytes(), 0o644)?;
            SYSTEM_BUNDLE
        }
        // An image without a bundle trusts only the box's CA.
        None => CA_FILE,
    };
    let mut vars: Vec<(String, Option<String>)> =
        BUNDLE_VARIABLES.iter().map(|v| (v.to_string(), Some(format!("/{bundle}")))).collect();
    vars.push((EXTRA_VARIABLE.to_string(), Some(format!("/{CA_FILE}"))));
    crate::environment::update(root, &vars)
}

/// `bundle` without the CA [`install`] added to it.
fn without_ca(bundle: &str) -> String {
    let Some(start) = bundle.find(MARK) else { return bundle.to_string() };
    const END: &str = "-----END CERTIFICATE-----\n";
    let end = bundle[start..].find(END).map_or(bundle.len(), |i| start + i + END.len());
    format!("{}{}", &bundle[..start], &bundle[end..])
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const ENVIRONMENT: &str = "etc/environment";
    const CA: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    const CA2: &str = "-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n";
    const SYSTEM: &str = "-----BEGIN CERTIFICATE-----\nSYS\n-----END CERTIFICATE-----\n";

    fn root_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for dir in ["etc/ssl/certs", LOCAL_ROOTS] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
        }
        for (path, text) in files {
            std::fs::write(root.path().join(path), text).unwrap();
        }
        root
    }

    fn read(root: &tempfile::TempDir, path: &str) -> String {
        std::fs::read_to_string(root.path().join(path)).unwrap()
    }

    #[test]
    fn installed_once_and_replaced_on_reinstall() {
        let root = root_with(&[(SYSTEM_BUNDLE, SYSTEM), (ENVIRONMENT, "LANG=C\nSSL_CERT_FILE=/elsewhere\n")]);
        let dir: OwnedFd = std::fs::File::open(root.path()).unwrap().into();
        install(&dir, CA).unwrap();
        install(&dir, CA2).unwrap();
        assert_eq!(read(&root, SYSTEM_BUNDLE), format!("{SYSTEM}{MARK}{CA2}"));
        assert_eq!(read(&root, CA_FILE), CA2);
        assert_eq!(read(&root, &format!("{LOCAL_ROOTS}/moat-box-ca.crt")), CA2);
        let env = read(&root, ENVIRONMENT);
        assert!(env.starts_with("LANG=C\n"), "{env}");
        assert_eq!(env.matches("SSL_CERT_FILE=").count(), 1, "{env}");
        assert!(env.contains("SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt\n"), "{env}");
        assert!(env.contains("NODE_EXTRA_CA_CERTS=/etc/moat/ca.pem\n"), "{env}");
    }

    #[test]
    fn an_image_without_a_bundle_trusts_the_box_ca_alone() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("etc")).unwrap();
        let dir: OwnedFd = std::fs::File::open(root.path()).unwrap().into();
        install(&dir, CA).unwrap();
        assert!(read(&root, ENVIRONMENT).contains("PIP_CERT=/etc/moat/ca.pem\n"));
        assert!(!root.path().join(SYSTEM_BUNDLE).exists());
    }

    #[test]
    fn a_planted_fifo_or_symlink_is_replaced_not_followed() {
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, SYSTEM).unwrap();
        let root = root_with(&[]);
        std::os::unix::fs::symlink(&victim, root.path().join(SYSTEM_BUNDLE)).unwrap();
        nix::unistd::mkfifo(&root.path().join(ENVIRONMENT), nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let dir: OwnedFd = std::fs::File::open(root.path()).unwrap().into();
        // Neither is followed out of the root nor waited on.
        install(&dir, CA).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), SYSTEM);
        assert!(read(&root, ENVIRONMENT).contains("GIT_SSL_CAINFO=/etc/moat/ca.pem\n"));
    }
}
