//! One upstream host and its health as a source reports it: what every discovery source
//! (`crate::discovery`), a STATIC cluster's endpoints (`crate::config`), health checking and
//! load balancing share.

use std::{collections::BTreeMap, net::SocketAddr};

use serde::{Deserialize, Serialize};

/// Health as reported by the discovery source itself (EDS `health_status`, Consul checks), before
/// active health checking. Envoy's `core.v3.HealthStatus`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EdsHealth {
    /// No information; treated as healthy.
    #[default]
    Unknown,
    /// Healthy.
    Healthy,
    /// Unhealthy; not routed.
    Unhealthy,
    /// Draining; treated as unhealthy for new connections.
    Draining,
    /// Health check timed out; treated as unhealthy.
    Timeout,
    /// Degraded: routed only when there are not enough healthy hosts.
    Degraded,
}

/// One upstream host of a cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Host {
    /// Address the kernel or the proxy connects to.
    pub addr: SocketAddr,
    /// Load-balancing weight, at least 1.
    pub weight: u32,
    /// Failover priority, 0 = highest.
    pub priority: u32,
    /// Health as the discovery source reports it.
    pub eds_health: EdsHealth,
    /// Host metadata (EDS metadata, Consul `Service.Meta`), used by subset filters.
    pub metadata: BTreeMap<String, String>,
    /// Hostname the address came from, if any (DNS-based clusters).
    pub hostname: Option<String>,
}

impl Host {
    /// A host with weight 1, priority 0, unknown health and no metadata.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            weight: 1,
            priority: 0,
            eds_health: EdsHealth::Unknown,
            metadata: BTreeMap::new(),
            hostname: None,
        }
    }
}

/// The hosts a discovery backend currently reports for one cluster.
pub type HostSet = Vec<Host>;
