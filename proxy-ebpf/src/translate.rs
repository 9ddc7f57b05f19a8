//! What the sock_addr hooks share: the service key of the syscall's address, the choice of a
//! target (a backend, or the proxy listener), and writing an address back with the 4-byte stores
//! the verifier accepts.

use aya_ebpf::{EbpfContext as _, bindings::bpf_sock_addr, programs::SockAddrContext};
use proxy_common::{
    counters,
    service::{
        Backend, FAMILY_V4, FAMILY_V6, SERVICE_F_LEAST_REQUEST, SERVICE_F_MAGLEV, SERVICE_F_PANIC,
        SERVICE_F_PASSIVE, SERVICE_F_PROXY, Service, ServiceKey,
    },
};

use crate::{
    maps::{SERVICES_V2, ServiceOutcome, count, count_service, settings},
    select::{NoBackend, choose},
};

/// The destination is a service that cannot be served; the syscall fails with EPERM.
pub struct Refuse;

/// Counter indices of one hook family's outcomes.
pub struct Outcomes {
    /// A service address was rewritten to a backend.
    pub rewritten: u32,
    /// Not a service.
    pub not_service: u32,
    /// A service with no routable host.
    pub no_host: u32,
}

/// Where a service address goes.
pub struct Target {
    /// The backend, or the proxy listener.
    pub dest: Backend,
    /// `dest` is the proxy listener (proxy mode).
    pub proxied: bool,
    /// The connection feeds the passive health signal (`SERVICE_F_PASSIVE`, kernel path only).
    pub passive: bool,
    /// The connection counts in its backend's open connections (`SERVICE_F_LEAST_REQUEST`).
    pub least: bool,
}

/// Re-reads of a service whose generation moved on while a program was choosing (see
/// [`target`]).
const RETRIES: u32 = 3;

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

/// Where `key` goes: `Ok(None)` when the syscall must proceed untouched. Proxy mode applies when
/// `allow_proxy` (TCP connects); everything else selects a backend (`ROTATE`: see
/// [`choose`]).
#[inline(always)]
pub fn target<const ROTATE: bool>(
    ctx: &SockAddrContext,
    key: &ServiceKey,
    outcomes: &Outcomes,
    allow_proxy: bool,
) -> Result<Option<Target>, Refuse> {
    // SAFETY: read-only use before the program returns; the map is not preallocated.
    let Some(svc) = (unsafe { SERVICES_V2.get(key) }) else {
        count(outcomes.not_service);
        return Ok(None);
    };
    if allow_proxy && svc.flags & SERVICE_F_PROXY != 0 {
        let redirect = proxy_listener(key.family);
        count_service(
            svc.id,
            if redirect.is_ok() {
                ServiceOutcome::ToProxy
            } else {
                ServiceOutcome::NoHost
            },
        );
        return redirect.map(Some);
    }
    // Only consistent hashing reads the client's network namespace.
    let netns = if svc.flags & SERVICE_F_MAGLEV != 0 {
        // SAFETY: the helper only reads the context, which is valid.
        unsafe { aya_ebpf::helpers::bpf_get_netns_cookie(ctx.as_ptr()) }
    } else {
        0
    };
    let Some((dest, flags)) = backend::<ROTATE>(key, svc, netns, outcomes)? else {
        return Ok(None);
    };
    if dest.family != key.family {
        count(counters::CONNECT_FAMILY_MISMATCH);
        return Ok(None);
    }
    count(outcomes.rewritten);
    count_service(
        svc.id,
        if flags & SERVICE_F_PANIC != 0 {
            ServiceOutcome::ToHostInPanic
        } else {
            ServiceOutcome::ToHost
        },
    );
    Ok(Some(Target {
        dest,
        proxied: false,
        passive: flags & SERVICE_F_PASSIVE != 0,
        least: flags & SERVICE_F_LEAST_REQUEST != 0,
    }))
}

/// A backend of `svc` (and the flags of the service entry it was chosen from); `Ok(None)` when
/// the service went away or names a backend that is not there (fail-open, counted).
///
/// The daemon frees a generation's tables a grace period after switching away from it; a
/// program that read the service long before that (preempted) finds them gone. Then the
/// service has a newer generation: it is read again, up to [`RETRIES`] times.
#[inline(always)]
fn backend<const ROTATE: bool>(
    key: &ServiceKey,
    mut svc: &Service,
    netns: u64,
    outcomes: &Outcomes,
) -> Result<Option<(Backend, u32)>, Refuse> {
    let mut attempt = 0;
    loop {
        match choose::<ROTATE>(svc, netns) {
            Ok(backend) => return Ok(Some((*backend, svc.flags))),
            Err(NoBackend::Missing) => {
                count(counters::CONNECT_BACKEND_MISSING);
                return Ok(None);
            }
            Err(NoBackend::NoHost) => {}
        }
        // SAFETY: read-only use before the program returns.
        match unsafe { SERVICES_V2.get(key) } {
            Some(again) if again.generation != svc.generation && attempt < RETRIES => {
                svc = again;
                attempt += 1;
            }
            Some(_) => {
                count(outcomes.no_host);
                count_service(svc.id, ServiceOutcome::NoHost);
                return Err(Refuse);
            }
            // Removed meanwhile: no longer a service.
            None => return Ok(None),
        }
    }
}

/// The proxy listener for clients of `family`; refused when the daemon has set none.
#[inline(always)]
fn proxy_listener(family: u8) -> Result<Target, Refuse> {
    let s = settings();
    let dest = if family == FAMILY_V4 {
        s.proxy_v4
    } else {
        s.proxy_v6
    };
    if dest.family != family {
        count(counters::CONNECT_PROXY_NO_LISTENER);
        return Err(Refuse);
    }
    count(counters::CONNECT_PROXY_REDIRECTED);
    Ok(Target {
        dest,
        proxied: true,
        passive: false,
        least: false,
    })
}
