//! Per-cluster discovery counters, named as Envoy's `cluster.<name>.*` stats, plus the
//! serve-stale ones of `dns_stale_bound` (`dns_stale_*`, not Envoy's).

use std::{
    collections::BTreeMap,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use tokio::time::Instant;

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
    pub(crate) stale_expired: AtomicU64,
    stale: Mutex<StaleClock>,
}

/// Which targets serve stale hosts since when, and how long ended stale periods lasted.
#[derive(Debug, Default)]
struct StaleClock {
    ended: Duration,
    since: BTreeMap<usize, Instant>,
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
    /// Names whose lookups fail while their last hosts are still served (gauge).
    pub dns_stale_names: u64,
    /// Milliseconds names served stale hosts, summed over names, the current periods included.
    pub dns_stale_served_ms: u64,
    /// Stale periods ended by `dns_stale_bound`: the name's hosts were dropped.
    pub dns_stale_expired: u64,
}

impl DnsClusterStats {
    /// Current values.
    pub fn values(&self) -> StatValues {
        let (stale_names, stale_served) = self.stale_now();
        StatValues {
            update_attempt: self.update_attempt.load(Relaxed),
            update_success: self.update_success.load(Relaxed),
            update_failure: self.update_failure.load(Relaxed),
            update_empty: self.update_empty.load(Relaxed),
            update_no_rebuild: self.update_no_rebuild.load(Relaxed),
            membership_change: self.membership_change.load(Relaxed),
            membership_total: self.membership_total.load(Relaxed),
            dns_stale_names: stale_names,
            dns_stale_served_ms: u64::try_from(stale_served.as_millis()).unwrap_or(u64::MAX),
            dns_stale_expired: self.stale_expired.load(Relaxed),
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
            ("dns_stale_names", v.dns_stale_names),
            ("dns_stale_served_ms", v.dns_stale_served_ms),
            ("dns_stale_expired", v.dns_stale_expired),
        ]
        .into_iter()
        .map(|(stat, value)| (format!("cluster.{cluster}.{stat}"), value))
        .collect()
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    /// Target `index` starts serving stale hosts at `now` (no-op if it already does).
    pub(crate) fn stale_begin(&self, index: usize, now: Instant) {
        self.clock().since.entry(index).or_insert(now);
    }

    /// Target `index` stops serving stale hosts at `now` (no-op if it did not).
    pub(crate) fn stale_end(&self, index: usize, now: Instant) {
        let mut clock = self.clock();
        if let Some(since) = clock.since.remove(&index) {
            clock.ended += now.saturating_duration_since(since);
        }
    }

    /// Names stale now, and the time served stale up to now.
    fn stale_now(&self) -> (u64, Duration) {
        let now = Instant::now();
        let clock = self.clock();
        let open = clock
            .since
            .values()
            .map(|since| now.saturating_duration_since(*since));
        (
            clock.since.len() as u64,
            clock.ended + open.sum::<Duration>(),
        )
    }

    fn clock(&self) -> std::sync::MutexGuard<'_, StaleClock> {
        self.stale
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
