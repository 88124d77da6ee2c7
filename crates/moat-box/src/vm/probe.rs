//! Boots a guest to learn what runs one here: the distribution's kernel and an
//! initramfs whose `/init` is moat-agent, on QEMU's `microvm` machine, first
//! with KVM, then with TCG. The agent says which kernel it runs on and powers
//! the machine off; a guest that says nothing in time is killed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::vm::initramfs::initramfs;
use crate::vm::Accel;

/// A guest that booted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booted {
    /// From starting QEMU to the agent saying it is up.
    pub took: Duration,
    /// The guest kernel's release, as the guest saw it.
    pub release: String,
    /// The virtio devices the guest found, by kind.
    pub devices: Vec<String>,
    /// What the guest found on its disk, if it was given one.
    pub disk: Option<String>,
    /// How long a ping took, through a new stream over the agent's
    /// virtio-serial port, once the guest was up (`None`: no answer).
    pub answered: Option<Duration>,
    /// What `uname -r` printed, run by the agent from the guest's disk
    /// (`None`: no disk, or no answer).
    pub uname: Option<String>,
}

/// Why a guest did not boot.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// No kernel to boot.
    #[error("no guest kernel in /boot (apt-get install linux-image-cloud-amd64)")]
    NoKernel,
    /// QEMU could not be started.
    #[error("qemu-system-x86_64: {0} (apt-get install qemu-system-x86)")]
    NoQemu(std::io::Error),
    /// The guest said nothing in time.
    #[error("no first line from the guest in {0:?} (it hangs)")]
    Hung(Duration),
    /// QEMU ended without the guest saying it was up.
    #[error("qemu ended before the guest was up: {0}")]
    Ended(String),
    /// A file could not be written.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The distribution kernel a guest boots by default: the newest
/// `/boot/vmlinuz-*-cloud-amd64` (Debian's, with virtio drivers as modules),
/// else the newest `/boot/vmlinuz-*`.
pub fn distribution_kernel() -> Option<PathBuf> {
    let mut kernels: Vec<PathBuf> = std::fs::read_dir("/boot")
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("vmlinuz-")))
        .collect();
    kernels.sort();
    let cloud = kernels.iter().rev().find(|p| p.to_string_lossy().ends_with("-cloud-amd64")).cloned();
    cloud.or_else(|| kernels.last().cloned())
}

/// The host's TSC frequency in kHz, which a TCG guest must be told
/// (`tsc_early_khz`): calibrating it under TCG hangs a share of boots.
pub fn host_tsc_khz() -> Option<u64> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = cpuinfo.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse().ok()?;
    Some((mhz * 1000.0).round() as u64)
}

/// The kernel release of a `vmlinuz-RELEASE` file.
pub fn kernel_release(kernel: &Path) -> Option<String> {
    kernel.file_name()?.to_str()?.strip_prefix("vmlinuz-").map(str::to_string)
}

/// What a probe boots.
#[derive(Debug, Clone, Copy)]
pub struct Guest<'a> {
    /// The kernel (`vmlinuz-RELEASE`; its modules from /lib/modules/RELEASE).
    pub kernel: &'a Path,
    /// The static agent, the initramfs's `/init`.
    pub agent: &'a Path,
    /// A raw disk the guest may write (a throwaway copy), attached as the
    /// first virtio disk: the guest runs on it as its root.
    pub disk: Option<&'a Path>,
    /// Guest memory.
    pub memory_mib: u64,
    /// Booted as a box is, when set: this unpacked `kernel` (see
    /// [`super::vmlinux`]), moat's boot options on its command line, and a
    /// box's network and balloon devices.
    pub as_box: Option<&'a Path>,
}

/// Boots `guest` under `accel`, with an entropy device and a serial
/// controller attached, and waits up to `timeout` for it to say it is up.
pub fn boot(guest: Guest<'_>, accel: Accel, timeout: Duration) -> Result<Booted, ProbeError> {
    let release = kernel_release(guest.kernel).ok_or(ProbeError::NoKernel)?;
    let initramfs = std::env::temp_dir().join(format!("moat-probe-{}.cpio", std::process::id()));
    std::fs::write(&initramfs, initramfs_bytes(guest.agent, &release)?)?;
    let result = run(guest, &initramfs, accel, timeout);
    let _ = std::fs::remove_file(&initramfs);
    result
}

/// Talks to the guest's agent through streams over its port (QEMU's end of
/// it is the unix socket `port`): how long a ping took, and (with a disk to
/// run programs from) what `uname -r` printed.
fn talk(port: &Path, has_disk: bool, timeout: Duration) -> (Option<Duration>, Option<String>) {
    use moat_agent::protocol::{ExecRequest, HostMsg, Run};
    let Some(mux) = std::os::unix::net::UnixStream::connect(port).ok().and_then(|link| {
        let reader = link.try_clone().ok()?;
        moat_agent::mux::Mux::start(Box::new(reader), Box::new(link), None).ok()
    }) else {
        return (None, None);
    };
    let started = Instant::now();
    let pong = exchange(&mux, &HostMsg::Ping, timeout);
    let answered = pong.filter(|(_, done)| *done).map(|_| started.elapsed());
    let uname = has_disk
        .then(|| {
            let exec = ExecRequest { run: Run::Command(b"uname -r".to_vec()), env: Vec::new(), pty: None };
            exchange(&mux, &HostMsg::Exec(exec), timeout)
        })
        .flatten()
        .filter(|(_, exited)| *exited)
        .map(|(out, _)| out.trim().to_string());
    (answered, uname)
}

/// Sends `request` on a new stream and reads the answers until `Pong` or
/// `Exit`: (the stdout it carried, whether it ended so).
fn exchange(
    mux: &moat_agent::mux::Mux,
    request: &moat_agent::protocol::HostMsg,
    timeout: Duration,
) -> Option<(String, bool)> {
    use moat_agent::protocol::AgentMsg;
    use std::io::{Read, Write};
    let mut stream = mux.open().ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.write_all(&request.encode()).ok()?;
    let (mut buf, mut out) = (Vec::new(), Vec::new());
    let mut chunk = [0u8; 4096];
    loop {
        while let Ok(Some((msg, used))) = AgentMsg::decode(&buf) {
            buf.drain(..used);
            match msg {
                AgentMsg::Pong | AgentMsg::Exit(_) => return Some((String::from_utf8_lossy(&out).into_owned(), true)),
                AgentMsg::Stdout(data) if out.len() < 4096 => out.extend_from_slice(&data),
                _ => {}
            }
        }
        let n = stream.read(&mut chunk).ok().filter(|n| *n > 0)?;
        if buf.len() > 1 << 20 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn initramfs_bytes(agent: &Path, release: &str) -> std::io::Result<Vec<u8>> {
    initramfs(&std::fs::read(agent)?, Path::new("/lib/modules"), release)
}

fn run(guest: Guest<'_>, initramfs: &Path, accel: Accel, timeout: Duration) -> Result<Booted, ProbeError> {
    let mut append = format!("console=ttyS0 quiet panic=-1 {}", moat_agent::PROBE_ARG);
    if guest.as_box.is_some() {
        append = format!("{append} {}", super::qemu::BOOT_OPTIONS);
    }
    if accel == Accel::Tcg {
        if let Some(khz) = host_tsc_khz() {
            append.push_str(&format!(" tsc_early_khz={khz}"));
        }
    }
    let port = initramfs.with_extension("sock");
    let _ = std::fs::remove_file(&port);
    let started = Instant::now();
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(["-M", "microvm", "-accel", accel.as_str(), "-m", &guest.memory_mib.to_string(), "-smp", "1"])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-serial", "stdio"])
        .args(["-device", "virtio-rng-device", "-device", "virtio-serial-device"])
        .args(["-chardev", &format!("socket,id=agent,path={},server=on,wait=off", port.display())])
        .args(["-device", &format!("virtserialport,chardev=agent,name={}", moat_agent::AGENT_PORT)])
        .arg("-kernel")
        .arg(guest.as_box.unwrap_or(guest.kernel))
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", &append]);
    if guest.as_box.is_some() {
        // A box's other devices: its balloon, and a network device (ending
        // on an empty hub here: a box's ends in its namespace).
        qemu.args(["-device", super::qemu::BALLOON]).args([
            "-netdev",
            "hubport,id=net,hubid=0",
            "-device",
            "virtio-net-device,netdev=net",
        ]);
    }
    if let Some(disk) = guest.disk {
        let mut drive = std::ffi::OsString::from("if=none,id=root,format=raw,file=");
        drive.push(disk);
        qemu.arg("-drive").arg(drive).args(["-device", "virtio-blk-device,drive=root"]);
    }
    // A daemon killed while it probes takes its QEMU with it (a guest that
    // hangs at boot would keep it for good).
    crate::sys::die_with_parent(&mut qemu);
    let mut child =
        qemu.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(ProbeError::NoQemu)?;
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take();
    std::thread::spawn(move || {
        let Some(stdout) = stdout else { return };
        let (mut devices, mut disk) = (Vec::new(), None);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let line = line.trim();
            if let Some(found) = line.strip_prefix(moat_agent::GUEST_DEVICES) {
                devices = found.split_whitespace().map(str::to_string).collect();
            }
            if let Some(found) = line.strip_prefix(moat_agent::GUEST_DISK) {
                disk = Some(found.trim().to_string());
            }
            if let Some(release) = line.strip_prefix(moat_agent::GUEST_UP) {
                let took = started.elapsed();
                let release = release.trim().to_string();
                let booted = Booted { took, release, devices, disk, answered: None, uname: None };
                let _ = tx.send(Some(booted));
                return;
            }
        }
        let _ = tx.send(None);
    });
    let outcome = rx.recv_timeout(timeout);
    let (answered, uname) = match &outcome {
        Ok(Some(booted)) => talk(&port, booted.disk.is_some(), timeout),
        _ => (None, None),
    };
    let _ = child.kill();
    let output = child.wait_with_output();
    let _ = std::fs::remove_file(&port);
    match outcome {
        Ok(Some(booted)) => Ok(Booted { answered, uname, ..booted }),
        Ok(None) => {
            let stderr = output.map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string()).unwrap_or_default();
            Err(ProbeError::Ended(stderr))
        }
        Err(_) => Err(ProbeError::Hung(timeout)),
    }
}
