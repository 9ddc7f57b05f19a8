//! Configuration of one Consul catalog cluster, and its validation.
//!
//! Durations are Envoy JSON strings (`"30s"`, `"0.5s"`, or `"500ms"`), as everywhere else in the
//! configuration. Only `service` is required:
//!
//! ```yaml
//! address: 127.0.0.1:8500   # the local agent's HTTP API
//! service: web
//! datacenter: dc2           # optional: the agent's own datacenter when unset
//! tag: v2                   # optional: only instances with this tag
//! wait: 30s                 # longest blocking query
//! only_passing: false       # true: a warning check makes an instance unhealthy
//! retry_backoff: { base_interval: 1s, max_interval: 30s }
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::discovery::dns::duration;

/// Consul caps a blocking query's `wait` at 10 minutes.
const MAX_WAIT: Duration = Duration::from_secs(600);

/// Smallest backoff interval accepted is anything strictly above this (as for DNS refreshes).
const MIN_BACKOFF: Duration = Duration::from_millis(1);

/// Where a cluster's hosts come from in the Consul catalog.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConsulConfig {
    /// `host:port` of the Consul agent's HTTP API (plain HTTP; usually the local agent).
    #[serde(default = "default_address")]
    pub address: String,
    /// Service name as registered in the catalog (`/v1/health/service/<service>`).
    pub service: String,
    /// Datacenter to query (`dc=`); the agent's own datacenter when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datacenter: Option<String>,
    /// Only instances carrying this tag (`tag=`); all instances when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Longest time one blocking query waits for a change (`wait=`); at most 10 minutes.
    #[serde(default = "default_wait", with = "duration")]
    pub wait: Duration,
    /// Consul's service-resolver `OnlyPassing`: when true an instance with any check that is not
    /// passing (a warning) is unhealthy; when false only critical checks make it unhealthy and a
    /// warning only switches it to its `Weights.Warning` weight.
    #[serde(default = "default_only_passing")]
    pub only_passing: bool,
    /// Jittered exponential backoff between failed queries; hosts are kept meanwhile.
    #[serde(default = "default_retry_backoff")]
    pub retry_backoff: RetryBackoff,
}

/// Envoy's `BackoffStrategy`: the n-th consecutive failure waits a random time below
/// `min(base_interval * 2^(n-1), max_interval)`; a success starts again from `base_interval`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBackoff {
    /// First bound of the random delay; > 1 ms.
    #[serde(default = "default_base_interval", with = "duration")]
    pub base_interval: Duration,
    /// Cap of the bound; >= `base_interval`.
    #[serde(default = "default_max_interval", with = "duration")]
    pub max_interval: Duration,
}

fn default_address() -> String {
    "127.0.0.1:8500".to_owned()
}

fn default_wait() -> Duration {
    Duration::from_secs(30)
}

fn default_only_passing() -> bool {
    false
}

fn default_base_interval() -> Duration {
    Duration::from_secs(1)
}

fn default_max_interval() -> Duration {
    Duration::from_secs(30)
}

fn default_retry_backoff() -> RetryBackoff {
    RetryBackoff {
        base_interval: default_base_interval(),
        max_interval: default_max_interval(),
    }
}

impl ConsulConfig {
    /// The defaults for `service`.
    pub fn new(service: impl Into<String>) -> Self {
        Self {
            address: default_address(),
            service: service.into(),
            datacenter: None,
            tag: None,
            wait: default_wait(),
            only_passing: default_only_passing(),
            retry_backoff: default_retry_backoff(),
        }
    }

    /// Checks what serde cannot: non-empty names, a port in `address`, bounded durations.
    pub fn validate(&self) -> Result<(), ConsulConfigError> {
        let port = self
            .address
            .rsplit_once(':')
            .map(|(host, port)| (host, port.parse::<u16>()));
        if !matches!(port, Some((host, Ok(p))) if !host.is_empty() && p != 0) {
            return Err(ConsulConfigError::Address {
                address: self.address.clone(),
            });
        }
        for (field, value) in [
            ("service", Some(&self.service)),
            ("datacenter", self.datacenter.as_ref()),
            ("tag", self.tag.as_ref()),
        ] {
            if value.is_some_and(std::string::String::is_empty) {
                return Err(ConsulConfigError::Empty { field });
            }
        }
        if self.wait.is_zero() || self.wait > MAX_WAIT {
            return Err(ConsulConfigError::Wait { wait: self.wait });
        }
        let RetryBackoff {
            base_interval,
            max_interval,
        } = self.retry_backoff;
        if base_interval <= MIN_BACKOFF || max_interval < base_interval {
            return Err(ConsulConfigError::Backoff {
                base_interval,
                max_interval,
            });
        }
        Ok(())
    }
}

/// Why a [`ConsulConfig`] was rejected.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConsulConfigError {
    /// `address` is not `host:port`.
    #[error("consul.address {address:?} is not host:port (for example 127.0.0.1:8500)")]
    Address {
        /// The configured value.
        address: String,
    },
    /// A name is empty.
    #[error("consul.{field} must not be empty (leave it out instead)")]
    Empty {
        /// Which field.
        field: &'static str,
    },
    /// `wait` is 0 or above Consul's 10-minute cap.
    #[error("consul.wait {wait:?} must be above 0 and at most 10 minutes (Consul's cap)")]
    Wait {
        /// The configured value.
        wait: Duration,
    },
    /// The backoff intervals are out of range.
    #[error(
        "consul.retry_backoff: base_interval {base_interval:?} must be above 1ms and \
         max_interval {max_interval:?} at least base_interval"
    )]
    Backoff {
        /// The configured base.
        base_interval: Duration,
        /// The configured cap.
        max_interval: Duration,
    },
}
