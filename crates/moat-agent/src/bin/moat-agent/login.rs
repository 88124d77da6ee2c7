//! The SSH user name as a user of the box.
//!
//! A box is reached as `NAME@HOST` and runs everything as root, but tools that
//! ask the remote shell for `~NAME` (Ansible does, to find its temp dir) get
//! the literal `~NAME` back when NAME is nobody's login, and create a
//! directory by that name. So the box's name becomes another name for root:
//! a passwd line with root's uid, home and shell, added at boot if the image
//! has a passwd file and no user of that name, and again before a session
//! when the host has given the box another name since (a box booted ahead
//! of demand is named when `new` takes it: the line of the name it booted
//! with is taken out then, before anything of the box's owner has run).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;

const PASSWD: &str = "/etc/passwd";
/// The comment of the lines this file adds.
const COMMENT: &str = "moat box login (root)";

/// The host name last given a passwd line (`None`: not yet).
static ALIASED: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Adds the box's host name (its SSH user name) to /etc/passwd as root, if
/// the name changed since the last call (a system call, when it did not).
pub fn alias_root_as_host_name() {
    let Ok(host) = nix::unistd::gethostname() else { return };
    let Some(name) = host.to_str().filter(|n| is_label(n)) else { return };
    let mut aliased = ALIASED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if aliased.as_deref() == Some(name) {
        return;
    }
    // Tried once per name: a file it cannot change (the box's doing) is left.
    let before = aliased.replace(name.to_string());
    // Non-blocking, and only a regular file: the box may have put a FIFO there.
    let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let Ok(mut file) = OpenOptions::new().read(true).append(true).custom_flags(flags).open(PASSWD) else {
        return;
    };
    // Not a regular file, or one too large, is left alone (the box wrote it).
    let Some((text, meta)) = crate::box_file::text_of(&mut file) else { return };
    match before.and_then(|old| without_alias(&text, &old)) {
        // Renamed: the file rewritten whole (its mode kept), then put in place at once.
        Some(rest) => {
            let line = alias_line(&rest, name).unwrap_or_default();
            let next = format!("{PASSWD}.moat-new");
            let _ = std::fs::remove_file(&next);
            let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777;
            let written = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&next)
                .and_then(|mut f| f.write_all(format!("{rest}{line}").as_bytes()).and_then(|()| f.sync_all()))
                .and_then(|()| std::fs::rename(&next, PASSWD));
            if written.is_err() {
                let _ = std::fs::remove_file(&next);
            }
        }
        None => {
            if let Some(line) = alias_line(&text, name) {
                let _ = file.write_all(line.as_bytes());
            }
        }
    }
}

/// `passwd` without the line this agent added for `old`, if it has one.
fn without_alias(passwd: &str, old: &str) -> Option<String> {
    let ours = format!("{old}:x:0:0:{COMMENT}:");
    let kept: Vec<&str> = passwd.split_inclusive('\n').filter(|l| !l.starts_with(&ours)).collect();
    (kept.len() < passwd.split_inclusive('\n').count()).then(|| kept.concat())
}

/// The line to append for `name`, if it needs one.
fn alias_line(passwd: &str, name: &str) -> Option<String> {
    let taken = passwd.lines().any(|l| l.split(':').next() == Some(name));
    if taken {
        return None;
    }
    // root:x:0:0:comment:home:shell → keep root's home and shell.
    let root: Vec<&str> = passwd.lines().find(|l| l.starts_with("root:"))?.split(':').collect();
    let (home, shell) = (root.get(5)?, root.get(6)?);
    let newline = if passwd.is_empty() || passwd.ends_with('\n') { "" } else { "\n" };
    Some(format!("{newline}{name}:x:0:0:{COMMENT}:{home}:{shell}\n"))
}

/// A DNS label (what box names are); nothing that could break a passwd line.
fn is_label(s: &str) -> bool {
    !s.is_empty() && s.len() <= 63 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_the_name_once_as_root() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin";
        assert_eq!(alias_line(passwd, "web").as_deref(), Some("\nweb:x:0:0:moat box login (root):/root:/bin/bash\n"));
        assert_eq!(alias_line(passwd, "daemon"), None, "an existing user keeps its line");
        assert_eq!(alias_line("", "web"), None, "no root line, nothing to copy");
        assert!(!is_label("a:b") && !is_label("a\nb") && is_label("web-2"));
    }

    #[test]
    fn a_renamed_box_loses_only_its_old_line() {
        let passwd = "root:x:0:0:root:/root:/bin/sh\nwarm-1:x:0:0:moat box login (root):/root:/bin/sh\nwarm-1x:x:1:1::/:/bin/sh\n";
        let rest = without_alias(passwd, "warm-1").unwrap();
        assert_eq!(rest, "root:x:0:0:root:/root:/bin/sh\nwarm-1x:x:1:1::/:/bin/sh\n");
        assert_eq!(without_alias(passwd, "daemon"), None);
        // A user of that name the box made itself is not ours to remove.
        assert_eq!(without_alias("warm-1:x:1000:1000::/home:/bin/sh\n", "warm-1"), None);
    }
}
