//! `cgroup/connect4` and `cgroup/connect6`: connect-time host selection (the kernel path) and the
//! redirect of proxy-mode services to the daemon's listener (the proxy path).
//!
//! Contract of both hooks:
//! - **Fail-open** for anything that is not a service, and for internal errors (a dangling backend
//!   id, a family mismatch): the connect proceeds to the address the application gave, counted.
//! - **Fail-closed** when the destination is a service with no routable host in any priority, or
//!   an HTTP-routed proxy-mode service while no proxy listener of the socket's family is there:
//!   the connect is refused with `ECONNREFUSED` (set with `bpf_set_retval`, Linux 5.18; before,
//!   `EPERM`, the errno a cgroup sock_addr program produces by rejecting), counted as
//!   `connect_no_host` / `connect_proxy_no_listener`. Nothing leaves the host for a VIP that has
//!   nowhere to go. A
//!   TCP service held to `max_connections` (`SERVICE_F_CX_LIMIT`) that has that many open
//!   connections is refused the same way, counted as `connect_cx_overflow` ([`crate::limit`]),
//!   and so is a connect to one with a drop overload (`SERVICE_F_DROP`) that draws a drop,
//!   counted as `connect_drop_overload` ([`crate::drop_overload`]).
//! - ROUND_ROBIN services rotate only in the `_rr` variants, which use atomic fetch-and-add
//!   (5.12); the loader attaches them where the kernel has it.
//! - Proxy mode (`SERVICE_F_PROXY`, TCP only): the destination becomes the listener address in
//!   `SETTINGS_V1` (a map, so the daemon can move its listener without reloading programs), and
//!   the dialled service is recorded under the socket cookie in `SOCK_ORIG_V1` for sockops.
//!   UDP services ignore the flag and select a backend.
//! - Host ending (`SERVICE_F_END`, TCP and connected UDP, kernel path only): the service and
//!   the chosen backend are recorded under the socket cookie in `SOCK_HOST_V2` (LRU, never
//!   removed on close), for the daemon's socket iterators that end a service's sockets to a
//!   host when it leaves that service's routable set.
//!   A failed record is counted as `sock_host_record_failed`; the connect proceeds.
//! - Every kernel-path connect (not a redirect to the proxy) counts one for its chosen host in
//!   `HOST_CX_V1` ([`crate::host_cx`]), the host's `cx_total` in `/clusters`.
//! - Proxy mode while no proxy listens (the daemon stopped and withdrew the listener, or was
//!   killed and left it set; [`crate::listener`] looks the listening socket up): the connect is
//!   served as the kernel path serves it instead of refused, counted as
//!   `connect_proxy_absent_direct`: to a host of the service's levels (`SERVICE_F_NO_PROXY_HOSTS`,
//!   a TCP service, then counted as any kernel-path connect), or to the address dialled
//!   (`SERVICE_F_NO_PROXY_DIALLED`, ORIGINAL_DST). A service with neither flag (HTTP-routed:
//!   only the proxy can route it) is refused. This is what lets a plain restart (SIGTERM or
//!   `kill -9`, then a new daemon) refuse no connect of a proxy-mode TCP service. The lookup is
//!   one per proxy-mode connect; a direct service pays nothing.
//! - Minimum kernel: 4.17 for the hooks; 5.2 for `bpf_sk_lookup_tcp` (the proxy listener's
//!   presence); 5.7 for `bpf_get_netns_cookie` (consistent hashing);
//!   5.7 for `bpf_get_current_cgroup_id` and by 5.10 `bpf_get_current_pid_tgid` (the cgroup
//!   and process hash keys; the loader probes both, see `crate::features`);
//!   5.7 for attaching through bpf_link (the daemon refuses to attach without it); 5.3 for
//!   `bpf_sock_addr.sk` and `bpf_sk_storage_get` in sock_addr programs (`SOCK_VIP_V2`).
//! - Reads `SERVICES_V2`, `SLOTS_V2`, `BACKENDS_V2`, `SETTINGS_V1`, `CX_MAX_V1`, `DROP_V1`;
//!   writes `CX_OPEN_V1` and `DROPPED_V1` (refusals' counts), the dialled service
//!   to `SOCK_VIP_V2` (the socket's local storage) for a socket sockops follows (proxy mode, or
//!   passive health), or else to `SOCK_PEER_V1` (a slot by cookie, for getpeername); `SOCK_HOST_V2`
//!   (host ending); `HOST_CX_V1`; `SOCK_ORIG_V1`
//!   (proxy mode), `UDP_REV_V1` (connected UDP, for recvfrom), `COUNTERS_V2` and the service's
//!   `SVC_COUNTERS_V3` entry.

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_socket_cookie, generated::bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use proxy_common::{
    abi, counters,
    service::{FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, ServiceKey, SockHost},
    socket::{
        SOCK_VIP_F_CX_LIMIT, SOCK_VIP_F_LEAST, SOCK_VIP_F_PASSIVE, SOCK_VIP_F_PROXIED, SockVip,
    },
};

use crate::{
    features, host_cx, log,
    maps::{SOCK_HOST_V2, SOCK_ORIG_V1, SOCK_VIP_V2, count},
    peer,
    sendmsg::remember_reply,
    sock_addr::{MAPPED, key4, key6, write4, write6},
    translate::{Outcomes, Refuse, Target, target},
};

/// Verdict of a cgroup sock_addr program: let the syscall proceed.
const ALLOW: i32 = 1;
/// Verdict of a cgroup sock_addr program: fail the syscall (EPERM, or the errno set by
/// `bpf_set_retval`).
const REJECT: i32 = 0;
/// `ECONNREFUSED`, as a negative errno for `bpf_set_retval`.
const ECONNREFUSED: i32 = 111;

const CONNECT: Outcomes = Outcomes {
    rewritten: counters::CONNECT_REWRITTEN,
    not_service: counters::CONNECT_NOT_SERVICE,
    no_host: counters::CONNECT_NO_HOST,
    connect: true,
};

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    verdict(try_connect4::<false>(&ctx))
}

/// [`connect4`] for kernels with atomic fetch-and-add: ROUND_ROBIN services rotate.
#[cgroup_sock_addr(connect4)]
pub fn connect4_rr(ctx: SockAddrContext) -> i32 {
    verdict(try_connect4::<true>(&ctx))
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    verdict(try_connect6::<false>(&ctx))
}

/// [`connect6`] for kernels with atomic fetch-and-add: ROUND_ROBIN services rotate.
#[cgroup_sock_addr(connect6)]
pub fn connect6_rr(ctx: SockAddrContext) -> i32 {
    verdict(try_connect6::<true>(&ctx))
}

/// A refused connect fails with ECONNREFUSED, as a connect to a closed port does, where the
/// kernel lets a program choose the error (5.18); before, the kernel's EPERM.
#[inline(always)]
fn verdict(result: Result<(), Refuse>) -> i32 {
    let Err(Refuse) = result else {
        return ALLOW;
    };
    if features::has(abi::features::SET_RETVAL) {
        // SAFETY: a helper that only sets the syscall's return value. It cannot fail for a
        // valid errno.
        unsafe { bpf_set_retval(-ECONNREFUSED) };
    }
    REJECT
}

#[inline(always)]
fn try_connect4<const ROTATE: bool>(ctx: &SockAddrContext) -> Result<(), Refuse> {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = key4(sa);
    let Some(t) = target::<ROTATE>(ctx, &key, &CONNECT, key.proto == PROTO_TCP)? else {
        return Ok(());
    };
    write4(sa, &t.dest);
    remember(ctx, &key, &t, FAMILY_V4, [t.dest.addr[0], 0, 0, 0]);
    Ok(())
}

#[inline(always)]
fn try_connect6<const ROTATE: bool>(ctx: &SockAddrContext) -> Result<(), Refuse> {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let (key, mapped) = key6(sa);
    let Some(t) = target::<ROTATE>(ctx, &key, &CONNECT, key.proto == PROTO_TCP)? else {
        return Ok(());
    };
    write6(sa, mapped, &t.dest);
    let seen = if mapped {
        [0, 0, MAPPED, t.dest.addr[0]]
    } else {
        t.dest.addr
    };
    remember(ctx, &key, &t, FAMILY_V6, seen);
    Ok(())
}

/// What sockops and the proxy follow a socket for: proxied, passive health, LEAST_REQUEST and
/// max_connections (the last three on TCP only).
#[inline(always)]
fn sock_flags(t: &Target, tcp: bool) -> u32 {
    let on = |yes: bool, flag: u32| if yes { flag } else { 0 };
    on(t.proxied, SOCK_VIP_F_PROXIED)
        | on(t.passive && tcp, SOCK_VIP_F_PASSIVE)
        | on(t.least && tcp, SOCK_VIP_F_LEAST)
        | on(t.limited && tcp, SOCK_VIP_F_CX_LIMIT)
}

/// Records which service the socket dialled: for getpeername, for sockops (followed sockets),
/// for the proxy (proxy mode), and for recvfrom on a connected UDP socket (`seen` is the backend
/// as the socket reports it).
#[inline(always)]
fn remember(ctx: &SockAddrContext, key: &ServiceKey, t: &Target, family: u8, seen: [u32; 4]) {
    let flags = sock_flags(t, key.proto == PROTO_TCP);
    follow(ctx, key, flags);
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if t.proxied {
        if SOCK_ORIG_V1.insert(&cookie, key, 0).is_err() {
            count(counters::ORIG_DST_RECORD_FAILED);
            log::service!(warn, WARN, key, "original destination lost; proxy refuses");
        }
        return;
    }
    host_cx::connected(&t.dest);
    if flags == 0 {
        peer::record(cookie, key);
    }
    if t.end {
        let host = SockHost {
            service: *key,
            backend: t.dest,
        };
        if SOCK_HOST_V2.insert(&cookie, &host, 0).is_err() {
            count(counters::SOCK_HOST_RECORD_FAILED);
        }
    }
    if key.proto == PROTO_UDP {
        remember_reply(cookie, family, seen, t.dest.port, key);
    }
}

/// Writes the dialled service and `flags` to the socket's `SOCK_VIP_V2` entry: created for a
/// followed socket (`flags` not 0), overwritten where one exists.
#[inline(always)]
fn follow(ctx: &SockAddrContext, key: &ServiceKey, flags: u32) {
    // SAFETY: `ctx.sock_addr.sk` is the (full) socket being connected, valid for the program.
    // A followed socket's entry is created zeroed when it has none; NULL (no memory) only costs
    // the getpeername translation and the socket's passive health signal. For any other socket
    // this is a read, and a NULL check for one that was never followed.
    let stored = unsafe {
        if flags != 0 {
            SOCK_VIP_V2.get_or_insert_ptr_mut(ctx, None)
        } else {
            SOCK_VIP_V2.get_ptr_mut(ctx)
        }
        .as_mut()
    };
    if let Some(vip) = stored {
        // A socket that connects again (UDP, or TCP after a failed connect) and was followed
        // before keeps its entry with the flags cleared: getpeername and sockops ignore it.
        *vip = SockVip { key: *key, flags };
    }
}
