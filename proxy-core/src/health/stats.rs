//! Per-cluster health statistics under Envoy's names, rendered as `(name, value)` pairs.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::state::CheckOutcome;

/// `cluster.<name>.health_check.*`. Shared with probes, hence atomics.
#[derive(Debug, Default)]
pub struct HealthCheckStats {
    /// Checks started.
    pub attempt: AtomicU64,
    /// Checks passed.
    pub success: AtomicU64,
    /// Checks failed, for any reason (includes network and passive failures).
    pub failure: AtomicU64,
    /// Failures from the network: connect errors, resets, timeouts.
    pub network_failure: AtomicU64,
    /// Failures reported passively (immediate-fail signals from traffic).
    pub passive_failure: AtomicU64,
    /// Responses whose cluster header was verified against `service_name_matcher`.
    pub verify_cluster: AtomicU64,
    /// Gauge: hosts currently passing active health checks.
    pub healthy: AtomicU64,
}

impl HealthCheckStats {
    /// Counts one finished check.
    pub fn record(&self, outcome: CheckOutcome) {
        match outcome {
            CheckOutcome::Healthy | CheckOutcome::Degraded => {
                self.success.fetch_add(1, Relaxed);
            }
            CheckOutcome::Failed(kind) => {
                self.failure.fetch_add(1, Relaxed);
                if kind.is_network() {
                    self.network_failure.fetch_add(1, Relaxed);
                }
            }
        }
    }

    /// Counts one passive failure.
    pub fn record_passive(&self) {
        self.failure.fetch_add(1, Relaxed);
        self.passive_failure.fetch_add(1, Relaxed);
    }

    /// `(suffix, value)` pairs, e.g. `("health_check.attempt", 3)`.
    pub fn pairs(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("health_check.attempt", self.attempt.load(Relaxed)),
            ("health_check.success", self.success.load(Relaxed)),
            ("health_check.failure", self.failure.load(Relaxed)),
            (
                "health_check.network_failure",
                self.network_failure.load(Relaxed),
            ),
            (
                "health_check.passive_failure",
                self.passive_failure.load(Relaxed),
            ),
            (
                "health_check.verify_cluster",
                self.verify_cluster.load(Relaxed),
            ),
            ("health_check.healthy", self.healthy.load(Relaxed)),
        ]
    }
}

/// `cluster.<name>.outlier_detection.*`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OutlierStats {
    /// Gauge: hosts ejected now.
    pub ejections_active: u64,
    /// Ejections enforced, any reason.
    pub ejections_enforced_total: u64,
    /// Ejections enforced for consecutive failures.
    pub ejections_enforced_consecutive_5xx: u64,
    /// Consecutive-failure ejections detected (enforced or not).
    pub ejections_detected_consecutive_5xx: u64,
    /// Ejections skipped because `max_ejection_percent` was reached.
    pub ejections_overflow: u64,
    /// Ejections enforced for consecutive gateway failures.
    pub ejections_enforced_consecutive_gateway_failure: u64,
    /// Consecutive-gateway-failure ejections detected (enforced or not).
    pub ejections_detected_consecutive_gateway_failure: u64,
    /// Ejections enforced by the success-rate detector.
    pub ejections_enforced_success_rate: u64,
    /// Success-rate ejections detected (enforced or not).
    pub ejections_detected_success_rate: u64,
    /// Ejections enforced by the failure-percentage detector.
    pub ejections_enforced_failure_percentage: u64,
    /// Failure-percentage ejections detected (enforced or not).
    pub ejections_detected_failure_percentage: u64,
}

impl OutlierStats {
    /// `(suffix, value)` pairs.
    pub fn pairs(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("outlier_detection.ejections_active", self.ejections_active),
            (
                "outlier_detection.ejections_enforced_total",
                self.ejections_enforced_total,
            ),
            (
                "outlier_detection.ejections_enforced_consecutive_5xx",
                self.ejections_enforced_consecutive_5xx,
            ),
            (
                "outlier_detection.ejections_detected_consecutive_5xx",
                self.ejections_detected_consecutive_5xx,
            ),
            (
                "outlier_detection.ejections_overflow",
                self.ejections_overflow,
            ),
            (
                "outlier_detection.ejections_enforced_consecutive_gateway_failure",
                self.ejections_enforced_consecutive_gateway_failure,
            ),
            (
                "outlier_detection.ejections_detected_consecutive_gateway_failure",
                self.ejections_detected_consecutive_gateway_failure,
            ),
            (
                "outlier_detection.ejections_enforced_success_rate",
                self.ejections_enforced_success_rate,
            ),
            (
                "outlier_detection.ejections_detected_success_rate",
                self.ejections_detected_success_rate,
            ),
            (
                "outlier_detection.ejections_enforced_failure_percentage",
                self.ejections_enforced_failure_percentage,
            ),
            (
                "outlier_detection.ejections_detected_failure_percentage",
                self.ejections_detected_failure_percentage,
            ),
        ]
    }
}

/// Membership gauges computed from the matrix.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MembershipStats {
    /// `membership_total`: hosts in the cluster, including those pending removal.
    pub total: u64,
    /// `membership_healthy`: hosts with no failure flag and not degraded.
    pub healthy: u64,
    /// `membership_degraded`.
    pub degraded: u64,
    /// `membership_excluded`: hosts still pending their first active check.
    pub excluded: u64,
}

impl MembershipStats {
    /// `(suffix, value)` pairs.
    pub fn pairs(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("membership_total", self.total),
            ("membership_healthy", self.healthy),
            ("membership_degraded", self.degraded),
            ("membership_excluded", self.excluded),
        ]
    }
}

/// Prefixes `(suffix, value)` pairs with `cluster.<name>.`.
pub fn render(cluster: &str, pairs: Vec<(&'static str, u64)>) -> Vec<(String, u64)> {
    pairs
        .into_iter()
        .map(|(suffix, v)| (format!("cluster.{cluster}.{suffix}"), v))
        .collect()
}
