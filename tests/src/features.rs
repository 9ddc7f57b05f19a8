//! What the running kernel supports, found by probing (loading a two-instruction program,
//! creating a one-entry map, attaching a link to a throwaway cgroup), so kernel tests can skip
//! with a printed reason on a kernel that lacks a feature, and run everywhere else.
//!
//! # Use in a test
//!
//! ```ignore
//! use integration_tests::features::{Feature, skip_unless};
//!
//! #[test]
//! fn sockops_splices_the_two_sockets() {
//!     require_root();
//!     if skip_unless("sockops_splices_the_two_sockets", &[Feature::SockOps, Feature::SockHash]) {
//!         return;
//!     }
//!     // ... the test proper
//! }
//! ```
//!
//! `skip_unless` prints `SKIP <test>: <reason>` to stderr and returns true only when the kernel
//! lacks a feature: the kernel refused the probe with `EINVAL` (unknown program type, attach
//! type, map type or command) or the verifier named the helper unknown. Any other failure
//! (`EPERM` without root, say) panics, so a test never skips on a kernel that has the feature.
//! `cargo xtask vm` counts the `SKIP` lines as skips in its result line. Probes run once per
//! test process; each leaves nothing behind (fds closed, the cgroup and namespace removed). The
//! first probe lifts RLIMIT_MEMLOCK for the test process (kernels before 5.11 charge BPF memory
//! to it).
//!
//! Add a feature by adding a variant (and to [`Feature::ALL`]), its minimum kernel in
//! [`Feature::min_kernel`] and its probe in `probe`; keep the table of docs/kernel-support.md in
//! step. `tests/kernel_features.rs` checks every probe against the running kernel's version.

use std::{
    collections::BTreeMap,
    ffi::CStr,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    process::Command,
    sync::Mutex,
};

use crate::kernel::{Netns, TestCgroup};

/// A kernel capability a test may need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Feature {
    /// `cgroup/connect4` and `cgroup/connect6` programs.
    ConnectHooks,
    /// `cgroup/sendmsg4` and `cgroup/sendmsg6` (unconnected UDP).
    SendmsgHooks,
    /// `cgroup/recvmsg4` and `cgroup/recvmsg6`.
    RecvmsgHooks,
    /// `cgroup/getpeername4` and `cgroup/getpeername6`.
    GetpeernameHooks,
    /// Attaching cgroup programs through bpf_link (`BPF_LINK_CREATE`), which can be pinned.
    CgroupLink,
    /// `bpf_get_netns_cookie` in cgroup sock_addr programs.
    NetnsCookie,
    /// `bpf_get_socket_cookie` in cgroup sock_addr programs.
    SocketCookie,
    /// `sockops` programs.
    SockOps,
    /// `sk_msg` programs.
    SkMsg,
    /// `BPF_MAP_TYPE_SOCKHASH`.
    SockHash,
    /// `sk_skb` stream verdict programs, as proxy-pair splicing uses them: attached to a
    /// sockhash without a stream parser, which needs 5.10 (before, such a verdict program is
    /// accepted but never runs). The probe loads a stream verdict program (4.14+); the version
    /// bound is the documented one.
    SkSkbVerdict,
    /// `BPF_MAP_TYPE_RINGBUF`.
    RingBuf,
    /// veth pairs (`ip link add ... type veth`; a module on Debian's kernels).
    Veth,
    /// BPF atomic fetch-and-add (`BPF_ATOMIC | BPF_FETCH`), which ROUND_ROBIN's `_rr` programs
    /// use.
    AtomicFetch,
    /// `bpf_set_retval` in cgroup sock_addr programs: a refused connect says ECONNREFUSED.
    SetRetval,
    /// `bpf_get_current_pid_tgid` in cgroup sock_addr programs (`hash_key: process`).
    CurrentPidTgid,
    /// `bpf_get_current_cgroup_id` in cgroup sock_addr programs (`hash_key: cgroup`).
    CurrentCgroupId,
    /// `bpf_get_current_uid_gid` in cgroup sock_addr programs (`hash_key: user`).
    CurrentUidGid,
}

impl Feature {
    /// Every feature, for reports.
    pub const ALL: [Self; 18] = [
        Self::ConnectHooks,
        Self::SendmsgHooks,
        Self::RecvmsgHooks,
        Self::GetpeernameHooks,
        Self::CgroupLink,
        Self::NetnsCookie,
        Self::SocketCookie,
        Self::SockOps,
        Self::SkMsg,
        Self::SockHash,
        Self::SkSkbVerdict,
        Self::RingBuf,
        Self::Veth,
        Self::AtomicFetch,
        Self::SetRetval,
        Self::CurrentPidTgid,
        Self::CurrentCgroupId,
        Self::CurrentUidGid,
    ];

    /// The first mainline kernel with the feature, where known (documentation and a
    /// cross-check of the probes; the probe decides).
    pub fn min_kernel(self) -> Option<(u32, u32)> {
        Some(match self {
            Self::ConnectHooks | Self::SkMsg | Self::CurrentUidGid => (4, 17),
            Self::SendmsgHooks | Self::SockHash => (4, 18),
            Self::RecvmsgHooks => (5, 2),
            Self::GetpeernameHooks | Self::RingBuf => (5, 8),
            Self::CgroupLink | Self::NetnsCookie | Self::CurrentCgroupId => (5, 7),
            // There by 5.10 at the latest (the oldest kernel of the matrix).
            Self::CurrentPidTgid => (5, 10),
            Self::SockOps => (4, 13),
            Self::SkSkbVerdict => (5, 10),
            Self::Veth => (2, 6),
            Self::AtomicFetch => (5, 12),
            Self::SetRetval => (5, 18),
            // Older than every kernel of the matrix; the exact release is not recorded here.
            Self::SocketCookie => return None,
        })
    }

    fn min_text(self) -> String {
        self.min_kernel()
            .map_or_else(|| "unknown".to_owned(), |(a, b)| format!("{a}.{b}"))
    }
}

/// The errno a connect to a service that has nowhere to go fails with: ECONNREFUSED where the
/// programs can set it (`bpf_set_retval`, 5.18), else EPERM, the kernel's errno for a connect
/// a cgroup program rejects.
pub fn refused_errno() -> &'static str {
    if missing(&[Feature::SetRetval]).is_none() {
        "ECONNREFUSED"
    } else {
        "EPERM"
    }
}

/// The running kernel's version from uname, e.g. `(5, 10, 0)` for `5.10.0-32-cloud-amd64`.
pub fn kernel_version() -> (u32, u32, u32) {
    let release = kernel_release();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

/// `uname -r`.
pub fn kernel_release() -> String {
    // SAFETY: utsname is plain data; uname fills it and NUL-terminates each field.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable utsname.
    if unsafe { libc::uname(&raw mut uts) } != 0 {
        return String::new();
    }
    // SAFETY: the kernel NUL-terminates `release` within its length.
    unsafe { CStr::from_ptr(uts.release.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Why the kernel lacks one of `features`, or `None` when it has them all.
pub fn missing(features: &[Feature]) -> Option<String> {
    static CACHE: Mutex<BTreeMap<Feature, Option<String>>> = Mutex::new(BTreeMap::new());
    features.iter().find_map(|&feature| {
        let mut cache = CACHE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        cache
            .entry(feature)
            .or_insert_with(|| {
                probe(feature).err().map(|why| {
                    format!(
                        "kernel {} lacks {feature:?} (mainline {}+): {why}",
                        kernel_release(),
                        feature.min_text()
                    )
                })
            })
            .clone()
    })
}

/// Prints `SKIP <test>: <reason>` and returns true when the kernel lacks one of `features`.
pub fn skip_unless(test: &str, features: &[Feature]) -> bool {
    match missing(features) {
        Some(reason) => {
            eprintln!("SKIP {test}: {reason}");
            true
        }
        None => false,
    }
}

// bpf(2) commands, program, attach and map types and helpers (include/uapi/linux/bpf.h).
const BPF_MAP_CREATE: u32 = 0;
const BPF_PROG_LOAD: u32 = 5;
const BPF_LINK_CREATE: u32 = 28;
const PROG_SOCK_OPS: u32 = 13;
const PROG_SK_SKB: u32 = 14;
const PROG_SK_MSG: u32 = 16;
const PROG_CGROUP_SOCK_ADDR: u32 = 18;
const ATTACH_CGROUP_SOCK_OPS: u32 = 3;
const ATTACH_SK_SKB_STREAM_VERDICT: u32 = 5;
const ATTACH_SK_MSG_VERDICT: u32 = 7;
const ATTACH_INET4_CONNECT: u32 = 10;
const ATTACH_INET6_CONNECT: u32 = 11;
const ATTACH_UDP4_SENDMSG: u32 = 14;
const ATTACH_UDP6_SENDMSG: u32 = 15;
const ATTACH_UDP4_RECVMSG: u32 = 19;
const ATTACH_UDP6_RECVMSG: u32 = 20;
const ATTACH_INET4_GETPEERNAME: u32 = 29;
const ATTACH_INET6_GETPEERNAME: u32 = 30;
const MAP_SOCKHASH: u32 = 18;
const MAP_RINGBUF: u32 = 27;
const FUNC_GET_CURRENT_PID_TGID: i32 = 14;
const FUNC_GET_CURRENT_UID_GID: i32 = 15;
const FUNC_GET_SOCKET_COOKIE: i32 = 46;
const FUNC_GET_CURRENT_CGROUP_ID: i32 = 80;
const FUNC_GET_NETNS_COOKIE: i32 = 122;
const FUNC_SET_RETVAL: i32 = 187;
const PROG_SOCKET_FILTER: u32 = 1;

/// Ok when the kernel has `feature`; Err(what it said) when it lacks it. Panics on any other
/// failure.
fn probe(feature: Feature) -> Result<(), String> {
    raise_memlock();
    let sock_addr = |attach| load(PROG_CGROUP_SOCK_ADDR, attach, None).map(drop);
    let connect_helper =
        |helper| load(PROG_CGROUP_SOCK_ADDR, ATTACH_INET4_CONNECT, Some(helper)).map(drop);
    match feature {
        Feature::ConnectHooks => {
            sock_addr(ATTACH_INET4_CONNECT).and_then(|()| sock_addr(ATTACH_INET6_CONNECT))
        }
        Feature::SendmsgHooks => {
            sock_addr(ATTACH_UDP4_SENDMSG).and_then(|()| sock_addr(ATTACH_UDP6_SENDMSG))
        }
        Feature::RecvmsgHooks => {
            sock_addr(ATTACH_UDP4_RECVMSG).and_then(|()| sock_addr(ATTACH_UDP6_RECVMSG))
        }
        Feature::GetpeernameHooks => {
            sock_addr(ATTACH_INET4_GETPEERNAME).and_then(|()| sock_addr(ATTACH_INET6_GETPEERNAME))
        }
        Feature::NetnsCookie => load(
            PROG_CGROUP_SOCK_ADDR,
            ATTACH_INET4_CONNECT,
            Some(FUNC_GET_NETNS_COOKIE),
        )
        .map(drop),
        Feature::SocketCookie => load(
            PROG_CGROUP_SOCK_ADDR,
            ATTACH_INET4_CONNECT,
            Some(FUNC_GET_SOCKET_COOKIE),
        )
        .map(drop),
        Feature::SockOps => load(PROG_SOCK_OPS, ATTACH_CGROUP_SOCK_OPS, None).map(drop),
        Feature::SkMsg => load(PROG_SK_MSG, ATTACH_SK_MSG_VERDICT, None).map(drop),
        Feature::SkSkbVerdict => stream_verdict(),
        Feature::SockHash => create_map(MAP_SOCKHASH, 4, 8, 1),
        Feature::RingBuf => create_map(MAP_RINGBUF, 0, 0, 4096),
        Feature::CgroupLink => cgroup_link(),
        Feature::Veth => veth(),
        Feature::AtomicFetch => atomic_fetch(),
        Feature::SetRetval => load(
            PROG_CGROUP_SOCK_ADDR,
            ATTACH_INET4_CONNECT,
            Some(FUNC_SET_RETVAL),
        )
        .map(drop),
        Feature::CurrentPidTgid => connect_helper(FUNC_GET_CURRENT_PID_TGID),
        Feature::CurrentCgroupId => connect_helper(FUNC_GET_CURRENT_CGROUP_ID),
        Feature::CurrentUidGid => connect_helper(FUNC_GET_CURRENT_UID_GID),
    }
}

/// A stream verdict program on a kernel old enough to ignore it without a parser is missing.
fn stream_verdict() -> Result<(), String> {
    load(PROG_SK_SKB, ATTACH_SK_SKB_STREAM_VERDICT, None)?;
    let (major, minor, _) = kernel_version();
    if (major, minor) < (5, 10) {
        return Err(format!(
            "a stream verdict without a stream parser needs 5.10; this is {major}.{minor}"
        ));
    }
    Ok(())
}

/// Before 5.11 the kernel charges BPF memory to RLIMIT_MEMLOCK, shared by every process of the
/// user (root's programs and pinned maps from other tests count): a probe would fail with EPERM
/// under the default 64 KiB. Lift the limit for this process, as the daemon and libbpf do.
fn raise_memlock() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let unlimited = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: setrlimit reads a valid rlimit; failing leaves the limit as it was.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const unlimited) };
    });
}

/// One eBPF instruction.
#[repr(C)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    /// Later fields, zero (the kernel accepts a larger attr whose tail is zero).
    tail: [u64; 8],
}

#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    tail: [u32; 15],
}

#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    tail: [u64; 4],
}

/// bpf(2); returns the new fd.
fn bpf<T>(cmd: u32, attr: &mut T) -> io::Result<OwnedFd> {
    let size = u32::try_from(size_of::<T>()).expect("small attr");
    // SAFETY: `attr` is a repr(C) bpf_attr prefix of `size` bytes that outlives the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).expect("fd fits in i32");
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `EINVAL` means the kernel does not know what was asked: the feature is missing. Anything
/// else is a broken test environment, not a missing feature.
fn judge(what: &str, err: &io::Error, log: &str) -> String {
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EINVAL),
        "feature probe {what} failed for another reason than a missing feature (root?): \
         {err}\n{log}"
    );
    let first = log
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    format!(
        "{what}: {err}{}",
        if first.is_empty() {
            String::new()
        } else {
            format!(" ({first})")
        }
    )
}

/// A socket filter that does one 64-bit atomic fetch-and-add on its stack. A kernel before
/// 5.12 refuses the instruction's fields (EINVAL, "uses reserved fields").
fn atomic_fetch() -> Result<(), String> {
    let insn = |code, regs, off, imm| Insn {
        code,
        regs,
        off,
        imm,
    };
    let insns = [
        insn(0xb7, 0x01, 0, 0),  // r1 = 0
        insn(0x7b, 0x1a, -8, 0), // *(u64 *)(r10 - 8) = r1
        insn(0xb7, 0x01, 0, 1),  // r1 = 1
        insn(0xdb, 0x1a, -8, 1), // r1 = atomic_fetch_add((u64 *)(r10 - 8), r1)
        insn(0xb7, 0x00, 0, 0),  // r0 = 0
        insn(0x95, 0x00, 0, 0),  // exit
    ];
    load_insns(PROG_SOCKET_FILTER, 0, &insns, "atomic fetch-and-add", false).map(drop)
}

/// Loads `r0 = 1; exit` (with a helper call first when given) as `prog_type` for `attach`.
fn load(prog_type: u32, attach: u32, helper: Option<i32>) -> Result<OwnedFd, String> {
    let mut insns = Vec::new();
    if let Some(id) = helper {
        insns.push(Insn {
            code: 0x85,
            regs: 0,
            off: 0,
            imm: id,
        }); // call id (r1 = ctx)
    }
    insns.push(Insn {
        code: 0xb7,
        regs: 0,
        off: 0,
        imm: 1,
    }); // r0 = 1
    insns.push(Insn {
        code: 0x95,
        regs: 0,
        off: 0,
        imm: 0,
    }); // exit
    let what = match helper {
        Some(id) => format!("helper {id} in program type {prog_type}"),
        None => format!("program type {prog_type} with attach type {attach}"),
    };
    load_insns(prog_type, attach, &insns, &what, helper.is_some())
}

/// Loads `insns` as `prog_type` for `attach`; Err(`judge`'s verdict) when the kernel refuses.
/// `helper_probe`: the program only calls a helper, so the verifier may refuse only that call.
fn load_insns(
    prog_type: u32,
    attach: u32,
    insns: &[Insn],
    what: &str,
    helper_probe: bool,
) -> Result<OwnedFd, String> {
    let mut log = vec![0u8; 4096];
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: u32::try_from(insns.len()).expect("short"),
        insns: insns.as_ptr() as u64,
        license: c"GPL".as_ptr() as u64,
        log_level: 1,
        log_size: u32::try_from(log.len()).expect("small"),
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
        prog_name: [0; 16],
        prog_ifindex: 0,
        expected_attach_type: attach,
        tail: [0; 8],
    };
    bpf(BPF_PROG_LOAD, &mut attr).map_err(|err| {
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .to_owned();
        if helper_probe && err.raw_os_error() == Some(libc::EINVAL) {
            assert!(
                log.contains("unknown func") || log.contains("invalid func"),
                "feature probe {what}: the verifier refused for another reason:\n{log}"
            );
        }
        judge(what, &err, &log)
    })
}

fn create_map(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
) -> Result<(), String> {
    let mut attr = MapCreateAttr {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_flags: 0,
        tail: [0; 15],
    };
    bpf(BPF_MAP_CREATE, &mut attr)
        .map(drop)
        .map_err(|err| judge(&format!("map type {map_type}"), &err, ""))
}

/// Attaches a pass-everything connect4 program to a throwaway cgroup through a bpf_link and
/// closes it again (the link detaches when its last fd closes).
fn cgroup_link() -> Result<(), String> {
    let prog = load(PROG_CGROUP_SOCK_ADDR, ATTACH_INET4_CONNECT, None)?;
    let cgroup = TestCgroup::new();
    let dir = std::fs::File::open(cgroup.path())
        .unwrap_or_else(|e| panic!("opening {}: {e}", cgroup.path().display()));
    let mut attr = LinkCreateAttr {
        prog_fd: u32::try_from(prog.as_raw_fd()).expect("fd"),
        target_fd: u32::try_from(dir.as_raw_fd()).expect("fd"),
        attach_type: ATTACH_INET4_CONNECT,
        flags: 0,
        tail: [0; 4],
    };
    bpf(BPF_LINK_CREATE, &mut attr)
        .map(drop)
        .map_err(|err| judge("BPF_LINK_CREATE on a cgroup", &err, ""))
}

/// Creates a veth pair in a throwaway namespace.
fn veth() -> Result<(), String> {
    let netns = Netns::new();
    let out = Command::new("ip")
        .args([
            "-n",
            netns.name(),
            "link",
            "add",
            "pv0",
            "type",
            "veth",
            "peer",
            "name",
            "pv1",
        ])
        .output()
        .unwrap_or_else(|e| panic!("running ip: {e}"));
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "ip link add type veth: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_kernel_does_not_know_probes_as_missing() {
        crate::kernel::require_root();
        let attach = load(PROG_CGROUP_SOCK_ADDR, 9999, None)
            .map(drop)
            .unwrap_err();
        assert!(attach.contains("attach type 9999"), "{attach}");
        let helper = load(PROG_CGROUP_SOCK_ADDR, ATTACH_INET4_CONNECT, Some(99_999)).map(drop);
        assert!(helper.unwrap_err().contains("helper 99999"));
        assert!(create_map(9999, 4, 4, 1).is_err());
    }

    #[test]
    fn the_kernel_version_parses() {
        let (major, _, _) = kernel_version();
        assert!(major >= 4, "{}", kernel_release());
    }
}
