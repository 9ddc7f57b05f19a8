//! Clusters, in Envoy v3 `Cluster` field names (`type`, `lb_policy`, `load_assignment`, ...).

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::defaults;
use crate::discovery::{EdsHealth, Host, HostSet};

/// An upstream cluster.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Unique name; services refer to it and stats are named `cluster.<name>.*`.
    pub name: String,
    /// Discovery type (Envoy's `type`). Default `STATIC`.
    #[serde(rename = "type", default)]
    pub cluster_type: ClusterType,
    /// How a host is chosen. On the kernel path `RANDOM` (weighted random, the default here) and
    /// `MAGLEV` (consistent hashing on the client's network namespace) are available.
    #[serde(default)]
    pub lb_policy: LbPolicy,
    /// The endpoints of a STATIC cluster (and the names to resolve for DNS clusters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_assignment: Option<LoadAssignment>,
}

/// Envoy's `Cluster.DiscoveryType`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ClusterType {
    /// Endpoints listed in `load_assignment`.
    #[default]
    Static,
    /// Every address of every name in `load_assignment`, resolved continuously.
    StrictDns,
    /// The first address of the latest answer.
    LogicalDns,
    /// Endpoints from an xDS server.
    Eds,
    /// The original destination of redirected connections (proxy path).
    OriginalDst,
}

/// Envoy's `Cluster.LbPolicy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LbPolicy {
    /// Weighted random choice of a slot. Default here (Envoy's default, ROUND_ROBIN, needs
    /// per-connection shared state the kernel path does not keep).
    #[default]
    Random,
    /// Consistent hashing over a Maglev table keyed by the client's network-namespace cookie.
    Maglev,
    /// Not available on the kernel path; rejected with an explanation.
    RoundRobin,
    /// Not available on the kernel path; rejected with an explanation.
    LeastRequest,
    /// Not available; use MAGLEV for consistent hashing.
    RingHash,
    /// Not available.
    ClusterProvided,
}

/// Envoy's `ClusterLoadAssignment`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoadAssignment {
    /// Name of the cluster this assignment is for (informational; Envoy requires it for EDS).
    #[serde(default)]
    pub cluster_name: String,
    /// Endpoints grouped by locality and priority.
    #[serde(default)]
    pub endpoints: Vec<LocalityLbEndpoints>,
}

/// Envoy's `LocalityLbEndpoints`: endpoints that share a locality and a priority.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LocalityLbEndpoints {
    /// The endpoints.
    #[serde(default)]
    pub lb_endpoints: Vec<LbEndpoint>,
    /// Failover priority, 0 (default) is the highest; at most 3 on the kernel path.
    #[serde(default)]
    pub priority: u32,
}

/// Envoy's `LbEndpoint`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LbEndpoint {
    /// Where the endpoint is.
    pub endpoint: Endpoint,
    /// Relative weight, at least 1. Default 1.
    #[serde(default = "defaults::weight")]
    pub load_balancing_weight: u32,
}

/// Envoy's `Endpoint`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// The endpoint's address.
    pub address: Address,
}

/// Envoy's `core.v3.Address` (only the `socket_address` form).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Address {
    /// An IP (or, for DNS clusters, a hostname) and a port.
    pub socket_address: SocketAddress,
}

/// Envoy's `core.v3.SocketAddress`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SocketAddress {
    /// An IP address for STATIC clusters; a hostname for DNS clusters.
    pub address: String,
    /// The port.
    pub port_value: u16,
}

impl Cluster {
    /// The hosts of a STATIC cluster. Call only on a validated config (addresses are IPs).
    pub fn static_hosts(&self) -> HostSet {
        let Some(assignment) = &self.load_assignment else {
            return Vec::new();
        };
        let mut hosts = Vec::new();
        for group in &assignment.endpoints {
            for lb in &group.lb_endpoints {
                let sa = &lb.endpoint.address.socket_address;
                let Ok(ip) = sa.address.parse::<IpAddr>() else {
                    continue;
                };
                hosts.push(Host {
                    weight: lb.load_balancing_weight,
                    priority: group.priority,
                    eds_health: EdsHealth::Unknown,
                    ..Host::new(SocketAddr::new(ip, sa.port_value))
                });
            }
        }
        hosts
    }
}
