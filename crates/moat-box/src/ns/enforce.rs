//! The privileged half of starting a box: applies a [`SpawnPlan`].
//!
//! It runs in a short-lived helper process (`moat box-spawn`), single-threaded
//! as `unshare`, `setns` and `fork` want, never inside the multithreaded daemon:
//!
//! 1. make the box's user namespace (through a throwaway child) and an idmapped
//!    clone of its root filesystem, so image files owned by uid 0 on disk belong
//!    to the box's root without a chown;
//! 2. join the box's cgroups, bind the agent's socket, open the agent binary;
//! 3. unshare mount, pid, net, uts, ipc and cgroup namespaces. They stay owned by
//!    the host's user namespace, so root in the box can change none of them (no
//!    mounts, no routes, no host name) even before seccomp;
//! 4. fork the box's PID 1, which mounts /proc, /sys, /dev and /run, pivots into
//!    the root, enters the user namespace as its root, drops capabilities, sets
//!    no_new_privs and seccomp, and execs moat-agent from the host's fd.
//!
//! The helper prints PID 1's host pid once the exec succeeded, or an error.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;

use nix::fcntl::OFlag;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::unistd::{fork, pipe2, ForkResult, Gid, Uid};

use super::plan::{SpawnPlan, AGENT_OOM_SCORE_ADJ, DEVICES, KEPT_CAPS, MASKED_PROC, MASKED_SYS};
use super::seccomp;
use crate::sys;

/// Adds what was being done to an error.
trait Context<T> {
    fn context(self, what: impl FnOnce() -> String) -> io::Result<T>;
}

impl<T, E: Into<io::Error>> Context<T> for Result<T, E> {
    fn context(self, what: impl FnOnce() -> String) -> io::Result<T> {
        self.map_err(|e| {
            let e: io::Error = e.into();
            io::Error::new(e.kind(), format!("{}: {e}", what()))
        })
    }
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Entry point of `moat box-spawn`: joins the cgroups in `join` (if any) and
/// says so on stdout, then reads a JSON plan on stdin and prints the pid.
pub fn helper_main(join: &[std::path::PathBuf]) -> i32 {
    if !join.is_empty() {
        let me = std::process::id().to_string();
        for procs in join {
            if let Err(e) = std::fs::write(procs, &me) {
                eprintln!("join {}: {e}", procs.display());
                return 1;
            }
        }
        // A spare makes the box's network now, off the path a user waits on.
        if let Err(e) =
            unshare(CloneFlags::CLONE_NEWNET).map_err(io::Error::from).and_then(|()| super::netns::prepare())
        {
            eprintln!("network namespace: {e}");
            return 1;
        }
        println!("{}", super::spare::READY);
    }
    let mut input = String::new();
    let plan: SpawnPlan = match io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| e.to_string())
        .and_then(|_| serde_json::from_str(&input).map_err(|e| format!("bad spawn plan: {e}")))
    {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    match spawn(&plan, !join.is_empty()) {
        Ok(pid) => {
            println!("{pid}");
            0
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

/// Starts the box (in the network namespace the caller made, if
/// `network_ready`); returns the host pid of its PID 1.
pub fn spawn(plan: &SpawnPlan, network_ready: bool) -> io::Result<i32> {
    let userns = sys::make_userns(&plan.id_map(), plan.uid_base).context(|| "user namespace".into())?;
    let tree =
        sys::open_tree_clone(&cpath(&plan.rootfs)?).context(|| format!("open_tree {}", plan.rootfs.display()))?;
    sys::mount_set_idmap(tree.as_fd(), userns.as_fd()).context(|| "idmapped mount".into())?;

    let me = std::process::id().to_string();
    for procs in &plan.cgroup_procs {
        std::fs::write(procs, &me).context(|| format!("join {}", procs.display()))?;
    }
    let _ = std::fs::remove_file(&plan.agent_socket);
    let listener =
        UnixListener::bind(&plan.agent_socket).context(|| format!("bind {}", plan.agent_socket.display()))?;
    std::fs::set_permissions(&plan.agent_socket, std::fs::Permissions::from_mode(0o600))?;
    let agent = File::open(&plan.agent_binary).context(|| format!("open agent {}", plan.agent_binary.display()))?;

    if !network_ready {
        // First, alone: preparing it runs tools, and the first child after
        // unsharing the pid namespace would become (and end) its PID 1.
        unshare(CloneFlags::CLONE_NEWNET).context(|| "unshare network".into())?;
        super::netns::prepare().context(|| "network namespace".into())?;
    }
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWPID
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWCGROUP,
    )
    .context(|| "unshare".into())?;
    nix::unistd::sethostname(&plan.hostname).context(|| "sethostname".into())?;
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .context(|| "make mounts private".into())?;
    sys::move_mount_to(tree.as_fd(), &cpath(&plan.rootfs)?).context(|| "attach root".into())?;

    let (err_read, err_write) = pipe2(OFlag::O_CLOEXEC)?;
    // SAFETY: the helper is single-threaded, so the child may do anything after fork.
    match unsafe { fork() }? {
        ForkResult::Child => {
            drop(err_read);
            let e = init_box(plan, &userns, listener, agent);
            let _ = File::from(err_write).write_all(e.to_string().as_bytes());
            std::process::exit(1);
        }
        ForkResult::Parent { child } => {
            drop(err_write);
            let mut msg = String::new();
            File::from(err_read).read_to_string(&mut msg)?;
            if msg.is_empty() {
                Ok(child.as_raw())
            } else {
                let _ = nix::sys::wait::waitpid(child, None);
                Err(io::Error::other(msg))
            }
        }
    }
}

/// Runs in the box's PID 1 until the exec; returns only on failure.
fn init_box(plan: &SpawnPlan, userns: &OwnedFd, listener: UnixListener, agent: File) -> io::Error {
    match init_box_inner(plan, userns, listener, agent) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

fn init_box_inner(
    plan: &SpawnPlan,
    userns: &OwnedFd,
    listener: UnixListener,
    agent: File,
) -> io::Result<std::convert::Infallible> {
    // The daemon reads the helper's stdout to its end: PID 1 must not hold it.
    let null = File::options().read(true).write(true).open("/dev/null")?;
    nix::unistd::dup2_stdin(&null)?;
    nix::unistd::dup2_stdout(&null)?;
    nix::unistd::dup2_stderr(&null)?;
    drop(null);
    // Leave the daemon's session: a box must not reach the operator's terminal.
    nix::unistd::setsid().context(|| "setsid".into())?;
    // Still host root here: only CAP_SYS_RESOURCE may lower the score, and a
    // host that withholds it (some sandboxes do) leaves the agent at 0; the
    // agent raises what it starts either way.
    let _ = std::fs::write("/proc/self/oom_score_adj", AGENT_OOM_SCORE_ADJ);
    if !plan.cpus.is_empty() {
        let mut set = nix::sched::CpuSet::new();
        for &cpu in &plan.cpus {
            set.set(cpu).context(|| format!("cpu {cpu}"))?;
        }
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).context(|| "cpu affinity".into())?;
    }
    std::env::set_current_dir(&plan.rootfs)?;
    mount_pseudo_filesystems(plan)?;

    nix::unistd::pivot_root(".", ".").context(|| "pivot_root".into())?;
    umount2(".", MntFlags::MNT_DETACH).context(|| "detach old root".into())?;
    std::env::set_current_dir("/")?;

    setns(userns, CloneFlags::CLONE_NEWUSER).context(|| "enter user namespace".into())?;
    nix::unistd::setgroups(&[]).context(|| "setgroups".into())?;
    nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0)).context(|| "setgid".into())?;
    nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).context(|| "setuid".into())?;
    drop_capabilities()?;

    // The agent finds its listening socket at fd 3; move the binary's fd clear of it.
    let agent = nix::fcntl::fcntl(&agent, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))?;
    sys::dup_onto(listener.as_fd(), 3)?;
    drop(listener);

    // The daemon runs with a raised descriptor limit; a box gets the usual one
    // (never above what it had: only the host's root may raise a hard limit).
    let nofile = nix::sys::resource::Resource::RLIMIT_NOFILE;
    let (_, hard) = nix::sys::resource::getrlimit(nofile).context(|| "read open-file limit".into())?;
    let hard = hard.min(65536);
    nix::sys::resource::setrlimit(nofile, hard.min(1024), hard).context(|| "limit open files".into())?;
    nix::sys::prctl::set_no_new_privs().context(|| "no_new_privs".into())?;
    let statfs = sys::install_seccomp_with_listener(&seccomp::filter()).context(|| "seccomp".into())?;
    // The agent answers the box's statfs calls on fd 4.
    sys::dup_onto(statfs.as_fd(), 4)?;
    let argv = [c"moat-agent"];
    // glibc's tunables, for the agent alone (what it runs gets an environment
    // of its own): the stacks of its ended session threads are unmapped, not
    // kept for reuse (up to 40 MiB of them), and its threads share one malloc
    // arena (they move bytes, they do not contend on malloc). A suspended box
    // is its agent: what it holds at rest is what a box costs (see
    // moat-agent's rest.rs).
    let envp = [
        c"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        c"GLIBC_TUNABLES=glibc.pthread.stack_cache_size=0:glibc.malloc.arena_max=1",
    ];
    // SAFETY: `agent` is a raw fd we own (from F_DUPFD_CLOEXEC); fexecve only reads it.
    let agent = unsafe { std::os::fd::BorrowedFd::borrow_raw(agent) };
    match nix::unistd::fexecve(agent, &argv, &envp) {
        Err(e) => Err(io::Error::from(e)).context(|| "exec moat-agent".into()),
    }
}

/// Mounts /proc, /sys, /dev and /run inside the root (the current directory).
fn mount_pseudo_filesystems(plan: &SpawnPlan) -> io::Result<()> {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    for dir in ["proc", "sys", "dev", "run"] {
        // The root may be a box's own work: refuse anything but a real directory
        // (a symlink would steer the mount elsewhere).
        if !Path::new(dir).symlink_metadata().map(|m| m.is_dir()).unwrap_or(false) {
            return Err(io::Error::other(format!("the box's /{dir} is not a directory")));
        }
    }
    mount(Some("proc"), "proc", Some("proc"), nosuid | MsFlags::MS_NOEXEC, None::<&str>)
        .context(|| "mount /proc".into())?;
    for entry in MASKED_PROC {
        let target = Path::new("proc").join(entry);
        if target.exists() {
            mount(Some("/dev/null"), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>)
                .context(|| format!("mask /proc/{entry}"))?;
        }
    }
    let read_only = nosuid | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY;
    match &plan.sys {
        // The host's own mount, never a path the box's files could steer.
        Some(shared) => bind(shared, "sys", read_only),
        None => mount(Some("sysfs"), "sys", Some("sysfs"), read_only, None::<&str>).map_err(io::Error::from),
    }
    .context(|| "mount /sys".into())?;
    // A tmpfs holds /dev, /dev/shm, /run and the empty directory that masks
    // parts of /sys, each a bind of a directory of it: the box's directory in
    // the tmpfs every box shares (see `boxtmp`), else one of its own on /dev.
    // Every superblock a box mounts gives every memory cgroup on the host one
    // more slot in its shrinker map (520 bytes per 64 superblocks, kernel 6.7
    // on), so a box's cost on a host of N boxes grows with N times its
    // superblocks: three (its proc, its devpts and the mqueue the kernel
    // mounts for its IPC namespace; /sys and this tmpfs are shared).
    let base = match &plan.tmp {
        Some(mine) => {
            // Its owner is root (the host's): the box never sees it whole.
            std::fs::create_dir(mine).context(|| format!("make {}", mine.display()))?;
            mine.clone()
        }
        None => {
            let owner = format!("uid={0},gid={0}", plan.uid_base);
            mount(Some("tmpfs"), "dev", Some("tmpfs"), MsFlags::empty(), Some(format!("mode=755,{owner}").as_str()))
                .context(|| "mount the box's tmpfs".into())?;
            std::path::PathBuf::from("dev")
        }
    };
    // A directory of `mode`, the box root's where `box_owned`.
    let dir = |path: &Path, mode: u32, box_owned: bool| -> io::Result<()> {
        std::fs::create_dir(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        if box_owned {
            let (uid, gid) = (Uid::from_raw(plan.uid_base), Gid::from_raw(plan.uid_base));
            nix::unistd::chown(path, Some(uid), Some(gid))?;
        }
        Ok(())
    };
    let (mask, run, dev) = (base.join(".mask"), base.join(".run"), base.join(".dev"));
    // The mask is root's (the host's): the box cannot write into it.
    dir(&mask, 0o555, false)?;
    dir(&run, 0o755, true)?;
    dir(&dev, 0o755, true)?;
    for dir in MASKED_SYS {
        let target = Path::new("sys").join(dir);
        if target.is_dir() {
            bind(&mask, &target, nosuid | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY)
                .context(|| format!("mask /sys/{dir}"))?;
        }
    }
    for (source, target) in &plan.binds {
        // Both ends are the host's own (the LXCFS mount, and the fresh /proc
        // and /sys just mounted), never a path the box's files could steer.
        super::hostview::retry_lost_lookups(|| {
            mount(Some(source.as_path()), target, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        })
        .context(|| format!("bind {}", target.display()))?;
    }
    bind(&run, "run", nosuid).context(|| "mount /run".into())?;
    // /dev last: it covers the box's own tmpfs's root (and the directories above).
    bind(&dev, "dev", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC).context(|| "mount /dev".into())?;
    for dev in DEVICES {
        let target = Path::new("dev").join(dev);
        File::create(&target)?;
        mount(Some(Path::new("/dev").join(dev).as_path()), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .context(|| format!("bind /dev/{dev}"))?;
    }
    std::fs::create_dir("dev/pts")?;
    // max=: pseudo-terminals come from one host-wide pool (kernel.pty.max); a
    // box that took them all would leave other boxes' `ssh -t` without one.
    let devpts = format!("newinstance,ptmxmode=0666,mode=0620,gid={},max={}", plan.devpts_gid, super::plan::MAX_PTYS);
    mount(Some("devpts"), "dev/pts", Some("devpts"), MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some(devpts.as_str()))
        .context(|| "mount /dev/pts".into())?;
    dir(Path::new("dev/shm"), 0o1777, true)?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, Path::new("dev").join(link))?;
    }
    Ok(())
}

/// Binds `source` onto `target` with `flags` (a bind takes its flags only
/// when remounted).
fn bind(source: impl AsRef<Path>, target: impl AsRef<Path>, flags: MsFlags) -> io::Result<()> {
    let source = source.as_ref();
    let target = target.as_ref();
    mount(Some(source), target, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    mount(None::<&str>, target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags, None::<&str>)?;
    Ok(())
}

/// Keeps only [`KEPT_CAPS`] in the bounding set; exec then grants root exactly those.
fn drop_capabilities() -> io::Result<()> {
    sys::drop_bounding_set(KEPT_CAPS).context(|| "drop capabilities".into())
}
