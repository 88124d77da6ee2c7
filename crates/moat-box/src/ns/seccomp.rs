//! The seccomp filter every box process runs under.
//!
//! A deny list compiled to classic BPF by hand: it is short enough to read whole.
//! It refuses what Docker's default profile refuses to a container without extra
//! capabilities (kernel modules, mounts, namespaces, keyrings, bpf, perf, clock
//! changes, reboot, ...), plus the new mount API, io_uring (whose operations
//! bypass seccomp) and terminal input injection. Syscalls newer than this list
//! answer ENOSYS, so a kernel upgrade cannot open a hole, and the x32 ABI, which
//! would let a process dodge syscall numbers, is refused outright.

use libc::sock_filter;

use crate::bpf::*;

/// Refused with EPERM, whatever the arguments.
const DENIED: &[libc::c_long] = &[
    libc::SYS_acct,
    libc::SYS_add_key,
    libc::SYS_bpf,
    libc::SYS_clock_settime,
    libc::SYS_settimeofday,
    libc::SYS_delete_module,
    libc::SYS_finit_module,
    libc::SYS_init_module,
    libc::SYS_ioperm,
    libc::SYS_iopl,
    libc::SYS_kcmp,
    // Takes a copy of another process's fd: box root could take the agent's
    // listening socket and answer later sessions itself.
    libc::SYS_pidfd_getfd,
    libc::SYS_kexec_file_load,
    libc::SYS_kexec_load,
    libc::SYS_keyctl,
    libc::SYS_request_key,
    libc::SYS_lookup_dcookie,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    libc::SYS_nfsservctl,
    libc::SYS_perf_event_open,
    libc::SYS_fanotify_init,
    libc::SYS_quotactl,
    libc::SYS_quotactl_fd,
    libc::SYS_reboot,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_sysfs,
    libc::SYS__sysctl,
    libc::SYS_syslog,
    libc::SYS_uselib,
    libc::SYS_userfaultfd,
    libc::SYS_ustat,
    libc::SYS_vhangup,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_mbind,
    libc::SYS_get_mempolicy,
    libc::SYS_memfd_secret,
    libc::SYS_set_mempolicy,
    libc::SYS_move_pages,
    libc::SYS_migrate_pages,
    libc::SYS_set_mempolicy_home_node,
    // Docker refuses these without CAP_SYS_ADMIN or CAP_SYS_PTRACE; the kernel
    // would refuse most of them here anyway, but the filter should say so.
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_process_madvise,
    LSM_GET_SELF_ATTR,
    LSM_SET_SELF_ATTR,
    LSM_LIST_MODULES,
    // Not implemented by the kernel; listed so the filter matches Docker's.
    CREATE_MODULE,
    GET_KERNEL_SYMS,
    QUERY_MODULE,
    libc::SYS_getpmsg,
    libc::SYS_putpmsg,
    libc::SYS_afs_syscall,
    libc::SYS_tuxcall,
    libc::SYS_security,
    libc::SYS_vserver,
];

// x86_64 numbers the libc crate no longer (or does not yet) name.
const CREATE_MODULE: libc::c_long = 174;
const GET_KERNEL_SYMS: libc::c_long = 177;
const QUERY_MODULE: libc::c_long = 178;
const LSM_GET_SELF_ATTR: libc::c_long = 459;
const LSM_SET_SELF_ATTR: libc::c_long = 460;
const LSM_LIST_MODULES: libc::c_long = 461;

/// `personality` values a box may set.
const ALLOWED_PERSONALITIES: [u32; 5] = [0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// `clone` flags that would make new namespaces.
const CLONE_NAMESPACE_FLAGS: u32 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWTIME) as u32;

/// The ioctl request numbers a box may not use.
fn denied_ioctls() -> Vec<u32> {
    let mut reqs = vec![libc::TIOCSTI as u32, libc::TIOCLINUX as u32];
    reqs.extend(crate::sys::BTRFS_SUBVOLUME_IOCTLS.iter().map(|r| *r as u32));
    reqs
}

/// Compiles the filter.
pub fn filter() -> Vec<sock_filter> {
    let mut prog = prologue();
    for nr in DENIED {
        if_syscall(&mut prog, *nr, &[ret_errno(libc::EPERM)]);
    }
    // clone3 passes its flags in memory, out of seccomp's sight: ENOSYS makes libc
    // fall back to clone, whose flags we can check.
    if_syscall(&mut prog, libc::SYS_clone3, &[ret_errno(libc::ENOSYS)]);
    if_syscall(
        &mut prog,
        libc::SYS_clone,
        &[
            stmt(BPF_LD_W_ABS, off_arg(0)),
            jump(BPF_JSET_K, CLONE_NAMESPACE_FLAGS, 0, 1),
            ret_errno(libc::EPERM),
            stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
        ],
    );
    // personality: only the values Docker allows (Linux, UNAME26, 32-bit
    // address space, and the query), not e.g. ADDR_NO_RANDOMIZE.
    if_syscall(&mut prog, libc::SYS_personality, &arg0_one_of(&ALLOWED_PERSONALITIES, libc::EPERM));
    // socket and socketpair: the family (an int) in the low half of arg 0.
    let block = crate::host::socket_rules();
    if_syscall(&mut prog, libc::SYS_socket, &block);
    if_syscall(&mut prog, libc::SYS_socketpair, &block);
    let ioctls = denied_ioctls();
    let mut block = vec![stmt(BPF_LD_W_ABS, off_arg(1))];
    for (i, req) in ioctls.iter().enumerate() {
        // Jump to the shared "deny" at the end of the block on a match.
        let to_deny = u8::try_from(ioctls.len() - i).unwrap_or(u8::MAX);
        block.push(jump(BPF_JEQ_K, *req, to_deny, 0));
    }
    block.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
    block.push(ret_errno(libc::EPERM));
    if_syscall(&mut prog, libc::SYS_ioctl, &block);
    // The box's PID 1 answers these for its own root: the box's disk limit and
    // use, not the pool's (see moat-agent's statfs.rs).
    for nr in [libc::SYS_statfs, libc::SYS_fstatfs] {
        if_syscall(&mut prog, nr, &[stmt(BPF_RET_K, libc::SECCOMP_RET_USER_NOTIF)]);
    }
    prog.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
    prog
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::test::run;

    const EPERM: u32 = SECCOMP_RET_ERRNO | libc::EPERM as u32;

    #[test]
    fn verdicts() {
        let prog = filter();
        let nr = |n: libc::c_long| n as u32;
        assert_eq!(run(&prog, nr(libc::SYS_read), [0; 6]), SECCOMP_RET_ALLOW);
        assert_eq!(run(&prog, nr(libc::SYS_mount), [0; 6]), EPERM);
        assert_eq!(run(&prog, nr(libc::SYS_init_module), [0; 6]), EPERM);
        // Docker's refusals without extra capabilities, and its allowances.
        for denied in [libc::SYS_sethostname, libc::SYS_process_madvise, LSM_SET_SELF_ATTR, CREATE_MODULE] {
            assert_eq!(run(&prog, nr(denied), [0; 6]), EPERM, "{denied}");
        }
        // statfs goes to the box's agent (its root's numbers are the box's).
        for call in [libc::SYS_statfs, libc::SYS_fstatfs] {
            assert_eq!(run(&prog, nr(call), [0; 6]), libc::SECCOMP_RET_USER_NOTIF);
        }
        for allowed in [libc::SYS_process_vm_readv, libc::SYS_clock_adjtime, libc::SYS_ptrace] {
            assert_eq!(run(&prog, nr(allowed), [0; 6]), SECCOMP_RET_ALLOW, "{allowed}");
        }
        assert_eq!(run(&prog, nr(libc::SYS_unshare), [0; 6]), EPERM);
        // fork-like clone is fine, namespace-making clone is not.
        assert_eq!(run(&prog, nr(libc::SYS_clone), [libc::SIGCHLD as u64, 0, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
        assert_eq!(
            run(&prog, nr(libc::SYS_clone), [(libc::CLONE_NEWUSER | libc::SIGCHLD) as u64, 0, 0, 0, 0, 0]),
            EPERM
        );
        assert_eq!(run(&prog, nr(libc::SYS_clone3), [0; 6]), SECCOMP_RET_ERRNO | libc::ENOSYS as u32);
        // ioctl: terminals work, injection does not.
        assert_eq!(run(&prog, nr(libc::SYS_ioctl), [0, libc::TIOCGWINSZ, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
        assert_eq!(run(&prog, nr(libc::SYS_ioctl), [0, libc::TIOCSTI, 0, 0, 0, 0]), EPERM);
        for req in crate::sys::BTRFS_SUBVOLUME_IOCTLS {
            assert_eq!(run(&prog, nr(libc::SYS_ioctl), [0, req, 0, 0, 0, 0]), EPERM);
        }
        // personality: the usual values pass, disabling ASLR does not.
        for ok in [0u64, 8, 0x20000, 0xffff_ffff] {
            assert_eq!(run(&prog, nr(libc::SYS_personality), [ok, 0, 0, 0, 0, 0]), SECCOMP_RET_ALLOW, "{ok:#x}");
        }
        assert_eq!(run(&prog, nr(libc::SYS_personality), [0x0040000, 0, 0, 0, 0, 0]), EPERM);
        // Sockets: only unix, inet, inet6 and netlink; never vsock or packet.
        for family in crate::host::ALLOWED_SOCKET_FAMILIES {
            for call in [libc::SYS_socket, libc::SYS_socketpair] {
                assert_eq!(run(&prog, nr(call), [u64::from(family), 1, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
            }
        }
        let eafnosupport = SECCOMP_RET_ERRNO | libc::EAFNOSUPPORT as u32;
        for family in [libc::AF_VSOCK, libc::AF_PACKET, libc::AF_BLUETOOTH, libc::AF_ALG, libc::AF_KEY] {
            assert_eq!(run(&prog, nr(libc::SYS_socket), [family as u64, 1, 0, 0, 0, 0]), eafnosupport, "{family}");
        }
        // Netlink: routes, socket lists, audit and generic; not uevents.
        let af_netlink = libc::AF_NETLINK as u64;
        for protocol in crate::host::ALLOWED_NETLINK {
            assert_eq!(
                run(&prog, nr(libc::SYS_socket), [af_netlink, 3, u64::from(protocol), 0, 0, 0]),
                SECCOMP_RET_ALLOW
            );
        }
        let eprotonosupport = SECCOMP_RET_ERRNO | libc::EPROTONOSUPPORT as u32;
        for protocol in [libc::NETLINK_KOBJECT_UEVENT, libc::NETLINK_CONNECTOR, libc::NETLINK_NETFILTER] {
            let call = [af_netlink, 3, protocol as u64, 0, 0, 0];
            assert_eq!(run(&prog, nr(libc::SYS_socket), call), eprotonosupport, "{protocol}");
        }
        assert_eq!(run(&prog, nr(libc::SYS_pidfd_getfd), [0; 6]), EPERM);
        // x32 numbers and syscalls newer than the list.
        assert_eq!(run(&prog, X32_SYSCALL_BIT | 1, [0; 6]), EPERM);
        assert_eq!(run(&prog, LAST_KNOWN_SYSCALL + 5, [0; 6]), SECCOMP_RET_ERRNO | libc::ENOSYS as u32);
        assert!(prog.len() < 4096);
    }
}
