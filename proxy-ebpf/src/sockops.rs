//! `sockops`: TCP lifecycle events of sockets in the cgroup.
//!
//! - `TCP_CONNECT_CB`: a socket that dialled a service (it has a `SOCK_VIP_V2` entry in its local
//!   storage) in proxy mode (`SOCK_VIP_F_PROXIED`: cleanup) or with passive health
//!   (`SOCK_VIP_F_PASSIVE`: its cluster has outlier detection) asks for state-change callbacks.
//!   For every other socket of the cgroup this is a read of the socket's storage.
//! - `ACTIVE_ESTABLISHED_CB`: a proxy-mode connection's (`SOCK_VIP_F_PROXIED` in its storage)
//!   original destination moves from the socket cookie (`SOCK_ORIG_V1`) to the client's 4-tuple
//!   (`ORIG_DST_V1`), where the proxy finds it from `accept()`; then, like
//!   `PASSIVE_ESTABLISHED_CB`, the socket is added to the splice sockhash `SPLICE_V1` when
//!   splicing is on and both ends are on this host. For a passive socket the backend's run of
//!   failures in `PASSIVE_RUN_V1` ends (the connect succeeded). A socket that is not followed
//!   (it did not ask for `STATE_CB`) only gets the splice switch checked: the cgroup's other
//!   connections pay one array-sized lookup here, nothing more.
//! - `STATE_CB` to `CLOSE`: a proxy-mode socket's `ORIG_DST_V1` entry is removed, so it does
//!   not grow with the number of connections (the `SOCK_VIP_V2` entry goes with the socket).
//!   For a passive socket, SYN_SENT -> CLOSE counts a failed connect for the backend,
//!   ESTABLISHED or CLOSE_WAIT -> CLOSE a reset (received or sent; a FIN handshake passes
//!   through FIN_WAIT or LAST_ACK instead), and either extends the backend's run in
//!   `PASSIVE_RUN_V1` (the accounting is in [`crate::passive`]).
//!
//! Contract: fail-open, always: this program never changes a connection's fate; a failure only
//! costs the feature (counted). Minimum kernel 4.13 (sockops), 4.16 (`STATE_CB`), 4.18
//! (sockhash), 5.3 (`bpf_sock_ops.sk`, `bpf_sk_storage_get`), 5.7 for attaching through
//! bpf_link. Reads `SOCK_VIP_V2`, `SOCK_ORIG_V1`, `SETTINGS_V1`, `SERVICES_V2`; writes
//! `ORIG_DST_V1`, `SOCK_ORIG_V1`, `SPLICE_V1`, `PASSIVE_V1`, `PASSIVE_RUN_V1`, `ACTIVE_V1`,
//! `CX_OPEN_V1` (open connections, [`crate::limit`]), `COUNTERS_V2`, `SVC_COUNTERS_V3`.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_ANY, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB,
        BPF_TCP_CLOSE,
    },
    helpers::bpf_get_socket_cookie,
    macros::sock_ops,
    programs::SockOpsContext,
};
use proxy_common::{
    counters,
    socket::{
        SETTINGS_F_SPLICE, SETTINGS_KEY, SOCK_VIP_F_COUNTED, SOCK_VIP_F_CX_COUNTED,
        SOCK_VIP_F_CX_LIMIT, SOCK_VIP_F_LEAST, SOCK_VIP_F_PASSIVE, SOCK_VIP_F_PROXIED, SockTuple,
    },
};

use crate::{
    active::active_add,
    limit, log,
    maps::{ORIG_DST_V1, SETTINGS_V1, SOCK_ORIG_V1, SPLICE_V1, count},
    passive,
    sock_vip::{count_limited, dialled, followed, set_counted},
    tuple,
};

/// Return value of a sockops program; only meaningful for ops that ask for a reply.
const DONE: u32 = 1;

/// A failure, as the counter that records it.
struct Failed(u32);

#[sock_ops]
pub fn proxy_sockops(ctx: SockOpsContext) -> u32 {
    if let Err(Failed(counter)) = try_sockops(&ctx) {
        count(counter);
    }
    DONE
}

fn try_sockops(ctx: &SockOpsContext) -> Result<(), Failed> {
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => watch(ctx),
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            // Only a socket that is followed asked for state callbacks (`watch`); every other
            // socket of the cgroup gets here too, and must cost no more than the splice switch:
            // no tuple, no cookie, no lookup.
            if ctx.cb_flags() & BPF_SOCK_OPS_STATE_CB_FLAG == 0 {
                return splice(ctx);
            }
            let flags = followed(ctx);
            let t = conn(ctx)?;
            if flags & SOCK_VIP_F_PASSIVE != 0 {
                passive::end_run(&tuple::remote(&t));
            }
            if flags & SOCK_VIP_F_PROXIED == 0 {
                return splice(ctx);
            }
            // A failed re-key must not cost the splice (and the other way round).
            let rekeyed = rekey_orig_dst(ctx, &t);
            splice(ctx).and(rekeyed)
        }
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => splice(ctx),
        BPF_SOCK_OPS_STATE_CB if ctx.arg(1) == BPF_TCP_CLOSE => closed(ctx, ctx.arg(0)),
        _ => Ok(()),
    }
}

/// Asks for state callbacks on sockets that dialled a service and are followed: proxy mode
/// (cleanup of the original destination), passive health (`SOCK_VIP_F_PASSIVE`) or
/// LEAST_REQUEST (`SOCK_VIP_F_LEAST`: the socket is counted in its backend's open connections
/// until it closes) or `max_connections` (`SOCK_VIP_F_CX_LIMIT`: counted in its service's).
/// Others, among them every kernel-path connection to a cluster without outlier detection, cost
/// nothing more.
#[inline(always)]
fn watch(ctx: &SockOpsContext) -> Result<(), Failed> {
    let followed = followed(ctx);
    if followed == 0 {
        return Ok(());
    }
    let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG;
    ctx.set_cb_flags(flags as i32)
        .map_err(|_| Failed(counters::SOCKOPS_CB_FLAGS_FAILED))?;
    // Counted only once the close callback is sure to come, and marked, so that it is taken
    // back exactly once.
    if followed & SOCK_VIP_F_CX_LIMIT != 0 {
        count_limited(ctx);
    }
    if followed & SOCK_VIP_F_LEAST != 0 && active_add(&tuple::remote(&conn(ctx)?), 1) {
        set_counted(ctx, SOCK_VIP_F_COUNTED, true);
    }
    Ok(())
}

/// Moves a proxied connection's original destination from its cookie to its 4-tuple.
#[inline(always)]
fn rekey_orig_dst(ctx: &SockOpsContext, t: &SockTuple) -> Result<(), Failed> {
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: the value is copied out before the program returns.
    let Some(vip) = (unsafe { SOCK_ORIG_V1.get(&cookie) }).copied() else {
        return Ok(());
    };
    let _ = SOCK_ORIG_V1.remove(&cookie);
    if ORIG_DST_V1.insert(t, &vip, 0).is_err() {
        log::service!(warn, WARN, &vip, "original destination not re-keyed");
        return Err(Failed(counters::ORIG_DST_REKEY_FAILED));
    }
    count(counters::ORIG_DST_REKEYED);
    Ok(())
}

/// Adds an established local socket to the splice sockhash, when splicing is on. The switch
/// is read first: with splicing off (the default) this is one lookup.
#[inline(always)]
fn splice(ctx: &SockOpsContext) -> Result<(), Failed> {
    if !splice_on() {
        return Ok(());
    }
    let mut t = conn(ctx)?;
    if !tuple::is_local(&t) {
        return Ok(());
    }
    // SAFETY: the context pointer is valid for the duration of the program.
    let ops = unsafe { &mut *ctx.ops };
    SPLICE_V1
        .update(&mut t, ops, u64::from(BPF_ANY))
        .map_err(|_| Failed(counters::SOCKHASH_INSERT_FAILED))?;
    count(counters::SOCKHASH_INSERTED);
    Ok(())
}

/// A watched socket reached CLOSE from `old`: its open-connection count taken back, cleanup of
/// the original destination, then the passive health signal.
#[inline(always)]
fn closed(ctx: &SockOpsContext, old: u32) -> Result<(), Failed> {
    let flags = followed(ctx);
    let t = conn(ctx)?;
    if flags & SOCK_VIP_F_COUNTED != 0 {
        // Adding u64::MAX is taking one back.
        active_add(&tuple::remote(&t), u64::MAX);
        set_counted(ctx, SOCK_VIP_F_COUNTED, false);
    }
    if flags & SOCK_VIP_F_CX_COUNTED != 0 {
        // SAFETY: a value of the socket's storage, valid while the program runs.
        if let Some(vip) = unsafe { dialled(ctx).as_ref() } {
            limit::closed(&vip.key);
        }
        set_counted(ctx, SOCK_VIP_F_CX_COUNTED, false);
    }
    if flags & SOCK_VIP_F_PROXIED != 0 && ORIG_DST_V1.remove(&t).is_ok() {
        count(counters::ORIG_DST_REMOVED);
    }
    if flags & SOCK_VIP_F_PASSIVE == 0 {
        return Ok(());
    }
    // SAFETY: a value of the socket's storage, valid while the program runs.
    if let Some(vip) = unsafe { dialled(ctx).as_ref() }.filter(|_| passive::is_failure(old)) {
        passive::service_failed(&vip.key);
    }
    passive::closed(&tuple::remote(&t), old)
        .map_err(|passive::NotRecorded| Failed(counters::PASSIVE_RECORD_FAILED))
}

/// The connection as this socket sees it.
#[inline(always)]
fn conn(ctx: &SockOpsContext) -> Result<SockTuple, Failed> {
    // SAFETY: the context pointer is valid for the duration of the program.
    tuple::from_ops(unsafe { &*ctx.ops }).ok_or(Failed(counters::SOCKHASH_INSERT_FAILED))
}

/// Whether the daemon turned splicing on (read in place: the settings are not copied).
#[inline(always)]
fn splice_on() -> bool {
    // SAFETY: one field is read before the program returns.
    unsafe { SETTINGS_V1.get(&SETTINGS_KEY) }.is_some_and(|s| s.flags & SETTINGS_F_SPLICE != 0)
}
