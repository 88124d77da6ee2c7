//! Classic BPF for seccomp, written by hand: the few instructions moat's
//! filters need, and (in tests) an interpreter to check their verdicts
//! without installing them.

use libc::sock_filter;

/// `AUDIT_ARCH_X86_64` (linux/audit.h).
pub const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// Bit that marks x32 syscall numbers.
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// The newest syscall this list was written against (mseal, Linux 6.10).
pub const LAST_KNOWN_SYSCALL: u32 = 462;

/// Let the call run.
pub const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
/// Fail the call with the errno in the low 16 bits.
pub const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
/// Kill the whole process.
pub const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;

/// Offset of the syscall number.
pub const OFF_NR: u32 = 0;
/// Offset of the audit architecture.
pub const OFF_ARCH: u32 = 4;
/// Low 32 bits of argument `i` (little-endian).
pub const fn off_arg(i: u32) -> u32 {
    16 + 8 * i
}

/// Load a word of `seccomp_data` into the accumulator.
pub const BPF_LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
/// Jump if the accumulator equals k.
pub const BPF_JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
/// Jump if the accumulator is at least k.
pub const BPF_JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
/// Jump if the accumulator has any bit of k.
pub const BPF_JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
/// Return k.
pub const BPF_RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

/// An instruction without jumps.
pub fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter { code, jt: 0, jf: 0, k }
}

/// A conditional jump: `jt` instructions ahead if taken, `jf` if not.
pub fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// Return "fail with `errno`".
pub fn ret_errno(errno: i32) -> sock_filter {
    stmt(BPF_RET_K, SECCOMP_RET_ERRNO | (errno as u32 & 0xffff))
}

/// Appends "if nr == `nr` { `block` }"; `block` must end in a return.
pub fn if_syscall(prog: &mut Vec<sock_filter>, nr: libc::c_long, block: &[sock_filter]) {
    // Blocks here are a handful of instructions, far below the 255-jump limit.
    let skip = u8::try_from(block.len()).unwrap_or(u8::MAX);
    prog.push(jump(BPF_JEQ_K, nr as u32, 0, skip));
    prog.extend_from_slice(block);
}

/// A block that allows the call when the low half of its first argument is
/// one of `allowed`, and fails it with `errno` otherwise.
pub fn arg0_one_of(allowed: &[u32], errno: i32) -> Vec<sock_filter> {
    arg_one_of(0, allowed, errno)
}

/// A block that allows the call when the low half of argument `arg` is one
/// of `allowed`, and fails it with `errno` otherwise.
pub fn arg_one_of(arg: u32, allowed: &[u32], errno: i32) -> Vec<sock_filter> {
    let mut block = vec![stmt(BPF_LD_W_ABS, off_arg(arg))];
    for (i, value) in allowed.iter().enumerate() {
        let to_allow = u8::try_from(allowed.len() - i).unwrap_or(u8::MAX);
        block.push(jump(BPF_JEQ_K, *value, to_allow, 0));
    }
    block.push(ret_errno(errno));
    block.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
    block
}

/// The start of every filter: anything but native x86-64 is killed, x32
/// numbers are refused, and syscalls newer than moat knows answer ENOSYS.
pub fn prologue() -> Vec<sock_filter> {
    vec![
        stmt(BPF_LD_W_ABS, OFF_ARCH),
        jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, OFF_NR),
        jump(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
        ret_errno(libc::EPERM),
        jump(BPF_JGE_K, LAST_KNOWN_SYSCALL + 1, 0, 1),
        ret_errno(libc::ENOSYS),
    ]
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
/// Test helpers.
pub mod test {
    use super::*;

    /// A classic-BPF interpreter for the instructions these programs use, so the
    /// program's verdicts can be checked without installing it.
    pub fn run(prog: &[sock_filter], nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&AUDIT_ARCH_X86_64.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let ins = prog[pc];
            match ins.code {
                BPF_LD_W_ABS => {
                    let k = ins.k as usize;
                    acc = u32::from_le_bytes(data[k..k + 4].try_into().unwrap());
                    pc += 1;
                }
                BPF_RET_K => return ins.k,
                code => {
                    let taken = match code {
                        BPF_JEQ_K => acc == ins.k,
                        BPF_JGE_K => acc >= ins.k,
                        BPF_JSET_K => acc & ins.k != 0,
                        other => panic!("unexpected opcode {other:#x}"),
                    };
                    pc += 1 + usize::from(if taken { ins.jt } else { ins.jf });
                }
            }
        }
    }
}
