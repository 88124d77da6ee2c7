//! A box's `/etc/environment`, which every session reads (the agent parses it
//! as pam_env does): the host sets and removes its own variables there (the
//! box CA's bundle, secrets' placeholders) and leaves every other line alone.
//! The root may be the box's own: see `identity` for how paths in it are
//! resolved.

use std::io;
use std::os::fd::OwnedFd;

use crate::in_root::{read_in_root, write_in_root};

const ENVIRONMENT: &str = "etc/environment";
/// A larger file than this in a box's root is not read.
const MAX_READ: u64 = 1 << 20;

/// Sets (`Some`) or removes (`None`) each variable in the box whose root is
/// `root`; a variable set twice before ends up set once.
pub fn update(root: &OwnedFd, vars: &[(String, Option<String>)]) -> io::Result<()> {
    let text = read_in_root(root, ENVIRONMENT, MAX_READ)?.map(|t| String::from_utf8_lossy(&t).into_owned());
    write_in_root(root, ENVIRONMENT, updated(&text.unwrap_or_default(), vars).as_bytes(), 0o644)
}

fn updated(text: &str, vars: &[(String, Option<String>)]) -> String {
    let ours = |line: &str| {
        let name = line.trim_start().trim_start_matches("export ").split('=').next().unwrap_or("").trim();
        vars.iter().any(|(n, _)| n == name)
    };
    let mut out: String = text.lines().filter(|l| !ours(l)).map(|l| format!("{l}\n")).collect();
    for (name, value) in vars {
        if let Some(value) = value {
            out.push_str(&format!("{name}={value}\n"));
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_the_named_variables_change() {
        let text = "LANG=C\nexport KEY=old\nKEYS=other\nKEY=twice\n# KEY=comment\n";
        let set = [("KEY".to_string(), Some("new".to_string())), ("GONE".to_string(), None)];
        assert_eq!(updated(text, &set), "LANG=C\nKEYS=other\n# KEY=comment\nKEY=new\n");
        assert_eq!(updated("KEY=x\nA=1\n", &[("KEY".into(), None)]), "A=1\n");
    }
}
