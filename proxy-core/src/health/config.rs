//! Health-checking, outlier-detection and panic-threshold configuration (Envoy v3 field names).
//!
//! The serde types mirror `config.core.v3.HealthCheck`, `config.cluster.v3.OutlierDetection` and
//! `Cluster.CommonLbConfig.healthy_panic_threshold`, restricted to the fields this proxy
//! implements (`deny_unknown_fields` rejects the rest loudly). [`HealthCheck::validate`] turns the
//! raw config into a [`HealthCheckSpec`] with every default applied.

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use super::udp_config::{DnsHealthCheck, UdpHealthCheck};
use super::{
    duration,
    spec::{CheckKind, GrpcSpec, HealthCheckSpec, HttpSpec, StatusRange, StringMatch, TcpSpec},
};

/// Why a health-checking configuration was rejected; every variant names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HealthConfigError {
    /// A required field is absent.
    #[error("health check field `{0}` is required")]
    Missing(&'static str),
    /// A duration that must be positive is zero.
    #[error("health check field `{0}` must be greater than 0")]
    NotPositive(&'static str),
    /// A timer interval below [`MIN_TIMER_INTERVAL`]: a loop that wakes every few nanoseconds
    /// would spin a CPU.
    #[error(
        "`{field}` is {value:?}; a timer interval must be at least 1ms (a shorter one would spin a CPU)"
    )]
    BelowTimerFloor {
        /// The field.
        field: &'static str,
        /// The configured value.
        value: Duration,
    },
    /// None or several of the checkers are set.
    #[error(
        "exactly one of `tcp_health_check`, `http_health_check`, `grpc_health_check`, `udp_health_check` must be set, found {0}"
    )]
    CheckerCount(usize),
    /// `udp_health_check` sets none or both of `send` and `dns`.
    #[error(
        "health check field `udp_health_check` must set exactly one of `send` (a payload) and `dns` (a query), found {0}"
    )]
    UdpForm(usize),
    /// `udp_health_check.receive` beside `dns`: a DNS check judges the answer's RCODE.
    #[error(
        "health check field `udp_health_check.receive` goes with `send`; a `dns` check judges the answer by `expected_rcode`"
    )]
    UdpReceiveWithDns,
    /// `udp_health_check.dns.name` is not a DNS name.
    #[error("health check field `udp_health_check.dns.name` {name:?} is not a DNS name: {reason}")]
    BadDnsName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A named value outside its list.
    #[error("health check field `{field}` is {value:?}; expected one of {allowed}")]
    NotOneOf {
        /// The field.
        field: &'static str,
        /// The value given.
        value: String,
        /// The accepted values, comma-separated.
        allowed: String,
    },
    /// A hex payload does not decode.
    #[error("health check field `{field}` is not valid hex: {text:?}")]
    BadHex {
        /// The field holding the payload.
        field: &'static str,
        /// The offending text.
        text: String,
    },
    /// A status range is empty or outside [100, 600).
    #[error(
        "health check field `{field}` has an invalid range [{start}, {end}): must satisfy 100 <= start < end <= 600"
    )]
    BadRange {
        /// The field holding the range.
        field: &'static str,
        /// Range start (inclusive).
        start: i64,
        /// Range end (exclusive).
        end: i64,
    },
    /// `service_name_matcher` sets none or several of its patterns (Envoy's `match_pattern`
    /// is a required oneof): all but one would be ignored.
    #[error(
        "health check field `http_health_check.service_name_matcher` must set exactly one of `exact`, `prefix`, `suffix`, `contains`, found {0}"
    )]
    MatcherPatterns(usize),
    /// `http_health_check.path` is empty.
    #[error("health check field `http_health_check.path` must not be empty")]
    EmptyPath,
    /// A percentage is above 100.
    #[error("field `{field}` must be between 0 and 100, got {value}")]
    BadPercent {
        /// The field holding the percentage.
        field: &'static str,
        /// The value given.
        value: f64,
    },
    /// `outlier_detection.max_ejection_time` below `base_ejection_time`.
    #[error(
        "field `outlier_detection.max_ejection_time`: outlier detector's max_ejection_time cannot be smaller than base_ejection_time"
    )]
    MaxEjectionBelowBase,
    /// More than one entry in `health_checks`; Envoy supports one checker per cluster.
    #[error(
        "field `health_checks` holds {0} entries; only one health checker per cluster is supported"
    )]
    TooManyHealthChecks(usize),
    /// A threshold is zero.
    #[error("health check field `{0}` must be at least 1")]
    ZeroThreshold(&'static str),
    /// Both locality choices of `common_lb_config` (Envoy's `locality_config_specifier` oneof).
    #[error(
        "`common_lb_config` sets both `locality_weighted_lb_config` and `zone_aware_lb_config`; Envoy takes one of them"
    )]
    TwoLocalityConfigs,
}

/// One active health checker (`config.core.v3.HealthCheck`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    /// Time to wait for one check to complete; required, > 0.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<Duration>,
    /// Time between checks; required, > 0.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub interval: Option<Duration>,
    /// Random delay in [0, initial_jitter) before the very first check only.
    #[serde(default = "zero", with = "duration")]
    pub initial_jitter: Duration,
    /// Random delay in [0, interval_jitter) added to every interval.
    #[serde(default = "zero", with = "duration")]
    pub interval_jitter: Duration,
    /// Random delay in [0, interval * pct / 100) added to every interval.
    #[serde(default)]
    pub interval_jitter_percent: u32,
    /// Consecutive failures that mark a healthy host unhealthy; required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_threshold: Option<u32>,
    /// Consecutive successes that mark an unhealthy host healthy; required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthy_threshold: Option<u32>,
    /// Interval used until the cluster has carried traffic (default 60 s).
    #[serde(default = "default_no_traffic_interval", with = "duration")]
    pub no_traffic_interval: Duration,
    /// Interval for healthy hosts before traffic (default `no_traffic_interval`).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub no_traffic_healthy_interval: Option<Duration>,
    /// Interval while a host is unhealthy (default `interval`).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub unhealthy_interval: Option<Duration>,
    /// Interval while failures accumulate towards `unhealthy_threshold` (default `unhealthy_interval`).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub unhealthy_edge_interval: Option<Duration>,
    /// Interval while successes accumulate towards `healthy_threshold` (default `interval`).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub healthy_edge_interval: Option<Duration>,
    /// Raw TCP checker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_health_check: Option<TcpHealthCheck>,
    /// HTTP/1.1 checker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_health_check: Option<HttpHealthCheck>,
    /// gRPC `grpc.health.v1.Health/Check` checker over h2c.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_health_check: Option<GrpcHealthCheck>,
    /// UDP checker (this daemon's own; Envoy has none): a payload or a DNS query.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_health_check: Option<UdpHealthCheck>,
}

/// `HealthCheck.TcpHealthCheck`: connect, optionally send a payload and expect blocks back.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpHealthCheck {
    /// Bytes to send after connecting; absent or empty means connect-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send: Option<Payload>,
    /// Blocks that must each appear in the response, in order (fuzzy match).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub receive: Vec<Payload>,
}

/// `HealthCheck.Payload`: only the hex `text` form is supported.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Payload {
    /// Hex-encoded bytes, e.g. `"50494E47"` for `PING`.
    pub text: String,
}

/// `HealthCheck.HttpHealthCheck`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpHealthCheck {
    /// `Host` header; defaults to the cluster name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Request path; required, non-empty.
    #[serde(default)]
    pub path: String,
    /// Healthy status ranges, half-open; default `[200, 201)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expected_statuses: Vec<Int64Range>,
    /// Statuses that count towards `unhealthy_threshold` instead of failing at once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retriable_statuses: Vec<Int64Range>,
    /// If set, `x-envoy-upstream-healthchecked-cluster` in the response must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name_matcher: Option<StringMatcher>,
}

/// `type.v3.Int64Range`: `[start, end)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Int64Range {
    /// Inclusive start.
    pub start: i64,
    /// Exclusive end.
    pub end: i64,
}

/// `type.matcher.v3.StringMatcher`, without `safe_regex`; exactly one pattern field is honoured
/// (the first set of exact, prefix, suffix, contains).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StringMatcher {
    /// The whole value must equal this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    /// The value must start with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// The value must end with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    /// The value must contain this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contains: Option<String>,
    /// Compare ASCII case-insensitively.
    #[serde(default)]
    pub ignore_case: bool,
}

/// `HealthCheck.GrpcHealthCheck`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpcHealthCheck {
    /// `service` in `HealthCheckRequest`; empty means the whole server.
    #[serde(default)]
    pub service_name: String,
    /// `:authority`; defaults to the cluster name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<String>,
}

fn zero() -> Duration {
    Duration::ZERO
}

fn default_no_traffic_interval() -> Duration {
    Duration::from_secs(60)
}

impl HealthCheck {
    /// Checks required fields and ranges and applies defaults. `cluster` fills the HTTP `Host`
    /// and gRPC `:authority` defaults, so the result is the exact probe a cluster would run.
    pub fn validate(&self, cluster: &str) -> Result<HealthCheckSpec, HealthConfigError> {
        let timeout = positive(self.timeout, "timeout")?;
        let interval = positive(self.interval, "interval")?;
        for (field, value) in [
            ("interval", Some(interval)),
            ("no_traffic_interval", Some(self.no_traffic_interval)),
            (
                "no_traffic_healthy_interval",
                self.no_traffic_healthy_interval,
            ),
            ("unhealthy_interval", self.unhealthy_interval),
            ("unhealthy_edge_interval", self.unhealthy_edge_interval),
            ("healthy_edge_interval", self.healthy_edge_interval),
        ] {
            timer_interval(field, value)?;
        }
        let unhealthy_threshold = threshold(self.unhealthy_threshold, "unhealthy_threshold")?;
        let healthy_threshold = threshold(self.healthy_threshold, "healthy_threshold")?;
        let unhealthy_interval = self.unhealthy_interval.unwrap_or(interval);
        Ok(HealthCheckSpec {
            timeout,
            interval,
            initial_jitter: self.initial_jitter,
            interval_jitter: self.interval_jitter,
            interval_jitter_percent: self.interval_jitter_percent,
            unhealthy_threshold,
            healthy_threshold,
            no_traffic_interval: self.no_traffic_interval,
            no_traffic_healthy_interval: self
                .no_traffic_healthy_interval
                .unwrap_or(self.no_traffic_interval),
            unhealthy_interval,
            unhealthy_edge_interval: self.unhealthy_edge_interval.unwrap_or(unhealthy_interval),
            healthy_edge_interval: self.healthy_edge_interval.unwrap_or(interval),
            kind: self.kind(cluster)?,
        })
    }

    fn kind(&self, cluster: &str) -> Result<CheckKind, HealthConfigError> {
        let count = usize::from(self.tcp_health_check.is_some())
            + usize::from(self.http_health_check.is_some())
            + usize::from(self.grpc_health_check.is_some())
            + usize::from(self.udp_health_check.is_some());
        if count != 1 {
            return Err(HealthConfigError::CheckerCount(count));
        }
        if let Some(udp) = &self.udp_health_check {
            return udp.validate().map(CheckKind::Udp);
        }
        if let Some(tcp) = &self.tcp_health_check {
            return tcp.validate().map(CheckKind::Tcp);
        }
        if let Some(http) = &self.http_health_check {
            return http.validate(cluster).map(CheckKind::Http);
        }
        let grpc = self
            .grpc_health_check
            .as_ref()
            .ok_or(HealthConfigError::CheckerCount(0))?;
        Ok(CheckKind::Grpc(GrpcSpec {
            service_name: grpc.service_name.clone(),
            authority: grpc.authority.clone().unwrap_or_else(|| cluster.to_owned()),
        }))
    }
}

/// The shortest timer interval taken anywhere in the configuration (DNS refreshes have the same
/// floor): a shorter one is a typo that would make a loop spin.
pub const MIN_TIMER_INTERVAL: Duration = Duration::from_millis(1);

/// `value`, when set, is at least [`MIN_TIMER_INTERVAL`].
pub fn timer_interval(
    field: &'static str,
    value: Option<Duration>,
) -> Result<(), HealthConfigError> {
    match value {
        Some(value) if value < MIN_TIMER_INTERVAL => {
            Err(HealthConfigError::BelowTimerFloor { field, value })
        }
        _ => Ok(()),
    }
}

fn positive(d: Option<Duration>, field: &'static str) -> Result<Duration, HealthConfigError> {
    match d {
        None => Err(HealthConfigError::Missing(field)),
        Some(d) if d.is_zero() => Err(HealthConfigError::NotPositive(field)),
        Some(d) => Ok(d),
    }
}

fn threshold(v: Option<u32>, field: &'static str) -> Result<u32, HealthConfigError> {
    match v {
        None => Err(HealthConfigError::Missing(field)),
        Some(0) => Err(HealthConfigError::ZeroThreshold(field)),
        Some(v) => Ok(v),
    }
}

impl TcpHealthCheck {
    fn validate(&self) -> Result<TcpSpec, HealthConfigError> {
        let send = match &self.send {
            Some(p) => decode_hex(&p.text, "tcp_health_check.send.text")?,
            None => Vec::new(),
        };
        let receive = self
            .receive
            .iter()
            .map(|p| decode_hex(&p.text, "tcp_health_check.receive.text"))
            .collect::<Result<_, _>>()?;
        Ok(TcpSpec { send, receive })
    }
}

impl HttpHealthCheck {
    fn validate(&self, cluster: &str) -> Result<HttpSpec, HealthConfigError> {
        if self.path.is_empty() {
            return Err(HealthConfigError::EmptyPath);
        }
        let mut expected = ranges(
            &self.expected_statuses,
            "http_health_check.expected_statuses",
        )?;
        if expected.is_empty() {
            expected.push(StatusRange {
                start: 200,
                end: 201,
            });
        }
        Ok(HttpSpec {
            host: self.host.clone().unwrap_or_else(|| cluster.to_owned()),
            path: self.path.clone(),
            expected_statuses: expected,
            retriable_statuses: ranges(
                &self.retriable_statuses,
                "http_health_check.retriable_statuses",
            )?,
            service_name_matcher: self
                .service_name_matcher
                .as_ref()
                .map(|m| m.validate().map(|()| StringMatch::from(m)))
                .transpose()?,
        })
    }
}

fn ranges(list: &[Int64Range], field: &'static str) -> Result<Vec<StatusRange>, HealthConfigError> {
    list.iter()
        .map(|r| {
            if r.start < 100 || r.end > 600 || r.start >= r.end {
                return Err(HealthConfigError::BadRange {
                    field,
                    start: r.start,
                    end: r.end,
                });
            }
            // In range [100, 600] after the check above, so the casts are lossless.
            Ok(StatusRange {
                start: r.start as u16,
                end: r.end as u16,
            })
        })
        .collect()
}

/// Decodes a hex string (either case, no separators).
pub fn decode_hex(text: &str, field: &'static str) -> Result<Vec<u8>, HealthConfigError> {
    let bad = || HealthConfigError::BadHex {
        field,
        text: text.to_owned(),
    };
    if !text.len().is_multiple_of(2) {
        return Err(bad());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|b| u8::from_str_radix(b, 16).ok())
                .ok_or_else(bad)
        })
        .collect()
}

impl StringMatcher {
    /// Exactly one pattern is set, as Envoy's oneof requires.
    fn validate(&self) -> Result<(), HealthConfigError> {
        let set = [&self.exact, &self.prefix, &self.suffix, &self.contains]
            .into_iter()
            .filter(|p| p.is_some())
            .count();
        if set == 1 {
            Ok(())
        } else {
            Err(HealthConfigError::MatcherPatterns(set))
        }
    }
}

impl From<&StringMatcher> for StringMatch {
    fn from(m: &StringMatcher) -> Self {
        let fold = |s: &String| {
            if m.ignore_case {
                s.to_ascii_lowercase()
            } else {
                s.clone()
            }
        };
        let ignore_case = m.ignore_case;
        if let Some(s) = &m.exact {
            StringMatch::Exact(fold(s), ignore_case)
        } else if let Some(s) = &m.prefix {
            StringMatch::Prefix(fold(s), ignore_case)
        } else if let Some(s) = &m.suffix {
            StringMatch::Suffix(fold(s), ignore_case)
        } else if let Some(s) = &m.contains {
            StringMatch::Contains(fold(s), ignore_case)
        } else {
            StringMatch::Exact(String::new(), ignore_case)
        }
    }
}
