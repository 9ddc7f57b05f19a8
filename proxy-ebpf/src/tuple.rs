//! A TCP connection's 4-tuple from the context of sockops or sk_msg, in the layout of
//! [`SockTuple`]. IPv4-mapped IPv6 connections are keyed as IPv4, so the proxy's IPv4 listener
//! and a dual-stack client agree on the key.

use aya_ebpf::bindings::bpf_sock_ops;
use proxy_common::{
    service::{Backend, FAMILY_V4, FAMILY_V6},
    socket::SockTuple,
};

use crate::sock_addr::MAPPED;

/// `AF_INET`.
const AF_INET: u32 = 2;
/// `AF_INET6`.
const AF_INET6: u32 = 10;

/// The address and port fields that `bpf_sock_ops` and `sk_msg_md` both have, as they have them:
/// `local_port` in host order, `remote_port` as the `__be16` in the upper 16 bits.
pub struct Fields {
    pub family: u32,
    pub local_ip4: u32,
    pub remote_ip4: u32,
    pub local_ip6: [u32; 4],
    pub remote_ip6: [u32; 4],
    pub local_port: u32,
    pub remote_port: u32,
}

/// The connection as this end sees it; `None` for a family that is neither IPv4 nor IPv6.
#[inline(always)]
pub fn from_fields(f: &Fields) -> Option<SockTuple> {
    let (family, local, remote) = match f.family {
        AF_INET => (FAMILY_V4, [f.local_ip4, 0, 0, 0], [f.remote_ip4, 0, 0, 0]),
        AF_INET6 if is_mapped(&f.local_ip6) && is_mapped(&f.remote_ip6) => (
            FAMILY_V4,
            [f.local_ip6[3], 0, 0, 0],
            [f.remote_ip6[3], 0, 0, 0],
        ),
        AF_INET6 => (FAMILY_V6, f.local_ip6, f.remote_ip6),
        _ => return None,
    };
    Some(SockTuple {
        local,
        remote,
        local_port: (f.local_port as u16).to_be(),
        remote_port: (f.remote_port >> 16) as u16,
        family,
        _pad: [0; 3],
    })
}

/// Whether both ends are on this host (in this network namespace): the remote address is a
/// loopback address or the local address itself.
#[inline(always)]
pub fn is_local(t: &SockTuple) -> bool {
    if t.remote == t.local {
        return true;
    }
    if t.family == FAMILY_V4 {
        u32::from_be(t.remote[0]) >> 24 == 127
    } else {
        t.remote[0] == 0 && t.remote[1] == 0 && t.remote[2] == 0 && t.remote[3] == 1u32.to_be()
    }
}

/// Reads a context's IPv6 address one word at a time (the verifier accepts only 4-byte loads of
/// these fields; a plain copy may become 8-byte loads).
#[inline(always)]
pub fn words(ip6: *const [u32; 4]) -> [u32; 4] {
    let p = ip6.cast::<u32>();
    // SAFETY: the caller passes a pointer to an array field of a valid context.
    unsafe {
        [
            core::ptr::read_volatile(p),
            core::ptr::read_volatile(p.add(1)),
            core::ptr::read_volatile(p.add(2)),
            core::ptr::read_volatile(p.add(3)),
        ]
    }
}

#[inline(always)]
fn is_mapped(ip6: &[u32; 4]) -> bool {
    ip6[0] == 0 && ip6[1] == 0 && ip6[2] == MAPPED
}

/// The connection as a sockops socket sees it.
#[inline(always)]
pub fn from_ops(ops: &bpf_sock_ops) -> Option<SockTuple> {
    from_fields(&Fields {
        family: ops.family,
        local_ip4: ops.local_ip4,
        remote_ip4: ops.remote_ip4,
        local_ip6: words(&raw const ops.local_ip6),
        remote_ip6: words(&raw const ops.remote_ip6),
        local_port: ops.local_port,
        remote_port: ops.remote_port,
    })
}

/// The remote end of a connection, as the backend the passive signal and the open-connection
/// counts are kept for.
#[inline(always)]
pub fn remote(t: &SockTuple) -> Backend {
    Backend {
        addr: t.remote,
        port: t.remote_port,
        family: t.family,
        _pad: 0,
    }
}
