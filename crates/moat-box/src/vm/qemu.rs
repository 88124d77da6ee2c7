//! QEMU as a box's VMM: the command line of a `microvm` machine with only
//! the devices a box needs, and QMP, its control channel.
//!
//! QEMU opens nothing by path that the host keeps private: every file and
//! socket it uses is a descriptor its supervisor hands it (see
//! [`Fds`]), so it can run as a uid of its own that may enter no directory
//! of moat's.

// Reads what a box or its QEMU sends, as root: it cannot panic.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How a guest's CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// QEMU's own translator: any host, 7-30x slower.
    Tcg,
}

impl Accel {
    /// Its name, as QEMU's `-accel` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Tcg => "tcg",
        }
    }
}

/// Where QEMU finds what its supervisor hands it.
pub struct Fds;

impl Fds {
    /// The kernel, read through `/proc/self/fd`.
    pub const KERNEL: i32 = 3;
    /// The initramfs, likewise.
    pub const INITRAMFS: i32 = 4;
    /// The root disk, opened read-write, in fd set 1.
    pub const DISK: i32 = 5;
    /// The root disk opened read-only, in fd set 1 too (QEMU opens an image
    /// read-only first, and a set hands out only descriptors of the mode asked).
    pub const DISK_READ: i32 = 10;
    /// A connected socket: the agent's virtio-serial port.
    pub const AGENT: i32 = 6;
    /// The tap device: the guest's network link.
    pub const TAP: i32 = 7;
    /// A listening socket: QMP.
    pub const QMP: i32 = 8;
    /// A saved machine to resume (`-incoming`), when there is one.
    pub const INCOMING: i32 = 9;
    /// The guest's memory, a file mapped shared (see [`MachineSpec::memory_file`]).
    pub const MEMORY: i32 = 11;
}

/// What a box's machine is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineSpec {
    /// How its CPUs run.
    pub accel: Accel,
    /// Guest memory.
    pub memory_mib: u64,
    /// Virtual CPUs.
    pub cpus: u32,
    /// The kernel's command line.
    pub cmdline: String,
    /// The guest's MAC address.
    pub mac: String,
    /// Resume a saved machine from [`Fds::INCOMING`] rather than boot.
    pub incoming: bool,
    /// The guest's RAM is the file at [`Fds::MEMORY`], mapped shared, and
    /// left out of saves (QEMU's `x-ignore-shared`, see [`Qmp::save`] and
    /// [`Qmp::load`]): a saved machine is its devices' state beside that
    /// file. Without, RAM is QEMU's own and a save writes it (a machine saved
    /// so is resumed so).
    #[serde(default)]
    pub memory_file: bool,
}

/// Memory QEMU itself needs beside the guest's, within the box's limit.
pub fn overhead_mib(accel: Accel) -> u64 {
    match accel {
        Accel::Kvm => 96,
        Accel::Tcg => 96 + TCG_CACHE_MIB,
    }
}

/// TCG's translated-code cache (64 MiB made boots ~15% slower here: the
/// cache filled and was flushed while the guest booted).
const TCG_CACHE_MIB: u64 = 256;
/// The least memory a guest gets.
pub const MIN_GUEST_MIB: u64 = 128;

/// A box's balloon: the guest hands back the memory it frees (in 2 MiB
/// blocks, a few seconds after), so the host's pages go and a saved machine
/// is as large as what the guest holds, not as all it ever touched.
pub const BALLOON: &str = "virtio-balloon-device,free-page-reporting=on";

/// What a box's kernel command line adds to speed its boot: no self-tests
/// of the kernel's crypto (~200 ms of a TCG boot; the guest's crypto is the
/// guest's own, the host trusts none of it).
pub const BOOT_OPTIONS: &str = "cryptomgr.notests";

/// The kernel command line of a box's guest: its console, no reboot on
/// panic, [`BOOT_OPTIONS`], and under TCG the host's TSC rate (calibrating
/// it there hangs a share of boots).
pub fn cmdline(accel: Accel, tsc_khz: Option<u64>) -> String {
    let mut line = format!("console=ttyS0 quiet panic=-1 rootfstype=ext4 {BOOT_OPTIONS}");
    if let (Accel::Tcg, Some(khz)) = (accel, tsc_khz) {
        line.push_str(&format!(" tsc_early_khz={khz}"));
    }
    line
}

/// QEMU's arguments for `machine`, its files and sockets at [`Fds`].
pub fn args(machine: &MachineSpec) -> Vec<String> {
    let accel = match machine.accel {
        Accel::Kvm => "kvm".to_string(),
        Accel::Tcg => format!("tcg,tb-size={TCG_CACHE_MIB}"),
    };
    let board = match machine.memory_file {
        true => "microvm,x-option-roms=off,memory-backend=ram",
        false => "microvm,x-option-roms=off",
    };
    let mut args: Vec<String> = [
        "-M",
        board,
        "-accel",
        &accel,
        "-m",
        &machine.memory_mib.to_string(),
        "-smp",
        &machine.cpus.to_string(),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        // No new processes, no privileges, no host resource changes.
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        "-kernel",
        &format!("/proc/self/fd/{}", Fds::KERNEL),
        "-initrd",
        &format!("/proc/self/fd/{}", Fds::INITRAMFS),
        "-append",
        &machine.cmdline,
        "-add-fd",
        &format!("fd={},set=1", Fds::DISK),
        "-add-fd",
        &format!("fd={},set=1", Fds::DISK_READ),
        "-drive",
        "if=none,id=root,format=raw,file=/dev/fdset/1,file.locking=off,discard=unmap",
        "-device",
        "virtio-blk-device,drive=root",
        "-device",
        "virtio-rng-device",
        "-device",
        BALLOON,
        "-device",
        "virtio-serial-device",
        "-chardev",
        &format!("socket,id=agent,fd={}", Fds::AGENT),
        "-device",
        &format!("virtserialport,chardev=agent,name={}", moat_agent::AGENT_PORT),
        "-netdev",
        &format!("tap,id=net,fd={}", Fds::TAP),
        "-device",
        &format!("virtio-net-device,netdev=net,mac={}", machine.mac),
        "-chardev",
        &format!("socket,id=qmp,fd={},server=on,wait=off", Fds::QMP),
        "-mon",
        "chardev=qmp,mode=control",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    if machine.memory_file {
        args.extend([
            "-object".to_string(),
            format!(
                "memory-backend-file,id=ram,size={}M,mem-path=/proc/self/fd/{},share=on",
                machine.memory_mib,
                Fds::MEMORY
            ),
        ]);
    }
    if machine.incoming {
        // A machine whose memory is its file is loaded once told to ignore
        // that file's block (QEMU 7.2 sets no capability from its command line).
        let from = if machine.memory_file { "defer".to_string() } else { format!("fd:{}", Fds::INCOMING) };
        args.extend(["-incoming".to_string(), from]);
    }
    args
}

/// The `fallocate` modes QEMU may use: discarding (punching holes) and
/// zeroing or allocating within the length its rlimit bounds. Allocating past
/// a file's end while keeping its length is not among them: the guest's
/// memory file is outside the box's disk quota, and a QEMU the guest took
/// over could fill the pool that way (RLIMIT_FSIZE does not see it).
const FALLOCATE_MODES: [u32; 3] =
    [0, (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u32, libc::FALLOC_FL_ZERO_RANGE as u32];

/// QEMU's own seccomp filter, beneath `-sandbox on` (which leaves socket
/// families and file sizes alone): the socket families a namespace box may
/// use, and no other (AF_VSOCK, in particular, would reach this host's
/// hypervisor from a QEMU the guest took over); [`FALLOCATE_MODES`]; and no
/// io_uring, whose requests no filter sees (an fallocate among them would
/// pass; QEMU falls back to its own I/O threads and poll).
pub fn filter() -> Vec<libc::sock_filter> {
    use crate::bpf::{arg_one_of, if_syscall, prologue, ret_errno, stmt, BPF_RET_K, SECCOMP_RET_ALLOW};
    let mut prog = prologue();
    for nr in [libc::SYS_io_uring_setup, libc::SYS_io_uring_enter, libc::SYS_io_uring_register] {
        if_syscall(&mut prog, nr, &[ret_errno(libc::ENOSYS)]);
    }
    let families = crate::host::socket_rules();
    if_syscall(&mut prog, libc::SYS_socket, &families);
    if_syscall(&mut prog, libc::SYS_socketpair, &families);
    if_syscall(&mut prog, libc::SYS_fallocate, &arg_one_of(1, &FALLOCATE_MODES, libc::EOPNOTSUPP));
    prog.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
    prog
}

/// A locally administered MAC address.
pub fn random_mac() -> String {
    let mut b = [0u8; 3];
    let _ = getrandom::fill(&mut b);
    format!("52:54:00:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2])
}

/// A connection to a machine's QMP socket, past the greeting.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

/// Most events passed over while waiting for one answer.
const MAX_EVENTS: usize = 1000;
/// The longest a machine may take to be saved.
const SAVE_TIME: Duration = Duration::from_secs(120);

/// The longest QMP answer read (a machine's answers are small; a hostile
/// guest cannot write here, but QEMU's events could pile up).
const MAX_LINE: usize = 1 << 20;

impl Qmp {
    /// Connects and negotiates capabilities; every read waits at most `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> io::Result<Self> {
        Self::on(UnixStream::connect(path)?, timeout)
    }

    /// Negotiates capabilities on a connection made already (it may wait in
    /// QEMU's backlog until QEMU runs); every read waits at most `timeout`.
    pub fn on(stream: UnixStream, timeout: Duration) -> io::Result<Self> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut qmp = Self { writer: stream.try_clone()?, reader: BufReader::new(stream) };
        let greeting = qmp.line()?;
        if greeting.get("QMP").is_none() {
            return Err(io::Error::other(format!("not a QMP greeting: {greeting}")));
        }
        qmp.execute("qmp_capabilities", serde_json::Value::Null)?;
        Ok(qmp)
    }

    /// Runs `command` with `arguments` (`Null`: none); its `return` value.
    pub fn execute(&mut self, command: &str, arguments: serde_json::Value) -> io::Result<serde_json::Value> {
        let request = match arguments {
            serde_json::Value::Null => serde_json::json!({ "execute": command }),
            arguments => serde_json::json!({ "execute": command, "arguments": arguments }),
        };
        let mut text = request.to_string();
        text.push('\n');
        self.writer.write_all(text.as_bytes())?;
        self.answer(command)
    }

    /// Whether the machine's vCPUs run.
    pub fn running(&mut self) -> io::Result<bool> {
        let status = self.execute("query-status", serde_json::Value::Null)?;
        Ok(status.get("running").and_then(serde_json::Value::as_bool).unwrap_or(false))
    }

    /// Writes the machine to `file`, its vCPUs paused for good measure
    /// (`cont` runs it on); waits until it is written. With `memory_file`
    /// (its RAM is a file it maps shared) only its devices are written.
    pub fn save(&mut self, file: &std::fs::File, memory_file: bool) -> io::Result<()> {
        self.execute("stop", serde_json::Value::Null)?;
        self.ignore_shared(memory_file)?;
        // The default bandwidth cap (128 MiB/s) is for links, not a local file.
        self.execute("migrate-set-parameters", serde_json::json!({ "max-bandwidth": 64u64 << 30 }))?;
        self.send_fd("moat-save", file)?;
        self.execute("migrate", serde_json::json!({ "uri": "fd:moat-save" }))?;
        let deadline = std::time::Instant::now() + SAVE_TIME;
        loop {
            if std::time::Instant::now() > deadline {
                let _ = self.execute("migrate_cancel", serde_json::Value::Null);
                return Err(io::Error::new(io::ErrorKind::TimedOut, "saving the machine took too long"));
            }
            let status = self.execute("query-migrate", serde_json::Value::Null)?;
            match status.get("status").and_then(|s| s.as_str()) {
                Some("completed") => return Ok(()),
                Some("failed" | "cancelled") => {
                    let why = status.get("error-desc").and_then(|d| d.as_str()).unwrap_or("no reason given");
                    return Err(io::Error::other(format!("saving the machine failed: {why}")));
                }
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }

    /// Loads a saved machine from descriptor `fd` into a QEMU started with
    /// `-incoming defer`, its RAM the file it was saved beside (see [`Qmp::save`]).
    pub fn load(&mut self, fd: i32) -> io::Result<()> {
        self.ignore_shared(true)?;
        self.execute("migrate-incoming", serde_json::json!({ "uri": format!("fd:{fd}") })).map(drop)
    }

    /// Whether saves and loads pass over RAM mapped shared from a file (both
    /// ends must agree: the stream's layout depends on it).
    fn ignore_shared(&mut self, on: bool) -> io::Result<()> {
        let capability = serde_json::json!({ "capability": "x-ignore-shared", "state": on });
        self.execute("migrate-set-capabilities", serde_json::json!({ "capabilities": [capability] })).map(drop)
    }

    /// Hands QEMU a descriptor by `name` (QMP `getfd`).
    fn send_fd(&mut self, name: &str, fd: &impl std::os::fd::AsRawFd) -> io::Result<()> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let mut text = serde_json::json!({ "execute": "getfd", "arguments": { "fdname": name } }).to_string();
        text.push('\n');
        let fds = [fd.as_raw_fd()];
        let sent = sendmsg::<()>(
            std::os::fd::AsRawFd::as_raw_fd(&self.writer),
            &[io::IoSlice::new(text.as_bytes())],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .map_err(io::Error::from)?;
        if sent != text.len() {
            return Err(io::Error::other("QMP took part of a request"));
        }
        self.answer("getfd").map(drop)
    }

    /// Reads until the answer to `command` (events are passed over, up to
    /// [`MAX_EVENTS`]: a QEMU the guest took over could send them forever).
    fn answer(&mut self, command: &str) -> io::Result<serde_json::Value> {
        for _ in 0..MAX_EVENTS {
            let answer = self.line()?;
            if let Some(value) = answer.get("return") {
                return Ok(value.clone());
            }
            if let Some(error) = answer.get("error") {
                let desc = error.get("desc").and_then(|d| d.as_str()).unwrap_or("unknown error");
                return Err(io::Error::other(format!("qmp {command}: {desc}")));
            }
            // An event: not the answer.
        }
        Err(io::Error::other(format!("qmp {command}: no answer among {MAX_EVENTS} events")))
    }

    fn line(&mut self) -> io::Result<serde_json::Value> {
        let mut buf = Vec::new();
        let n = (&mut self.reader).take(MAX_LINE as u64).read_until(b'\n', &mut buf)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "QMP closed"));
        }
        serde_json::from_slice(&buf).map_err(io::Error::other)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::string_slice, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn tcg_machines_are_told_the_tsc_rate_and_kvm_ones_are_not() {
        assert!(cmdline(Accel::Tcg, Some(2_400_000)).contains("tsc_early_khz=2400000"));
        assert!(!cmdline(Accel::Kvm, Some(2_400_000)).contains("tsc_early_khz"));
    }

    #[test]
    fn qemu_gets_no_vsock_socket() {
        use crate::bpf::test::run;
        use crate::bpf::{SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO};
        let prog = filter();
        let nr = |n: libc::c_long| n as u32;
        let refused = SECCOMP_RET_ERRNO | libc::EAFNOSUPPORT as u32;
        for family in [libc::AF_VSOCK, libc::AF_PACKET, libc::AF_ALG] {
            assert_eq!(run(&prog, nr(libc::SYS_socket), [family as u64, 1, 0, 0, 0, 0]), refused, "{family}");
            assert_eq!(run(&prog, nr(libc::SYS_socketpair), [family as u64, 1, 0, 0, 0, 0]), refused, "{family}");
        }
        assert_eq!(run(&prog, nr(libc::SYS_socket), [libc::AF_UNIX as u64, 1, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
        assert_eq!(run(&prog, nr(libc::SYS_read), [0; 6]), SECCOMP_RET_ALLOW);
    }

    #[test]
    fn qemu_cannot_allocate_past_a_files_end() {
        use crate::bpf::test::run;
        use crate::bpf::{SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO};
        let prog = filter();
        let fallocate = |mode: i32| run(&prog, libc::SYS_fallocate as u32, [9, mode as u64, 0, 1 << 40, 0, 0]);
        let refused = SECCOMP_RET_ERRNO | libc::EOPNOTSUPP as u32;
        for mode in [libc::FALLOC_FL_KEEP_SIZE, libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE] {
            assert_eq!(fallocate(mode), refused, "{mode:#x}");
        }
        for mode in [0, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, libc::FALLOC_FL_ZERO_RANGE] {
            assert_eq!(fallocate(mode), SECCOMP_RET_ALLOW, "{mode:#x}");
        }
        // Nor through io_uring, which no filter sees into.
        for nr in [libc::SYS_io_uring_setup, libc::SYS_io_uring_enter, libc::SYS_io_uring_register] {
            assert_eq!(run(&prog, nr as u32, [0; 6]), SECCOMP_RET_ERRNO | libc::ENOSYS as u32, "{nr}");
        }
    }

    #[test]
    fn a_machine_opens_nothing_by_a_path_of_the_host() {
        let m = MachineSpec {
            accel: Accel::Tcg,
            memory_mib: 256,
            cpus: 1,
            cmdline: cmdline(Accel::Tcg, None),
            mac: random_mac(),
            incoming: true,
            memory_file: true,
        };
        let args = args(&m);
        let joined = args.join(" ");
        assert!(joined.contains("-sandbox on,"), "{joined}");
        assert!(joined.contains("-nodefaults"));
        assert!(args.iter().all(|a| !a.contains("/var/") && !a.contains("/boot/")), "{joined}");
        assert!(joined.ends_with("-incoming defer"), "{joined}");
        let without = super::args(&MachineSpec { memory_file: false, ..m });
        assert!(without.join(" ").ends_with("-incoming fd:9"), "{joined}");
        assert!(joined.contains("mem-path=/proc/self/fd/11,share=on"), "{joined}");
    }
}
