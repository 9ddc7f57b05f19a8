//! Counters and gauges of one Consul cluster: Envoy's `cluster.<name>.*` discovery stats plus
//! `cluster.<name>.consul.*` for what only a Consul watch has.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Shared between the watch task and readers.
#[derive(Debug, Default)]
pub struct ConsulStats {
    pub(crate) update_attempt: AtomicU64,
    pub(crate) update_success: AtomicU64,
    pub(crate) update_failure: AtomicU64,
    pub(crate) update_no_rebuild: AtomicU64,
    pub(crate) membership_change: AtomicU64,
    pub(crate) membership_total: AtomicU64,
    pub(crate) index: AtomicU64,
    pub(crate) index_reset: AtomicU64,
    pub(crate) instances_skipped: AtomicU64,
    pub(crate) acl_denied: AtomicU64,
}

/// A point-in-time copy of [`ConsulStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsulStatValues {
    /// Queries started.
    pub update_attempt: u64,
    /// Queries answered with 200 and a valid body.
    pub update_success: u64,
    /// Queries that failed (connection, timeout, status, body); hosts were kept.
    pub update_failure: u64,
    /// Successful queries whose host set equalled the previous one (a blocking query that timed
    /// out, or a change elsewhere in the catalog); nothing was published.
    pub update_no_rebuild: u64,
    /// Published host-set changes.
    pub membership_change: u64,
    /// Hosts now (gauge).
    pub membership_total: u64,
    /// The index the next blocking query waits on (gauge; 0 = the next query does not block).
    pub index: u64,
    /// Times the returned `X-Consul-Index` went backwards and the watch restarted from 0.
    pub index_reset: u64,
    /// Instances of the last response that were left out (address not an IP literal, or an
    /// entry this daemon cannot use, such as a port out of range; gauge).
    pub instances_skipped: u64,
    /// Answers not applied because Consul's ACLs refused the token, or would show an empty
    /// answer to no token (see `acl`); the hosts were kept. Also counted in `update_failure`.
    pub acl_denied: u64,
}

impl ConsulStats {
    /// Current values.
    pub fn values(&self) -> ConsulStatValues {
        ConsulStatValues {
            update_attempt: self.update_attempt.load(Relaxed),
            update_success: self.update_success.load(Relaxed),
            update_failure: self.update_failure.load(Relaxed),
            update_no_rebuild: self.update_no_rebuild.load(Relaxed),
            membership_change: self.membership_change.load(Relaxed),
            membership_total: self.membership_total.load(Relaxed),
            index: self.index.load(Relaxed),
            index_reset: self.index_reset.load(Relaxed),
            instances_skipped: self.instances_skipped.load(Relaxed),
            acl_denied: self.acl_denied.load(Relaxed),
        }
    }

    /// `(cluster.<name>.<stat>, value)` pairs for `/stats`.
    pub fn named(&self, cluster: &str) -> Vec<(String, u64)> {
        let v = self.values();
        [
            ("update_attempt", v.update_attempt),
            ("update_success", v.update_success),
            ("update_failure", v.update_failure),
            ("update_no_rebuild", v.update_no_rebuild),
            ("membership_change", v.membership_change),
            ("membership_total", v.membership_total),
            ("consul.index", v.index),
            ("consul.index_reset", v.index_reset),
            ("consul.instances_skipped", v.instances_skipped),
            ("consul.acl_denied", v.acl_denied),
        ]
        .into_iter()
        .map(|(stat, value)| (format!("cluster.{cluster}.{stat}"), value))
        .collect()
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    pub(crate) fn set(gauge: &AtomicU64, value: u64) {
        gauge.store(value, Relaxed);
    }
}
