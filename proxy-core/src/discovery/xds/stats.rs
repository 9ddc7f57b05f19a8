//! Envoy-named statistics of EDS clusters (`cluster.<name>.*`) and of the control-plane
//! connection (`control_plane.*`).
//!
//! Counting rules (Envoy's gRPC/REST subscription stats plus `EdsClusterImpl`):
//! * a response (or REST poll answer) that concerns a cluster: `update_attempt`, then
//!   `update_success` when accepted or `update_rejected` when NACKed (a NACK concerns every
//!   cluster of the stream, as Envoy fails every watch of the type);
//! * a stream or poll failure: `update_attempt` and `update_failure` for every cluster;
//! * an accepted response without the cluster's assignment (only counted when the stream
//!   subscribes to that one cluster, as Envoy's mux only calls a lone watch) or a delta removal
//!   of it: `update_empty`, hosts kept;
//! * an accepted assignment that leaves the hosts as they were: `update_no_rebuild`;
//! * an accepted assignment with `policy.endpoint_stale_after`: `assignment_timeout_received`;
//!   its lease running out before the next one (hosts removed): `assignment_stale`;
//! * `version`: the accepted `version_info` as a number when it is one, else its 64-bit FNV-1a
//!   hash (Envoy uses an xxHash64 of the string: same role, different values).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::{
    discovery::source_stats::{SourceStatValues, SourceStats},
    host::{EdsHealth, HostSet},
    tls::TlsFailure,
};

/// Counters and gauges of one EDS cluster: the discovery counters every source keeps, and the
/// EDS ones.
#[derive(Debug, Default)]
pub struct ClusterStats {
    pub(crate) source: SourceStats,
    pub(crate) init_fetch_timeout: AtomicU64,
    pub(crate) assignment_timeout_received: AtomicU64,
    pub(crate) assignment_stale: AtomicU64,
    pub(crate) version: AtomicU64,
    pub(crate) membership_healthy: AtomicU64,
    pub(crate) membership_degraded: AtomicU64,
}

/// A point-in-time copy of [`ClusterStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterStatValues {
    /// `update_*` and `membership_change`/`membership_total`, as every source has them.
    pub source: SourceStatValues,
    /// Times `initial_fetch_timeout` expired before the first update.
    pub init_fetch_timeout: u64,
    /// Accepted assignments with a lease (`policy.endpoint_stale_after`).
    pub assignment_timeout_received: u64,
    /// Leases that ran out before the next assignment: the hosts were removed.
    pub assignment_stale: u64,
    /// Accepted version (gauge): numeric `version_info`, else its FNV-1a hash.
    pub version: u64,
    /// Hosts whose EDS health is UNKNOWN or HEALTHY (gauge).
    pub membership_healthy: u64,
    /// Hosts whose EDS health is DEGRADED (gauge).
    pub membership_degraded: u64,
}

impl ClusterStats {
    /// Current values.
    pub fn values(&self) -> ClusterStatValues {
        ClusterStatValues {
            source: self.source.values(),
            init_fetch_timeout: self.init_fetch_timeout.load(Relaxed),
            assignment_timeout_received: self.assignment_timeout_received.load(Relaxed),
            assignment_stale: self.assignment_stale.load(Relaxed),
            version: self.version.load(Relaxed),
            membership_healthy: self.membership_healthy.load(Relaxed),
            membership_degraded: self.membership_degraded.load(Relaxed),
        }
    }

    /// `(cluster.<cluster>.<stat>, value)` pairs with Envoy's names.
    pub fn named(&self, cluster: &str) -> Vec<(String, u64)> {
        let v = self.values();
        v.source.named(
            cluster,
            [
                ("init_fetch_timeout", v.init_fetch_timeout),
                ("assignment_timeout_received", v.assignment_timeout_received),
                ("assignment_stale", v.assignment_stale),
                ("version", v.version),
                ("membership_healthy", v.membership_healthy),
                ("membership_degraded", v.membership_degraded),
            ],
        )
    }

    /// Sets the membership gauges from `hosts`.
    pub(crate) fn set_membership(&self, hosts: &HostSet) {
        let count = |f: fn(EdsHealth) -> bool| hosts.iter().filter(|h| f(h.eds_health)).count();
        let healthy = count(|h| matches!(h, EdsHealth::Unknown | EdsHealth::Healthy));
        let degraded = count(|h| h == EdsHealth::Degraded);
        SourceStats::set(&self.source.membership_total, hosts.len() as u64);
        self.membership_healthy.store(healthy as u64, Relaxed);
        self.membership_degraded.store(degraded as u64, Relaxed);
    }
}

/// Statistics of one control-plane connection (a gRPC stream or a REST poller).
#[derive(Debug, Default)]
pub struct ControlPlaneStats {
    pub(crate) connected_state: AtomicU64,
    pub(crate) stream_attempts: AtomicU64,
    pub(crate) oversized_responses: AtomicU64,
    tls_failures: [AtomicU64; TlsFailure::ALL.len()],
}

impl ControlPlaneStats {
    /// 1 while a gRPC stream is established (REST: after a successful poll), else 0.
    pub fn connected(&self) -> bool {
        self.connected_state.load(Relaxed) == 1
    }

    /// `(control_plane.<stat>, value)` pairs. `connected_state` is Envoy's gauge;
    /// `stream_attempts` counts connection or poll attempts and `oversized_responses` the
    /// streams ended by a response over the decode limit; `tls_failure.<cause>` counts failed
    /// connections or polls by TLS cause (all ours, not Envoy's).
    /// `rate_limit_enforced` and `pending_requests` are not produced: there is no rate limiter.
    pub fn named(&self) -> Vec<(String, u64)> {
        let mut named = vec![
            (
                "control_plane.connected_state".to_owned(),
                self.connected_state.load(Relaxed),
            ),
            (
                "control_plane.stream_attempts".to_owned(),
                self.stream_attempts.load(Relaxed),
            ),
            (
                "control_plane.oversized_responses".to_owned(),
                self.oversized_responses.load(Relaxed),
            ),
        ];
        named.extend(
            TlsFailure::ALL
                .iter()
                .zip(&self.tls_failures)
                .map(|(cause, n)| {
                    (
                        format!("control_plane.tls_failure.{}", cause.name()),
                        n.load(Relaxed),
                    )
                }),
        );
        named
    }

    /// Counts `error` under its TLS cause, if TLS is involved; returns the cause.
    pub(crate) fn count_tls_failure(
        &self,
        error: &(dyn std::error::Error + 'static),
    ) -> Option<TlsFailure> {
        let cause = TlsFailure::of(error)?;
        let index = TlsFailure::ALL.iter().position(|c| *c == cause)?;
        self.tls_failures[index].fetch_add(1, Relaxed);
        Some(cause)
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected_state.store(u64::from(connected), Relaxed);
    }
}

/// The `version` gauge of a `version_info`: its value when it is a decimal number, else its
/// 64-bit FNV-1a hash; 0 for an empty string.
pub fn version_gauge(version_info: &str) -> u64 {
    if version_info.is_empty() {
        return 0;
    }
    if let Ok(number) = version_info.parse::<u64>() {
        return number;
    }
    version_info
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}
