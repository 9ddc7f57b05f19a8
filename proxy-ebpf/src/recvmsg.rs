//! `cgroup/recvmsg4` and `cgroup/recvmsg6`: replies to translated UDP appear to come from the
//! service address. The source address `recvfrom`/`recvmsg` reports is looked up with the
//! socket cookie in `UDP_REV_V1` (written by sendmsg4/6 and, for connected UDP, connect4/6) and
//! replaced by the service address.
//!
//! Contract: fail-open (a datagram from anywhere else is reported as it is; this hook cannot
//! reject). Runs only when the application asks for the source address. Minimum kernel 5.2.
//! Reads `UDP_REV_V1`; writes the syscall's address and `COUNTERS_V2`.

use aya_ebpf::{
    EbpfContext as _, helpers::bpf_get_socket_cookie, macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use proxy_common::{
    counters,
    service::{FAMILY_V4, FAMILY_V6},
    socket::UdpReverseKey,
};

use crate::{
    maps::{UDP_REV_V1, count},
    sock_addr::{MAPPED, set_user_ip6, user_ip6},
};

/// Verdict of a recvmsg program: always proceed (rejecting is not allowed for this hook).
const ALLOW: i32 = 1;

#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx);
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    ALLOW
}

#[inline(always)]
fn reverse4(ctx: &SockAddrContext) {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = reverse_key(ctx, FAMILY_V4, [sa.user_ip4, 0, 0, 0], sa.user_port as u16);
    // SAFETY: read-only use before the program returns.
    let Some(vip) = (unsafe { UDP_REV_V1.get(&key) }) else {
        return;
    };
    if vip.family != FAMILY_V4 {
        return;
    }
    sa.user_ip4 = vip.addr[0];
    sa.user_port = u32::from(vip.port);
    count(counters::RECVMSG_REWRITTEN);
}

#[inline(always)]
fn reverse6(ctx: &SockAddrContext) {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = reverse_key(ctx, FAMILY_V6, user_ip6(sa), sa.user_port as u16);
    // SAFETY: read-only use before the program returns.
    let Some(vip) = (unsafe { UDP_REV_V1.get(&key) }) else {
        return;
    };
    if vip.family == FAMILY_V4 {
        set_user_ip6(sa, [0, 0, MAPPED, vip.addr[0]]);
    } else {
        set_user_ip6(sa, vip.addr);
    }
    sa.user_port = u32::from(vip.port);
    count(counters::RECVMSG_REWRITTEN);
}

#[inline(always)]
fn reverse_key(ctx: &SockAddrContext, family: u8, addr: [u32; 4], port: u16) -> UdpReverseKey {
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    UdpReverseKey {
        cookie,
        addr,
        port,
        family,
        _pad: [0; 5],
    }
}
