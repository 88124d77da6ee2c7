//! PID 1 of a microVM guest: the agent run as the initramfs's `/init`.
//!
//! So far it proves that a guest boots: it mounts the kernel's own
//! filesystems, says on the console which kernel it runs on, and powers the
//! machine off. Mounting the box's root disk and serving the host over
//! virtio-serial come with the microVM backend (issue 12).

use std::io::Write;

use nix::mount::{mount, MsFlags};

/// Runs the guest; never returns (the machine powers off).
pub fn run() -> ! {
    for (source, target, fstype) in
        [("proc", "/proc", "proc"), ("sysfs", "/sys", "sysfs"), ("devtmpfs", "/dev", "devtmpfs")]
    {
        let _ = std::fs::create_dir_all(target);
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
        if let Err(e) = mount(Some(source), target, Some(fstype), flags, None::<&str>) {
            eprintln!("moat-agent: mount {target}: {e}");
        }
    }
    let release = nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{} {release}", moat_agent::GUEST_UP);
    if !cmdline.split_whitespace().any(|w| w == moat_agent::PROBE_ARG) {
        let _ = writeln!(out, "moat-agent: this guest serves nothing yet (the microVM backend is not built)");
    }
    let _ = out.flush();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    // Powering off does not return; if it did, PID 1 must not exit (a panic).
    loop {
        std::thread::park();
    }
}
