//! Envoy's per-cluster timing histograms (`upstream_cx_connect_ms`, `upstream_rq_time`) and
//! response classes (`upstream_rq_2xx` ...) and codes (`upstream_rq_200` ...) for the proxy
//! path. A recording is a few relaxed atomic adds, made by the connection's own task; a
//! response's code also takes a short lock on its cluster's table of codes.
//!
//! The buckets are Envoy's default histogram buckets, in milliseconds, so a dashboard's
//! `histogram_quantile` over `_bucket{le=...}` reads the same bounds from the daemon as from
//! Envoy. Values are kept in microseconds (the sum is exact to the microsecond) and shown in
//! milliseconds.

use std::{
    collections::BTreeMap,
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

/// Envoy's default bucket bounds, in milliseconds (`le` labels): 0.5 ms to one hour.
pub const BUCKETS_MS: [f64; 19] = [
    0.5,
    1.0,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    2500.0,
    5000.0,
    10000.0,
    30000.0,
    60000.0,
    300_000.0,
    600_000.0,
    1_800_000.0,
    3_600_000.0,
];

/// A histogram of durations over [`BUCKETS_MS`].
#[derive(Debug, Default)]
pub struct Histogram {
    /// Samples per bucket (not cumulative); the last slot is past the largest bound.
    buckets: [AtomicU64; BUCKETS_MS.len() + 1],
    count: AtomicU64,
    /// Sum of the samples, in microseconds.
    sum_us: AtomicU64,
}

/// What a [`Histogram`] holds at one moment, as Prometheus shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound in ms, samples at or below it)`, cumulative, for each of [`BUCKETS_MS`].
    pub buckets: Vec<(f64, u64)>,
    /// Samples in all (the `+Inf` bucket).
    pub count: u64,
    /// Sum of the samples, in milliseconds.
    pub sum_ms: f64,
}

impl Histogram {
    /// Records one duration.
    pub fn record(&self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        // Bounds are in ms; compare in µs so 0.5 ms is exact.
        let slot = BUCKETS_MS
            .iter()
            .position(|bound| us as f64 <= bound * 1000.0)
            .unwrap_or(BUCKETS_MS.len());
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// The buckets (cumulative), count and sum now. Read without a lock: a recording in
    /// flight may show in one figure and not yet in another.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut seen = 0;
        let buckets = BUCKETS_MS
            .iter()
            .zip(&self.buckets)
            .map(|(bound, n)| {
                seen += n.load(Ordering::Relaxed);
                (*bound, seen)
            })
            .collect();
        let past = self.buckets[BUCKETS_MS.len()].load(Ordering::Relaxed);
        HistogramSnapshot {
            buckets,
            count: seen + past,
            sum_ms: self.sum_us.load(Ordering::Relaxed) as f64 / 1000.0,
        }
    }
}

impl HistogramSnapshot {
    /// The estimated `q` quantile (0 to 1) in ms, by linear interpolation inside its bucket
    /// (Prometheus' `histogram_quantile`); `None` without samples. Past the largest bound it
    /// is that bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count as f64;
        let (mut lower, mut below) = (0.0, 0);
        for &(bound, cumulative) in &self.buckets {
            if cumulative as f64 >= rank && cumulative > below {
                let inside = (cumulative - below) as f64;
                return Some(lower + (bound - lower) * (rank - below as f64) / inside);
            }
            (lower, below) = (bound, cumulative);
        }
        Some(lower)
    }
}

/// HTTP requests sent (`upstream_rq_total`), responses by class (`upstream_rq_1xx` to
/// `upstream_rq_5xx`) and completed requests (`upstream_rq_completed`), with the request time
/// histogram.
#[derive(Debug, Default)]
pub struct Responses {
    /// Requests sent to the cluster's hosts, retries included (`upstream_rq_total`).
    total: AtomicU64,
    classes: [AtomicU64; 5],
    /// Per status code (`upstream_rq_200` ...): at most the 500 codes of 100..=599.
    codes: Mutex<BTreeMap<u16, u64>>,
    completed: AtomicU64,
    /// From the request's start to the response's end (`upstream_rq_time`).
    pub time: Histogram,
}

impl Responses {
    /// A request goes to one of the cluster's hosts (a retry too).
    pub fn sent(&self) {
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    /// A response with `status` came back (or the proxy answered for the host: a reset as 503,
    /// a request timeout as 504, as Envoy's router counts them). A status outside 100..=599 is
    /// counted as completed only. Its time goes to [`Responses::time`] separately.
    pub fn count(&self, status: u16) {
        if let Some(class) = (100..600).contains(&status).then(|| status / 100 - 1) {
            self.classes[usize::from(class)].fetch_add(1, Ordering::Relaxed);
            *self
                .codes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(status)
                .or_default() += 1;
        }
        self.completed.fetch_add(1, Ordering::Relaxed);
    }

    /// Responses per status code seen (Envoy's `upstream_rq_<code>`).
    pub fn codes(&self) -> Vec<(u16, u64)> {
        let codes = self.codes.lock().unwrap_or_else(PoisonError::into_inner);
        codes.iter().map(|(&code, &n)| (code, n)).collect()
    }

    /// Envoy's names without the cluster prefix: `upstream_rq_total`, `upstream_rq_<n>xx` and
    /// `upstream_rq_completed`.
    pub fn named(&self) -> [(&'static str, u64); 7] {
        let class = |i: usize| self.classes[i].load(Ordering::Relaxed);
        [
            ("upstream_rq_total", self.total.load(Ordering::Relaxed)),
            ("upstream_rq_1xx", class(0)),
            ("upstream_rq_2xx", class(1)),
            ("upstream_rq_3xx", class(2)),
            ("upstream_rq_4xx", class(3)),
            ("upstream_rq_5xx", class(4)),
            (
                "upstream_rq_completed",
                self.completed.load(Ordering::Relaxed),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_land_in_envoys_buckets_inclusive_of_the_bound() {
        let h = Histogram::default();
        for us in [400, 500, 501, 7_000, 4_000_000_000] {
            h.record(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!(s.count, 5);
        // Bounds 0.5, 1, 5 and 10 ms are the first four; one hour is the last.
        let at = |i: usize| s.buckets[i].1;
        assert_eq!((at(0), at(1), at(2), at(3)), (2, 3, 3, 4));
        assert_eq!(at(18), 4, "the hour-plus sample is only in +Inf");
        assert!((s.sum_ms - 4_000_008.401).abs() < 1e-6, "{}", s.sum_ms);
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket() {
        let h = Histogram::default();
        assert_eq!(h.snapshot().quantile(0.5), None);
        for _ in 0..4 {
            h.record(Duration::from_millis(20));
        }
        // All four in (10, 25]: the median is halfway through it.
        assert_eq!(h.snapshot().quantile(0.5), Some(17.5));
        assert_eq!(h.snapshot().quantile(1.0), Some(25.0));
    }

    #[test]
    fn responses_count_by_class_and_refuse_nonsense_statuses() {
        let r = Responses::default();
        for status in [200, 204, 404, 503, 99, 600, 101, 302] {
            r.count(status);
        }
        let named: std::collections::BTreeMap<_, _> = r.named().into_iter().collect();
        assert_eq!(named["upstream_rq_2xx"], 2);
        assert_eq!(named["upstream_rq_1xx"], 1);
        assert_eq!(named["upstream_rq_3xx"], 1);
        assert_eq!(named["upstream_rq_4xx"], 1);
        assert_eq!(named["upstream_rq_5xx"], 1);
        assert_eq!(named["upstream_rq_completed"], 8);
        assert_eq!(
            r.codes(),
            [(101, 1), (200, 1), (204, 1), (302, 1), (404, 1), (503, 1)]
        );
        r.sent();
        assert_eq!(r.named()[0], ("upstream_rq_total", 1));
    }
}
