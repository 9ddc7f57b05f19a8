//! sockops' view of a socket's `SOCK_VIP_V2` entry (its local storage): which service it
//! dialled, what sockops follows of it, and the marks of what it was counted in.

use aya_ebpf::{helpers::bpf_sk_storage_get, programs::SockOpsContext};
use proxy_common::socket::{
    SOCK_VIP_F_COUNTED, SOCK_VIP_F_CX_COUNTED, SOCK_VIP_F_CX_LIMIT, SOCK_VIP_F_LEAST,
    SOCK_VIP_F_PASSIVE, SOCK_VIP_F_PROXIED, SockVip,
};

use crate::{limit, maps::SOCK_VIP_V2};

/// Counts the socket in its service's open connections (`max_connections`), marked so that
/// its close takes it back exactly once.
#[inline(always)]
pub fn count_limited(ctx: &SockOpsContext) {
    // SAFETY: a value of the socket's storage, valid while the program runs; the key is copied.
    let Some(key) = (unsafe { dialled(ctx).as_ref() }).map(|vip| vip.key) else {
        return;
    };
    if limit::opened(&key) {
        set_counted(ctx, SOCK_VIP_F_CX_COUNTED, true);
    }
}

/// Marks (or unmarks) the socket as counted: `bit` is `SOCK_VIP_F_COUNTED` (`ACTIVE_V1`) or
/// `SOCK_VIP_F_CX_COUNTED` (`CX_OPEN_V1`).
#[inline(always)]
pub fn set_counted(ctx: &SockOpsContext, bit: u32, counted: bool) {
    // SAFETY: the socket's own storage value, valid while the program runs; only this program
    // writes the flag, on the socket's own callbacks (which the kernel serialises).
    if let Some(vip) = unsafe { dialled(ctx).cast_mut().as_mut() } {
        if counted {
            vip.flags |= bit;
        } else {
            vip.flags &= !bit;
        }
    }
}

/// The socket's `SOCK_VIP_V2` entry: NULL when it dialled no service (or is no full socket).
/// Not hashed: the socket points at its storage, so this costs the same in a cgroup of a million
/// connections.
#[inline(always)]
pub fn dialled(ctx: &SockOpsContext) -> *const SockVip {
    // SAFETY: the context pointer is valid for the duration of the program; `sk` is NULL unless
    // the kernel has a full socket here (it always has at TCP_CONNECT_CB and STATE_CB).
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return core::ptr::null();
    }
    // aya-ebpf's `SkStorage` only takes a sock_addr context, so the helper is called directly,
    // with the map's address (relocated to the map by the loader). No flags: a read, never a
    // create. SAFETY: `sk` is a non-NULL full socket.
    unsafe {
        bpf_sk_storage_get(
            core::ptr::from_ref(&SOCK_VIP_V2).cast_mut().cast(),
            sk.cast(),
            core::ptr::null_mut(),
            0,
        )
    }
    .cast()
}

/// What sockops follows of the socket: its `SOCK_VIP_F_PROXIED`, `SOCK_VIP_F_PASSIVE`,
/// `SOCK_VIP_F_LEAST`, `SOCK_VIP_F_COUNTED` and `SOCK_VIP_F_CX_*` bits (0 for a socket that
/// dialled no service). Only a proxied socket has an original destination
/// to move at ESTABLISHED and to remove at CLOSE (a kernel-path socket would pay a missing
/// lookup in `SOCK_ORIG_V1` and one in `ORIG_DST_V1` for nothing), and only a passive one is
/// counted.
#[inline(always)]
pub fn followed(ctx: &SockOpsContext) -> u32 {
    // SAFETY: a value of the socket's storage, valid while the program runs; one field is read.
    unsafe { dialled(ctx).as_ref() }.map_or(0, |v| {
        v.flags
            & (SOCK_VIP_F_PROXIED
                | SOCK_VIP_F_PASSIVE
                | SOCK_VIP_F_LEAST
                | SOCK_VIP_F_COUNTED
                | SOCK_VIP_F_CX_LIMIT
                | SOCK_VIP_F_CX_COUNTED)
    })
}
