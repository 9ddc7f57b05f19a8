//! The steady state's seccomp filter: a classic BPF program that lets through only the system
//! calls the daemon makes once its data path is attached (the runtime, sockets, epoll, splice,
//! `bpf(2)` on its own maps, files it reads), and fails every other one with `EPERM` instead of
//! killing the process, so a call this list missed is an error with a message, not a dead
//! daemon. Signals go only to the daemon's own threads (`tgkill` with its own pid); `ioctl`
//! takes only the requests the daemon makes (so no `TIOCSTI` into a terminal); `clone`
//! may start threads but no namespace; `clone3` answers `ENOSYS`, which makes the C library
//! fall back to `clone`, whose flags the filter can read. Built for x86_64 and aarch64;
//! [`Arch::native`] is `None` elsewhere.

pub use super::syscalls::allowed;

/// The instructions of classic BPF that the filter uses (linux/filter.h).
const LD_W_ABS: u16 = 0x20;
const JEQ_K: u16 = 0x15;
const JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;

/// Offsets in `struct seccomp_data` (linux/seccomp.h): the call's number, the audit
/// architecture, the low 32 bits of the first argument (both architectures are little-endian).
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG0_LOW: u32 = 16;
const ARG1_LOW: u32 = 24;

/// The `ioctl(2)` requests the daemon makes: non-blocking and close-on-exec switches, the
/// queue sizes the proxy reads (`SIOCINQ`, `SIOCOUTQ`), and whether stderr is a terminal.
/// Nothing else: `TIOCSTI` especially would type into the terminal the daemon was started from.
const IOCTLS: [u32; 6] = [
    libc::FIONBIO as u32,
    libc::FIOCLEX as u32,
    libc::FIONCLEX as u32,
    libc::FIONREAD as u32,
    libc::TIOCOUTQ as u32,
    libc::TCGETS as u32,
];

/// Actions (linux/seccomp.h); the low 16 bits of `RET_ERRNO` are the errno.
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_ERRNO: u32 = 0x0005_0000;

/// The namespace flags of `clone(2)`: a thread never needs one. `CLONE_NEWUSER` especially
/// would give an unprivileged process a full set of capabilities in a namespace of its own.
const CLONE_NAMESPACES: u32 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u32;

/// A system call architecture the filter is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// `AUDIT_ARCH_*` (linux/audit.h), what `seccomp_data.arch` holds.
    pub audit: u32,
    /// Its name, for the log.
    pub name: &'static str,
    /// x86_64's x32 calls carry this bit in their number; they are refused.
    x32_bit: Option<u32>,
}

impl Arch {
    /// The architecture this daemon is built for, if the filter knows its call numbers.
    pub fn native() -> Option<Self> {
        if cfg!(target_arch = "x86_64") {
            Some(Self {
                audit: 0xc000_003e,
                name: "x86_64",
                x32_bit: Some(0x4000_0000),
            })
        } else if cfg!(target_arch = "aarch64") {
            Some(Self {
                audit: 0xc000_00b7,
                name: "aarch64",
                x32_bit: None,
            })
        } else {
            None
        }
    }
}

/// Where a conditional jump goes.
#[derive(Clone, Copy, Debug)]
enum To {
    Next,
    Allow,
    Deny,
    Errno(u16),
    /// Over this many instructions.
    Skip(u8),
}

/// One instruction, its jumps not yet resolved to offsets.
#[derive(Clone, Copy, Debug)]
struct Insn {
    code: u16,
    k: u32,
    jt: To,
    jf: To,
}

const fn load(offset: u32) -> Insn {
    Insn {
        code: LD_W_ABS,
        k: offset,
        jt: To::Next,
        jf: To::Next,
    }
}

const fn jeq(k: u32, jt: To, jf: To) -> Insn {
    Insn {
        code: JEQ_K,
        k,
        jt,
        jf,
    }
}

/// Why a filter could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// Classic BPF jumps at most 255 instructions forward.
    #[error("the seccomp filter allows too many calls: a jump of {0} instructions does not fit")]
    TooLong(usize),
}

/// The filter for `arch`, letting `allowed` through and `tgkill` only to process `pid` (the
/// daemon's own).
pub fn program(
    arch: Arch,
    allowed: &[libc::c_long],
    pid: u32,
) -> Result<Vec<libc::sock_filter>, FilterError> {
    let mut body = vec![load(ARCH), jeq(arch.audit, To::Next, To::Deny), load(NR)];
    if let Some(bit) = arch.x32_bit {
        body.push(Insn {
            code: JSET_K,
            k: bit,
            jt: To::Deny,
            jf: To::Next,
        });
    }
    body.push(jeq(
        nr(libc::SYS_clone3),
        To::Errno(libc::ENOSYS as u16),
        To::Next,
    ));
    body.extend(
        allowed
            .iter()
            .map(|&call| jeq(nr(call), To::Allow, To::Next)),
    );
    // `ioctl`: only the requests listed.
    body.extend([
        jeq(
            nr(libc::SYS_ioctl),
            To::Next,
            To::Skip(IOCTLS.len() as u8 + 1),
        ),
        load(ARG1_LOW),
    ]);
    body.extend(IOCTLS.iter().enumerate().map(|(i, &request)| {
        let last = i + 1 == IOCTLS.len();
        jeq(request, To::Allow, if last { To::Deny } else { To::Next })
    }));
    // `clone`: threads, never a namespace. Its first argument is the flags on both
    // architectures.
    body.extend([
        jeq(nr(libc::SYS_clone), To::Next, To::Skip(2)),
        load(ARG0_LOW),
        Insn {
            code: JSET_K,
            k: CLONE_NAMESPACES,
            jt: To::Deny,
            jf: To::Allow,
        },
    ]);
    // Anything else but `tgkill` to this process is refused.
    body.extend([
        load(NR),
        jeq(nr(libc::SYS_tgkill), To::Next, To::Deny),
        load(ARG0_LOW),
        jeq(pid, To::Allow, To::Deny),
    ]);
    resolve(&body)
}

/// A call number as the filter compares it (every number fits in 32 bits).
fn nr(call: libc::c_long) -> u32 {
    u32::try_from(call).unwrap_or(u32::MAX)
}

/// Lays out `body`, then the return instructions its jumps go to: allow, deny (`EPERM`), and
/// one per other errno.
fn resolve(body: &[Insn]) -> Result<Vec<libc::sock_filter>, FilterError> {
    let mut errnos: Vec<u16> = body
        .iter()
        .flat_map(|i| [i.jt, i.jf])
        .filter_map(|t| match t {
            To::Errno(e) => Some(e),
            _ => None,
        })
        .collect();
    errnos.sort_unstable();
    errnos.dedup();
    let allow = body.len();
    let deny = allow + 1;
    let target = |at: usize, to: To| -> Result<u8, FilterError> {
        let index = match to {
            To::Next => at + 1,
            To::Allow => allow,
            To::Deny => deny,
            To::Skip(n) => at + 1 + usize::from(n),
            To::Errno(e) => deny + 1 + errnos.iter().position(|&x| x == e).unwrap_or(0),
        };
        let offset = index - at - 1;
        u8::try_from(offset).map_err(|_| FilterError::TooLong(offset))
    };
    let mut out = Vec::with_capacity(body.len() + 2 + errnos.len());
    for (at, insn) in body.iter().enumerate() {
        out.push(libc::sock_filter {
            code: insn.code,
            jt: target(at, insn.jt)?,
            jf: target(at, insn.jf)?,
            k: insn.k,
        });
    }
    let ret = |k| libc::sock_filter {
        code: RET_K,
        jt: 0,
        jf: 0,
        k,
    };
    out.push(ret(RET_ALLOW));
    out.push(ret(RET_ERRNO | libc::EPERM as u32));
    out.extend(errnos.iter().map(|&e| ret(RET_ERRNO | u32::from(e))));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PID: u32 = 4242;

    /// Runs `prog` as the kernel would for one call: the verdict (bounded: every jump goes
    /// forward, so at most one step per instruction).
    fn verdict(prog: &[libc::sock_filter], arch: u32, call: libc::c_long, args: [u64; 2]) -> u32 {
        let [arg0, arg1] = args;
        let (mut acc, mut pc) = (0u32, 0usize);
        for _ in 0..prog.len() {
            let insn = prog[pc];
            let jump = |taken: bool| 1 + usize::from(if taken { insn.jt } else { insn.jf });
            match insn.code {
                LD_W_ABS => {
                    acc = match insn.k {
                        NR => nr(call),
                        ARCH => arch,
                        ARG0_LOW => u32::try_from(arg0 & 0xffff_ffff).unwrap(),
                        ARG1_LOW => u32::try_from(arg1 & 0xffff_ffff).unwrap(),
                        other => panic!("load of offset {other}"),
                    };
                    pc += 1;
                }
                JEQ_K => pc += jump(acc == insn.k),
                JSET_K => pc += jump(acc & insn.k != 0),
                RET_K => return insn.k,
                other => panic!("instruction {other:#x}"),
            }
        }
        panic!("the program ran off its end");
    }

    fn filter() -> (Arch, Vec<libc::sock_filter>) {
        let arch = Arch::native().expect("built on x86_64 or aarch64");
        (arch, program(arch, &allowed(), PID).expect("builds"))
    }

    const EPERM: u32 = RET_ERRNO | libc::EPERM as u32;

    #[test]
    fn the_allowed_calls_pass_and_others_fail_with_eperm() {
        let (arch, prog) = filter();
        for call in allowed() {
            assert_eq!(
                verdict(&prog, arch.audit, call, [0, 0]),
                RET_ALLOW,
                "call {call}"
            );
        }
        for call in [
            libc::SYS_kill,
            libc::SYS_tkill,
            libc::SYS_execve,
            libc::SYS_ptrace,
            libc::SYS_setuid,
            libc::SYS_setresuid,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_mount,
            libc::SYS_process_vm_writev,
            libc::SYS_perf_event_open,
        ] {
            assert_eq!(
                verdict(&prog, arch.audit, call, [0, 0]),
                EPERM,
                "call {call}"
            );
        }
    }

    #[test]
    fn another_architecture_or_x32_is_refused() {
        let (arch, prog) = filter();
        assert_eq!(verdict(&prog, 0x4000_0003, libc::SYS_read, [0, 0]), EPERM);
        if let Some(bit) = arch.x32_bit {
            let x32 = libc::SYS_read | libc::c_long::from(bit);
            assert_eq!(verdict(&prog, arch.audit, x32, [0, 0]), EPERM);
        }
    }

    #[test]
    fn threads_yes_namespaces_no_and_signals_only_to_itself() {
        let (arch, prog) = filter();
        let thread = (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64;
        let run = |call, arg0| verdict(&prog, arch.audit, call, [arg0, 0]);
        assert_eq!(run(libc::SYS_clone, thread), RET_ALLOW);
        let userns = thread | libc::CLONE_NEWUSER as u64;
        assert_eq!(run(libc::SYS_clone, userns), EPERM);
        assert_eq!(run(libc::SYS_clone, libc::CLONE_NEWNET as u64), EPERM);
        assert_eq!(
            run(libc::SYS_clone3, 0),
            RET_ERRNO | libc::ENOSYS as u32,
            "clone3's flags are out of the filter's reach: the C library falls back to clone"
        );
        assert_eq!(run(libc::SYS_tgkill, u64::from(PID)), RET_ALLOW);
        assert_eq!(run(libc::SYS_tgkill, 1), EPERM);
        assert_eq!(run(libc::SYS_tgkill, (1 << 32) | 1), EPERM);
    }

    #[test]
    fn ioctl_takes_the_listed_requests_only() {
        let (arch, prog) = filter();
        let ioctl = |request: u64| verdict(&prog, arch.audit, libc::SYS_ioctl, [2, request]);
        for request in IOCTLS {
            assert_eq!(ioctl(u64::from(request)), RET_ALLOW, "{request:#x}");
        }
        assert_eq!(ioctl(libc::TIOCSTI), EPERM);
        assert_eq!(ioctl(libc::TIOCSCTTY), EPERM);
    }

    #[test]
    fn the_list_is_unique_and_leaves_the_checked_calls_to_the_program() {
        let mut calls = allowed();
        let n = calls.len();
        assert_eq!(
            calls[..super::super::syscalls::HOT.len()],
            *super::super::syscalls::HOT,
            "the hot calls come first"
        );
        calls.sort_unstable();
        calls.dedup();
        assert_eq!(calls.len(), n, "a call listed twice");
        for special in [
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_tgkill,
            libc::SYS_ioctl,
        ] {
            assert!(
                !calls.contains(&special),
                "{special} is checked by the program"
            );
        }
    }

    #[test]
    fn a_list_too_long_for_a_jump_is_an_error() {
        let arch = Arch::native().unwrap();
        let many: Vec<libc::c_long> = (1000..1300).collect();
        let err = program(arch, &many, PID).unwrap_err();
        assert!(err.to_string().contains("too many calls"), "{err}");
    }
}
