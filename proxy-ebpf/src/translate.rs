//! What the sock_addr hooks share: the choice of a target for a service key (a backend, or the
//! proxy listener). The key of a syscall's address and writing an address back are in
//! [`crate::sock_addr`].

use aya_ebpf::{EbpfContext as _, programs::SockAddrContext};
use proxy_common::{
    abi, counters,
    service::{
        Backend, HASH_KEY_CGROUP, HASH_KEY_PROCESS, HASH_KEY_SOCKET, HASH_KEY_USER,
        SERVICE_F_CX_LIMIT, SERVICE_F_DROP, SERVICE_F_END, SERVICE_F_LEAST_REQUEST,
        SERVICE_F_MAGLEV, SERVICE_F_NO_PROXY_DIALLED, SERVICE_F_NO_PROXY_HOSTS, SERVICE_F_PANIC,
        SERVICE_F_PASSIVE, SERVICE_F_PROXY, Service, ServiceKey, hash_key_of,
    },
};

use crate::{
    drop_overload, features, limit, listener, log,
    maps::{SERVICES_V2, ServiceOutcome, count, count_service},
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
    /// The hook family is connect4/6 (else sendmsg4/6), for log records. A flag, not the
    /// record's text: the verifier cannot follow a string pointer read from a struct.
    pub connect: bool,
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
    /// The connection counts in its service's open connections (`SERVICE_F_CX_LIMIT`).
    pub limited: bool,
    /// The socket is recorded for host ending (`SERVICE_F_END`, kernel path only).
    pub end: bool,
}

/// Re-reads of a service whose generation moved on while a program was choosing (see
/// [`target`]).
const RETRIES: u32 = 3;

/// Where `key` goes: `Ok(None)` when the syscall must proceed untouched. Proxy mode and
/// `max_connections` apply when `allow_proxy` (TCP connects); everything else selects a
/// backend (`ROTATE`: see [`choose`]).
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
        match to_proxy(ctx, svc, key)? {
            Proxied::Listener(t) => return Ok(Some(t)),
            Proxied::Dialled => return Ok(None),
            Proxied::Hosts => {}
        }
    }
    // Envoy drops before the circuit breakers are asked.
    if allow_proxy && svc.flags & SERVICE_F_DROP != 0 && !drop_overload::admit(key) {
        return Err(Refuse);
    }
    if allow_proxy && svc.flags & SERVICE_F_CX_LIMIT != 0 && !limit::admit(key) {
        return Err(Refuse);
    }
    let client = client_key(ctx, svc.flags);
    let Some((dest, flags)) = backend::<ROTATE>(key, svc, client, outcomes)? else {
        return Ok(None);
    };
    if dest.family != key.family {
        count(counters::CONNECT_FAMILY_MISMATCH);
        log::service!(error, ERROR, key, "host of other family; not rewritten");
        return Ok(None);
    }
    count(outcomes.rewritten);
    Ok(Some(to_host(svc.id, dest, flags)))
}

/// What consistent hashing keys on for a service with `flags` (`SERVICE_HASH_KEY_MASK`); 0
/// for a service that does not hash (only consistent hashing reads a key of the client).
/// The daemon publishes a process or cgroup key only when the loader found its helper; on a
/// kernel without it the branch is dead, and the verifier never sees the call.
#[inline(always)]
fn client_key(ctx: &SockAddrContext, flags: u32) -> u64 {
    if flags & SERVICE_F_MAGLEV == 0 {
        return 0;
    }
    match hash_key_of(flags) {
        // Without the helper (never published so: the daemon refuses the service) every
        // client has key 0 rather than another key.
        HASH_KEY_CGROUP if !features::has(abi::features::CURRENT_CGROUP_ID) => 0,
        HASH_KEY_PROCESS if !features::has(abi::features::CURRENT_PID_TGID) => 0,
        HASH_KEY_CGROUP => {
            // SAFETY: a helper without arguments or side effects.
            unsafe { aya_ebpf::helpers::bpf_get_current_cgroup_id() }
        }
        // The thread-group id is the high half.
        HASH_KEY_PROCESS => aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32,
        // The uid is the low half.
        HASH_KEY_USER => aya_ebpf::helpers::bpf_get_current_uid_gid() & 0xffff_ffff,
        HASH_KEY_SOCKET => {
            // SAFETY: the helper only reads the context, which is valid.
            unsafe { aya_ebpf::helpers::bpf_get_socket_cookie(ctx.as_ptr()) }
        }
        _ => {
            // SAFETY: the helper only reads the context, which is valid.
            unsafe { aya_ebpf::helpers::bpf_get_netns_cookie(ctx.as_ptr()) }
        }
    }
}

/// Where a proxy-mode connect goes.
enum Proxied {
    /// To the proxy listener.
    Listener(Target),
    /// No proxy listens: to the address dialled (`SERVICE_F_NO_PROXY_DIALLED`).
    Dialled,
    /// No proxy listens: to a host, chosen as for a direct service (`SERVICE_F_NO_PROXY_HOSTS`).
    Hosts,
}

/// A proxy-mode service: the proxy listener while one is there ([`listener::live`]); else the
/// kernel path's answer where the daemon published one, and a refusal where it did not (an
/// HTTP-routed service, which only the proxy can serve). Counted for the service.
#[inline(always)]
fn to_proxy(ctx: &SockAddrContext, svc: &Service, key: &ServiceKey) -> Result<Proxied, Refuse> {
    if let Some(dest) = listener::live(ctx, key) {
        count(counters::CONNECT_PROXY_REDIRECTED);
        count_service(svc.id, ServiceOutcome::ToProxy);
        return Ok(Proxied::Listener(Target {
            dest,
            proxied: true,
            passive: false,
            least: false,
            limited: false,
            end: false,
        }));
    }
    if svc.flags & (SERVICE_F_NO_PROXY_HOSTS | SERVICE_F_NO_PROXY_DIALLED) == 0 {
        count(counters::CONNECT_PROXY_NO_LISTENER);
        count_service(svc.id, ServiceOutcome::NoHost);
        log::service!(warn, WARN, key, "connect refused: no proxy listener");
        return Err(Refuse);
    }
    count(counters::CONNECT_PROXY_ABSENT_DIRECT);
    if svc.flags & SERVICE_F_NO_PROXY_HOSTS != 0 {
        return Ok(Proxied::Hosts);
    }
    count_service(svc.id, ServiceOutcome::ToHost);
    Ok(Proxied::Dialled)
}

/// The chosen backend `dest` of service `id`, whose entry had `flags`, counted for the service.
#[inline(always)]
fn to_host(id: u32, dest: Backend, flags: u32) -> Target {
    let outcome = if flags & SERVICE_F_PANIC != 0 {
        ServiceOutcome::ToHostInPanic
    } else {
        ServiceOutcome::ToHost
    };
    count_service(id, outcome);
    Target {
        dest,
        proxied: false,
        passive: flags & SERVICE_F_PASSIVE != 0,
        least: flags & SERVICE_F_LEAST_REQUEST != 0,
        limited: flags & SERVICE_F_CX_LIMIT != 0,
        end: flags & SERVICE_F_END != 0,
    }
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
    client: u64,
    outcomes: &Outcomes,
) -> Result<Option<(Backend, u32)>, Refuse> {
    let mut attempt = 0;
    loop {
        match choose::<ROTATE>(svc, client) {
            Ok(backend) => return Ok(Some((*backend, svc.flags))),
            Err(NoBackend::Missing) => {
                count(counters::CONNECT_BACKEND_MISSING);
                log::service!(error, ERROR, key, "slot names a missing backend");
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
                if outcomes.connect {
                    log::service!(warn, WARN, key, "connect refused: no routable host");
                } else {
                    log::service!(warn, WARN, key, "datagram refused: no routable host");
                }
                count_service(svc.id, ServiceOutcome::NoHost);
                return Err(Refuse);
            }
            // Removed meanwhile: no longer a service.
            None => return Ok(None),
        }
    }
}
