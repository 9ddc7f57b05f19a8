//! The discovery counters every source keeps, named once: Envoy's `cluster.<name>.update_*` and
//! `membership_*` stats. DNS, Consul and xDS each embed one [`SourceStats`] and add what only
//! they have (serve-stale, the Consul index, EDS leases and versions) beside it.
//!
//! What each counter means is the same for every source; when a source counts one is written in
//! its own module (`dns::engine`, `consul::watch`, `xds::stats`). A counter a source never
//! increments stays 0 and is still shown, as Envoy shows every cluster stat of every cluster.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The counters and gauges shared between a source's tasks and its readers.
#[derive(Debug, Default)]
pub struct SourceStats {
    pub(crate) update_attempt: AtomicU64,
    pub(crate) update_success: AtomicU64,
    pub(crate) update_failure: AtomicU64,
    pub(crate) update_rejected: AtomicU64,
    pub(crate) update_empty: AtomicU64,
    pub(crate) update_no_rebuild: AtomicU64,
    pub(crate) membership_change: AtomicU64,
    pub(crate) membership_total: AtomicU64,
}

/// A point-in-time copy of [`SourceStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceStatValues {
    /// Fetches started (a resolution, a Consul query, an xDS response or failure that concerned
    /// the cluster).
    pub update_attempt: u64,
    /// Fetches whose answer was accepted (empty ones included).
    pub update_success: u64,
    /// Fetches that failed (network, server error, timeout); the hosts were kept.
    pub update_failure: u64,
    /// Answers refused as invalid (an xDS NACK); the hosts were kept.
    pub update_rejected: u64,
    /// Accepted answers without hosts for the cluster that left its hosts as they were (EDS).
    pub update_empty: u64,
    /// Accepted answers that changed nothing.
    pub update_no_rebuild: u64,
    /// Published host-set changes.
    pub membership_change: u64,
    /// Hosts now (gauge).
    pub membership_total: u64,
}

impl SourceStats {
    /// Current values.
    pub fn values(&self) -> SourceStatValues {
        SourceStatValues {
            update_attempt: self.update_attempt.load(Relaxed),
            update_success: self.update_success.load(Relaxed),
            update_failure: self.update_failure.load(Relaxed),
            update_rejected: self.update_rejected.load(Relaxed),
            update_empty: self.update_empty.load(Relaxed),
            update_no_rebuild: self.update_no_rebuild.load(Relaxed),
            membership_change: self.membership_change.load(Relaxed),
            membership_total: self.membership_total.load(Relaxed),
        }
    }

    /// Adds one to `counter`.
    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    /// Sets `gauge` to `value`.
    pub(crate) fn set(gauge: &AtomicU64, value: u64) {
        gauge.store(value, Relaxed);
    }
}

impl SourceStatValues {
    /// `(stat, value)` pairs with Envoy's names: the one place they are spelled.
    pub fn pairs(&self) -> [(&'static str, u64); 8] {
        [
            ("update_attempt", self.update_attempt),
            ("update_success", self.update_success),
            ("update_failure", self.update_failure),
            ("update_rejected", self.update_rejected),
            ("update_empty", self.update_empty),
            ("update_no_rebuild", self.update_no_rebuild),
            ("membership_change", self.membership_change),
            ("membership_total", self.membership_total),
        ]
    }

    /// `(cluster.<cluster>.<stat>, value)` pairs for `/stats`: these values, then a source's
    /// own `extra` ones.
    pub fn named(
        &self,
        cluster: &str,
        extra: impl IntoIterator<Item = (&'static str, u64)>,
    ) -> Vec<(String, u64)> {
        self.pairs()
            .into_iter()
            .chain(extra)
            .map(|(stat, value)| (format!("cluster.{cluster}.{stat}"), value))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_is_named_once_under_its_cluster() {
        let stats = SourceStats::default();
        SourceStats::inc(&stats.update_attempt);
        SourceStats::inc(&stats.update_attempt);
        SourceStats::inc(&stats.update_rejected);
        SourceStats::set(&stats.membership_total, 3);
        let named = stats.values().named("web", [("consul.index", 7)]);
        let want: Vec<(String, u64)> = [
            ("update_attempt", 2),
            ("update_success", 0),
            ("update_failure", 0),
            ("update_rejected", 1),
            ("update_empty", 0),
            ("update_no_rebuild", 0),
            ("membership_change", 0),
            ("membership_total", 3),
            ("consul.index", 7),
        ]
        .into_iter()
        .map(|(stat, value)| (format!("cluster.web.{stat}"), value))
        .collect();
        assert_eq!(named, want);
    }
}
