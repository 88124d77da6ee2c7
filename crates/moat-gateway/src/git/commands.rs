//! The command list that opens a `git-receive-pack` request body: optional
//! `shallow ID` lines, then one `OLD NEW REFNAME` line per ref (the first
//! with a NUL and the client's capabilities), a flush, and, where the
//! client asked for `push-options`, option lines and a second flush. The
//! pack follows (none when every command deletes).

use moat_core::policy::RefChange;

use super::pktline::{self, Pkt};
use super::GitError;

/// Most commands one push may carry.
pub const MAX_COMMANDS: usize = 4096;
/// Most bytes of command list (and options) read.
pub const MAX_LIST: usize = 1 << 20;
/// Longest ref name taken.
const MAX_REF: usize = 1024;

/// One ref a push changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// What the client believes the ref holds (all zeros: nothing).
    pub old: String,
    /// What it is to hold (all zeros: deleted).
    pub new: String,
    /// The ref.
    pub refname: String,
}

impl Command {
    /// What the command does to its ref.
    pub fn change(&self) -> RefChange {
        if is_zero(&self.new) {
            RefChange::Delete
        } else if is_zero(&self.old) {
            RefChange::Create
        } else {
            RefChange::Update
        }
    }
}

/// A push's command list, read whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandList {
    /// The commands, in order.
    pub commands: Vec<Command>,
    /// The client's capabilities (from the first command).
    pub caps: Vec<String>,
    /// Bytes of body the list (and its options) took: the pack starts here.
    pub len: usize,
}

impl CommandList {
    /// Whether the client asked for capability `name` (`name` or `name=...`).
    pub fn has(&self, name: &str) -> bool {
        self.caps.iter().any(|c| c == name || c.strip_prefix(name).is_some_and(|v| v.starts_with('=')))
    }

    /// Whether object ids are SHA-256 (the client says `object-format=sha256`).
    pub fn sha256(&self) -> bool {
        self.caps.iter().any(|c| c == "object-format=sha256")
    }

    /// Whether a pack follows (it does unless every command deletes).
    pub fn has_pack(&self) -> bool {
        self.commands.iter().any(|c| c.change() != RefChange::Delete)
    }
}

/// Reads the command list from the start of `body` (`None`: more bytes
/// are needed; `ended`: the body is whole, so a list still cut is refused).
pub fn parse(body: &[u8], ended: bool) -> Result<Option<CommandList>, GitError> {
    let mut at = 0usize;
    let mut commands = Vec::new();
    let mut caps = Vec::new();
    let mut id_len = None;
    loop {
        let Some((pkt, n)) = next_within(body, at, ended)? else { return Ok(None) };
        at += n;
        let line = match pkt {
            Pkt::Flush => break,
            Pkt::Data(line) => line.strip_suffix(b"\n").unwrap_or(line),
            Pkt::Delim | Pkt::ResponseEnd => return Err(GitError::BadCommand),
        };
        if commands.is_empty() && line.starts_with(b"shallow ") {
            continue;
        }
        if commands.is_empty() && line.starts_with(b"push-cert") {
            return Err(GitError::Signed);
        }
        if commands.len() >= MAX_COMMANDS {
            return Err(GitError::TooManyCommands);
        }
        let (text, more) = match line.iter().position(|&b| b == 0) {
            Some(nul) if commands.is_empty() => (line.get(..nul).unwrap_or_default(), line.get(nul + 1..)),
            Some(_) => return Err(GitError::BadCommand),
            None => (line, None),
        };
        if let Some(more) = more {
            let more = std::str::from_utf8(more).map_err(|_| GitError::BadCommand)?;
            caps = more.split(' ').filter(|c| !c.is_empty()).map(str::to_string).collect();
        }
        let command = command(text)?;
        // Every id of one push is of one hash.
        if *id_len.get_or_insert(command.old.len()) != command.old.len() {
            return Err(GitError::BadId);
        }
        commands.push(command);
    }
    let mut list = CommandList { commands, caps, len: at };
    if list.has("push-options") && !list.commands.is_empty() {
        loop {
            let Some((pkt, n)) = next_within(body, list.len, ended)? else { return Ok(None) };
            list.len += n;
            match pkt {
                Pkt::Flush => break,
                Pkt::Data(_) => {}
                Pkt::Delim | Pkt::ResponseEnd => return Err(GitError::BadCommand),
            }
        }
    }
    Ok(Some(list))
}

/// The next pkt-line at `at`, within the list's bound.
fn next_within(body: &[u8], at: usize, ended: bool) -> Result<Option<(Pkt<'_>, usize)>, GitError> {
    let rest = body.get(at..).unwrap_or_default();
    match pktline::next(rest)? {
        Some(found) if at + found.1 <= MAX_LIST => Ok(Some(found)),
        Some(_) => Err(GitError::TooManyCommands),
        None if at + rest.len() >= MAX_LIST => Err(GitError::TooManyCommands),
        None if ended => Err(GitError::Cut),
        None => Ok(None),
    }
}

fn command(text: &[u8]) -> Result<Command, GitError> {
    let text = std::str::from_utf8(text).map_err(|_| GitError::BadCommand)?;
    let mut words = text.splitn(3, ' ');
    let (Some(old), Some(new), Some(refname)) = (words.next(), words.next(), words.next()) else {
        return Err(GitError::BadCommand);
    };
    if !is_id(old) || !is_id(new) || old.len() != new.len() || (is_zero(old) && is_zero(new)) {
        return Err(GitError::BadId);
    }
    if !is_ref(refname) {
        return Err(GitError::BadRef);
    }
    Ok(Command { old: old.into(), new: new.into(), refname: refname.into() })
}

/// Lower-case hex of SHA-1 or SHA-256.
fn is_id(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn is_zero(s: &str) -> bool {
    s.bytes().all(|b| b == b'0')
}

/// A ref name as `git check-ref-format` takes it, under `refs/`.
fn is_ref(s: &str) -> bool {
    let bad_byte = |b: u8| b <= b' ' || b == 0x7f || b"~^:?*[\\".contains(&b);
    s.starts_with("refs/")
        && s.len() <= MAX_REF
        && !s.bytes().any(bad_byte)
        && !s.contains("..")
        && !s.contains("@{")
        && !s.ends_with('/')
        && !s.ends_with(".lock")
        && !s.ends_with('.')
        && s.split('/').all(|c| !c.is_empty() && !c.starts_with('.'))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
pub(crate) mod tests {
    use super::*;

    /// A body of these pkt-line payloads, then a flush.
    pub fn body(lines: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for line in lines {
            pktline::encode(line.as_bytes(), &mut out);
        }
        out.extend_from_slice(b"0000");
        out
    }

    const A: &str = "1111111111111111111111111111111111111111";
    const B: &str = "2222222222222222222222222222222222222222";
    const Z: &str = "0000000000000000000000000000000000000000";

    #[test]
    fn commands_and_capabilities() {
        let first = format!("{A} {B} refs/heads/main\0report-status side-band-64k agent=git/2.47");
        let second = format!("{Z} {B} refs/heads/new\n");
        let third = format!("{A} {Z} refs/tags/v1\n");
        let mut b = body(&["shallow 3333333333333333333333333333333333333333", &first, &second, &third]);
        let len = b.len();
        b.extend_from_slice(b"PACK");
        let list = parse(&b, false).unwrap().unwrap();
        assert_eq!(list.len, len);
        let changes: Vec<_> = list.commands.iter().map(|c| (c.refname.as_str(), c.change())).collect();
        assert_eq!(
            changes,
            [
                ("refs/heads/main", RefChange::Update),
                ("refs/heads/new", RefChange::Create),
                ("refs/tags/v1", RefChange::Delete)
            ]
        );
        assert!(list.has("report-status") && list.has("agent") && !list.has("push-options"));
        assert!(list.has_pack() && !list.sha256());
        // Every prefix is "more, please", never a wrong answer.
        for cut in 0..len {
            assert_eq!(parse(&b[..cut], false), Ok(None), "{cut}");
            assert!(parse(&b[..cut], true).is_err(), "{cut}");
        }
    }

    #[test]
    fn options_follow_when_asked_for() {
        let first = format!("{A} {B} refs/heads/x\0report-status push-options");
        let mut b = body(&[&first]);
        assert_eq!(parse(&b, false), Ok(None));
        b.extend_from_slice(&body(&["ci.skip"]));
        assert_eq!(parse(&b, false).unwrap().unwrap().len, b.len());
    }

    #[test]
    fn malformed_lists_are_refused() {
        let ok = format!("{A} {B} refs/heads/x");
        for (lines, why) in [
            (vec![format!("{A} {B}")], GitError::BadCommand),
            (vec![format!("{A} {B} heads/x")], GitError::BadRef),
            (vec![format!("{A} {B} refs/heads/a..b")], GitError::BadRef),
            (vec![format!("{A} {B} refs/heads/a b")], GitError::BadRef),
            (vec![format!("{A} {B} refs/heads/x.lock")], GitError::BadRef),
            (vec![format!("{} {B} refs/heads/x", &A[1..])], GitError::BadId),
            (vec![format!("{} {B} refs/heads/x", A.to_uppercase().replace('1', "A"))], GitError::BadId),
            (vec![format!("{Z} {Z} refs/heads/x")], GitError::BadId),
            (vec![ok.clone(), format!("{A} {B} refs/heads/y\0caps")], GitError::BadCommand),
            (vec!["push-cert\0report-status".into()], GitError::Signed),
        ] {
            let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
            assert_eq!(parse(&body(&lines), true), Err(why), "{lines:?}");
        }
        let sha256 = format!("{A}{} {B}{} refs/heads/x", &A[..24], &B[..24]);
        assert_eq!(parse(&body(&[&ok, &sha256]), true), Err(GitError::BadId));
        let many: Vec<String> = (0..=MAX_COMMANDS).map(|i| format!("{A} {B} refs/heads/b{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(parse(&body(&many), true), Err(GitError::TooManyCommands));
        let endless = body(&["shallow 1111"; MAX_LIST / 16]);
        assert_eq!(parse(&endless[..endless.len() - 4], false), Err(GitError::TooManyCommands));
        // A probe (an empty list) is no push at all.
        assert_eq!(parse(b"0000", true).unwrap().unwrap().commands, []);
    }
}
