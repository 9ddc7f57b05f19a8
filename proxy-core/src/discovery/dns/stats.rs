//! Per-cluster discovery counters: the ones every source keeps, named as Envoy's
//! `cluster.<name>.*` stats, plus the serve-stale ones of `dns_stale_bound` (`dns_stale_*`, not
//! Envoy's).
//!
//! A resolution started is an `update_attempt`; one that succeeded an `update_success` (an empty
//! answer is a success, except for LOGICAL_DNS), and an `update_no_rebuild` when it changed
//! nothing; one that failed an `update_failure`, the hosts left unchanged. DNS clusters never
//! count `update_empty` or `update_rejected` (Envoy's neither).

use std::{
    collections::BTreeMap,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use tokio::time::Instant;

use crate::discovery::source_stats::{SourceStatValues, SourceStats};

/// Counters and gauges of one DNS cluster; shared between its tasks and readers.
#[derive(Debug, Default)]
pub struct DnsClusterStats {
    pub(crate) source: SourceStats,
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
    /// `update_*` and `membership_change`/`membership_total`, as every source has them.
    pub source: SourceStatValues,
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
            source: self.source.values(),
            dns_stale_names: stale_names,
            dns_stale_served_ms: u64::try_from(stale_served.as_millis()).unwrap_or(u64::MAX),
            dns_stale_expired: self.stale_expired.load(Relaxed),
        }
    }

    /// `(cluster.<name>.<stat>, value)` pairs for an admin or metrics endpoint.
    pub fn named(&self, cluster: &str) -> Vec<(String, u64)> {
        let v = self.values();
        v.source.named(
            cluster,
            [
                ("dns_stale_names", v.dns_stale_names),
                ("dns_stale_served_ms", v.dns_stale_served_ms),
                ("dns_stale_expired", v.dns_stale_expired),
            ],
        )
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
