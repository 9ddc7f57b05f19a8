//! Passive health: Envoy's outlier detection, four detectors over the results the data paths
//! report per host.
//!
//! Every result is an HTTP status, as Envoy records results without
//! `split_external_local_origin_errors` ([`PassiveResult`]): a response counts with its status,
//! a failed connect as 503, a connect timeout as 504, a TCP connection's successful connect as
//! 200.
//!
//! * Consecutive 5xx: the `consecutive_5xx`-th 5xx in a row detects the host; any other status
//!   resets the run.
//! * Consecutive gateway failure: the same over 502, 503 and 504 (another 5xx resets the run);
//!   detected first when one result completes both runs.
//! * Success rate, on each sweep: among hosts that are not ejected and had at least
//!   `success_rate_request_volume` results in the last interval, when there are at least
//!   `success_rate_minimum_hosts` of them, a host whose success rate is below
//!   `mean - success_rate_stdev_factor / 1000 x stdev` (population deviation) is detected.
//! * Failure percentage, on each sweep: among hosts with `failure_percentage_request_volume`
//!   results, when there are `failure_percentage_minimum_hosts`, a host whose failure
//!   percentage is at least `failure_percentage_threshold` is detected.
//!
//! A detection ejects when the ejected share, counting this host, stays within
//! `max_ejection_percent` (or none is ejected and `always_eject_one_host`), and the detector's
//! enforcement roll passes. An ejection lasts `base_ejection_time x backoff`, capped by
//! `max_ejection_time`; the backoff grows with each ejection (while below the cap) and, once a
//! host has been back for an `interval`, decays by one per sweep. Unejection happens on the
//! periodic [`tick`](OutlierDetector::tick) (every `interval`) and resets the host's runs.
//! Hosts are visited in address order, so which host a `max_ejection_percent` overflow skips is
//! reproducible. Time is `tokio::time::Instant`, so paused-time tests drive it.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use tokio::time::Instant;
use tracing::info;

use super::{cluster_config::OutlierDetection, random::Random, stats::OutlierStats};

/// One result the data path reports for a host, as an HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassiveResult(pub u16);

impl PassiveResult {
    /// A TCP connection's connect succeeded (Envoy's final local-origin success).
    pub const CONNECT_SUCCESS: Self = Self(200);
    /// A connect failed.
    pub const CONNECT_FAILURE: Self = Self(503);
    /// A connect timed out.
    pub const CONNECT_TIMEOUT: Self = Self(504);

    fn is_5xx(self) -> bool {
        (500..600).contains(&self.0)
    }

    fn is_gateway_failure(self) -> bool {
        matches!(self.0, 502..=504)
    }
}

/// Which detector found a host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Detector {
    Consecutive5xx,
    ConsecutiveGatewayFailure,
    SuccessRate,
    FailurePercentage,
}

#[derive(Debug, Default, Clone)]
struct Monitor {
    consecutive_5xx: u32,
    consecutive_gateway: u32,
    /// Results of the current interval: (successes, total).
    current: (u64, u64),
    /// Results of the last full interval, which the sweep's detectors read.
    last: (u64, u64),
    ejected_at: Option<Instant>,
    unejected_at: Option<Instant>,
    backoff: u32,
}

impl Monitor {
    fn reset_runs(&mut self) {
        self.consecutive_5xx = 0;
        self.consecutive_gateway = 0;
    }
}

/// The outlier detector of one cluster.
#[derive(Debug)]
pub struct OutlierDetector {
    config: OutlierDetection,
    monitors: BTreeMap<SocketAddr, Monitor>,
    stats: OutlierStats,
    random: Arc<dyn Random>,
}

/// What a result did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureVerdict {
    /// No detection (below the thresholds, already ejected, or an unknown host).
    Counted,
    /// The host was ejected.
    Ejected,
    /// Detected but not ejected (enforcement roll or `max_ejection_percent`).
    NotEnforced,
}

impl OutlierDetector {
    /// A detector with no hosts.
    pub fn new(config: OutlierDetection, random: Arc<dyn Random>) -> Self {
        Self {
            config,
            monitors: BTreeMap::new(),
            stats: OutlierStats::default(),
            random,
        }
    }

    /// Tracks exactly `addrs`: new hosts start clean, gone hosts are forgotten.
    pub fn sync_hosts(&mut self, addrs: impl IntoIterator<Item = SocketAddr>) {
        let keep: BTreeMap<SocketAddr, Monitor> = addrs
            .into_iter()
            .map(|a| (a, self.monitors.remove(&a).unwrap_or_default()))
            .collect();
        self.monitors = keep;
        self.stats.ejections_active = self
            .monitors
            .values()
            .filter(|m| m.ejected_at.is_some())
            .count() as u64;
    }

    /// Whether `addr` is ejected now.
    pub fn is_ejected(&self, addr: SocketAddr) -> bool {
        self.monitors
            .get(&addr)
            .is_some_and(|m| m.ejected_at.is_some())
    }

    /// Counters.
    pub fn stats(&self) -> &OutlierStats {
        &self.stats
    }

    /// Whether a passing active health check unejects a host at once.
    pub fn unejects_on_health_check(&self) -> bool {
        self.config.successful_active_health_check_uneject_host
    }

    /// A successful connect of a TCP connection.
    pub fn record_connect_success(&mut self, addr: SocketAddr) {
        self.record(addr, PassiveResult::CONNECT_SUCCESS, Instant::now());
    }

    /// A failed connect; may eject the host.
    pub fn record_connect_failure(&mut self, addr: SocketAddr, now: Instant) -> FailureVerdict {
        self.record(addr, PassiveResult::CONNECT_FAILURE, now)
    }

    /// One result for `addr`; may eject the host.
    pub fn record(
        &mut self,
        addr: SocketAddr,
        result: PassiveResult,
        now: Instant,
    ) -> FailureVerdict {
        let (threshold_5xx, threshold_gateway) = (
            self.config.consecutive_5xx,
            self.config.consecutive_gateway_failure,
        );
        let Some(m) = self.monitors.get_mut(&addr) else {
            return FailureVerdict::Counted;
        };
        m.current.1 += 1;
        let mut detected = Vec::new();
        if result.is_5xx() {
            if result.is_gateway_failure() {
                m.consecutive_gateway += 1;
                if m.consecutive_gateway == threshold_gateway {
                    detected.push(Detector::ConsecutiveGatewayFailure);
                }
            } else {
                m.consecutive_gateway = 0;
            }
            m.consecutive_5xx += 1;
            if m.consecutive_5xx == threshold_5xx {
                detected.push(Detector::Consecutive5xx);
            }
        } else {
            m.current.0 += 1;
            m.reset_runs();
        }
        let mut verdict = FailureVerdict::Counted;
        for detector in detected {
            // A host ejected by the first detection is not detected again; its run goes on
            // and is reset when it is unejected.
            if self.is_ejected(addr) {
                break;
            }
            self.count_detected(detector);
            let outcome = self.try_eject(addr, detector, now);
            if let Some(m) = self.monitors.get_mut(&addr) {
                match detector {
                    Detector::Consecutive5xx => m.consecutive_5xx = 0,
                    _ => m.consecutive_gateway = 0,
                }
            }
            if verdict != FailureVerdict::Ejected {
                verdict = outcome;
            }
        }
        verdict
    }

    fn count_detected(&mut self, detector: Detector) {
        let s = &mut self.stats;
        match detector {
            Detector::Consecutive5xx => s.ejections_detected_consecutive_5xx += 1,
            Detector::ConsecutiveGatewayFailure => {
                s.ejections_detected_consecutive_gateway_failure += 1;
            }
            Detector::SuccessRate => s.ejections_detected_success_rate += 1,
            Detector::FailurePercentage => s.ejections_detected_failure_percentage += 1,
        }
    }

    fn enforcing(&self, detector: Detector) -> u32 {
        let c = &self.config;
        match detector {
            Detector::Consecutive5xx => c.enforcing_consecutive_5xx,
            Detector::ConsecutiveGatewayFailure => c.enforcing_consecutive_gateway_failure,
            Detector::SuccessRate => c.enforcing_success_rate,
            Detector::FailurePercentage => c.enforcing_failure_percentage,
        }
    }

    fn try_eject(&mut self, addr: SocketAddr, detector: Detector, now: Instant) -> FailureVerdict {
        let active = self.stats.ejections_active;
        let total = self.monitors.len().max(1) as u64;
        let max_pct = u64::from(self.config.max_ejection_percent.min(100));
        // The share ejected once this host is: within the cap, or the first ejection when one
        // host may always be ejected.
        let within = (active + 1) * 100 <= max_pct * total;
        if !(within || (self.config.always_eject_one_host && active == 0)) {
            self.stats.ejections_overflow += 1;
            return FailureVerdict::NotEnforced;
        }
        if self.random.below(100) >= u64::from(self.enforcing(detector)) {
            return FailureVerdict::NotEnforced;
        }
        let (base, max) = (
            self.config.base_ejection_time,
            self.config.max_ejection_time(),
        );
        let Some(m) = self.monitors.get_mut(&addr) else {
            return FailureVerdict::Counted;
        };
        m.ejected_at = Some(now);
        // Saturating: both times come from configuration, as large as a user writes them.
        if base.saturating_mul(m.backoff) < max.saturating_add(base) {
            m.backoff += 1;
        }
        let backoff = m.backoff;
        let s = &mut self.stats;
        s.ejections_active += 1;
        s.ejections_enforced_total += 1;
        match detector {
            Detector::Consecutive5xx => s.ejections_enforced_consecutive_5xx += 1,
            Detector::ConsecutiveGatewayFailure => {
                s.ejections_enforced_consecutive_gateway_failure += 1;
            }
            Detector::SuccessRate => s.ejections_enforced_success_rate += 1,
            Detector::FailurePercentage => s.ejections_enforced_failure_percentage += 1,
        }
        info!(%addr, backoff, reason = ?detector, "outlier detection ejected host");
        FailureVerdict::Ejected
    }

    /// How long the current ejection of a host with this backoff lasts.
    fn ejection_time(&self, backoff: u32) -> Duration {
        (self.config.base_ejection_time.saturating_mul(backoff))
            .min(self.config.max_ejection_time())
    }

    /// The periodic sweep: unejects hosts whose time is up, closes the interval's results,
    /// runs the success-rate and failure-percentage detectors on them, and decays backoffs.
    /// Returns whether any host was ejected or unejected.
    pub fn tick(&mut self, now: Instant) -> bool {
        let mut unejected = Vec::new();
        let times: Vec<(SocketAddr, Duration)> = self
            .monitors
            .iter()
            .map(|(a, m)| (*a, self.ejection_time(m.backoff)))
            .collect();
        for (addr, eject_for) in times {
            let Some(m) = self.monitors.get_mut(&addr) else {
                continue;
            };
            if m.ejected_at
                .is_some_and(|at| now.saturating_duration_since(at) >= eject_for)
            {
                m.ejected_at = None;
                m.unejected_at = Some(now);
                m.reset_runs();
                unejected.push(addr);
            }
            m.last = std::mem::take(&mut m.current);
        }
        self.stats.ejections_active -= unejected.len() as u64;
        for addr in &unejected {
            info!(%addr, "outlier detection unejected host");
        }
        let ejected = self.rate_detectors(now);
        let interval = self.config.interval;
        for m in self.monitors.values_mut() {
            if m.ejected_at.is_none()
                && m.unejected_at
                    .is_some_and(|u| now.saturating_duration_since(u) >= interval)
            {
                m.backoff = m.backoff.saturating_sub(1);
            }
        }
        !unejected.is_empty() || ejected
    }

    /// The success-rate and failure-percentage detectors over the last interval's results.
    /// Returns whether they ejected a host.
    fn rate_detectors(&mut self, now: Instant) -> bool {
        let c = &self.config;
        let hosts = self.monitors.len() as u64;
        if hosts < u64::from(c.success_rate_minimum_hosts)
            && hosts < u64::from(c.failure_percentage_minimum_hosts)
        {
            return false;
        }
        let (sr_volume, fp_volume) = (
            u64::from(c.success_rate_request_volume),
            u64::from(c.failure_percentage_request_volume),
        );
        let mut success_rate = Vec::new();
        let mut failure_percentage = Vec::new();
        for (addr, m) in &self.monitors {
            let (ok, total) = m.last;
            if m.ejected_at.is_some() || total == 0 {
                continue;
            }
            let rate = ok as f64 * 100.0 / total as f64;
            if total >= sr_volume {
                success_rate.push((*addr, rate));
            }
            if total >= fp_volume {
                failure_percentage.push((*addr, rate));
            }
        }
        let mut detected = Vec::new();
        if !success_rate.is_empty()
            && success_rate.len() as u64 >= u64::from(c.success_rate_minimum_hosts)
        {
            let n = success_rate.len() as f64;
            let mean = success_rate.iter().map(|(_, r)| r).sum::<f64>() / n;
            let variance = success_rate
                .iter()
                .map(|(_, r)| (r - mean).powi(2))
                .sum::<f64>()
                / n;
            let threshold =
                mean - f64::from(c.success_rate_stdev_factor) / 1000.0 * variance.sqrt();
            detected.extend(
                success_rate
                    .iter()
                    .filter(|(_, r)| *r < threshold)
                    .map(|(a, _)| (*a, Detector::SuccessRate)),
            );
        }
        if !failure_percentage.is_empty()
            && failure_percentage.len() as u64 >= u64::from(c.failure_percentage_minimum_hosts)
        {
            let threshold = f64::from(c.failure_percentage_threshold);
            detected.extend(
                failure_percentage
                    .iter()
                    .filter(|(_, r)| 100.0 - r >= threshold)
                    .map(|(a, _)| (*a, Detector::FailurePercentage)),
            );
        }
        let mut ejected = false;
        for (addr, detector) in detected {
            if self.is_ejected(addr) {
                continue;
            }
            self.count_detected(detector);
            ejected |= self.try_eject(addr, detector, now) == FailureVerdict::Ejected;
        }
        ejected
    }

    /// Unejects a host at once (a passing active health check, with
    /// `successful_active_health_check_uneject_host`).
    pub fn uneject(&mut self, addr: SocketAddr, now: Instant) -> bool {
        let Some(m) = self.monitors.get_mut(&addr) else {
            return false;
        };
        if m.ejected_at.take().is_none() {
            return false;
        }
        m.unejected_at = Some(now);
        m.reset_runs();
        self.stats.ejections_active -= 1;
        true
    }
}
