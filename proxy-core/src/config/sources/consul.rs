//! Configuration of one Consul catalog cluster, and its validation; `crate::discovery::consul`
//! watches the catalog with it.
//!
//! Durations are Envoy JSON strings (`"30s"`, `"0.5s"`, or `"500ms"`), as everywhere else in the
//! configuration. Only `service` is required:
//!
//! ```yaml
//! address: 127.0.0.1:8500   # the agent's HTTP API; else CONSUL_HTTP_ADDR, else this
//! token_file: /etc/consul.d/proxy.token  # or `token:`; else CONSUL_HTTP_TOKEN(_FILE)
//! service: web
//! datacenter: dc2           # optional: the agent's own datacenter when unset
//! tag: v2                   # optional: only instances with this tag
//! wait: 30s                 # longest blocking query
//! only_passing: false       # true: a warning check makes an instance unhealthy
//! retry_backoff: { base_interval: 1s, max_interval: 30s }
//! ```

pub mod access;
pub mod entries;

use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use self::access::ConsulToken;
use crate::{config::duration, tls::TlsSettings};

/// Consul caps a blocking query's `wait` at 10 minutes.
const MAX_WAIT: Duration = Duration::from_secs(600);

/// Smallest backoff interval accepted is anything strictly above this (as for DNS refreshes).
const MIN_BACKOFF: Duration = Duration::from_millis(1);

/// Where a cluster's hosts come from in the Consul catalog.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConsulConfig {
    /// `host:port` of the Consul agent's HTTP API (usually the local agent), optionally with an
    /// `http://` or `https://` prefix. When unset: `CONSUL_HTTP_ADDR`, else `127.0.0.1:8500`,
    /// as Consul's CLI reads them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// ACL token sent as `X-Consul-Token` (serialized as `<redacted>`). When neither this nor
    /// `token_file` is set: `CONSUL_HTTP_TOKEN_FILE`, else `CONSUL_HTTP_TOKEN`, else none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<ConsulToken>,
    /// File holding the ACL token (surrounding whitespace trimmed), read before every query so
    /// a rotated token applies without a restart. Not together with `token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
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
    /// TLS to the agent (`ca_file`, `cert_file`, `key_file`, `server_name`); setting it means
    /// https. When unset and https is asked for (`https://`, `CONSUL_HTTP_SSL=true`):
    /// `CONSUL_CACERT`, `CONSUL_CLIENT_CERT`, `CONSUL_CLIENT_KEY`, `CONSUL_TLS_SERVER_NAME`.
    /// The files are read again for every connection, so rotated files apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<Box<TlsSettings>>,
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
            address: None,
            token: None,
            token_file: None,
            tls: None,
            service: service.into(),
            datacenter: None,
            tag: None,
            wait: default_wait(),
            only_passing: default_only_passing(),
            retry_backoff: default_retry_backoff(),
        }
    }

    /// Checks what serde cannot: non-empty names, a port in the address, one token source,
    /// bounded durations; and the `CONSUL_HTTP_*` variables this process would use.
    pub fn validate(&self) -> Result<(), ConsulConfigError> {
        self.validate_fields()?;
        access::resolve(self, &|name| std::env::var(name).ok()).map(drop)
    }

    /// [`Self::validate`] without the environment.
    pub(crate) fn validate_fields(&self) -> Result<(), ConsulConfigError> {
        if self
            .token_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return Err(ConsulConfigError::Empty {
                field: "token_file",
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
    /// The address is not `host:port`.
    #[error("{field} {address:?} is not host:port (for example 127.0.0.1:8500)")]
    Address {
        /// `consul.address` or `CONSUL_HTTP_ADDR`.
        field: &'static str,
        /// The address after its scheme.
        address: String,
    },
    /// The address has a scheme other than `http://` (Consul's `unix://` included).
    #[error("{field} has scheme {scheme:?}; only http:// is supported")]
    Scheme {
        /// `consul.address` or `CONSUL_HTTP_ADDR`.
        field: &'static str,
        /// The scheme given.
        scheme: String,
    },
    /// https was asked for without a CA to trust.
    #[error(
        "https to consul needs a CA: set consul.tls.ca_file or CONSUL_CACERT (the system store \
         is not used)"
    )]
    NoCa,
    /// Only one of the client certificate and key is set.
    #[error("{field}: the client certificate and key must be set together, or both left out")]
    TlsPair {
        /// `consul.tls` or `CONSUL_CACERT` (the environment's TLS variables).
        field: &'static str,
    },
    /// The TLS server name is neither a DNS name nor an IP address.
    #[error("consul TLS server name {name:?} is neither a DNS name nor an IP address")]
    TlsServerName {
        /// The name.
        name: String,
    },
    /// `CONSUL_HTTP_SSL` is not a boolean.
    #[error("CONSUL_HTTP_SSL={value:?} is not a boolean (true, false, 1, 0)")]
    SslEnv {
        /// The value.
        value: String,
    },
    /// Both `token` and `token_file` are set.
    #[error("consul.token and consul.token_file are both set; keep one")]
    TokenAndFile,
    /// `CONSUL_HTTP_TOKEN` cannot be sent as a header.
    #[error(
        "CONSUL_HTTP_TOKEN is not visible ASCII without spaces (its value is not shown); is it \
         set to the token itself?"
    )]
    TokenEnv,
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
