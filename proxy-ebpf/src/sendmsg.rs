//! `cgroup/sendmsg4` and `cgroup/sendmsg6`: unconnected UDP, translated per datagram. A
//! `sendto(VIP)` goes to a host chosen like connect4/6 would choose it, and the pair (socket,
//! backend) is recorded so that recvmsg4/6 can show the reply as coming from the VIP.
//!
//! Contract of both hooks:
//! - Run only for datagrams that carry a destination (`sendto`/`sendmsg` with an address);
//!   connected UDP sockets were translated once by connect4/6.
//! - **Fail-open** for destinations that are not services and for internal errors; **fail-closed**
//!   (`EPERM` from the send) for a service with no routable host, counted `sendmsg_no_host`.
//!   Proxy mode does not apply to UDP: the flag is ignored and a backend is selected.
//! - Minimum kernel 4.18; 5.7 for `bpf_get_netns_cookie`; the hash keys as in connect4/6
//!   (`crate::connect`).
//! - Reads `SERVICES_V2`, `SLOTS_V2`, `BACKENDS_V2`; writes `UDP_REV_V1` (only when the entry is
//!   missing or different, so a steady flow costs one lookup per datagram), `COUNTERS_V2` and the
//!   service's `SVC_COUNTERS_V3` entry.

use aya_ebpf::{
    EbpfContext as _, helpers::bpf_get_socket_cookie, macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use proxy_common::{
    counters,
    service::{FAMILY_V4, FAMILY_V6, ServiceKey},
    socket::UdpReverseKey,
};

use crate::{
    maps::{UDP_REV_V1, count},
    sock_addr::{MAPPED, key4, key6, write4, write6},
    translate::{Outcomes, Refuse, target},
};

/// Verdict of a cgroup sock_addr program: let the syscall proceed.
const ALLOW: i32 = 1;
/// Verdict of a cgroup sock_addr program: fail the syscall with EPERM.
const REJECT: i32 = 0;

const SENDMSG: Outcomes = Outcomes {
    rewritten: counters::SENDMSG_REWRITTEN,
    not_service: counters::SENDMSG_NOT_SERVICE,
    no_host: counters::SENDMSG_NO_HOST,
    connect: false,
};

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    verdict(try_sendmsg4::<false>(&ctx))
}

/// [`sendmsg4`] for kernels with atomic fetch-and-add: ROUND_ROBIN services rotate.
#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4_rr(ctx: SockAddrContext) -> i32 {
    verdict(try_sendmsg4::<true>(&ctx))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    verdict(try_sendmsg6::<false>(&ctx))
}

/// [`sendmsg6`] for kernels with atomic fetch-and-add: ROUND_ROBIN services rotate.
#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6_rr(ctx: SockAddrContext) -> i32 {
    verdict(try_sendmsg6::<true>(&ctx))
}

#[inline(always)]
fn verdict(result: Result<(), Refuse>) -> i32 {
    match result {
        Ok(()) => ALLOW,
        Err(Refuse) => REJECT,
    }
}

#[inline(always)]
fn try_sendmsg4<const ROTATE: bool>(ctx: &SockAddrContext) -> Result<(), Refuse> {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = key4(sa);
    let Some(t) = target::<ROTATE>(ctx, &key, &SENDMSG, false)? else {
        return Ok(());
    };
    write4(sa, &t.dest);
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    remember_reply(
        cookie,
        FAMILY_V4,
        [t.dest.addr[0], 0, 0, 0],
        t.dest.port,
        &key,
    );
    Ok(())
}

#[inline(always)]
fn try_sendmsg6<const ROTATE: bool>(ctx: &SockAddrContext) -> Result<(), Refuse> {
    // SAFETY: the context pointer is valid for the duration of the program.
    let sa = unsafe { &mut *ctx.sock_addr };
    let (key, mapped) = key6(sa);
    let Some(t) = target::<ROTATE>(ctx, &key, &SENDMSG, false)? else {
        return Ok(());
    };
    write6(sa, mapped, &t.dest);
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let seen = if mapped {
        [0, 0, MAPPED, t.dest.addr[0]]
    } else {
        t.dest.addr
    };
    remember_reply(cookie, FAMILY_V6, seen, t.dest.port, &key);
    Ok(())
}

/// Records that datagrams from `addr:port` to socket `cookie` are replies from `vip`. `family`
/// and `addr` are the socket's view (recvmsg4 or recvmsg6 sees the same words).
#[inline(always)]
pub fn remember_reply(cookie: u64, family: u8, addr: [u32; 4], port: u16, vip: &ServiceKey) {
    let key = UdpReverseKey {
        cookie,
        addr,
        port,
        family,
        _pad: [0; 5],
    };
    // SAFETY: read-only use before the program returns.
    if unsafe { UDP_REV_V1.get(&key) } == Some(vip) {
        return;
    }
    if UDP_REV_V1.insert(&key, vip, 0).is_err() {
        count(counters::UDP_REVERSE_RECORD_FAILED);
    }
}
