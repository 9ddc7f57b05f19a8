//! Proxy mode's target: the daemon's proxy listener, and whether one is there to take a connect.
//!
//! `SETTINGS_V1` names the listener of each family while the daemon runs; the daemon withdraws
//! it when it stops. A daemon killed with `kill -9` (or dead of a fatal error) leaves it set
//! while nothing listens any more. So the settings alone cannot tell: the listener is looked up
//! with `bpf_sk_lookup_tcp` (cgroup sock_addr programs, Linux 5.2), one hash lookup in the
//! kernel's listening sockets, and only for proxy-mode connects.
//!
//! The lookup runs in the network namespace of the socket being connected. That answers only
//! for a listener on a loopback or unspecified address: a connect rewritten to one of those
//! stays in the client's own namespace, so nothing listening there means nothing can take it.
//! A listener on another address may be in another namespace, where the lookup cannot see:
//! such a listener counts as there whenever it is set (as before the lookup existed).

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_F_CURRENT_NETNS, bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2,
    },
    helpers::generated::{bpf_sk_lookup_tcp, bpf_sk_release},
    programs::SockAddrContext,
};
use proxy_common::service::{Backend, FAMILY_V4, ServiceKey};

use crate::maps::settings;

/// `::1`'s last word, network byte order.
const LOOPBACK6: u32 = u32::from_be(1);

/// The proxy listener for a client of `key`'s family, when one is there to take the connect:
/// set in the settings and, where the lookup can tell ([`checkable`]), listening. `None`: no
/// proxy can take it now.
#[inline(always)]
pub fn live(ctx: &SockAddrContext, key: &ServiceKey) -> Option<Backend> {
    let s = settings();
    let dest = if key.family == FAMILY_V4 {
        s.proxy_v4
    } else {
        s.proxy_v6
    };
    if dest.family != key.family {
        return None;
    }
    if checkable(&dest) && !listening(ctx, &dest) {
        return None;
    }
    Some(dest)
}

/// Whether `dest` is an address only the client's own network namespace can reach (loopback,
/// or unspecified, which a connect takes for the local host): then a lookup there answers.
#[inline(always)]
fn checkable(dest: &Backend) -> bool {
    let a = dest.addr;
    if dest.family == FAMILY_V4 {
        // Network byte order: the first octet is the lowest byte.
        return a[0] == 0 || a[0] & 0xff == 127;
    }
    a[0] == 0 && a[1] == 0 && a[2] == 0 && (a[3] == 0 || a[3] == LOOPBACK6)
}

/// Whether a TCP socket listens at `dest` in the network namespace of the socket being
/// connected. The tuple's source is zero: no established connection matches it, so a socket
/// found is a listener. Its reference is released at once.
#[inline(always)]
fn listening(ctx: &SockAddrContext, dest: &Backend) -> bool {
    let (mut tuple, size) = tuple_of(dest);
    // SAFETY: the helper reads `size` bytes of the tuple on this stack and returns a referenced
    // socket or NULL; a socket found is released before the program returns, as the verifier
    // requires.
    unsafe {
        let sk = bpf_sk_lookup_tcp(
            ctx.as_ptr(),
            &raw mut tuple,
            size,
            BPF_F_CURRENT_NETNS as u64,
            0,
        );
        if sk.is_null() {
            return false;
        }
        bpf_sk_release(sk.cast());
    }
    true
}

/// The lookup tuple of a connection to `dest` from nowhere, and its size for `dest`'s family
/// (the size tells the kernel which half of the union to read).
#[inline(always)]
fn tuple_of(dest: &Backend) -> (bpf_sock_tuple, u32) {
    // SAFETY: all-zero is a valid tuple (plain integers).
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    // Only the half of the union that `dest`'s family uses is written (and read by the kernel).
    if dest.family == FAMILY_V4 {
        tuple.__bindgen_anon_1.ipv4.daddr = dest.addr[0];
        tuple.__bindgen_anon_1.ipv4.dport = dest.port;
        return (
            tuple,
            size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>() as u32,
        );
    }
    tuple.__bindgen_anon_1.ipv6.daddr = dest.addr;
    tuple.__bindgen_anon_1.ipv6.dport = dest.port;
    (
        tuple,
        size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>() as u32,
    )
}
