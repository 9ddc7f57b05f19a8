//! One upstream host and its health as a source reports it: what every discovery source
//! (`crate::discovery`), a STATIC cluster's endpoints (`crate::config`), health checking and
//! load balancing share.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

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
    /// Hostname the address came from (DNS-based clusters), or the endpoint's `hostname` (EDS,
    /// the file): shown in `/clusters`, never resolved.
    pub hostname: Option<String>,
    /// Envoy's `Endpoint.health_check_config`: where and how active checks reach this host.
    pub health_check: HealthCheckTarget,
    /// Where the host runs (the enclosing `LocalityLbEndpoints.locality`); empty when the
    /// source names none.
    pub locality: Locality,
    /// The enclosing `LocalityLbEndpoints.load_balancing_weight`, when set: the locality's
    /// weight under locality-weighted load balancing (the same on every host of a locality).
    pub locality_weight: Option<u32>,
}

/// Envoy's `core.v3.Locality`: region, zone and sub-zone, each empty when not named. Two hosts
/// are in one locality when all three are equal.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Locality {
    /// The region.
    #[serde(default)]
    pub region: String,
    /// The zone within the region.
    #[serde(default)]
    pub zone: String,
    /// The sub-zone within the zone.
    #[serde(default)]
    pub sub_zone: String,
}

/// Envoy's `Endpoint.HealthCheckConfig`: an active check of a host may go to another address or
/// port than its traffic, name it differently, or not run at all.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct HealthCheckTarget {
    /// `address`: the IP checks connect to instead of the host's.
    pub address: Option<IpAddr>,
    /// `address.socket_address.port_value`, when `address` is set: its port.
    pub address_port: Option<u16>,
    /// `port_value` (not 0): the port checks connect to, over any other.
    pub port: Option<u16>,
    /// `hostname`: the HTTP `Host` (gRPC `:authority`) of checks to this host, over the
    /// cluster's configured one.
    pub hostname: Option<String>,
    /// `disable_active_health_check`: this host is not checked, and routes without a check.
    pub disabled: bool,
}

impl HealthCheckTarget {
    /// Where checks of a host at `addr` connect, as Envoy resolves it: the alternate address
    /// (with its own port) when set, then `port_value` over the port.
    pub fn addr(&self, addr: SocketAddr) -> SocketAddr {
        let mut target = match self.address {
            Some(ip) => SocketAddr::new(ip, self.address_port.unwrap_or(addr.port())),
            None => addr,
        };
        if let Some(port) = self.port {
            target.set_port(port);
        }
        target
    }
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
            health_check: HealthCheckTarget::default(),
            locality: Locality::default(),
            locality_weight: None,
        }
    }
}

/// The hosts a discovery backend currently reports for one cluster.
pub type HostSet = Vec<Host>;
