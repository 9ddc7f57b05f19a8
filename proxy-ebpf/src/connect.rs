//! `cgroup/connect4` and `cgroup/connect6`: connect-time host selection (the kernel path).
//!
//! Contract of both hooks:
//! - **Fail-open** for anything that is not a service, and for internal errors (a dangling backend
//!   id, a family mismatch): the connect proceeds to the address the application gave, counted.
//! - **Fail-closed** when the destination is a service with no routable host in any priority: the
//!   connect is refused with `EPERM` (the errno a cgroup sock_addr program produces by rejecting),
//!   counted as `connect_no_host`. Nothing leaves the host for a VIP that has nowhere to go.
//! - Minimum kernel: 4.17 for the hooks; 5.7 for `bpf_get_netns_cookie` (consistent hashing);
//!   5.8 for attaching through bpf_link (the daemon falls back to prog-attach before that).
//! - Reads `SERVICES_V1`, `SLOTS_V1`, `BACKENDS_V1`; writes `SOCK_VIP_V1` (socket cookie ->
//!   dialled service, for getpeername) and `COUNTERS_V1`.
//!
//! TCP and connected UDP both go through these hooks; the protocol is part of the service key.

use aya_ebpf::{
    EbpfContext as _, helpers::bpf_get_socket_cookie, macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use proxy_common::{
    counters,
    service::{Backend, FAMILY_V4, FAMILY_V6, ServiceKey},
};

use crate::{
    maps::{SERVICES_V1, SOCK_VIP_V1, count},
    select::{NoBackend, choose},
};

/// Writes `bpf_sock_addr.user_ip6` one word at a time: the verifier accepts only 4-byte stores
/// at fixed offsets of the context, and a plain array assignment may be lowered to a memcpy.
#[inline(always)]
pub fn set_user_ip6(sa: &mut aya_ebpf::bindings::bpf_sock_addr, words: [u32; 4]) {
    // SAFETY: each pointer is a field of the valid context; volatile keeps the 4-byte stores.
    unsafe {
        core::ptr::write_volatile(&mut sa.user_ip6[0], words[0]);
        core::ptr::write_volatile(&mut sa.user_ip6[1], words[1]);
        core::ptr::write_volatile(&mut sa.user_ip6[2], words[2]);
        core::ptr::write_volatile(&mut sa.user_ip6[3], words[3]);
    }
}

/// Verdict of a cgroup sock_addr program: let the syscall proceed.
const ALLOW: i32 = 1;
/// Verdict of a cgroup sock_addr program: fail the syscall with EPERM.
const REJECT: i32 = 0;

/// The destination is a service with no routable host.
struct Refuse;

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    match try_connect4(&ctx) {
        Ok(()) => ALLOW,
        Err(Refuse) => REJECT,
    }
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    match try_connect6(&ctx) {
        Ok(()) => ALLOW,
        Err(Refuse) => REJECT,
    }
}

fn try_connect4(ctx: &SockAddrContext) -> Result<(), Refuse> {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = ServiceKey {
        addr: [sa.user_ip4, 0, 0, 0],
        port: sa.user_port as u16,
        proto: sa.protocol as u8,
        family: FAMILY_V4,
    };
    let Some(backend) = lookup(ctx, &key)? else {
        return Ok(());
    };
    if backend.family != FAMILY_V4 {
        count(counters::CONNECT_FAMILY_MISMATCH);
        return Ok(());
    }
    sa.user_ip4 = backend.addr[0];
    // The verifier refuses 2-byte stores to user_port: write the whole word.
    sa.user_port = u32::from(backend.port);
    remember(ctx, &key);
    Ok(())
}

fn try_connect6(ctx: &SockAddrContext) -> Result<(), Refuse> {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let ip6 = sa.user_ip6;
    // An IPv4-mapped address (::ffff:a.b.c.d) on a dual-stack socket dials an IPv4 service.
    let mapped = ip6[0] == 0 && ip6[1] == 0 && ip6[2] == u32::from_be(0x0000_ffff);
    let key = ServiceKey {
        addr: if mapped { [ip6[3], 0, 0, 0] } else { ip6 },
        port: sa.user_port as u16,
        proto: sa.protocol as u8,
        family: if mapped { FAMILY_V4 } else { FAMILY_V6 },
    };
    let Some(backend) = lookup(ctx, &key)? else {
        return Ok(());
    };
    if backend.family != key.family {
        count(counters::CONNECT_FAMILY_MISMATCH);
        return Ok(());
    }
    if mapped {
        set_user_ip6(sa, [0, 0, ip6[2], backend.addr[0]]);
    } else {
        set_user_ip6(sa, backend.addr);
    }
    sa.user_port = u32::from(backend.port);
    remember(ctx, &key);
    Ok(())
}

/// Finds the backend for `key`: `Ok(None)` when the connect must proceed untouched.
#[inline(always)]
fn lookup(ctx: &SockAddrContext, key: &ServiceKey) -> Result<Option<&'static Backend>, Refuse> {
    // SAFETY: read-only use before the program returns; the map is not preallocated.
    let Some(svc) = (unsafe { SERVICES_V1.get(key) }) else {
        count(counters::CONNECT_NOT_SERVICE);
        return Ok(None);
    };
    // SAFETY: the helper only reads the context, which is valid.
    let netns = unsafe { aya_ebpf::helpers::bpf_get_netns_cookie(ctx.as_ptr()) };
    match choose(svc, netns) {
        Ok(backend) => {
            count(counters::CONNECT_REWRITTEN);
            Ok(Some(backend))
        }
        Err(NoBackend::NoHost) => {
            count(counters::CONNECT_NO_HOST);
            Err(Refuse)
        }
        Err(NoBackend::Missing) => {
            count(counters::CONNECT_BACKEND_MISSING);
            Ok(None)
        }
    }
}

/// Records which service the socket dialled, for getpeername.
#[inline(always)]
fn remember(ctx: &SockAddrContext, key: &ServiceKey) {
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // An LRU map cannot be full; an error here only costs the getpeername translation.
    let _ = SOCK_VIP_V1.insert(&cookie, key, 0);
}
