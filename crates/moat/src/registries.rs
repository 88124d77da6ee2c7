//! The package registries this host's own tools use: the hosts of the
//! `registries` preset. Read from apt's sources, pip's, npm's and cargo's
//! configuration; each tool's default index is added whatever is configured.

use std::path::{Path, PathBuf};

use moat_core::policy::{HostName, DEFAULT_REGISTRIES};

/// Every registry host found, with the tools' defaults.
pub fn of_this_host() -> Vec<HostName> {
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()));
    let mut files: Vec<PathBuf> = vec!["/etc/apt/sources.list".into()];
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        files.extend(dir.flatten().map(|e| e.path()));
    }
    files.extend(["/etc/pip.conf".into(), "/etc/npmrc".into()]);
    for rel in [".config/pip/pip.conf", ".pip/pip.conf", ".npmrc", ".cargo/config.toml", ".cargo/config"] {
        files.push(home.join(rel));
    }
    let mut hosts: Vec<HostName> = DEFAULT_REGISTRIES.iter().filter_map(|h| HostName::parse(h).ok()).collect();
    for file in files {
        for host in hosts_in(&file) {
            if !hosts.contains(&host) {
                hosts.push(host);
            }
        }
    }
    hosts
}

/// Hosts of the http(s) URLs in a configuration file.
fn hosts_in(path: &Path) -> Vec<HostName> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        for (i, _) in line.match_indices("://") {
            let scheme = line[..i].rsplit(|c: char| !c.is_ascii_alphanumeric() && c != '+').next().unwrap_or("");
            if !scheme.ends_with("http") && !scheme.ends_with("https") {
                continue;
            }
            let rest = &line[i + 3..];
            let authority = rest.split(['/', '"', '\'', ' ', ']']).next().unwrap_or("");
            let host = authority.rsplit('@').next().unwrap_or("").split(':').next().unwrap_or("");
            if let Ok(host) = HostName::parse(host) {
                out.push(host);
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn finds_urls_in_the_usual_files() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x");
        std::fs::write(
            &f,
            "deb [signed-by=/k.gpg] http://deb.debian.org/debian bookworm main\n\
             URIs: https://mirror.example.org/debian\n\
             # deb http://commented.example/\n\
             index-url = https://user:pw@pypi.internal:8443/simple\n\
             registry = \"sparse+https://index.crates.io/\"\n",
        )
        .unwrap();
        let hosts: Vec<String> = hosts_in(&f).iter().map(|h| h.to_string()).collect();
        assert_eq!(hosts, ["deb.debian.org", "mirror.example.org", "pypi.internal", "index.crates.io"]);
    }
}
