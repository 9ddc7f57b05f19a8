//! Per-cluster passive-health and panic settings: `outlier_detection` and `common_lb_config`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{config::HealthConfigError, duration, priority::Balance, spec::HealthCheckSpec};

/// `config.cluster.v3.OutlierDetection`: the consecutive-5xx, consecutive-gateway-failure,
/// success-rate and failure-percentage detectors, with Envoy's defaults.
///
/// Results are what Envoy records without `split_external_local_origin_errors`: an HTTP response
/// of the proxy path counts with its status; a failed connect counts as 503 and a connect that
/// timed out as 504 (both gateway failures); a successful connect of a TCP connection (either
/// path) counts as 200, while an HTTP connection's success is its response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierDetection {
    /// Consecutive 5xx results that eject a host (default 5; 0 disables).
    #[serde(default = "default_consecutive")]
    pub consecutive_5xx: u32,
    /// Period of the sweep that unejects hosts, runs the success-rate and failure-percentage
    /// detectors and decays backoff (default 10 s).
    #[serde(default = "default_interval", with = "duration")]
    pub interval: Duration,
    /// Ejection time, multiplied by the host's ejection backoff (default 30 s).
    #[serde(default = "default_base_ejection_time", with = "duration")]
    pub base_ejection_time: Duration,
    /// Cap on one ejection's length (default the larger of 300 s and `base_ejection_time`, as
    /// Envoy's); see [`OutlierDetection::max_ejection_time`].
    #[serde(
        default,
        rename = "max_ejection_time",
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_ejection_time_set: Option<Duration>,
    /// Most hosts ejected at once, in percent of the cluster's hosts, counting the one about to
    /// be ejected (default 10).
    #[serde(default = "default_max_ejection_percent")]
    pub max_ejection_percent: u32,
    /// One host may be ejected whatever `max_ejection_percent` says (default false).
    #[serde(default)]
    pub always_eject_one_host: bool,
    /// Chance in percent that a consecutive-5xx detection ejects (default 100).
    #[serde(default = "default_enforcing")]
    pub enforcing_consecutive_5xx: u32,
    /// Consecutive gateway failures (502, 503, 504, failed connects) that eject a host
    /// (default 5; 0 disables).
    #[serde(default = "default_consecutive")]
    pub consecutive_gateway_failure: u32,
    /// Chance in percent that a gateway-failure detection ejects (default 0: detected and
    /// counted, not enforced).
    #[serde(default)]
    pub enforcing_consecutive_gateway_failure: u32,
    /// Hosts with enough requests in one interval needed for the success-rate detector
    /// (default 5).
    #[serde(default = "default_minimum_hosts")]
    pub success_rate_minimum_hosts: u32,
    /// Requests in one interval that make a host count for the success-rate detector
    /// (default 100).
    #[serde(default = "default_success_rate_request_volume")]
    pub success_rate_request_volume: u32,
    /// A host whose success rate is below the mean minus this factor (in thousandths) times the
    /// standard deviation is ejected (default 1900: 1.9).
    #[serde(default = "default_success_rate_stdev_factor")]
    pub success_rate_stdev_factor: u32,
    /// Chance in percent that a success-rate detection ejects (default 100).
    #[serde(default = "default_enforcing")]
    pub enforcing_success_rate: u32,
    /// Failure percentage at or above which a host is ejected (default 85).
    #[serde(default = "default_failure_percentage_threshold")]
    pub failure_percentage_threshold: u32,
    /// Hosts with enough requests needed for the failure-percentage detector (default 5).
    #[serde(default = "default_minimum_hosts")]
    pub failure_percentage_minimum_hosts: u32,
    /// Requests in one interval that make a host count for the failure-percentage detector
    /// (default 50).
    #[serde(default = "default_failure_percentage_request_volume")]
    pub failure_percentage_request_volume: u32,
    /// Chance in percent that a failure-percentage detection ejects (default 0).
    #[serde(default)]
    pub enforcing_failure_percentage: u32,
    /// A passing active health check unejects an ejected host at once (default true).
    #[serde(default = "default_true")]
    pub successful_active_health_check_uneject_host: bool,
}

impl Default for OutlierDetection {
    fn default() -> Self {
        Self {
            consecutive_5xx: default_consecutive(),
            interval: default_interval(),
            base_ejection_time: default_base_ejection_time(),
            max_ejection_time_set: None,
            max_ejection_percent: default_max_ejection_percent(),
            always_eject_one_host: false,
            enforcing_consecutive_5xx: default_enforcing(),
            consecutive_gateway_failure: default_consecutive(),
            enforcing_consecutive_gateway_failure: 0,
            success_rate_minimum_hosts: default_minimum_hosts(),
            success_rate_request_volume: default_success_rate_request_volume(),
            success_rate_stdev_factor: default_success_rate_stdev_factor(),
            enforcing_success_rate: default_enforcing(),
            failure_percentage_threshold: default_failure_percentage_threshold(),
            failure_percentage_minimum_hosts: default_minimum_hosts(),
            failure_percentage_request_volume: default_failure_percentage_request_volume(),
            enforcing_failure_percentage: 0,
            successful_active_health_check_uneject_host: true,
        }
    }
}

fn default_consecutive() -> u32 {
    5
}
fn default_interval() -> Duration {
    Duration::from_secs(10)
}
fn default_base_ejection_time() -> Duration {
    Duration::from_secs(30)
}
/// Envoy's `max_ejection_time` when unset (or `base_ejection_time`, when larger).
const DEFAULT_MAX_EJECTION_TIME: Duration = Duration::from_secs(300);
fn default_max_ejection_percent() -> u32 {
    10
}
fn default_enforcing() -> u32 {
    100
}
fn default_minimum_hosts() -> u32 {
    5
}
fn default_success_rate_request_volume() -> u32 {
    100
}
fn default_success_rate_stdev_factor() -> u32 {
    1900
}
fn default_failure_percentage_threshold() -> u32 {
    85
}
fn default_failure_percentage_request_volume() -> u32 {
    50
}
fn default_true() -> bool {
    true
}

impl OutlierDetection {
    /// The cap on one ejection: as given, else the larger of 300 s and `base_ejection_time`.
    pub fn max_ejection_time(&self) -> Duration {
        self.max_ejection_time_set
            .unwrap_or(DEFAULT_MAX_EJECTION_TIME.max(self.base_ejection_time))
    }

    /// Checks percentages and positive durations, and that `max_ejection_time` is not below
    /// `base_ejection_time` (Envoy's rule).
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
            (
                "outlier_detection.enforcing_consecutive_gateway_failure",
                self.enforcing_consecutive_gateway_failure,
            ),
            (
                "outlier_detection.enforcing_success_rate",
                self.enforcing_success_rate,
            ),
            (
                "outlier_detection.failure_percentage_threshold",
                self.failure_percentage_threshold,
            ),
            (
                "outlier_detection.enforcing_failure_percentage",
                self.enforcing_failure_percentage,
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
        super::config::timer_interval("outlier_detection.interval", Some(self.interval))?;
        if self.base_ejection_time.is_zero() {
            return Err(HealthConfigError::NotPositive(
                "outlier_detection.base_ejection_time",
            ));
        }
        if self.max_ejection_time() < self.base_ejection_time {
            return Err(HealthConfigError::MaxEjectionBelowBase);
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

/// `Cluster.CommonLbConfig`: the panic threshold and locality-weighted balancing.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommonLbConfig {
    /// Below this healthy percentage a priority routes to all its hosts (default 50; 0 disables).
    #[serde(default = "default_panic_threshold")]
    pub healthy_panic_threshold: Percent,
    /// Present (`{}`): inside each priority, localities share traffic by their effective
    /// weights (Envoy's locality-weighted load balancing). Absent: host by host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality_weighted_lb_config: Option<LocalityWeightedLbConfig>,
    /// Zone-aware routing: priority 0's traffic stays in this node's locality
    /// (`node.locality`) as far as the upstream's healthy hosts there can take the share the
    /// local cluster (`cluster_manager.local_cluster_name`) sends from it, and spills by residual
    /// capacity (see `lb::zone`). Needs both settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone_aware_lb_config: Option<ZoneAwareLbConfig>,
}

impl Default for CommonLbConfig {
    fn default() -> Self {
        Self {
            healthy_panic_threshold: default_panic_threshold(),
            locality_weighted_lb_config: None,
            zone_aware_lb_config: None,
        }
    }
}

/// `CommonLbConfig.ZoneAwareLbConfig`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZoneAwareLbConfig {
    /// Percent of picks routed by zone (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_enabled: Option<Percent>,
    /// Fewer healthy priority-0 hosts than this: no zone routing (default 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_cluster_size: Option<u64>,
    /// A priority in panic fails its traffic instead of routing to every host (default false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fail_traffic_on_panic: bool,
}

impl ZoneAwareLbConfig {
    /// These settings for a node in `node`, with Envoy's defaults.
    pub fn settings(&self, node: crate::host::Locality) -> crate::lb::zone::ZoneSettings {
        crate::lb::zone::ZoneSettings {
            node,
            routing_enabled: self.routing_enabled.map_or(100.0, |p| p.value),
            min_cluster_size: self
                .min_cluster_size
                .unwrap_or(crate::lb::zone::DEFAULT_MIN_CLUSTER_SIZE),
            fail_traffic_on_panic: self.fail_traffic_on_panic,
        }
    }
}

/// `CommonLbConfig.LocalityWeightedLbConfig`: an empty message whose presence turns locality
/// weighting on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalityWeightedLbConfig {}

/// The part of `ClusterLoadAssignment.policy` that shapes routing; it travels with the host
/// set (the file's `load_assignment`, a CDS inline assignment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AssignmentPolicy {
    /// `overprovisioning_factor`, percent (default 140).
    pub overprovisioning_factor: u32,
    /// `weighted_priority_health` (default false).
    pub weighted_priority_health: bool,
    /// `drop_overloads`: the share of traffic refused (default none).
    pub drop_overload: super::DropOverload,
}

impl Default for AssignmentPolicy {
    fn default() -> Self {
        Self {
            overprovisioning_factor: super::priority::OVERPROVISIONING_PERCENT,
            weighted_priority_health: false,
            drop_overload: super::DropOverload::NONE,
        }
    }
}

fn default_panic_threshold() -> Percent {
    Percent { value: 50.0 }
}

/// The health fields of a cluster, declared once for [`ClusterHealthConfig`] and for the file's
/// `Cluster` (see `config::fields`); `health_fields!(@copy c, assignment_policy: p)` is the
/// [`ClusterHealthConfig`] of `c`'s.
macro_rules! health_fields {
    ($($args:tt)*) => {
        $crate::config::fields::group! { $crate::health::ClusterHealthConfig [$($args)*]
            /// Active health checks (at most one per cluster); see
            /// `proxy_core::health::HealthCheck`.
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            health_checks: Vec<$crate::health::HealthCheck>,
            /// Passive health checking from the connections' results (Envoy's
            /// `outlier_detection`); absent disables it.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            outlier_detection: Option<$crate::health::OutlierDetection>,
            /// `healthy_panic_threshold` (default 50 %; 0 disables panic mode) and the locality
            /// choices (`locality_weighted_lb_config`, `zone_aware_lb_config`).
            #[serde(default)]
            common_lb_config: $crate::health::CommonLbConfig,
            /// With active health checking: delete a host discovery no longer returns at once
            /// instead of keeping it until it fails a check. Default false (Envoy's).
            #[serde(default, skip_serializing_if = "std::ops::Not::not")]
            ignore_health_on_host_removal: bool,
        }
    };
}
pub(crate) use health_fields;

crate::config::fields::splice! {
    {
        /// The health-related fields of a cluster, as they appear in the cluster config.
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct ClusterHealthConfig {
            /// The host set's assignment policy (from `load_assignment.policy`, not a field here).
            #[serde(skip)]
            pub assignment_policy: AssignmentPolicy,
        }
    }
    [health_fields]
}

impl ClusterHealthConfig {
    /// How routing spreads load: the panic threshold, locality weighting and the policy.
    pub fn balance(&self) -> Balance {
        Balance {
            panic_threshold: self.common_lb_config.healthy_panic_threshold.value,
            overprovisioning_factor: self.assignment_policy.overprovisioning_factor,
            weighted_priority_health: self.assignment_policy.weighted_priority_health,
            locality_weighted: self.common_lb_config.locality_weighted_lb_config.is_some(),
            drop_overload: self.assignment_policy.drop_overload,
        }
    }

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
        let lb = &self.common_lb_config;
        if let Some(zone) = &lb.zone_aware_lb_config {
            if lb.locality_weighted_lb_config.is_some() {
                return Err(HealthConfigError::TwoLocalityConfigs);
            }
            let enabled = zone.routing_enabled.map_or(100.0, |p| p.value);
            if !(0.0..=100.0).contains(&enabled) {
                return Err(HealthConfigError::BadPercent {
                    field: "common_lb_config.zone_aware_lb_config.routing_enabled",
                    value: enabled,
                });
            }
        }
        self.health_checks
            .first()
            .map(|hc| hc.validate(cluster))
            .transpose()
    }
}
