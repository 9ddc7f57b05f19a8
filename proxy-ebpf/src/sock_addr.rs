//! A sock_addr hook's syscall address: the service key it names, and writing an address back,
//! with the 4-byte loads and stores of the context the verifier accepts.

use aya_ebpf::bindings::bpf_sock_addr;
use proxy_common::service::{Backend, FAMILY_V4, FAMILY_V6, ServiceKey};

/// `ffff` in the third word of an IPv4-mapped IPv6 address, network byte order.
pub const MAPPED: u32 = u32::from_be(0x0000_ffff);

/// The service key of an IPv4 syscall address.
#[inline(always)]
pub fn key4(sa: &bpf_sock_addr) -> ServiceKey {
    ServiceKey {
        addr: [sa.user_ip4, 0, 0, 0],
        port: sa.user_port as u16,
        proto: sa.protocol as u8,
        family: FAMILY_V4,
    }
}

/// The service key of an IPv6 syscall address, and whether it is IPv4-mapped (then the key is
/// the IPv4 service: a dual-stack socket dialling an IPv4 address).
#[inline(always)]
pub fn key6(sa: &bpf_sock_addr) -> (ServiceKey, bool) {
    let ip6 = user_ip6(sa);
    let mapped = ip6[0] == 0 && ip6[1] == 0 && ip6[2] == MAPPED;
    let key = ServiceKey {
        addr: if mapped { [ip6[3], 0, 0, 0] } else { ip6 },
        port: sa.user_port as u16,
        proto: sa.protocol as u8,
        family: if mapped { FAMILY_V4 } else { FAMILY_V6 },
    };
    (key, mapped)
}

/// Reads `bpf_sock_addr.user_ip6` one word at a time: the verifier accepts only 4-byte loads
/// of it, and the compiler may merge plain reads of neighbouring words into 8-byte loads.
#[inline(always)]
pub fn user_ip6(sa: &bpf_sock_addr) -> [u32; 4] {
    // SAFETY: each pointer is a field of the valid context; volatile keeps the 4-byte loads.
    unsafe {
        [
            core::ptr::read_volatile(&raw const sa.user_ip6[0]),
            core::ptr::read_volatile(&raw const sa.user_ip6[1]),
            core::ptr::read_volatile(&raw const sa.user_ip6[2]),
            core::ptr::read_volatile(&raw const sa.user_ip6[3]),
        ]
    }
}

/// Writes `dest` into an IPv4 syscall address.
#[inline(always)]
pub fn write4(sa: &mut bpf_sock_addr, dest: &Backend) {
    sa.user_ip4 = dest.addr[0];
    // The verifier refuses 2-byte stores to user_port: write the whole word.
    sa.user_port = u32::from(dest.port);
}

/// Writes `dest` into an IPv6 syscall address, IPv4-mapped when `mapped`.
#[inline(always)]
pub fn write6(sa: &mut bpf_sock_addr, mapped: bool, dest: &Backend) {
    if mapped {
        set_user_ip6(sa, [0, 0, MAPPED, dest.addr[0]]);
    } else {
        set_user_ip6(sa, dest.addr);
    }
    sa.user_port = u32::from(dest.port);
}

/// Writes `bpf_sock_addr.user_ip6` one word at a time: the verifier accepts only 4-byte stores
/// at fixed offsets of the context, and a plain array assignment may be lowered to a memcpy.
#[inline(always)]
pub fn set_user_ip6(sa: &mut bpf_sock_addr, words: [u32; 4]) {
    // SAFETY: each pointer is a field of the valid context; volatile keeps the 4-byte stores.
    unsafe {
        core::ptr::write_volatile(&raw mut sa.user_ip6[0], words[0]);
        core::ptr::write_volatile(&raw mut sa.user_ip6[1], words[1]);
        core::ptr::write_volatile(&raw mut sa.user_ip6[2], words[2]);
        core::ptr::write_volatile(&raw mut sa.user_ip6[3], words[3]);
    }
}
