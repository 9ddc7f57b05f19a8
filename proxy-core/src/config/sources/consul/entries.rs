//! The `consul_config_entries` block: where the daemon reads Consul's config entries from, with
//! the connection settings of a Consul catalog cluster (and their validation).
//!
//! ```yaml
//! consul_config_entries:
//!   address: 127.0.0.1:8500   # else CONSUL_HTTP_ADDR, else this
//!   token_file: /etc/proxy/consul.token   # or token:; else CONSUL_HTTP_TOKEN(_FILE)
//!   datacenter: dc1           # optional: the agent's own datacenter when unset
//!   wait: 30s                 # longest blocking query
//!   retry_backoff: { base_interval: 1s, max_interval: 30s }
//! ```

use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use super::{ConsulConfig, ConsulConfigError, RetryBackoff, access::ConsulToken};
use crate::{config::duration, tls::TlsSettings};

/// Name given to the connection settings in place of a catalog service (never queried).
const CONNECTION: &str = "config-entries";

/// Where Consul's config entries come from. Every field means what it means for a
/// `proxy.clusters.consul` cluster.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConsulEntriesConfig {
    /// `host:port` of the Consul agent's HTTP API, optionally with `http://` or `https://`.
    /// When unset: `CONSUL_HTTP_ADDR`, else `127.0.0.1:8500`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// ACL token sent as `X-Consul-Token` (serialized as `<redacted>`). When neither this nor
    /// `token_file` is set: `CONSUL_HTTP_TOKEN_FILE`, else `CONSUL_HTTP_TOKEN`, else none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<ConsulToken>,
    /// File holding the ACL token, read before every query. Not together with `token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Datacenter whose entries are read (`dc=`); the agent's own datacenter when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datacenter: Option<String>,
    /// Longest time one blocking query waits for a change (`wait=`); at most 10 minutes.
    #[serde(default = "default_wait", with = "duration")]
    pub wait: Duration,
    /// TLS to the agent; setting it means https (as for catalog clusters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<Box<TlsSettings>>,
    /// Jittered exponential backoff between failed queries; the last entries are kept meanwhile.
    #[serde(default = "default_retry_backoff")]
    pub retry_backoff: RetryBackoff,
}

fn default_wait() -> Duration {
    ConsulConfig::new(CONNECTION).wait
}

fn default_retry_backoff() -> RetryBackoff {
    ConsulConfig::new(CONNECTION).retry_backoff
}

impl Default for ConsulEntriesConfig {
    fn default() -> Self {
        Self {
            address: None,
            token: None,
            token_file: None,
            datacenter: None,
            wait: default_wait(),
            tls: None,
            retry_backoff: default_retry_backoff(),
        }
    }
}

impl ConsulEntriesConfig {
    /// The same settings as a catalog cluster's, so that address, token, TLS and the
    /// `CONSUL_HTTP_*` variables resolve by one set of rules.
    pub(crate) fn connection(&self) -> ConsulConfig {
        ConsulConfig {
            address: self.address.clone(),
            token: self.token.clone(),
            token_file: self.token_file.clone(),
            datacenter: self.datacenter.clone(),
            wait: self.wait,
            tls: self.tls.clone(),
            retry_backoff: self.retry_backoff,
            ..ConsulConfig::new(CONNECTION)
        }
    }

    /// Checks the settings and the `CONSUL_HTTP_*` variables this process would use, as
    /// [`ConsulConfig::validate`] does.
    pub fn validate(&self) -> Result<(), ConsulConfigError> {
        self.connection().validate()
    }
}
