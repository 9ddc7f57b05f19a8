//! Per-cluster passive-health and panic settings: `outlier_detection` and `common_lb_config`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{
    config::{HealthCheck, HealthConfigError},
    duration,
    spec::HealthCheckSpec,
};

/// `config.cluster.v3.OutlierDetection`, the consecutive-failure subset.
///
/// For an L4 proxy the "5xx" signal is a failed connect (Envoy's TCP proxy does the same).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierDetection {
    /// Consecutive failures that eject a host (default 5).
    #[serde(default = "default_consecutive_5xx")]
    pub consecutive_5xx: u32,
    /// Period of the ejection sweep that unejects hosts and decays backoff (default 10 s).
    #[serde(default = "default_interval", with = "duration")]
    pub interval: Duration,
    /// Ejection time, multiplied by the host's ejection count (default 30 s).
    #[serde(default = "default_base_ejection_time", with = "duration")]
    pub base_ejection_time: Duration,
    /// Cap on one ejection's length (default 300 s).
    #[serde(default = "default_max_ejection_time", with = "duration")]
    pub max_ejection_time: Duration,
    /// Most hosts ejected at once, in percent; one host may always be ejected (default 10).
    #[serde(default = "default_max_ejection_percent")]
    pub max_ejection_percent: u32,
    /// Chance in percent that a detected consecutive-failure ejection is enforced (default 100).
    #[serde(default = "default_enforcing")]
    pub enforcing_consecutive_5xx: u32,
}

impl Default for OutlierDetection {
    fn default() -> Self {
        Self {
            consecutive_5xx: default_consecutive_5xx(),
            interval: default_interval(),
            base_ejection_time: default_base_ejection_time(),
            max_ejection_time: default_max_ejection_time(),
            max_ejection_percent: default_max_ejection_percent(),
            enforcing_consecutive_5xx: default_enforcing(),
        }
    }
}

fn default_consecutive_5xx() -> u32 {
    5
}
fn default_interval() -> Duration {
    Duration::from_secs(10)
}
fn default_base_ejection_time() -> Duration {
    Duration::from_secs(30)
}
fn default_max_ejection_time() -> Duration {
    Duration::from_secs(300)
}
fn default_max_ejection_percent() -> u32 {
    10
}
fn default_enforcing() -> u32 {
    100
}

impl OutlierDetection {
    /// Checks percentages and positive durations.
    pub fn validate(&self) -> Result<(), HealthConfigError> {
        for (field, v) in [
            (
                "outlier_detection.max_ejection_percent",
                self.max_ejection_percent,
            ),
            (
                "outlier_detection.enforcing_consecutive_5xx",
                self.enforcing_consecutive_5xx,
            ),
        ] {
            if v > 100 {
                return Err(HealthConfigError::BadPercent {
                    field,
                    value: f64::from(v),
                });
            }
        }
        if self.interval.is_zero() {
            return Err(HealthConfigError::NotPositive("outlier_detection.interval"));
        }
        if self.base_ejection_time.is_zero() {
            return Err(HealthConfigError::NotPositive(
                "outlier_detection.base_ejection_time",
            ));
        }
        Ok(())
    }
}

/// `type.v3.Percent`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Percent {
    /// 0.0 to 100.0.
    pub value: f64,
}

/// `Cluster.CommonLbConfig`, the panic-threshold subset.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommonLbConfig {
    /// Below this healthy percentage a priority routes to all its hosts (default 50; 0 disables).
    #[serde(default = "default_panic_threshold")]
    pub healthy_panic_threshold: Percent,
}

impl Default for CommonLbConfig {
    fn default() -> Self {
        Self {
            healthy_panic_threshold: default_panic_threshold(),
        }
    }
}

fn default_panic_threshold() -> Percent {
    Percent { value: 50.0 }
}

/// The health-related fields of a cluster, as they appear in the cluster config.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterHealthConfig {
    /// Active health checkers; at most one is supported.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub health_checks: Vec<HealthCheck>,
    /// Passive health checking; absent disables it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier_detection: Option<OutlierDetection>,
    /// Panic threshold.
    #[serde(default)]
    pub common_lb_config: CommonLbConfig,
    /// A host that discovery no longer returns is deleted at once, even when active health
    /// checking still finds it healthy (Envoy's `ignore_health_on_host_removal`). Default false:
    /// it stays until it fails a check.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignore_health_on_host_removal: bool,
}

impl ClusterHealthConfig {
    /// Validates everything; returns the active check (if any) for cluster `cluster`.
    pub fn validate(&self, cluster: &str) -> Result<Option<HealthCheckSpec>, HealthConfigError> {
        if self.health_checks.len() > 1 {
            return Err(HealthConfigError::TooManyHealthChecks(
                self.health_checks.len(),
            ));
        }
        if let Some(od) = &self.outlier_detection {
            od.validate()?;
        }
        let panic = self.common_lb_config.healthy_panic_threshold.value;
        if !(0.0..=100.0).contains(&panic) {
            return Err(HealthConfigError::BadPercent {
                field: "common_lb_config.healthy_panic_threshold",
                value: panic,
            });
        }
        self.health_checks
            .first()
            .map(|hc| hc.validate(cluster))
            .transpose()
    }
}
