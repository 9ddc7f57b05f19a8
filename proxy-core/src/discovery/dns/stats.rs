//! Per-cluster discovery counters, named as Envoy's `cluster.<name>.*` stats.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters and gauges of one DNS cluster; shared between its tasks and readers.
#[derive(Debug, Default)]
pub struct DnsClusterStats {
    pub(crate) update_attempt: AtomicU64,
    pub(crate) update_success: AtomicU64,
    pub(crate) update_failure: AtomicU64,
    pub(crate) update_empty: AtomicU64,
    pub(crate) update_no_rebuild: AtomicU64,
    pub(crate) membership_change: AtomicU64,
    pub(crate) membership_total: AtomicU64,
}

/// A point-in-time copy of [`DnsClusterStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatValues {
    /// Resolutions started.
    pub update_attempt: u64,
    /// Resolutions that succeeded (an empty answer is a success, except for LOGICAL_DNS).
    pub update_success: u64,
    /// Resolutions that failed; hosts were left unchanged.
    pub update_failure: u64,
    /// Envoy counts empty EDS assignments here; DNS clusters never increment it (Envoy neither).
    pub update_empty: u64,
    /// Successful resolutions that changed nothing.
    pub update_no_rebuild: u64,
    /// Published host-set changes.
    pub membership_change: u64,
    /// Hosts in the cluster now (gauge).
    pub membership_total: u64,
}

impl DnsClusterStats {
    /// Current values.
    pub fn values(&self) -> StatValues {
        StatValues {
            update_attempt: self.update_attempt.load(Relaxed),
            update_success: self.update_success.load(Relaxed),
            update_failure: self.update_failure.load(Relaxed),
            update_empty: self.update_empty.load(Relaxed),
            update_no_rebuild: self.update_no_rebuild.load(Relaxed),
            membership_change: self.membership_change.load(Relaxed),
            membership_total: self.membership_total.load(Relaxed),
        }
    }

    /// `(cluster.<name>.<stat>, value)` pairs for an admin or metrics endpoint.
    pub fn named(&self, cluster: &str) -> Vec<(String, u64)> {
        let v = self.values();
        [
            ("update_attempt", v.update_attempt),
            ("update_success", v.update_success),
            ("update_failure", v.update_failure),
            ("update_empty", v.update_empty),
            ("update_no_rebuild", v.update_no_rebuild),
            ("membership_change", v.membership_change),
            ("membership_total", v.membership_total),
        ]
        .into_iter()
        .map(|(stat, value)| (format!("cluster.{cluster}.{stat}"), value))
        .collect()
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }
}
