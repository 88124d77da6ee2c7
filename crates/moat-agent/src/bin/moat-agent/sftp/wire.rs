//! SFTP's wire format (draft-ietf-secsh-filexfer-02, which OpenSSH speaks):
//! packet framing, the request fields read from the front, attributes, and
//! answers encoded. No input makes a reader panic: a missing field is `None`.

use std::ffi::OsStr;
use std::fs::Metadata;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

/// Longest packet either side sends (OpenSSH's `SFTP_MAX_MSG_LENGTH`).
pub(super) const MAX_PACKET: usize = 256 * 1024;
/// Most bytes one read answers, and one write should carry.
pub(super) const MAX_DATA: usize = MAX_PACKET - 1024;
pub(super) mod kind {
    pub const INIT: u8 = 1;
    pub const VERSION: u8 = 2;
    pub const OPEN: u8 = 3;
    pub const CLOSE: u8 = 4;
    pub const READ: u8 = 5;
    pub const WRITE: u8 = 6;
    pub const LSTAT: u8 = 7;
    pub const FSTAT: u8 = 8;
    pub const SETSTAT: u8 = 9;
    pub const FSETSTAT: u8 = 10;
    pub const OPENDIR: u8 = 11;
    pub const READDIR: u8 = 12;
    pub const REMOVE: u8 = 13;
    pub const MKDIR: u8 = 14;
    pub const RMDIR: u8 = 15;
    pub const REALPATH: u8 = 16;
    pub const STAT: u8 = 17;
    pub const RENAME: u8 = 18;
    pub const READLINK: u8 = 19;
    pub const SYMLINK: u8 = 20;
    pub const STATUS: u8 = 101;
    pub const HANDLE: u8 = 102;
    pub const DATA: u8 = 103;
    pub const NAME: u8 = 104;
    pub const ATTRS: u8 = 105;
    pub const EXTENDED: u8 = 200;
    pub const EXTENDED_REPLY: u8 = 201;
}

pub(super) mod status {
    pub const OK: u32 = 0;
    pub const EOF: u32 = 1;
    pub const NO_SUCH_FILE: u32 = 2;
    pub const PERMISSION_DENIED: u32 = 3;
    pub const FAILURE: u32 = 4;
    pub const BAD_MESSAGE: u32 = 5;
    pub const OP_UNSUPPORTED: u32 = 8;
}

pub(super) mod attr {
    pub const SIZE: u32 = 0x1;
    pub const UIDGID: u32 = 0x2;
    pub const PERMISSIONS: u32 = 0x4;
    pub const ACMODTIME: u32 = 0x8;
    pub const EXTENDED: u32 = 0x8000_0000;
}

pub(super) mod open {
    pub const READ: u32 = 0x1;
    pub const WRITE: u32 = 0x2;
    pub const APPEND: u32 = 0x4;
    pub const CREAT: u32 = 0x8;
    pub const TRUNC: u32 = 0x10;
    pub const EXCL: u32 = 0x20;
}

/// The next packet's type and body, `None` at the end of the input.
pub(super) fn read_packet(input: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len == 0 || len > MAX_PACKET {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a packet of {len} bytes")));
    }
    let mut packet = vec![0u8; len];
    input.read_exact(&mut packet)?;
    Ok(Some(packet))
}

/// A request's fields, read from the front; `None` once one is missing.
pub(super) struct Fields<'a>(pub(super) &'a [u8]);

impl<'a> Fields<'a> {
    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    pub(super) fn u8(&mut self) -> Option<u8> {
        self.take(1)?.first().copied()
    }

    pub(super) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }

    pub(super) fn string(&mut self) -> Option<&'a [u8]> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    pub(super) fn path(&mut self) -> Option<PathBuf> {
        let bytes = self.string()?;
        // An empty path is the current directory, as OpenSSH's server takes it.
        Some(if bytes.is_empty() { PathBuf::from(".") } else { PathBuf::from(OsStr::from_bytes(bytes)) })
    }

    pub(super) fn attrs(&mut self) -> Option<Attrs> {
        let flags = self.u32()?;
        let mut attrs = Attrs::default();
        if flags & attr::SIZE != 0 {
            attrs.size = Some(self.u64()?);
        }
        if flags & attr::UIDGID != 0 {
            attrs.ids = Some((self.u32()?, self.u32()?));
        }
        if flags & attr::PERMISSIONS != 0 {
            attrs.mode = Some(self.u32()?);
        }
        if flags & attr::ACMODTIME != 0 {
            attrs.times = Some((self.u32()?, self.u32()?));
        }
        if flags & attr::EXTENDED != 0 {
            for _ in 0..self.u32()? {
                self.string()?;
                self.string()?;
            }
        }
        Some(attrs)
    }
}

/// A file's attributes, as much of them as a request or an answer carries.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Attrs {
    pub(super) size: Option<u64>,
    pub(super) ids: Option<(u32, u32)>,
    pub(super) mode: Option<u32>,
    pub(super) times: Option<(u32, u32)>,
}

impl Attrs {
    pub(super) fn of(meta: &Metadata) -> Self {
        // SFTP version 3 has 32-bit times: later ones are cut, as OpenSSH's.
        let time = |t: i64| u32::try_from(t.max(0)).unwrap_or(u32::MAX);
        Self {
            size: Some(meta.size()),
            ids: Some((meta.uid(), meta.gid())),
            mode: Some(meta.mode()),
            times: Some((time(meta.atime()), time(meta.mtime()))),
        }
    }
}

/// An answer's body, after its type and id.
pub(super) enum Reply {
    Status(u32, String),
    Handle(u32),
    Data(Vec<u8>),
    Names(Vec<(Vec<u8>, Vec<u8>, Attrs)>),
    Attrs(Attrs),
    Extended(Vec<u8>),
}

/// A request that failed: its status code and message.
#[derive(Debug)]
pub(super) struct Fail(pub(super) u32, pub(super) String);

impl Fail {
    pub(super) fn bad_message() -> Self {
        Self(status::BAD_MESSAGE, "Bad message".into())
    }

    pub(super) fn failure(why: &str) -> Self {
        Self(status::FAILURE, why.into())
    }
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        // OpenSSH's sftp-server's mapping (`errno_to_portable`), which its
        // clients read: `readlink` of a file that is no link is a bad message.
        let code = match e.raw_os_error() {
            Some(libc::ENOENT | libc::ENOTDIR | libc::EBADF | libc::ELOOP) => status::NO_SUCH_FILE,
            Some(libc::EACCES | libc::EPERM | libc::EFAULT) => status::PERMISSION_DENIED,
            Some(libc::ENAMETOOLONG | libc::EINVAL) => status::BAD_MESSAGE,
            Some(libc::ENOSYS) => status::OP_UNSUPPORTED,
            _ => status::FAILURE,
        };
        let mut text = e.to_string();
        if let Some(at) = text.find(" (os error") {
            text.truncate(at);
        }
        Self(code, text)
    }
}

impl From<nix::Error> for Fail {
    fn from(e: nix::Error) -> Self {
        io::Error::from(e).into()
    }
}

pub(super) type Answer = Result<Reply, Fail>;

/// An outgoing packet: its length is filled in at the end.
pub(super) struct Packet(pub(super) Vec<u8>);

impl Packet {
    pub(super) fn new(kind: u8) -> Self {
        Self(vec![0, 0, 0, 0, kind])
    }

    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn string(&mut self, s: &[u8]) -> &mut Self {
        self.u32(u32::try_from(s.len()).unwrap_or(u32::MAX));
        self.0.extend_from_slice(s);
        self
    }

    pub(super) fn attrs(&mut self, a: &Attrs) -> &mut Self {
        let flags = [
            (a.size.is_some(), attr::SIZE),
            (a.ids.is_some(), attr::UIDGID),
            (a.mode.is_some(), attr::PERMISSIONS),
            (a.times.is_some(), attr::ACMODTIME),
        ];
        self.u32(flags.iter().filter(|(set, _)| *set).fold(0, |all, (_, bit)| all | bit));
        if let Some(size) = a.size {
            self.u64(size);
        }
        if let Some((uid, gid)) = a.ids {
            self.u32(uid).u32(gid);
        }
        if let Some(mode) = a.mode {
            self.u32(mode);
        }
        if let Some((atime, mtime)) = a.times {
            self.u32(atime).u32(mtime);
        }
        self
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        let len = u32::try_from(self.0.len() - 4).unwrap_or(u32::MAX);
        if let Some(prefix) = self.0.get_mut(..4) {
            prefix.copy_from_slice(&len.to_be_bytes());
        }
        self.0
    }
}

/// The answer to request `id`, as a packet.
pub(super) fn encode(id: u32, answer: Answer) -> Vec<u8> {
    let reply = answer.unwrap_or_else(|Fail(code, text)| Reply::Status(code, text));
    let mut p;
    match reply {
        Reply::Status(code, text) => {
            p = Packet::new(kind::STATUS);
            p.u32(id).u32(code).string(text.as_bytes()).string(b"");
        }
        Reply::Handle(handle) => {
            p = Packet::new(kind::HANDLE);
            p.u32(id).string(&handle.to_be_bytes());
        }
        Reply::Data(data) => {
            p = Packet::new(kind::DATA);
            p.u32(id).string(&data);
        }
        Reply::Names(names) => {
            p = Packet::new(kind::NAME);
            p.u32(id).u32(u32::try_from(names.len()).unwrap_or(0));
            for (name, long, attrs) in &names {
                p.string(name).string(long).attrs(attrs);
            }
        }
        Reply::Attrs(attrs) => {
            p = Packet::new(kind::ATTRS);
            p.u32(id).attrs(&attrs);
        }
        Reply::Extended(body) => {
            p = Packet::new(kind::EXTENDED_REPLY);
            p.u32(id);
            p.0.extend_from_slice(&body);
        }
    }
    p.finish()
}
