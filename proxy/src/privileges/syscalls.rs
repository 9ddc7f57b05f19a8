//! The system calls the steady state's seccomp filter lets through, by what they are for, in
//! the numbering of the architecture the daemon is built for.

/// The calls the steady state makes, besides `clone`, `clone3`, `ioctl` and `tgkill`, which
/// [`super::seccomp::program`] checks on their own. Found by reading what the runtime, the
/// proxy engine, the admin, discovery and the kernel-log reader call, and checked under
/// `strace -f` of `daemon_unprivileged.rs`; a missing one shows as an `EPERM` error naming the
/// operation.
///
/// The filter compares a call with the list in order, so the calls the steady state makes most
/// ([`HOT`]) come first; each also stays in its group below.
pub fn allowed() -> Vec<libc::c_long> {
    let mut calls = HOT.to_vec();
    let groups = [RUNTIME, DESCRIPTORS, SOCKETS, FILES, BPF, LEGACY];
    for &call in groups.iter().copied().flatten() {
        if !calls.contains(&call) {
            calls.push(call);
        }
    }
    calls
}

/// The calls of every connection, map update and wake-up of the runtime and the proxy engine.
pub const HOT: &[libc::c_long] = &[
    libc::SYS_futex,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_bpf,
    libc::SYS_epoll_ctl,
    libc::SYS_accept4,
    libc::SYS_close,
    libc::SYS_connect,
    libc::SYS_socket,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_splice,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_sched_yield,
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_madvise,
];

/// Memory, threads, time, the runtime's wake-ups.
const RUNTIME: &[libc::c_long] = &[
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_set_tid_address,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getresuid,
    libc::SYS_getresgid,
    libc::SYS_getrandom,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettimeofday,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_restart_syscall,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_prctl,
    libc::SYS_prlimit64,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_membarrier,
];

/// Descriptors, epoll, eventfd, timers, pipes, splice.
const DESCRIPTORS: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_pipe2,
    libc::SYS_splice,
    libc::SYS_tee,
    libc::SYS_sendfile,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_ppoll,
    libc::SYS_pselect6,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
];

/// Sockets.
const SOCKETS: &[libc::c_long] = &[
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvmmsg,
];

/// Files: the configuration at a reload, TLS files, /proc, the socket files it owns.
const FILES: &[libc::c_long] = &[
    libc::SYS_openat,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_lseek,
    libc::SYS_getdents64,
    libc::SYS_readlinkat,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_getcwd,
    libc::SYS_mkdirat,
    libc::SYS_unlinkat,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_ftruncate,
    libc::SYS_flock,
    libc::SYS_umask,
];

/// Its own maps: updates, lookups, batches, the ring buffer of the kernel's log.
const BPF: &[libc::c_long] = &[libc::SYS_bpf];

/// The calls x86_64 keeps from before the `*at` and `*2` ones, which its C library and
/// standard library still use in places.
#[cfg(target_arch = "x86_64")]
const LEGACY: &[libc::c_long] = &[
    libc::SYS_open,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_access,
    libc::SYS_readlink,
    libc::SYS_unlink,
    libc::SYS_mkdir,
    libc::SYS_chmod,
    libc::SYS_poll,
    libc::SYS_select,
    libc::SYS_pipe,
    libc::SYS_dup2,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_create,
    libc::SYS_getdents,
    libc::SYS_arch_prctl,
    libc::SYS_time,
];

/// aarch64 has only the newer calls.
#[cfg(not(target_arch = "x86_64"))]
const LEGACY: &[libc::c_long] = &[];
