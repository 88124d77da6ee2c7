//! An SFTP server (version 3, with OpenSSH's extensions) for images that have
//! no `sftp-server` of their own: `sftp`, and `scp` (which speaks SFTP since
//! OpenSSH 9), then work in any box, even one without a shell. The agent runs
//! it as a program of its own (its own binary exec'd again, as the session's
//! user, in the session's directory) on the session's stdin and stdout, and it
//! answers one request at a time, as OpenSSH's server does.
//!
//! Everything it reads is the client's: a packet over [`MAX_PACKET`] ends the
//! session, a malformed one is answered `SSH_FX_BAD_MESSAGE`, handles are
//! bounded, and no input makes it panic.

mod ls;
mod wire;

use std::collections::HashMap;
use std::fs::{self, File, ReadDir};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use nix::sys::time::TimeSpec;

use ls::named;
use wire::{encode, kind, open, read_packet, status, Answer, Attrs, Fail, Fields, Packet, Reply, MAX_DATA, MAX_PACKET};

/// The `argv[0]` the agent runs as this server under.
pub const ARGV0: &str = "moat-sftp-server";

/// Most handles open at once.
const MAX_HANDLES: usize = 512;
/// Most names one `READDIR` answer carries.
const NAMES_PER_READDIR: usize = 100;

/// The extensions announced in `VERSION`, with their versions.
const EXTENSIONS: [(&str, &str); 9] = [
    ("posix-rename@openssh.com", "1"),
    ("statvfs@openssh.com", "2"),
    ("fstatvfs@openssh.com", "2"),
    ("hardlink@openssh.com", "1"),
    ("fsync@openssh.com", "1"),
    ("lsetstat@openssh.com", "1"),
    ("limits@openssh.com", "1"),
    ("expand-path@openssh.com", "1"),
    ("copy-data", "1"),
];

/// Serves SFTP on stdin and stdout until the client ends it; the process's
/// exit status.
pub fn serve_stdio() -> i32 {
    match serve(io::stdin().lock(), io::stdout().lock()) {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(io::stderr(), "moat-sftp-server: {e}");
            1
        }
    }
}

/// Serves SFTP on `input` and `output` until `input` ends.
pub fn serve(input: impl Read, output: impl Write) -> io::Result<()> {
    let mut input = BufReader::with_capacity(MAX_PACKET, input);
    let mut output = BufWriter::with_capacity(MAX_PACKET, output);
    let mut server = Server::default();
    let Some(first) = read_packet(&mut input)? else { return Ok(()) };
    if first.first() != Some(&kind::INIT) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "the first packet is not SSH_FXP_INIT"));
    }
    let mut version = Packet::new(kind::VERSION);
    version.u32(3);
    for (name, value) in EXTENSIONS {
        version.string(name.as_bytes()).string(value.as_bytes());
    }
    output.write_all(&version.finish())?;
    output.flush()?;
    while let Some(packet) = read_packet(&mut input)? {
        let mut fields = Fields(&packet);
        let (Some(kind), Some(id)) = (fields.u8(), fields.u32()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a packet too short for its id"));
        };
        let answer = server.answer(kind, &mut fields).unwrap_or_else(|| Err(Fail::bad_message()));
        output.write_all(&encode(id, answer))?;
        // Pipelined requests are answered together, in one write.
        if input.buffer().is_empty() {
            output.flush()?;
        }
    }
    output.flush()
}

/// An open file or directory.
enum Handle {
    File(File),
    Dir {
        path: PathBuf,
        entries: ReadDir,
        /// `.` and `..` go first, as `readdir` gives them.
        dots_sent: bool,
    },
}

#[derive(Default)]
struct Server {
    handles: HashMap<u32, Handle>,
    next_handle: u32,
}

impl Server {
    /// The answer to a request of `kind` (its id read); `None` when a field
    /// is missing.
    fn answer(&mut self, kind: u8, f: &mut Fields<'_>) -> Option<Answer> {
        Some(match kind {
            kind::OPEN => {
                let (path, flags, attrs) = (f.path()?, f.u32()?, f.attrs()?);
                self.open_file(&path, flags, attrs)
            }
            kind::CLOSE => {
                let handle = f.string()?;
                self.close(handle)
            }
            kind::READ => {
                let (handle, offset, len) = (f.string()?, f.u64()?, f.u32()?);
                self.file(handle).and_then(|file| read_at(file, offset, len as usize))
            }
            kind::WRITE => {
                let (handle, offset, data) = (f.string()?, f.u64()?, f.string()?);
                self.file(handle).and_then(|file| done(file.write_all_at(data, offset)))
            }
            kind::LSTAT => stat(&f.path()?, false),
            kind::STAT => stat(&f.path()?, true),
            kind::FSTAT => {
                let handle = f.string()?;
                match self.handle(handle) {
                    Ok(Handle::File(file)) => file.metadata().map(|m| Reply::Attrs(Attrs::of(&m))).map_err(Fail::from),
                    Ok(Handle::Dir { path, .. }) => stat(path, true),
                    Err(e) => Err(e),
                }
            }
            kind::SETSTAT => {
                let (path, attrs) = (f.path()?, f.attrs()?);
                set_attrs(Target::Path(&path, true), attrs)
            }
            kind::FSETSTAT => {
                let (handle, attrs) = (f.string()?, f.attrs()?);
                self.file(handle).and_then(|file| set_attrs(Target::File(file), attrs))
            }
            kind::OPENDIR => {
                let path = f.path()?;
                let opened = self.room().and_then(|()| Ok(fs::read_dir(&path)?));
                opened.and_then(|entries| self.keep(Handle::Dir { path, entries, dots_sent: false }))
            }
            kind::READDIR => {
                let handle = f.string()?;
                self.read_dir(handle)
            }
            kind::REMOVE => done(fs::remove_file(f.path()?)),
            kind::MKDIR => {
                let (path, attrs) = (f.path()?, f.attrs()?);
                let mode = attrs.mode.map_or(0o777, |m| m & 0o7777);
                done(fs::DirBuilder::new().mode(mode).create(path))
            }
            kind::RMDIR => done(fs::remove_dir(f.path()?)),
            kind::REALPATH => realpath(&f.path()?),
            kind::RENAME => {
                let (from, to) = (f.path()?, f.path()?);
                rename_no_replace(&from, &to)
            }
            kind::READLINK => match fs::read_link(f.path()?) {
                Ok(target) => {
                    let target = target.into_os_string().into_vec();
                    Ok(Reply::Names(vec![(target.clone(), target, Attrs::default())]))
                }
                Err(e) => Err(e.into()),
            },
            kind::SYMLINK => {
                // OpenSSH's order, which its clients follow: the target first.
                let (target, link) = (f.path()?, f.path()?);
                done(std::os::unix::fs::symlink(target, link))
            }
            kind::EXTENDED => {
                let name = f.string()?;
                self.extended(name, f)?
            }
            kind::INIT => Err(Fail::failure("the session is already initialised")),
            _ => Err(Fail(status::OP_UNSUPPORTED, "Operation unsupported".into())),
        })
    }

    fn extended(&mut self, name: &[u8], f: &mut Fields<'_>) -> Option<Answer> {
        Some(match name {
            b"posix-rename@openssh.com" => {
                let (from, to) = (f.path()?, f.path()?);
                done(fs::rename(from, to))
            }
            b"hardlink@openssh.com" => {
                let (from, to) = (f.path()?, f.path()?);
                done(fs::hard_link(from, to))
            }
            b"statvfs@openssh.com" => nix::sys::statvfs::statvfs(&f.path()?).map(statvfs_reply).map_err(Fail::from),
            b"fstatvfs@openssh.com" => {
                let handle = f.string()?;
                self.file(handle)
                    .and_then(|file| nix::sys::statvfs::fstatvfs(file).map(statvfs_reply).map_err(Fail::from))
            }
            b"fsync@openssh.com" => {
                let handle = f.string()?;
                self.file(handle).and_then(|file| done(file.sync_all()))
            }
            b"lsetstat@openssh.com" => {
                let (path, attrs) = (f.path()?, f.attrs()?);
                set_attrs(Target::Path(&path, false), attrs)
            }
            b"limits@openssh.com" => {
                let mut reply = Vec::with_capacity(32);
                for limit in [MAX_PACKET, MAX_DATA, MAX_DATA, MAX_HANDLES] {
                    reply.extend_from_slice(&(limit as u64).to_be_bytes());
                }
                Ok(Reply::Extended(reply))
            }
            b"expand-path@openssh.com" => realpath(&expand_home(&f.path()?)),
            b"copy-data" => {
                let (from, from_at, length) = (f.string()?.to_vec(), f.u64()?, f.u64()?);
                let (to, to_at) = (f.string()?.to_vec(), f.u64()?);
                self.copy_data((&from, from_at), length, (&to, to_at))
            }
            _ => Err(Fail(status::OP_UNSUPPORTED, "Operation unsupported".into())),
        })
    }

    fn open_file(&mut self, path: &Path, flags: u32, attrs: Attrs) -> Answer {
        let mut oflag = match (flags & open::READ != 0, flags & open::WRITE != 0) {
            (true, true) => OFlag::O_RDWR,
            (false, true) => OFlag::O_WRONLY,
            _ => OFlag::O_RDONLY,
        };
        for (bit, o) in [
            (open::APPEND, OFlag::O_APPEND),
            (open::CREAT, OFlag::O_CREAT),
            (open::TRUNC, OFlag::O_TRUNC),
            (open::EXCL, OFlag::O_EXCL),
        ] {
            if flags & bit != 0 {
                oflag |= o;
            }
        }
        let mode = Mode::from_bits_truncate(attrs.mode.map_or(0o666, |m| m & 0o7777));
        // Checked first: a file O_CREAT made must not be left by a refusal.
        self.room()?;
        let fd = nix::fcntl::open(path, oflag | OFlag::O_CLOEXEC | OFlag::O_NOCTTY, mode)?;
        self.keep(Handle::File(File::from(fd)))
    }

    /// Whether another handle may be opened.
    fn room(&self) -> Result<(), Fail> {
        if self.handles.len() >= MAX_HANDLES {
            return Err(Fail::failure("too many open handles"));
        }
        Ok(())
    }

    /// Keeps `handle` under an id no open handle has (ids wrap around).
    fn keep(&mut self, handle: Handle) -> Answer {
        while self.handles.contains_key(&self.next_handle) {
            self.next_handle = self.next_handle.wrapping_add(1);
        }
        let id = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1);
        self.handles.insert(id, handle);
        Ok(Reply::Handle(id))
    }

    fn close(&mut self, handle: &[u8]) -> Answer {
        let id = handle_id(handle)?;
        match self.handles.remove(&id) {
            Some(_) => Ok(ok()),
            None => Err(bad_handle()),
        }
    }

    fn handle(&mut self, handle: &[u8]) -> Result<&mut Handle, Fail> {
        let id = handle_id(handle)?;
        self.handles.get_mut(&id).ok_or_else(bad_handle)
    }

    fn file(&mut self, handle: &[u8]) -> Result<&File, Fail> {
        match self.handle(handle)? {
            Handle::File(file) => Ok(file),
            Handle::Dir { .. } => Err(bad_handle()),
        }
    }

    /// `copy-data` (sftp's `cp`): `length` bytes (to the end if 0) of one
    /// open file into another, without the client carrying them. Never
    /// within one file, as OpenSSH's server refuses it: copied to the end,
    /// a copy ahead of where it reads reads its own writes until the disk
    /// is full (through one handle or two, or two paths to one file).
    fn copy_data(&mut self, (from, from_at): (&[u8], u64), length: u64, (to, to_at): (&[u8], u64)) -> Answer {
        use std::os::unix::fs::MetadataExt;
        let source = self.file(from)?.try_clone()?;
        let target = self.file(to)?.try_clone()?;
        let (read, written) = (source.metadata()?, target.metadata()?);
        if (read.dev(), read.ino()) == (written.dev(), written.ino()) {
            return Err(Fail::failure("a copy within one file"));
        }
        let limit = if length == 0 { u64::MAX } else { length };
        let mut buf = vec![0u8; MAX_DATA];
        let mut copied = 0u64;
        while copied < limit {
            let want = usize::try_from(limit - copied).unwrap_or(usize::MAX).min(buf.len());
            let chunk = buf.get_mut(..want).unwrap_or_default();
            let n = source.read_at(chunk, from_at.saturating_add(copied))?;
            if n == 0 {
                break;
            }
            target.write_all_at(chunk.get(..n).unwrap_or_default(), to_at.saturating_add(copied))?;
            copied += n as u64;
        }
        Ok(ok())
    }

    fn read_dir(&mut self, handle: &[u8]) -> Answer {
        let Handle::Dir { path, entries, dots_sent } = self.handle(handle)? else { return Err(bad_handle()) };
        let (mut names, now) = (Vec::new(), ls::now());
        if !std::mem::replace(dots_sent, true) {
            for (name, at) in [(".", path.clone()), ("..", path.join(".."))] {
                if let Ok(meta) = fs::symlink_metadata(&at) {
                    names.push(named(name.as_bytes().to_vec(), &meta, now));
                }
            }
        }
        while names.len() < NAMES_PER_READDIR {
            let Some(entry) = entries.next() else { break };
            let entry = entry?;
            // One that went meanwhile is left out, as `ls` leaves it.
            if let Ok(meta) = entry.metadata() {
                names.push(named(entry.file_name().into_vec(), &meta, now));
            }
        }
        if names.is_empty() {
            return Err(Fail(status::EOF, "End of file".into()));
        }
        Ok(Reply::Names(names))
    }
}

fn ok() -> Reply {
    Reply::Status(status::OK, "Success".into())
}

/// `Success`, or why not.
fn done<E: Into<Fail>>(result: Result<(), E>) -> Answer {
    result.map(|()| ok()).map_err(Into::into)
}

fn bad_handle() -> Fail {
    Fail::failure("no such handle")
}

fn handle_id(handle: &[u8]) -> Result<u32, Fail> {
    Ok(u32::from_be_bytes(handle.try_into().map_err(|_| bad_handle())?))
}

fn read_at(file: &File, offset: u64, len: usize) -> Answer {
    let mut data = vec![0u8; len.min(MAX_DATA)];
    let mut got = 0;
    while got < data.len() {
        let Some(at) = offset.checked_add(got as u64) else { break };
        match file.read_at(data.get_mut(got..).unwrap_or_default(), at) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if got == 0 => return Err(e.into()),
            Err(_) => break,
        }
    }
    if got == 0 {
        return Err(Fail(status::EOF, "End of file".into()));
    }
    data.truncate(got);
    Ok(Reply::Data(data))
}

fn stat(path: &Path, follow: bool) -> Answer {
    let meta = if follow { fs::metadata(path) } else { fs::symlink_metadata(path) };
    Ok(Reply::Attrs(Attrs::of(&meta?)))
}

/// What `SETSTAT`, `FSETSTAT` and `lsetstat` change.
enum Target<'a> {
    /// A path, and whether a symlink there is followed.
    Path(&'a Path, bool),
    File(&'a File),
}

fn set_attrs(target: Target<'_>, attrs: Attrs) -> Answer {
    use nix::sys::stat::{futimens, utimensat, UtimensatFlags};
    if let Some(size) = attrs.size {
        match target {
            Target::Path(path, _) => nix::unistd::truncate(path, i64::try_from(size).unwrap_or(i64::MAX))?,
            Target::File(file) => file.set_len(size)?,
        }
    }
    if let Some(mode) = attrs.mode {
        let perms = fs::Permissions::from_mode(mode & 0o7777);
        match target {
            // A symlink's own mode cannot be changed on Linux: said, as
            // OpenSSH's server says it (its fchmodat fails).
            Target::Path(path, false) if fs::symlink_metadata(path)?.file_type().is_symlink() => {
                return Err(Fail::failure("a symlink's mode cannot be changed"));
            }
            Target::Path(path, _) => fs::set_permissions(path, perms)?,
            Target::File(file) => file.set_permissions(perms)?,
        }
    }
    if let Some((uid, gid)) = attrs.ids {
        match target {
            Target::Path(path, true) => std::os::unix::fs::chown(path, Some(uid), Some(gid))?,
            Target::Path(path, false) => std::os::unix::fs::lchown(path, Some(uid), Some(gid))?,
            Target::File(file) => std::os::unix::fs::fchown(file, Some(uid), Some(gid))?,
        }
    }
    if let Some((atime, mtime)) = attrs.times {
        let (atime, mtime) = (TimeSpec::new(atime.into(), 0), TimeSpec::new(mtime.into(), 0));
        match target {
            Target::Path(path, follow) => {
                let how = if follow { UtimensatFlags::FollowSymlink } else { UtimensatFlags::NoFollowSymlink };
                utimensat(nix::fcntl::AT_FDCWD, path, &atime, &mtime, how)?;
            }
            Target::File(file) => futimens(file, &atime, &mtime)?,
        }
    }
    Ok(ok())
}

/// `RENAME` as version 3 has it: refused if the new name exists.
fn rename_no_replace(from: &Path, to: &Path) -> Answer {
    use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};
    match renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => Ok(ok()),
        // A file system without the flag: looked at first, then renamed.
        Err(nix::Error::EINVAL) => {
            if fs::symlink_metadata(to).is_ok() {
                return Err(Fail::failure("File exists"));
            }
            done(fs::rename(from, to))
        }
        Err(e) => Err(e.into()),
    }
}

/// The absolute path `path` names: resolved where it exists, else (a name
/// about to be made) its directory resolved and its last name added, as
/// OpenSSH's server does: a missing directory on the way, or a missing
/// name followed by `/`, `.` or `..`, is no such file.
fn realpath(path: &Path) -> Answer {
    let path = if path.as_os_str().is_empty() { Path::new(".") } else { path };
    let name = resolve(path, 0)?.into_os_string().into_vec();
    Ok(Reply::Names(vec![(name.clone(), name, Attrs::default())]))
}

/// [`realpath`]'s answer: a symlink whose target is missing leads where its
/// target would be, by the same rule (as OpenSSH's: a link to `/gone`
/// resolves to `/gone`, one to `/gone/deeper` is no such file).
fn resolve(path: &Path, links: u8) -> io::Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let e = match fs::canonicalize(path) {
        Ok(resolved) => return Ok(resolved),
        Err(e) if e.kind() == io::ErrorKind::NotFound => e,
        Err(e) => return Err(e),
    };
    let text = path.as_os_str().as_bytes();
    let (dir, last) = match text.iter().rposition(|c| *c == b'/') {
        Some(0) => (&b"/"[..], &text[1..]),
        Some(at) => (&text[..at], &text[at + 1..]),
        None => (&b"."[..], text),
    };
    if matches!(last, b"" | b"." | b"..") {
        return Err(e);
    }
    let dir = fs::canonicalize(std::ffi::OsStr::from_bytes(dir))?;
    let candidate = dir.join(std::ffi::OsStr::from_bytes(last));
    match fs::symlink_metadata(&candidate) {
        Ok(meta) if meta.file_type().is_symlink() => match links {
            MAX_LINKS.. => Err(io::Error::from_raw_os_error(libc::ELOOP)),
            _ => resolve(&dir.join(fs::read_link(&candidate)?), links + 1),
        },
        _ => Ok(candidate),
    }
}

/// Most symlinks [`resolve`] follows (the kernel's own limit).
const MAX_LINKS: u8 = 40;

/// `~` and `~/...` as the session's home.
fn expand_home(path: &Path) -> PathBuf {
    let home = || std::env::var_os("HOME").map_or_else(|| PathBuf::from("/"), PathBuf::from);
    match path.strip_prefix("~") {
        Ok(rest) => home().join(rest),
        Err(_) => path.to_path_buf(),
    }
}

fn statvfs_reply(s: nix::sys::statvfs::Statvfs) -> Reply {
    let fields = [
        s.block_size(),
        s.fragment_size(),
        s.blocks(),
        s.blocks_free(),
        s.blocks_available(),
        s.files(),
        s.files_free(),
        s.files_available(),
        s.filesystem_id(),
        s.flags().bits(),
        s.name_max(),
    ];
    let mut reply = Vec::with_capacity(fields.len() * 8);
    for field in fields {
        // 64 bits here; narrower on some targets.
        #[allow(clippy::unnecessary_cast)]
        reply.extend_from_slice(&(field as u64).to_be_bytes());
    }
    Reply::Extended(reply)
}

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStrExt;

    use super::*;

    /// A request packet: type, id, then `body`.
    fn request(kind: u8, id: u32, body: &[&[u8]]) -> Vec<u8> {
        let mut p = Packet::new(kind);
        p.u32(id);
        for field in body {
            p.0.extend_from_slice(field);
        }
        p.finish()
    }

    fn s(bytes: impl AsRef<[u8]>) -> Vec<u8> {
        let bytes = bytes.as_ref();
        let mut out = (bytes.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(bytes);
        out
    }

    fn n32(v: u32) -> Vec<u8> {
        v.to_be_bytes().to_vec()
    }

    fn n64(v: u64) -> Vec<u8> {
        v.to_be_bytes().to_vec()
    }

    /// An answer: its type, its id, the rest.
    type Answered = (u8, u32, Vec<u8>);

    /// The answers to `requests`, sent after INIT in one go.
    fn session(requests: &[Vec<u8>]) -> (io::Result<()>, Vec<Answered>) {
        let mut input = Packet::new(kind::INIT);
        input.u32(3);
        let mut input = input.finish();
        for r in requests {
            input.extend_from_slice(r);
        }
        let mut output = Vec::new();
        let served = serve(&input[..], &mut output);
        let mut answers = Vec::new();
        let mut rest = &output[..];
        while rest.len() >= 4 {
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            let body = &rest[4..4 + len];
            let id = if body[0] == kind::VERSION { 0 } else { u32::from_be_bytes(body[1..5].try_into().unwrap()) };
            answers.push((body[0], id, body[5.min(body.len())..].to_vec()));
            rest = &rest[4 + len..];
        }
        (served, answers)
    }

    fn status_of(answer: &Answered) -> u32 {
        assert_eq!(answer.0, kind::STATUS, "{answer:?}");
        u32::from_be_bytes(answer.2[..4].try_into().unwrap())
    }

    /// Where OpenSSH's server answers otherwise than plain calls would:
    /// `copy-data` copies between handles (sftp's `cp`), a dangling
    /// symlink resolves where its target would be, a symlink's mode is not
    /// changed quietly, and `readlink` of a file that is no link is a bad
    /// message.
    #[test]
    fn copies_links_and_statuses_as_openssh() {
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| s(dir.path().join(name).as_os_str().as_bytes());
        std::fs::write(dir.path().join("src"), b"0123456789").unwrap();
        std::os::unix::fs::symlink("/nonexistent", dir.path().join("to-gone")).unwrap();
        std::os::unix::fs::symlink("/nonexistent/deeper", dir.path().join("to-deeper")).unwrap();
        let (no_attrs, mode) = (n32(0), [n32(0x4), n32(0o600)].concat());
        let write_flags = n32(open::WRITE | open::CREAT | open::TRUNC);
        let (served, answers) = session(&[
            request(kind::OPEN, 1, &[&path("src"), &n32(open::READ), &no_attrs]),
            request(kind::OPEN, 2, &[&path("dst"), &write_flags, &no_attrs]),
            request(kind::EXTENDED, 3, &[&s(b"copy-data"), &s(n32(0)), &n64(2), &n64(0), &s(n32(1)), &n64(0)]),
            request(kind::EXTENDED, 4, &[&s(b"copy-data"), &s(n32(0)), &n64(0), &n64(4), &s(n32(0)), &n64(2)]),
            request(kind::REALPATH, 5, &[&path("to-gone")]),
            request(kind::REALPATH, 6, &[&path("to-deeper")]),
            request(kind::EXTENDED, 7, &[&s(b"lsetstat@openssh.com"), &path("to-gone"), &mode]),
            request(kind::READLINK, 8, &[&path("src")]),
            // Two handles to one file: to its end, the copy would read its own writes.
            request(kind::OPEN, 9, &[&path("src"), &n32(open::WRITE), &no_attrs]),
            request(kind::EXTENDED, 10, &[&s(b"copy-data"), &s(n32(0)), &n64(0), &n64(0), &s(n32(2)), &n64(10)]),
        ]);
        served.unwrap();
        assert!(answers[0].2.windows(9).any(|w| w == b"copy-data"), "announced");
        let by_id = |id: u32| answers.iter().find(|a| a.1 == id && a.0 != kind::VERSION).unwrap();
        assert_eq!(status_of(by_id(3)), status::OK);
        assert_eq!(std::fs::read(dir.path().join("dst")).unwrap(), b"23456789", "from 2 to the end");
        assert_eq!(status_of(by_id(4)), status::FAILURE, "a copy within one file");
        assert!(by_id(5).2.windows(12).any(|w| w == b"/nonexistent"), "{:?}", by_id(5));
        assert_eq!(status_of(by_id(6)), status::NO_SUCH_FILE);
        assert_eq!(status_of(by_id(7)), status::FAILURE);
        assert_eq!(status_of(by_id(8)), status::BAD_MESSAGE);
        assert_eq!(status_of(by_id(10)), status::FAILURE, "two handles to one file");
        assert_eq!(std::fs::read(dir.path().join("src")).unwrap(), b"0123456789");
    }

    #[test]
    fn files_are_written_read_listed_and_renamed() {
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| s(dir.path().join(name).as_os_str().as_bytes());
        let no_attrs = n32(0);
        let write_flags = n32(open::WRITE | open::CREAT | open::TRUNC);
        let (served, answers) = session(&[
            request(kind::OPEN, 1, &[&path("f"), &write_flags, &no_attrs]),
            request(kind::WRITE, 2, &[&s(n32(0)), &n64(0), &s(b"hello world")]),
            request(kind::CLOSE, 3, &[&s(n32(0))]),
            request(kind::OPEN, 4, &[&path("f"), &n32(open::READ), &no_attrs]),
            request(kind::READ, 5, &[&s(n32(1)), &n64(6), &n32(100)]),
            request(kind::READ, 6, &[&s(n32(1)), &n64(11), &n32(100)]),
            request(kind::STAT, 7, &[&path("f")]),
            request(kind::OPENDIR, 8, &[&path("")]),
            request(kind::SYMLINK, 9, &[&path("f"), &path("link")]),
            request(kind::READLINK, 10, &[&path("link")]),
            request(kind::OPEN, 11, &[&path("g"), &write_flags, &no_attrs]),
            // Version 3's rename keeps an existing name; OpenSSH's replaces it.
            request(kind::RENAME, 12, &[&path("g"), &path("f")]),
            request(kind::EXTENDED, 13, &[&s(b"posix-rename@openssh.com"), &path("g"), &path("f")]),
            request(kind::STAT, 14, &[&path("f")]),
            request(kind::REALPATH, 15, &[&s(format!("{}/x/../new", dir.path().display()))]),
            request(kind::REALPATH, 18, &[&s(format!("{}/new", dir.path().display()))]),
            request(kind::REALPATH, 19, &[&s(format!("{}/new/", dir.path().display()))]),
            request(kind::REALPATH, 20, &[&s(b"")]),
            request(kind::CLOSE, 16, &[&s(n32(77))]),
            request(kind::EXTENDED, 17, &[&s(b"limits@openssh.com")]),
        ]);
        served.unwrap();
        let version = &answers[0];
        assert_eq!(version.0, kind::VERSION);
        assert!(version.2.windows(24).any(|w| w == b"posix-rename@openssh.com"), "{version:?}");
        let by_id = |id: u32| answers.iter().find(|a| a.1 == id && a.0 != kind::VERSION).unwrap();
        assert_eq!(by_id(1).0, kind::HANDLE);
        assert_eq!(status_of(by_id(2)), status::OK);
        assert_eq!(by_id(5).0, kind::DATA);
        assert_eq!(&by_id(5).2[4..], b"world");
        assert_eq!(status_of(by_id(6)), status::EOF);
        let size = u64::from_be_bytes(by_id(7).2[4..12].try_into().unwrap());
        assert_eq!(size, 11);
        assert_eq!(status_of(by_id(9)), status::OK);
        let target = dir.path().join("f");
        let target = target.as_os_str().as_bytes();
        assert_eq!(by_id(10).0, kind::NAME);
        assert_eq!(&by_id(10).2[8..8 + target.len()], target, "the link's target: its first string");
        assert_eq!(status_of(by_id(12)), status::FAILURE, "rename over an existing name");
        assert_eq!(status_of(by_id(13)), status::OK);
        let size = u64::from_be_bytes(by_id(14).2[4..12].try_into().unwrap());
        assert_eq!(size, 0, "f is now the empty g");
        // As OpenSSH's server: a name about to be made resolves, in a
        // directory that exists only.
        assert_eq!(status_of(by_id(15)), status::NO_SUCH_FILE, "x is missing");
        let real = format!("{}/new", dir.path().canonicalize().unwrap().display());
        assert!(by_id(18).2.windows(real.len()).any(|w| w == real.as_bytes()), "{:?}", by_id(18));
        assert_eq!(status_of(by_id(19)), status::NO_SUCH_FILE, "a missing name followed by /");
        assert_eq!(by_id(20).0, kind::NAME, "the empty path is the working directory");
        assert_eq!(status_of(by_id(16)), status::FAILURE, "no such handle");
        assert_eq!(by_id(17).0, kind::EXTENDED_REPLY);
    }

    #[test]
    fn directories_list_in_batches_then_end() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..150 {
            fs::write(dir.path().join(format!("f{i}")), b"").unwrap();
        }
        let handle = s(n32(0));
        let (_, answers) = session(&[
            request(kind::OPENDIR, 1, &[&s(dir.path().as_os_str().as_bytes())]),
            request(kind::READDIR, 2, &[&handle]),
            request(kind::READDIR, 3, &[&handle]),
            request(kind::READDIR, 4, &[&handle]),
        ]);
        let count = |a: &Answered| u32::from_be_bytes(a.2[..4].try_into().unwrap());
        assert_eq!((answers[2].0, count(&answers[2])), (kind::NAME, 100));
        assert_eq!((answers[3].0, count(&answers[3])), (kind::NAME, 52), "150 files, '.' and '..'");
        assert_eq!(status_of(&answers[4]), status::EOF);
    }

    #[test]
    fn hostile_packets_get_an_answer_or_end_the_session() {
        // Fields missing: a bad message, and the session goes on.
        let (served, answers) =
            session(&[request(kind::OPEN, 1, &[&n32(1000)]), request(kind::REALPATH, 2, &[&s(".")])]);
        served.unwrap();
        assert_eq!(status_of(&answers[1]), status::BAD_MESSAGE);
        assert_eq!(answers[2].0, kind::NAME);
        // An unknown type, an unknown extension: unsupported.
        let (_, answers) = session(&[request(99, 1, &[]), request(kind::EXTENDED, 2, &[&s(b"nope@example.com")])]);
        assert_eq!(status_of(&answers[1]), status::OP_UNSUPPORTED);
        assert_eq!(status_of(&answers[2]), status::OP_UNSUPPORTED);
        // A packet longer than the limit ends the session (its body is never read).
        let (served, _) = session(&[n32(u32::MAX)]);
        assert_eq!(served.unwrap_err().kind(), io::ErrorKind::InvalidData);
        // A huge read is cut to what one packet carries.
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big");
        fs::write(&big, vec![7u8; MAX_PACKET * 2]).unwrap();
        let (_, answers) = session(&[
            request(kind::OPEN, 1, &[&s(big.as_os_str().as_bytes()), &n32(open::READ), &n32(0)]),
            request(kind::READ, 2, &[&s(n32(0)), &n64(0), &n32(u32::MAX)]),
        ]);
        assert_eq!(answers[2].2.len(), 4 + MAX_DATA);
        // Handles are bounded.
        let opens: Vec<_> = (0..MAX_HANDLES as u32 + 1)
            .map(|i| request(kind::OPENDIR, i, &[&s(dir.path().as_os_str().as_bytes())]))
            .collect();
        let (_, answers) = session(&opens);
        assert_eq!(status_of(answers.last().unwrap()), status::FAILURE);
        assert_eq!(answers.iter().filter(|a| a.0 == kind::HANDLE).count(), MAX_HANDLES);
    }
}
