//! The commits of a pack (git's packfile, version 2 or 3): each object's
//! type and size, its zlib data inflated (and dropped, unless it may be a
//! commit), deltas against earlier objects (`OFS_DELTA`) or named ones
//! (`REF_DELTA`, whose base may be outside a thin pack) resolved where the
//! base is a commit. What comes out is each commit's id and parents: enough
//! to tell whether one commit descends from another within the pack.
//!
//! Bounded: a commit (or a delta that may make one) larger than
//! [`MAX_COMMIT`] is not kept, and a pack inflating to more than
//! [`MAX_INFLATED`] is not read on; either way the answer is "cannot tell",
//! never a wrong one.

use std::collections::HashMap;

use flate2::{Decompress, FlushDecompress, Status};

use super::delta;
use super::GitError;

/// Largest commit (or delta that may make one) kept.
pub const MAX_COMMIT: usize = 1 << 20;
/// Most bytes a pack may inflate to before the gateway stops reading it.
pub const MAX_INFLATED: u64 = 256 << 20;
/// Most bytes of commits and deltas (which may make one) kept from a pack:
/// 250 commits of 1 MiB each in a 282 KB push held half a gigabyte.
pub const MAX_KEPT: usize = 32 << 20;
/// Longest chain of deltas followed.
const MAX_DEPTH: usize = 64;
/// Most objects one pack may say it holds.
const MAX_OBJECTS: u32 = 1 << 24;

/// The hash a repository names objects with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hash {
    /// SHA-1 (20 bytes).
    Sha1,
    /// SHA-256 (32 bytes).
    Sha256,
}

impl Hash {
    fn len(self) -> usize {
        match self {
            Self::Sha1 => 20,
            Self::Sha256 => 32,
        }
    }

    /// The id of a commit object with this content.
    pub fn commit_id(self, data: &[u8]) -> Vec<u8> {
        let header = format!("commit {}\0", data.len());
        match self {
            Self::Sha1 => {
                use sha1::Digest as _;
                let mut h = sha1::Sha1::new();
                h.update(header.as_bytes());
                h.update(data);
                h.finalize().to_vec()
            }
            Self::Sha256 => {
                use sha2::Digest as _;
                let mut h = sha2::Sha256::new();
                h.update(header.as_bytes());
                h.update(data);
                h.finalize().to_vec()
            }
        }
    }
}

/// Commits found in a pack: id to parents (raw bytes).
#[derive(Debug, Default)]
pub struct Commits {
    /// Each commit's parents.
    pub parents: HashMap<Vec<u8>, Vec<Vec<u8>>>,
    /// The pack had objects that may be commits the gateway could not read
    /// (too large, or deltas against bases outside the pack).
    pub unreadable: usize,
}

/// Whether a commit descends from another, as far as a pack tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Descent {
    /// It does (or it is the same commit).
    Yes,
    /// It does not: every ancestor is in the pack, and none is the old one.
    No,
    /// The walk left the pack at this commit (hex): the server may know more.
    Unknown(String),
}

impl Commits {
    /// Whether `new` descends from `old` (both raw ids).
    pub fn descends(&self, new: &[u8], old: &[u8]) -> Descent {
        if new == old {
            return Descent::Yes;
        }
        let mut missing = None;
        let mut seen: std::collections::HashSet<&[u8]> = std::collections::HashSet::new();
        let mut todo: Vec<&[u8]> = vec![new];
        while let Some(id) = todo.pop() {
            if !seen.insert(id) {
                continue;
            }
            let Some(parents) = self.parents.get(id) else {
                missing.get_or_insert(id);
                continue;
            };
            for parent in parents {
                if parent.as_slice() == old {
                    return Descent::Yes;
                }
                todo.push(parent);
            }
        }
        match missing {
            Some(id) => Descent::Unknown(hex(id)),
            None => Descent::No,
        }
    }
}

/// Lower-case hex.
pub fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Raw bytes of lower-case hex (`None`: not hex).
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let digits: Option<Vec<u8>> = s.chars().map(|c| c.to_digit(16).and_then(|d| u8::try_from(d).ok())).collect();
    let digits = digits?;
    if digits.len() % 2 != 0 {
        return None;
    }
    Some(digits.chunks(2).map(|p| p.iter().fold(0u8, |acc, &d| acc.wrapping_mul(16).wrapping_add(d))).collect())
}

/// What one object of the pack is, as far as commits go.
enum Object {
    /// A commit, whole.
    Commit(Vec<u8>),
    /// Something else (a tree, blob, tag), or a commit too large to keep.
    Other { maybe_commit: bool },
    /// A delta against the object at this offset.
    Ofs { base: usize, delta: Option<Vec<u8>> },
    /// A delta against the object with this id.
    Ref { base: Vec<u8>, delta: Option<Vec<u8>> },
}

/// Reads the commits of `pack` (the whole pack, trailer included).
pub fn commits(pack: &[u8], hash: Hash) -> Result<Commits, GitError> {
    let bad = GitError::BadPack;
    if pack.get(..4) != Some(b"PACK") {
        return Err(bad("no PACK signature"));
    }
    let word = |at: usize| -> Result<u32, GitError> {
        let b: [u8; 4] = pack.get(at..at + 4).and_then(|b| b.try_into().ok()).ok_or(bad("cut short"))?;
        Ok(u32::from_be_bytes(b))
    };
    if !matches!(word(4)?, 2 | 3) {
        return Err(bad("an unknown pack version"));
    }
    let count = word(8)?;
    if count > MAX_OBJECTS {
        return Err(bad("too many objects"));
    }
    let mut at = 12usize;
    let mut objects: Vec<(usize, Object)> = Vec::new();
    let mut inflated = 0u64;
    let mut kept = 0usize;
    for _ in 0..count {
        let start = at;
        let (kind, size) = object_header(pack, &mut at)?;
        let keep = size <= MAX_COMMIT as u64;
        let object = match kind {
            1 => {
                let data = inflate(pack, &mut at, size, keep, &mut inflated)?;
                match data {
                    Some(data) => Object::Commit(data),
                    None => Object::Other { maybe_commit: true },
                }
            }
            2..=4 => {
                inflate(pack, &mut at, size, false, &mut inflated)?;
                Object::Other { maybe_commit: false }
            }
            6 => {
                let back = ofs(pack, &mut at)?;
                let base = start.checked_sub(back).filter(|_| back > 0).ok_or(bad("a delta base before the pack"))?;
                Object::Ofs { base, delta: inflate(pack, &mut at, size, keep, &mut inflated)? }
            }
            7 => {
                let base = pack.get(at..at + hash.len()).ok_or(bad("cut short"))?.to_vec();
                at += hash.len();
                Object::Ref { base, delta: inflate(pack, &mut at, size, keep, &mut inflated)? }
            }
            _ => return Err(bad("an unknown object type")),
        };
        kept += match &object {
            Object::Commit(data) | Object::Ofs { delta: Some(data), .. } | Object::Ref { delta: Some(data), .. } => {
                data.len()
            }
            _ => 0,
        };
        if kept > MAX_KEPT {
            return Err(bad("its commits are larger than the gateway reads"));
        }
        objects.push((start, object));
    }
    if pack.len().checked_sub(at) != Some(hash.len()) {
        return Err(bad("bytes after the last object"));
    }
    Ok(resolve(objects, hash))
}

/// Every commit's id and parents, deltas applied where their base is one.
fn resolve(mut objects: Vec<(usize, Object)>, hash: Hash) -> Commits {
    let at: HashMap<usize, usize> = objects.iter().enumerate().map(|(i, (start, _))| (*start, i)).collect();
    // Each object's content where it is a commit, filled in as deltas resolve.
    let mut content: Vec<Option<Vec<u8>>> = Vec::with_capacity(objects.len());
    let mut by_id: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut out = Commits::default();
    for (i, (_, object)) in objects.iter_mut().enumerate() {
        // Moved, not copied: a pack's commits are kept once.
        let data = match object {
            Object::Commit(data) => Some(std::mem::take(data)),
            _ => None,
        };
        if let Some(data) = &data {
            by_id.insert(hash.commit_id(data), i);
        }
        content.push(data);
    }
    // Bases of either kind may come later (a REF_DELTA's): a few passes.
    for _ in 0..MAX_DEPTH {
        let mut progress = false;
        for (i, (_, object)) in objects.iter().enumerate() {
            if content.get(i).is_some_and(Option::is_some) {
                continue;
            }
            let (base, delta) = match object {
                Object::Ofs { base, delta: Some(delta) } => (at.get(base).copied(), delta),
                Object::Ref { base, delta: Some(delta) } => (by_id.get(base).copied(), delta),
                _ => continue,
            };
            let Some(base) = base.and_then(|b| content.get(b)).and_then(Option::as_ref) else { continue };
            let Ok(data) = delta::apply(base, delta, MAX_COMMIT) else { continue };
            by_id.insert(hash.commit_id(&data), i);
            if let Some(slot) = content.get_mut(i) {
                *slot = Some(data);
            }
            progress = true;
        }
        if !progress {
            break;
        }
    }
    for (i, (_, object)) in objects.iter().enumerate() {
        match content.get(i).and_then(Option::as_ref) {
            Some(data) => match parents(data, hash) {
                Some(parents) => {
                    out.parents.insert(hash.commit_id(data), parents);
                }
                None => out.unreadable += 1,
            },
            // A delta whose base is no commit here may still be one (its base
            // outside a thin pack); a commit too large to keep is one.
            None => match object {
                Object::Other { maybe_commit: true } => out.unreadable += 1,
                Object::Ofs { base, .. } if !at.contains_key(base) => out.unreadable += 1,
                Object::Ref { base, .. } if !by_id.contains_key(base) => out.unreadable += 1,
                Object::Ofs { delta: None, .. } | Object::Ref { delta: None, .. } => out.unreadable += 1,
                _ => {}
            },
        }
    }
    out
}

/// A commit's parents, read as git reads them: the `parent` lines right
/// after its first line (`tree`). A `parent` header further down is no
/// parent to git (a commit could hide its real history behind one); `None`:
/// a commit git would not parse.
fn parents(data: &[u8], hash: Hash) -> Option<Vec<Vec<u8>>> {
    let id = |hex: &[u8]| std::str::from_utf8(hex).ok().and_then(unhex).filter(|id| id.len() == hash.len());
    let mut lines = data.split(|&b| b == b'\n');
    id(lines.next()?.strip_prefix(b"tree ")?)?;
    let mut parents = Vec::new();
    for line in lines {
        let Some(hex) = line.strip_prefix(b"parent ") else { break };
        parents.push(id(hex)?);
    }
    Some(parents)
}

/// An object's type and inflated size.
fn object_header(pack: &[u8], at: &mut usize) -> Result<(u8, u64), GitError> {
    let mut byte = *pack.get(*at).ok_or(GitError::BadPack("cut short"))?;
    *at += 1;
    let kind = (byte >> 4) & 7;
    let mut size = u64::from(byte & 15);
    let mut shift = 4;
    while byte & 0x80 != 0 {
        if shift > 57 {
            return Err(GitError::BadPack("an object size too large"));
        }
        byte = *pack.get(*at).ok_or(GitError::BadPack("cut short"))?;
        *at += 1;
        size |= u64::from(byte & 0x7f) << shift;
        shift += 7;
    }
    Ok((kind, size))
}

/// An `OFS_DELTA`'s distance back to its base.
fn ofs(pack: &[u8], at: &mut usize) -> Result<usize, GitError> {
    let cut = GitError::BadPack("cut short");
    let mut byte = *pack.get(*at).ok_or(cut.clone())?;
    *at += 1;
    let mut back = usize::from(byte & 0x7f);
    while byte & 0x80 != 0 {
        byte = *pack.get(*at).ok_or(cut.clone())?;
        *at += 1;
        back = back
            .checked_add(1)
            .and_then(|b| b.checked_mul(128))
            .map(|b| b | usize::from(byte & 0x7f))
            .ok_or(GitError::BadPack("a delta offset too large"))?;
    }
    Ok(back)
}

/// Inflates the zlib stream at `*at`, which must come to `size` bytes;
/// returns them where `keep`, and moves `*at` past the stream.
fn inflate(
    pack: &[u8],
    at: &mut usize,
    size: u64,
    keep: bool,
    inflated: &mut u64,
) -> Result<Option<Vec<u8>>, GitError> {
    let bad = GitError::BadPack;
    *inflated = inflated.saturating_add(size);
    if *inflated > MAX_INFLATED {
        return Err(bad("it inflates to more than the gateway reads"));
    }
    let mut z = Decompress::new(true);
    let mut kept = if keep { Vec::with_capacity(usize::try_from(size).unwrap_or(0)) } else { Vec::new() };
    let mut scratch = vec![0u8; 64 << 10];
    let input = pack.get(*at..).unwrap_or_default();
    loop {
        let (in_before, out_before) = (z.total_in(), z.total_out());
        let rest = input.get(usize::try_from(in_before).unwrap_or(usize::MAX)..).unwrap_or_default();
        let status = z.decompress(rest, &mut scratch, FlushDecompress::None).map_err(|_| bad("bad zlib data"))?;
        let made = usize::try_from(z.total_out() - out_before).unwrap_or(0);
        if z.total_out() > size {
            return Err(bad("an object larger than its header says"));
        }
        if keep {
            kept.extend_from_slice(scratch.get(..made).unwrap_or_default());
        }
        match status {
            Status::StreamEnd => break,
            _ if z.total_in() == in_before && made == 0 => return Err(bad("cut short")),
            _ => {}
        }
    }
    if z.total_out() != size {
        return Err(bad("an object smaller than its header says"));
    }
    *at += usize::try_from(z.total_in()).map_err(|_| bad("cut short"))?;
    Ok(keep.then_some(kept))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]
pub(crate) mod tests {
    use std::path::Path;
    use std::process::{Command, Stdio};

    use super::*;

    /// Runs git in `dir`; its stdout.
    fn git(dir: &Path, args: &[&str], input: Option<&[u8]>) -> Vec<u8> {
        let mut cmd = Command::new("git");
        cmd.current_dir(dir)
            .args([
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "-c",
                "init.defaultBranch=main",
                "-c",
                "core.bigFileThreshold=1g",
            ])
            .args(args)
            .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("git");
        if let Some(input) = input {
            use std::io::Write as _;
            child.stdin.take().unwrap().write_all(input).unwrap();
        }
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    /// A repository with `n` commits whose long, alike messages git packs
    /// as deltas of each other; their ids, oldest first.
    pub fn repo(dir: &Path, n: usize) -> Vec<String> {
        git(dir, &["init", "-q"], None);
        let text: String = (0..200).map(|i| format!("line {i} of a long and repetitive commit message\n")).collect();
        (0..n)
            .map(|i| {
                std::fs::write(dir.join("f"), format!("{i}\n")).unwrap();
                git(dir, &["add", "f"], None);
                git(dir, &["commit", "-q", "-m", &format!("commit {i}\n\n{text}")], None);
                String::from_utf8(git(dir, &["rev-parse", "HEAD"], None)).unwrap().trim().to_string()
            })
            .collect()
    }

    /// A pack of what `revs` (rev-list arguments, one a line) name.
    pub fn pack(dir: &Path, revs: &str, extra: &[&str]) -> Vec<u8> {
        let mut args = vec!["pack-objects", "--stdout", "--revs", "-q", "--window=50", "--depth=50"];
        args.extend_from_slice(extra);
        git(dir, &args, Some(revs.as_bytes()))
    }

    fn id(s: &str) -> Vec<u8> {
        unhex(s).unwrap()
    }

    /// How many commits of a pack git stored as deltas.
    fn deltified_commits(dir: &Path, pack: &[u8]) -> usize {
        let path = dir.join("t.pack");
        std::fs::write(&path, pack).unwrap();
        git(dir, &["index-pack", "t.pack"], None);
        let listing = String::from_utf8(git(dir, &["verify-pack", "-v", "t.idx"], None)).unwrap();
        listing
            .lines()
            .filter(|l| l.split_whitespace().nth(1) == Some("commit") && l.split_whitespace().count() >= 7)
            .count()
    }

    #[test]
    fn commits_of_real_packs_deltas_and_thin_ones() {
        let dir = std::env::temp_dir().join(format!("moat-pack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let c = repo(&dir, 6);
        for extra in [&["--delta-base-offset"][..], &[]] {
            let whole = pack(&dir, "HEAD\n", extra);
            assert!(deltified_commits(&dir, &whole) > 0, "git stored no commit as a delta ({extra:?})");
            let found = commits(&whole, Hash::Sha1).unwrap();
            assert_eq!(found.parents.len(), 6, "{extra:?}");
            assert_eq!(found.unreadable, 0);
            assert_eq!(found.parents[&id(&c[3])], vec![id(&c[2])]);
            assert_eq!(found.descends(&id(&c[5]), &id(&c[0])), Descent::Yes);
            assert_eq!(found.descends(&id(&c[0]), &id(&c[5])), Descent::No);
            assert_eq!(found.descends(&id(&c[2]), &id(&c[2])), Descent::Yes);
        }
        // A thin pack of the last two, as a push sends it.
        let thin = pack(&dir, &format!("{}\n^{}\n", c[5], c[3]), &["--thin", "--delta-base-offset"]);
        let found = commits(&thin, Hash::Sha1).unwrap();
        assert_eq!(found.descends(&id(&c[5]), &id(&c[3])), Descent::Yes);
        assert_eq!(found.descends(&id(&c[5]), &id(&c[1])), Descent::Unknown(c[3].clone()));
        // Cut or bent anywhere: refused or read, never a panic.
        for cut in 0..thin.len() {
            let _ = commits(&thin[..cut], Hash::Sha1);
        }
        assert!(commits(&thin[..thin.len() - 1], Hash::Sha1).is_err());
        for at in 0..thin.len() {
            let mut bent = thin.clone();
            bent[at] ^= 0x5a;
            let _ = commits(&bent, Hash::Sha1);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_commits_parents_are_those_git_reads() {
        let (t, a, b) = ("1".repeat(40), "a".repeat(40), "b".repeat(40));
        let commit = |body: String| parents(body.as_bytes(), Hash::Sha1);
        assert_eq!(commit(format!("tree {t}\nparent {a}\nparent {b}\nauthor x\n\nm")), Some(vec![id(&a), id(&b)]));
        // A parent header after another header is not one to git: the
        // history it names is not this commit's.
        assert_eq!(commit(format!("tree {t}\nparent {a}\nauthor x\ncommitter y\nparent {b}\n\nm")), Some(vec![id(&a)]));
        assert_eq!(commit(format!("tree {t}\nauthor x\nparent {b}\n\nm")), Some(vec![]));
        // What git would not parse is no commit to judge by.
        assert_eq!(commit(format!("parent {a}\ntree {t}\n\nm")), None);
        assert_eq!(commit(format!("tree {t}\nparent {}\n\nm", &a[..39])), None);
        assert_eq!(commit(format!("tree {t}\nparent {a} \n\nm")), None);
    }

    #[test]
    fn headers_that_lie_are_refused() {
        let mut pack = b"PACK\0\0\0\x02\0\0\0\x01".to_vec();
        // A blob that says 3 bytes and inflates to 5.
        pack.push(0x33);
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut z, b"hello").unwrap();
        pack.extend(z.finish().unwrap());
        pack.extend([0u8; 20]);
        assert_eq!(commits(&pack, Hash::Sha1).unwrap_err(), GitError::BadPack("an object larger than its header says"));
        assert!(commits(b"PACK\0\0\0\x04\0\0\0\0", Hash::Sha1).is_err());
        assert!(commits(b"KCAP\0\0\0\x02\0\0\0\0", Hash::Sha1).is_err());
        // A huge object count is refused before anything is allocated for it.
        assert!(commits(b"PACK\0\0\0\x02\xff\xff\xff\xff", Hash::Sha1).is_err());
        assert!(commits(&[b"PACK\0\0\0\x02\0\0\0\0".as_slice(), &[0u8; 20]].concat(), Hash::Sha1)
            .unwrap()
            .parents
            .is_empty());
    }

    /// A small pack of many large commits (zeros compress to nothing) is
    /// refused once what it keeps passes MAX_KEPT, before it is all inflated.
    #[test]
    fn what_a_pack_keeps_is_bounded() {
        let count = MAX_KEPT / MAX_COMMIT + 2;
        let mut pack = b"PACK\0\0\0\x02".to_vec();
        pack.extend(u32::try_from(count).unwrap().to_be_bytes());
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut z, &vec![0u8; MAX_COMMIT]).unwrap();
        let zeros = z.finish().unwrap();
        for _ in 0..count {
            // A commit (type 1) of MAX_COMMIT bytes: the size in 4 bits, then 7 a byte.
            let mut size = MAX_COMMIT;
            let mut header = vec![0x90 | (size & 0x0f) as u8];
            size >>= 4;
            while size > 0 {
                header.push((size & 0x7f) as u8 | if size > 0x7f { 0x80 } else { 0 });
                size >>= 7;
            }
            pack.extend(header);
            pack.extend(&zeros);
        }
        pack.extend([0u8; 20]);
        assert!(pack.len() < 100_000, "{}", pack.len());
        assert_eq!(
            commits(&pack, Hash::Sha1).unwrap_err(),
            GitError::BadPack("its commits are larger than the gateway reads")
        );
    }
}
