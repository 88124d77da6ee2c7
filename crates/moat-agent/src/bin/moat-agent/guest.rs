//! PID 1 of a microVM guest: the agent run as the initramfs's `/init`.
//!
//! It mounts the kernel's own filesystems, loads the modules the initramfs
//! carries (the virtio drivers), brings up its network, makes the first
//! virtio disk its root (with the host's files for it written in), says on
//! the console which virtio devices it found, what its disk holds and which
//! kernel it runs on; then it serves the agent protocol on the virtio-serial
//! port [`AGENT_PORT`] (streams multiplexed over it) until the host ends the
//! machine, or powers it off if there is no such port.
//!
//! [`AGENT_PORT`]: moat_agent::AGENT_PORT

use std::io::Write;
use std::os::unix::net::UnixStream;

use nix::mount::{mount, MsFlags};

/// Loads every module the initramfs carries, in the order of their names
/// (dependencies first); one that fails is said and skipped.
fn load_modules() {
    let mut files: Vec<_> = std::fs::read_dir(moat_agent::GUEST_MODULES_DIR)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    files.sort();
    for path in files {
        let loaded = match std::fs::File::open(&path) {
            Ok(f) => nix::kmod::finit_module(&f, c"", nix::kmod::ModuleInitFlags::empty()),
            Err(e) => {
                eprintln!("moat-agent: open {}: {e}", path.display());
                continue;
            }
        };
        match loaded {
            Ok(()) | Err(nix::Error::EEXIST) => {}
            Err(e) => eprintln!("moat-agent: load {}: {e}", path.display()),
        }
    }
}

/// How long the agent waits for its port to appear: the driver adds ports
/// from a work queue after the host's control messages, so the port can
/// come after the modules are loaded (a second or more under TCG).
const PORT_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// The device of the virtio-serial port named [`moat_agent::AGENT_PORT`],
/// once the driver has added it and the host has named it.
fn agent_port() -> Option<std::path::PathBuf> {
    let deadline = std::time::Instant::now() + PORT_WAIT;
    loop {
        let found = std::fs::read_dir("/sys/class/virtio-ports").ok().and_then(|ports| {
            ports.filter_map(Result::ok).find_map(|e| {
                let name = std::fs::read_to_string(e.path().join("name")).ok()?;
                let device = std::path::Path::new("/dev").join(e.file_name());
                (name.trim() == moat_agent::AGENT_PORT && device.exists()).then_some(device)
            })
        });
        if found.is_some() || std::time::Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Serves the streams the host opens over `port` until the link ends.
fn serve_port(port: &std::path::Path, serve: impl Fn(UnixStream) + Send + Sync + 'static) {
    let Ok(link) = std::fs::OpenOptions::new().read(true).write(true).open(port) else { return };
    let Ok(reader) = link.try_clone() else { return };
    let (tx, accepted) = std::sync::mpsc::channel();
    if moat_agent::mux::Mux::start(Box::new(reader), Box::new(link), Some(tx)).is_err() {
        return;
    }
    let serve = std::sync::Arc::new(serve);
    for stream in accepted {
        let serve = std::sync::Arc::clone(&serve);
        let _ = std::thread::Builder::new().spawn(move || serve(stream));
    }
}

/// Makes the first virtio disk (a box's root disk: the guest writes it, the
/// host never mounts it) the guest's root, if there is one; says what it
/// holds.
fn root_disk() -> Option<String> {
    if !std::path::Path::new("/dev/vda").exists() {
        return None;
    }
    let _ = std::fs::create_dir_all("/disk");
    if let Err(e) = mount(Some("/dev/vda"), "/disk", Some("ext4"), MsFlags::empty(), None::<&str>) {
        return Some(format!("not mounted ({e})"));
    }
    crate::host_files::put_tree(std::path::Path::new(moat_agent::GUEST_FILES_DIR), std::path::Path::new("/disk"));
    let entries = std::fs::read_dir("/disk").map(Iterator::count).unwrap_or(0);
    let shell = std::fs::symlink_metadata("/disk/bin/sh").is_ok();
    let switched = match switch_root("/disk") {
        Ok(()) => "the guest's root now".to_string(),
        Err(e) => format!("not made the root ({e})"),
    };
    let shell = if shell { "present" } else { "missing" };
    Some(format!("ext4, {entries} entries at its root, /bin/sh {shell}, {switched}"))
}

/// After a pause or as a copy of another guest: the host's time, and the
/// kernel's random number generator reseeded with the host's bytes (a copy
/// would otherwise produce its parent's numbers).
pub fn resumed(unix_ns: u64, entropy: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    /// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
    const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
    /// `RNDRESEEDCRNG`: `_IO('R', 0x07)`.
    const RNDRESEEDCRNG: libc::Ioctl = 0x5207;
    let now = nix::sys::time::TimeSpec::new((unix_ns / 1_000_000_000) as i64, (unix_ns % 1_000_000_000) as i64);
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, now)
        .map_err(|e| std::io::Error::other(format!("set the clock: {e}")))?;
    let words: Vec<u32> =
        entropy.chunks(4).map(|c| c.iter().fold(0u32, |w, b| (w << 8) | u32::from(*b))).take(64).collect();
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info: Vec<i32> = vec![(words.len() * 32) as i32, (words.len() * 4) as i32];
    info.extend(words.iter().map(|w| *w as i32));
    let random = std::fs::OpenOptions::new().write(true).open("/dev/urandom")?;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf_size bytes follow
    // its two ints, all in `info`, which lives across the call; RNDRESEEDCRNG
    // takes no argument.
    unsafe {
        if libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) < 0
            || libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) < 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// What a box's processes need mounted besides the kernel's own file
/// systems: terminals, shared memory, `/run` and `/tmp` in memory, and the
/// `/dev` links programs expect.
fn mount_box_filesystems() {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    for (source, target, fstype, flags, data) in [
        ("devpts", "/dev/pts", "devpts", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, "ptmxmode=0666,mode=0620,gid=5"),
        ("tmpfs", "/dev/shm", "tmpfs", nosuid, "mode=1777"),
        ("tmpfs", "/run", "tmpfs", nosuid, "mode=755"),
    ] {
        let _ = std::fs::create_dir_all(target);
        if let Err(e) = mount(Some(source), target, Some(fstype), flags, Some(data)) {
            eprintln!("moat-agent: mount {target}: {e}");
        }
    }
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(target, link);
    }
    if let Some(name) = crate::box_file::read_text("/etc/hostname") {
        let _ = nix::unistd::sethostname(name.trim());
    }
}

/// Makes `new` the root: the kernel's filesystems move into it, it moves
/// over `/`, and this process's root becomes it (the initramfs cannot be
/// pivoted away; what it held stays in memory, unreachable).
fn switch_root(new: &str) -> nix::Result<()> {
    for fs in ["/dev", "/proc", "/sys"] {
        let target = format!("{new}{fs}");
        let _ = std::fs::create_dir_all(&target);
        mount(Some(fs), target.as_str(), None::<&str>, MsFlags::MS_MOVE, None::<&str>)?;
    }
    nix::unistd::chdir(new)?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)?;
    nix::unistd::chroot(".")?;
    nix::unistd::chdir("/")
}

/// The virtio devices the kernel found, by kind (virtio device ids).
fn virtio_devices() -> Vec<String> {
    let mut kinds: Vec<String> = std::fs::read_dir("/sys/bus/virtio/devices")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("device")).ok())
        .map(|id| match u32::from_str_radix(id.trim().trim_start_matches("0x"), 16) {
            Ok(1) => "net".to_string(),
            Ok(2) => "block".to_string(),
            Ok(3) => "console".to_string(),
            Ok(4) => "rng".to_string(),
            Ok(5) => "balloon".to_string(),
            _ => format!("other({})", id.trim()),
        })
        .collect();
    kinds.sort();
    kinds
}

/// Runs the guest, serving each stream the host opens with `serve`; never
/// returns.
pub fn run(serve: impl Fn(UnixStream) + Send + Sync + 'static) -> ! {
    for (source, target, fstype) in
        [("proc", "/proc", "proc"), ("sysfs", "/sys", "sysfs"), ("devtmpfs", "/dev", "devtmpfs")]
    {
        let _ = std::fs::create_dir_all(target);
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
        if let Err(e) = mount(Some(source), target, Some(fstype), flags, None::<&str>) {
            eprintln!("moat-agent: mount {target}: {e}");
        }
    }
    load_modules();
    if let Err(e) = crate::guest_net::configure() {
        eprintln!("moat-agent: network: {e}");
    }
    let release = nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{} {}", moat_agent::GUEST_DEVICES, virtio_devices().join(" "));
    if let Some(disk) = root_disk() {
        let _ = writeln!(out, "{} {disk}", moat_agent::GUEST_DISK);
        mount_box_filesystems();
        crate::login::alias_root_as_host_name();
    }
    // Up means the host can talk to it: the port is found first.
    let port = agent_port();
    let _ = writeln!(out, "{} {release}", moat_agent::GUEST_UP);
    let _ = out.flush();
    match port {
        Some(port) => serve_port(&port, serve),
        None if !cmdline.split_whitespace().any(|w| w == moat_agent::PROBE_ARG) => {
            let _ = writeln!(out, "moat-agent: no {} port: nothing to serve", moat_agent::AGENT_PORT);
        }
        None => {}
    }
    let _ = out.flush();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    // Powering off does not return; if it did, PID 1 must not exit (a panic).
    loop {
        std::thread::park();
    }
}
