//! A cluster's `circuit_breakers`, in Envoy's v3 shape: per-priority thresholds on the proxy
//! path's upstream connections, pending requests, requests and retries, resolved to
//! [`Limits`] with Envoy's defaults where a threshold is absent.

use serde::{Deserialize, Serialize};

/// Envoy's default `max_connections`, `max_pending_requests` and `max_requests`.
pub const DEFAULT_MAX: u32 = 1024;
/// Envoy's default `max_retries`.
pub const DEFAULT_MAX_RETRIES: u32 = 3;

/// Envoy's `cluster.v3.CircuitBreakers`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakers {
    /// At most one set of thresholds per priority (`DEFAULT`, `HIGH`).
    #[serde(default)]
    pub thresholds: Vec<Thresholds>,
    /// Envoy's per-host thresholds: not supported here (refused by name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_host_thresholds: Option<serde_json::Value>,
}

/// Envoy's `CircuitBreakers.Thresholds`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Thresholds {
    /// The routing priority these thresholds apply to. Default `DEFAULT`.
    #[serde(default)]
    pub priority: Priority,
    /// Upstream connections open at once to the cluster's hosts. Default 1024.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// HTTP requests waiting for an upstream connection at once. Default 1024.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_requests: Option<u32>,
    /// HTTP requests in flight at once (sent and not yet fully answered). Default 1024.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_requests: Option<u32>,
    /// HTTP retries in flight at once. Default 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u32>,
    /// Publish the `remaining_*` gauges (`circuit_breakers.default.remaining_cx`, ...).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub track_remaining: bool,
    /// Envoy's retry budget: not supported here (refused by name; use `max_retries`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<serde_json::Value>,
    /// Envoy's limit on connection pools: not supported here (refused by name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connection_pools: Option<serde_json::Value>,
}

/// Envoy's `RoutingPriority`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Priority {
    /// The priority of every request and connection here.
    #[default]
    Default,
    /// Accepted for Envoy compatibility; no traffic here has this priority (routes have no
    /// `priority` field), so these thresholds limit nothing.
    High,
}

impl Priority {
    /// Envoy's name of the priority.
    pub fn name(self) -> &'static str {
        match self {
            Priority::Default => "DEFAULT",
            Priority::High => "HIGH",
        }
    }
}

/// The limits one priority's traffic is held to, Envoy's defaults filled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Upstream connections open at once.
    pub max_connections: u64,
    /// Requests waiting for a connection at once.
    pub max_pending_requests: u64,
    /// Requests in flight at once.
    pub max_requests: u64,
    /// Retries in flight at once.
    pub max_retries: u64,
    /// Whether the `remaining_*` gauges are published.
    pub track_remaining: bool,
}

impl Default for Limits {
    /// Envoy's defaults: what a cluster without `circuit_breakers` gets.
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX.into(),
            max_pending_requests: DEFAULT_MAX.into(),
            max_requests: DEFAULT_MAX.into(),
            max_retries: DEFAULT_MAX_RETRIES.into(),
            track_remaining: false,
        }
    }
}

impl CircuitBreakers {
    /// The limits of `DEFAULT` priority traffic (all traffic here): the `DEFAULT` thresholds
    /// with Envoy's defaults for what they leave out, or Envoy's defaults without them.
    pub fn default_limits(breakers: Option<&Self>) -> Limits {
        Self::limits(breakers, Priority::Default)
    }

    /// The limits of `priority`'s traffic: its thresholds with Envoy's defaults for what they
    /// leave out, or Envoy's defaults without them.
    pub fn limits(breakers: Option<&Self>, priority: Priority) -> Limits {
        let Some(t) = breakers.and_then(|b| b.thresholds.iter().find(|t| t.priority == priority))
        else {
            return Limits::default();
        };
        let or = |v: Option<u32>, d: u32| u64::from(v.unwrap_or(d));
        Limits {
            max_connections: or(t.max_connections, DEFAULT_MAX),
            max_pending_requests: or(t.max_pending_requests, DEFAULT_MAX),
            max_requests: or(t.max_requests, DEFAULT_MAX),
            max_retries: or(t.max_retries, DEFAULT_MAX_RETRIES),
            track_remaining: t.track_remaining,
        }
    }

    /// The first field refused, as (path below `circuit_breakers`, why).
    pub fn check(&self) -> Result<(), (String, String)> {
        if self.per_host_thresholds.is_some() {
            return Err((
                "per_host_thresholds".into(),
                "per-host circuit breakers are not supported by this daemon (it would ignore \
                 them); remove the field or limit the cluster as a whole with thresholds"
                    .into(),
            ));
        }
        for (i, t) in self.thresholds.iter().enumerate() {
            t.check(i, &self.thresholds[..i])?;
        }
        Ok(())
    }
}

impl Thresholds {
    /// The `i`th thresholds, after `before`: the first field refused, as in
    /// [`CircuitBreakers::check`].
    fn check(&self, i: usize, before: &[Thresholds]) -> Result<(), (String, String)> {
        let at = |field: &str| format!("thresholds[{i}].{field}");
        if self.retry_budget.is_some() {
            return Err((
                at("retry_budget"),
                "retry budgets are not supported by this daemon (it would ignore them); \
                 limit retries in flight with max_retries instead"
                    .into(),
            ));
        }
        if self.max_connection_pools.is_some() {
            return Err((
                at("max_connection_pools"),
                "is not supported by this daemon (it would ignore it): it keeps one \
                 connection pool per host and protocol; remove the field"
                    .into(),
            ));
        }
        if before.iter().any(|o| o.priority == self.priority) {
            return Err((
                at("priority"),
                format!(
                    "a second set of thresholds for priority {}; give each priority at most one",
                    self.priority.name()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> CircuitBreakers {
        serde_norway::from_str(yaml).expect("circuit_breakers parse")
    }

    #[test]
    fn a_cluster_without_circuit_breakers_gets_envoys_defaults() {
        let limits = CircuitBreakers::default_limits(None);
        assert_eq!(
            (
                limits.max_connections,
                limits.max_pending_requests,
                limits.max_requests,
                limits.max_retries,
                limits.track_remaining
            ),
            (1024, 1024, 1024, 3, false)
        );
    }

    #[test]
    fn default_thresholds_fill_in_what_they_leave_out_and_high_limits_nothing() {
        let cb = parse(
            "thresholds:\n\
             - {priority: HIGH, max_connections: 1, max_requests: 1}\n\
             - {max_connections: 2, max_pending_requests: 0, track_remaining: true}\n",
        );
        cb.check().expect("valid");
        assert_eq!(
            CircuitBreakers::default_limits(Some(&cb)),
            Limits {
                max_connections: 2,
                max_pending_requests: 0,
                max_requests: 1024,
                max_retries: 3,
                track_remaining: true,
            }
        );
        let high_only = parse("thresholds: [{priority: HIGH, max_connections: 1}]");
        assert_eq!(
            CircuitBreakers::default_limits(Some(&high_only)),
            Limits::default()
        );
        assert_eq!(
            CircuitBreakers::limits(Some(&high_only), Priority::High),
            Limits {
                max_connections: 1,
                ..Limits::default()
            }
        );
    }

    #[test]
    fn fields_not_honoured_are_refused_by_name() {
        for (yaml, field, says) in [
            (
                "per_host_thresholds: [{max_connections: 1}]",
                "per_host_thresholds",
                "per-host",
            ),
            (
                "thresholds: [{retry_budget: {budget_percent: {value: 20}}}]",
                "thresholds[0].retry_budget",
                "max_retries",
            ),
            (
                "thresholds: [{max_connection_pools: 4}]",
                "thresholds[0].max_connection_pools",
                "one connection pool per host",
            ),
            (
                "thresholds: [{max_retries: 1}, {priority: DEFAULT}]",
                "thresholds[1].priority",
                "a second set of thresholds for priority DEFAULT",
            ),
        ] {
            let (at, why) = parse(yaml).check().expect_err(yaml);
            assert_eq!(at, field, "{yaml}");
            assert!(why.contains(says), "{yaml}: {why}");
        }
    }

    /// The file's rules: a refusal names the field and its line; ORIGINAL_DST clusters refuse
    /// breakers; the effective form is dumped as given.
    #[test]
    fn a_config_file_locates_refusals_and_dumps_the_thresholds() {
        let parse = |text: &str| crate::config::Config::parse(text, std::path::Path::new("t.yaml"));
        let budget = "clusters:\n- name: a\n  circuit_breakers:\n    thresholds:\n    \
                      - max_connections: 2\n      retry_budget: {}\n";
        let err = parse(budget).expect_err("retry_budget refused").to_string();
        assert!(
            err.starts_with("t.yaml:6:")
                && err.contains(
                    "clusters[0].circuit_breakers.thresholds[0].retry_budget: retry budgets"
                ),
            "{err}"
        );
        let orig = "clusters:\n- name: o\n  type: ORIGINAL_DST\n  lb_policy: CLUSTER_PROVIDED\n  \
                    circuit_breakers: {thresholds: [{max_connections: 1}]}\n";
        let err = parse(orig).expect_err("ORIGINAL_DST refused").to_string();
        assert!(
            err.contains("clusters[0].circuit_breakers: ORIGINAL_DST"),
            "{err}"
        );
        let ok = "clusters:\n- name: a\n  circuit_breakers:\n    thresholds: [{max_requests: 5, track_remaining: true}]\n";
        let config = parse(ok).expect("valid");
        assert_eq!(
            serde_json::to_value(&config.clusters[0]).unwrap()["circuit_breakers"],
            serde_json::json!({"thresholds": [{"priority": "DEFAULT", "max_requests": 5, "track_remaining": true}]})
        );
    }

    #[test]
    fn unknown_fields_and_priorities_do_not_parse() {
        for yaml in [
            "thresholds: [{max_conections: 1}]",
            "thresholds: [{priority: LOW}]",
            "thresholds: [{max_connections: -1}]",
            "budget: 1",
        ] {
            assert!(
                serde_norway::from_str::<CircuitBreakers>(yaml).is_err(),
                "{yaml}"
            );
        }
    }
}
