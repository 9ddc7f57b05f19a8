//! `cgroup/getpeername4` and `cgroup/getpeername6`: the application sees the service address it
//! dialled, never the backend the kernel chose.
//!
//! Contract: fail-open (a socket that did not dial a service is reported as the kernel has it).
//! Minimum kernel 5.8 (the hooks; `bpf_sk_storage_get` on `bpf_sock_addr.sk` is 5.3). Reads
//! `SOCK_VIP_V2` (followed sockets: an entry with flags), then `SOCK_PEER_V1` (every other
//! socket that dialled a service, by cookie); writes the syscall's address and `COUNTERS_V2`.

use aya_ebpf::{
    EbpfContext as _, helpers::bpf_get_socket_cookie, macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use proxy_common::{
    counters,
    service::{FAMILY_V4, ServiceKey},
};

use crate::{
    maps::{SOCK_VIP_V2, count},
    peer,
    sock_addr::{MAPPED, set_user_ip6},
};

/// Verdict of a getpeername program: always proceed (rejecting is not allowed for this hook).
const ALLOW: i32 = 1;

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, false);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, true);
    ALLOW
}

#[inline(always)]
fn reverse(ctx: &SockAddrContext, v6_socket: bool) {
    let Some(vip) = dialled(ctx) else {
        return;
    };
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    match (v6_socket, vip.family == FAMILY_V4) {
        (false, true) => sa.user_ip4 = vip.addr[0],
        // A dual-stack socket that dialled an IPv4 service through a mapped address.
        (true, true) => set_user_ip6(sa, [0, 0, MAPPED, vip.addr[0]]),
        (true, false) => set_user_ip6(sa, vip.addr),
        (false, false) => return,
    }
    sa.user_port = u32::from(vip.port);
    count(counters::GETPEERNAME_REWRITTEN);
}

/// The service the socket dialled: from its storage when sockops follows it (flags set: an entry
/// whose flags were cleared is from an earlier connect of the socket), else by its cookie.
#[inline(always)]
fn dialled(ctx: &SockAddrContext) -> Option<ServiceKey> {
    // SAFETY: `ctx.sock_addr.sk` is the socket of the syscall; a socket that was never followed
    // has no entry (NULL); the value is copied out before the program returns.
    if let Some(vip) = unsafe { SOCK_VIP_V2.get_ptr_mut(ctx).as_ref() }
        && vip.flags != 0
    {
        return Some(vip.key);
    }
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    peer::lookup(cookie)
}
