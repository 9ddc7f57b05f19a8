//! Indices of the per-CPU counter array `COUNTERS_V2`. Every outcome of a hook and every error it
//! can meet has one; the daemon sums them over CPUs and exports them under `/stats`.
//!
//! `NAMES[i]` is the exported name of index `i`; a unit test keeps the two lists in step.
//!
//! Per service, `SVC_COUNTERS_V3` (a per-CPU hash by `Service::id`) holds [`ServiceCounts`]: the
//! same outcomes, for the one service, exported with its name.

/// connect4/6: a service address was rewritten to a chosen host.
pub const CONNECT_REWRITTEN: u32 = 0;
/// connect4/6: the destination is not a service; the connect proceeds untouched.
pub const CONNECT_NOT_SERVICE: u32 = 1;
/// connect4/6: the service has no routable host in any priority; the connect is refused.
pub const CONNECT_NO_HOST: u32 = 2;
/// connect4/6 (and sendmsg4/6): a slot points at a backend id that is not in the backend map (a
/// publishing bug); the syscall proceeds untouched (fail-open).
pub const CONNECT_BACKEND_MISSING: u32 = 3;
/// connect4/6 (and sendmsg4/6): the chosen backend's family differs from the socket's; proceeds
/// untouched.
pub const CONNECT_FAMILY_MISMATCH: u32 = 4;
/// connect4/6: a proxy-mode service was redirected to the daemon's listener.
pub const CONNECT_PROXY_REDIRECTED: u32 = 5;
/// connect4/6: a proxy-mode service, but no proxy listener of the socket's family is there
/// (none set, or none listening at the address set) and the service has no kernel fallback
/// (an HTTP-routed service); refused.
pub const CONNECT_PROXY_NO_LISTENER: u32 = 6;
/// connect4/6: recording the original destination under the socket cookie failed.
pub const ORIG_DST_RECORD_FAILED: u32 = 7;
/// sendmsg4/6: an unconnected UDP datagram to a service was sent to a chosen host.
pub const SENDMSG_REWRITTEN: u32 = 8;
/// sendmsg4/6: the destination is not a service; the datagram goes out untouched.
pub const SENDMSG_NOT_SERVICE: u32 = 9;
/// sendmsg4/6: the service has no routable host; the send fails with EPERM.
pub const SENDMSG_NO_HOST: u32 = 10;
/// sendmsg4/6 and connect4/6 (UDP): recording the reverse translation failed.
pub const UDP_REVERSE_RECORD_FAILED: u32 = 11;
/// recvmsg4/6: a reply from a backend was shown as coming from the service address.
pub const RECVMSG_REWRITTEN: u32 = 12;
/// getpeername4/6: the service address was shown instead of the backend.
pub const GETPEERNAME_REWRITTEN: u32 = 13;
/// sockops: a proxied connection's original destination was re-keyed by its 4-tuple.
pub const ORIG_DST_REKEYED: u32 = 14;
/// sockops: writing the 4-tuple entry failed; the proxy will not find the original destination.
pub const ORIG_DST_REKEY_FAILED: u32 = 15;
/// sockops: a closed connection's 4-tuple entry was removed.
pub const ORIG_DST_REMOVED: u32 = 16;
/// sockops: an established local socket was added to the splice sockhash.
pub const SOCKHASH_INSERTED: u32 = 17;
/// sockops: adding a socket to the splice sockhash failed; it is not spliced.
pub const SOCKHASH_INSERT_FAILED: u32 = 18;
/// sockops: setting the state-change callback flag failed (no passive health, no cleanup).
pub const SOCKOPS_CB_FLAGS_FAILED: u32 = 19;
/// sk_msg: a message was redirected straight to the peer socket.
pub const SK_MSG_REDIRECTED: u32 = 20;
/// sk_msg: the peer socket is not in the sockhash; the message takes the TCP path.
pub const SK_MSG_REDIRECT_FAILED: u32 = 21;
/// sockops: a connect to a backend failed (SYN_SENT -> CLOSE).
pub const PASSIVE_CONNECT_FAILED: u32 = 22;
/// sockops: an established connection to a backend was reset or aborted.
pub const PASSIVE_RESET: u32 = 23;
/// sockops: updating the per-backend passive counters failed.
pub const PASSIVE_RECORD_FAILED: u32 = 24;
/// pair_verdict: bytes a spliced proxy socket received were redirected out of its peer.
pub const PAIR_REDIRECTED: u32 = 25;
/// pair_verdict: a spliced proxy socket's peer is not in `PAIR_PEER_V2`; the bytes are dropped
/// (the daemon is tearing the pair down).
pub const PAIR_REDIRECT_FAILED: u32 = 26;
/// pair_verdict: bytes a spliced proxy socket received were passed to the daemon to copy (the
/// peer used up its credit: backpressure).
pub const PAIR_PASSED: u32 = 27;
/// connect4/6: a service held to `max_connections` (`SERVICE_F_CX_LIMIT`) had that many open
/// connections; the connect is refused (Envoy's `upstream_cx_overflow`).
pub const CONNECT_CX_OVERFLOW: u32 = 28;
/// connect4/6: a service with a drop overload (`SERVICE_F_DROP`) drew a drop; the connect is
/// refused (Envoy's `upstream_rq_drop_overload`).
pub const CONNECT_DROP_OVERLOAD: u32 = 29;
/// connect4/6: a proxy-mode service while no proxy listener of the socket's family is there
/// (the daemon stopped, was killed, or has not listened yet): the connect was served as the
/// kernel path serves (`SERVICE_F_NO_PROXY_HOSTS`: a host of its levels; or
/// `SERVICE_F_NO_PROXY_DIALLED`: the address dialled) instead of refused.
pub const CONNECT_PROXY_ABSENT_DIRECT: u32 = 30;
/// connect4/6: the backend of a socket of a `SERVICE_F_END` service could not be recorded in
/// `SOCK_HOST_V2`; that socket is not ended when its host leaves.
pub const SOCK_HOST_RECORD_FAILED: u32 = 31;
/// connect4/6: a kernel-path connect could not be counted for its host in `HOST_CX_V1` (no
/// memory for a new entry); the connect proceeds, and that host's `cx_total` misses it.
pub const HOST_CX_RECORD_FAILED: u32 = 32;

/// Number of counters; the size of `COUNTERS_V2` (room to grow without a layout change).
pub const COUNT: u32 = 64;

/// Names used by the daemon when it exports the counters, indexed like the constants above.
pub const NAMES: [&str; 33] = [
    "connect_rewritten",
    "connect_not_service",
    "connect_no_host",
    "connect_backend_missing",
    "connect_family_mismatch",
    "connect_proxy_redirected",
    "connect_proxy_no_listener",
    "orig_dst_record_failed",
    "sendmsg_rewritten",
    "sendmsg_not_service",
    "sendmsg_no_host",
    "udp_reverse_record_failed",
    "recvmsg_rewritten",
    "getpeername_rewritten",
    "orig_dst_rekeyed",
    "orig_dst_rekey_failed",
    "orig_dst_removed",
    "sockhash_inserted",
    "sockhash_insert_failed",
    "sockops_cb_flags_failed",
    "sk_msg_redirected",
    "sk_msg_redirect_failed",
    "passive_connect_failed",
    "passive_reset",
    "passive_record_failed",
    "pair_redirected",
    "pair_redirect_failed",
    "pair_passed",
    "connect_cx_overflow",
    "connect_drop_overload",
    "connect_proxy_absent_direct",
    "sock_host_record_failed",
    "host_cx_record_failed",
];
const _: () = assert!(NAMES.len() as u32 <= COUNT);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_indices() {
        assert_eq!(NAMES[CONNECT_REWRITTEN as usize], "connect_rewritten");
        assert_eq!(
            NAMES[ORIG_DST_RECORD_FAILED as usize],
            "orig_dst_record_failed"
        );
        assert_eq!(
            NAMES[GETPEERNAME_REWRITTEN as usize],
            "getpeername_rewritten"
        );
        assert_eq!(
            NAMES[SOCKOPS_CB_FLAGS_FAILED as usize],
            "sockops_cb_flags_failed"
        );
        assert_eq!(
            NAMES[PASSIVE_RECORD_FAILED as usize],
            "passive_record_failed"
        );
        assert_eq!(NAMES[PAIR_REDIRECT_FAILED as usize], "pair_redirect_failed");
        assert_eq!(NAMES[PAIR_PASSED as usize], "pair_passed");
        assert_eq!(NAMES[CONNECT_CX_OVERFLOW as usize], "connect_cx_overflow");
        assert_eq!(
            NAMES[CONNECT_DROP_OVERLOAD as usize],
            "connect_drop_overload"
        );
        assert_eq!(
            NAMES[CONNECT_PROXY_ABSENT_DIRECT as usize],
            "connect_proxy_absent_direct"
        );
        assert_eq!(
            NAMES[SOCK_HOST_RECORD_FAILED as usize],
            "sock_host_record_failed"
        );
        assert_eq!(
            NAMES[HOST_CX_RECORD_FAILED as usize],
            "host_cx_record_failed"
        );
        assert_eq!(NAMES.len(), HOST_CX_RECORD_FAILED as usize + 1);
    }
}

/// Value of `SVC_COUNTERS_V3` (per CPU, by `Service::id`): what happened to the connects and
/// datagrams addressed to one service. The hooks create a service's entry on its first use; the
/// daemon deletes it with the service. A service's clusters count as having carried traffic
/// (Envoy's "no traffic" health-check interval ends) once `to_host` or `to_proxy` moved. `_V2`:
/// `panic` was added; `_V3`: `passive_failures`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceCounts {
    /// Connects (connect4/6) and unconnected datagrams (sendmsg4/6) sent to a chosen host.
    pub to_host: u64,
    /// Connects redirected to the daemon's proxy listener (proxy mode).
    pub to_proxy: u64,
    /// Connects and datagrams refused because the service had no routable host.
    pub no_host: u64,
    /// Of `to_host`, those chosen while the service's routing was in panic mode (the daemon
    /// publishes it with `SERVICE_F_PANIC`): Envoy's `lb_healthy_panic`.
    pub panic: u64,
    /// Connects of the service that sockops saw fail or reset (sockets it follows for the
    /// passive health signal, `SERVICE_F_PASSIVE`): `passive_connect_failed` and
    /// `passive_reset` of this service.
    pub passive_failures: u64,
}
const _: () = assert!(core::mem::size_of::<ServiceCounts>() == 40);

impl ServiceCounts {
    /// The sum of per-CPU values.
    #[must_use]
    pub fn sum<'a>(per_cpu: impl IntoIterator<Item = &'a Self>) -> Self {
        per_cpu.into_iter().fold(Self::default(), |a, c| Self {
            to_host: a.to_host.wrapping_add(c.to_host),
            to_proxy: a.to_proxy.wrapping_add(c.to_proxy),
            no_host: a.no_host.wrapping_add(c.no_host),
            panic: a.panic.wrapping_add(c.panic),
            passive_failures: a.passive_failures.wrapping_add(c.passive_failures),
        })
    }
}
