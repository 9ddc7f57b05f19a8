//! Clusters, in Envoy v3 `Cluster` field names (`type`, `lb_policy`, `load_assignment`, ...).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    num::NonZeroU32,
    time::Duration,
};

use serde::{Deserialize, Serialize};

use super::defaults;
use crate::{
    config::{
        duration,
        fields::splice,
        sources::dns::{
            DnsEndpoint, DnsSettings, QueryLimits, dns_cluster_fields, dns_file_fields,
        },
    },
    health::{
        AssignmentPolicy, ClusterHealthConfig, cluster_config::health_fields,
        drop_overload::DropOverloadsConfig,
    },
    host::{EdsHealth, Host, HostDetail, HostSet, Locality},
};

splice! {
{
/// An upstream cluster: its own fields, then the DNS fields (`dns_cluster_fields`,
/// `dns_file_fields`) and the health fields (`health_fields`), declared once with the types the
/// DNS source and health checking take (`config::fields`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Unique name; services refer to it and stats are named `cluster.<name>.*`.
    pub name: String,
    /// Discovery type (Envoy's `type`). Default `STATIC`.
    #[serde(rename = "type", default)]
    pub cluster_type: ClusterType,
    /// How a host is chosen: `RANDOM` (weighted random, the default here), `ROUND_ROBIN`,
    /// `LEAST_REQUEST`, `RING_HASH` or `MAGLEV`. On the kernel path the hash policies key on the
    /// client's network namespace; on the proxy path they are Envoy's ring and table, keyed by
    /// the service's `hash_policy`.
    #[serde(default)]
    pub lb_policy: LbPolicy,
    /// `lb_policy: RING_HASH` on the proxy path: the ring's `minimum_ring_size` (default 1024)
    /// and `maximum_ring_size` (default and most 8388608), Envoy's `ring_hash_lb_config`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring_hash_lb_config: Option<crate::lb::RingHashLbConfig>,
    /// `lb_policy: MAGLEV` on the proxy path: the table's `table_size` (a prime, default
    /// 65537, at most 5000011), Envoy's `maglev_lb_config`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maglev_lb_config: Option<crate::lb::MaglevLbConfig>,
    /// The endpoints of a STATIC cluster (and the names to resolve for DNS clusters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_assignment: Option<LoadAssignment>,
    /// Envoy's `transport_socket` (`envoy.transport_sockets.tls`): TLS to an xDS server, only
    /// on a STATIC cluster that an xDS config source names (`envoy_grpc`, REST
    /// `cluster_names`); refused on any other cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport_socket: Option<crate::config::sources::xds::transport_socket::TransportSocket>,
    /// A custom discovery backend, Envoy's `cluster_type: {name, typed_config}` (then `type` is
    /// not used): `proxy.clusters.consul` (typed_config: `proxy_core::discovery::consul::
    /// ConsulConfig`: `address`, `service`, `datacenter`, `tag`, `wait`, `only_passing`, ...),
    /// `proxy.clusters.dns_srv` (typed_config: `{service_names: ["_web._tcp.example"]}`, with the
    /// cluster's DNS fields), or Envoy's `envoy.cluster.dns` (typed_config: Envoy's
    /// `DnsCluster`), which validation turns into a STRICT_DNS or LOGICAL_DNS cluster.
    #[serde(
        rename = "cluster_type",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub custom_cluster_type: Option<CustomClusterType>,
    /// EDS clusters: Envoy's `eds_cluster_config` (`service_name`, `eds_config` with `ads: {}`
    /// or an `api_config_source`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eds_cluster_config: Option<crate::config::sources::xds::EdsClusterConfig>,
    /// DNS clusters: Envoy's resolver extension (`envoy.network.dns_resolver.cares` with
    /// `resolvers`, or `envoy.network.dns_resolver.getaddrinfo` for the system's); turned into
    /// `dns_resolvers` when the file is validated (`config::envoy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub typed_dns_resolver_config: Option<super::envoy::TypedDnsResolverConfig>,
    /// DNS clusters: how long one try of a query waits and how many tries it makes, from the
    /// c-ares resolver's `query_timeout_seconds` and `query_tries` (Envoy's defaults, 5 s and
    /// 4, when not given). Set only through `typed_dns_resolver_config`, as in Envoy.
    #[serde(skip)]
    pub dns_query_limits: QueryLimits,
    /// How long a connect of the daemon's own to one of the cluster's hosts may take: the proxy
    /// path's upstream connects. Default: `proxy.connect_timeout` (5 s, Envoy's default). On the
    /// kernel path the application connects, and its own timeout applies.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub connect_timeout: Option<Duration>,
    /// Proxy path: reset the connections to a host as soon as it fails health checking.
    /// Unset: `proxy.close_connections_on_host_health_failure` (false). The kernel path never
    /// closes an application's connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_connections_on_host_health_failure: Option<bool>,
    /// Envoy's `circuit_breakers`: limits on the proxy path's upstream connections, pending
    /// requests, requests and retries to the cluster (`DEFAULT` thresholds; absent ones take
    /// Envoy's defaults, 1024/1024/1024/3); on the kernel path an explicit `max_connections`
    /// only (`kernel::kernel_max_connections`). See `config::circuit_breakers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub circuit_breakers: Option<super::circuit_breakers::CircuitBreakers>,
    /// ORIGINAL_DST clusters: hosts unused for this long are flushed with their pooled
    /// connections. Default 5000 ms (Envoy's).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub cleanup_interval: Option<Duration>,
    /// ORIGINAL_DST clusters: Envoy's `original_dst_lb_config`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_dst_lb_config: Option<OriginalDstLbConfig>,
}
}
[dns_cluster_fields, dns_file_fields, health_fields]
}

/// Envoy's `Cluster.OriginalDstLbConfig`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OriginalDstLbConfig {
    /// Treat the service's traffic as HTTP (per-request forwarding over pooled connections)
    /// and take the destination from a request's `x-envoy-original-dst-host` header when it has
    /// one. The header is not sanitised (as in Envoy): enable it only for trusted clients.
    #[serde(default)]
    pub use_http_header: bool,
}

/// Envoy's `Cluster.CustomClusterType`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CustomClusterType {
    /// `proxy.clusters.consul` or `proxy.clusters.dns_srv`.
    pub name: String,
    /// The backend's settings (a Consul `token` in them serializes redacted).
    #[serde(
        default,
        serialize_with = "crate::config::sources::consul::access::serialize_redacted"
    )]
    pub typed_config: serde_json::Value,
    /// `typed_config` as its type, filled when the file is validated: what the source starts
    /// from, so nothing parses it twice.
    #[serde(skip)]
    pub typed: Option<CustomConfig>,
}

/// A custom cluster type's settings, typed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CustomConfig {
    /// `proxy.clusters.consul`: the Consul catalog.
    Consul(crate::config::sources::consul::ConsulConfig),
    /// `proxy.clusters.dns_srv`: DNS SRV records.
    DnsSrv(DnsSrvConfig),
}

/// `typed_config` of `proxy.clusters.dns_srv`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DnsSrvConfig {
    /// SRV owner names (`_service._proto.name`) whose targets are the hosts; SRV priority and
    /// weight become the hosts' priority and weight.
    pub service_names: Vec<String>,
}

/// Name of the Consul catalog backend.
pub const CONSUL_CLUSTER: &str = "proxy.clusters.consul";
/// Name of the DNS SRV backend.
pub const DNS_SRV_CLUSTER: &str = "proxy.clusters.dns_srv";

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
    /// Weighted random choice of a slot. Default here (Envoy's default is ROUND_ROBIN, which
    /// costs every connect of the service an atomic increment of one shared counter, and needs
    /// Linux 5.12).
    #[default]
    Random,
    /// Consistent hashing over a Maglev table: on the kernel path keyed by the service's
    /// `hash_key` (the client's process by default), on the proxy path Envoy's table
    /// (`maglev_lb_config`) keyed by the service's `hash_policy`.
    Maglev,
    /// An exact weighted rotation: on the kernel path a per-table atomic cursor over a slot
    /// table in smooth weighted order (needs BPF atomic fetch-and-add, Linux 5.12); on the proxy
    /// path the same order with a cursor per cluster.
    RoundRobin,
    /// The power of two choices: of two hosts drawn by weight, the one with fewer open
    /// connections (on the kernel path, counted by sockops per backend; on the proxy path, the
    /// proxy's own connections).
    LeastRequest,
    /// Consistent hashing: on the proxy path Envoy's ring (`ring_hash_lb_config`), on the
    /// kernel path the kernel's Maglev slot table.
    RingHash,
    /// Not available.
    ClusterProvided,
}

impl LbPolicy {
    /// Whether the policy is consistent hashing (MAGLEV, RING_HASH): the kernel serves both
    /// with its Maglev table, keyed by the service's `hash_key`.
    pub fn hashes(self) -> bool {
        matches!(self, Self::Maglev | Self::RingHash)
    }
}

/// Envoy's `ClusterLoadAssignment`.
#[derive(Clone, Debug, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoadAssignment {
    /// Name of the cluster this assignment is for (informational; Envoy requires it for EDS).
    #[serde(default)]
    pub cluster_name: String,
    /// Endpoints grouped by locality and priority.
    #[serde(default)]
    pub endpoints: Vec<LocalityLbEndpoints>,
    /// Envoy's `ClusterLoadAssignment.Policy` (`overprovisioning_factor`,
    /// `weighted_priority_health`, `drop_overloads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<AssignmentPolicyConfig>,
}

/// Envoy's `ClusterLoadAssignment.Policy`, the fields that shape routing.
#[derive(Clone, Debug, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AssignmentPolicyConfig {
    /// Percent by which priorities and localities count as overprovisioned: one is whole while
    /// its available hosts times this reach 100 % (default 140; must be above 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overprovisioning_factor: Option<NonZeroU32>,
    /// A priority's health counts host weights instead of hosts (default false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub weighted_priority_health: bool,
    /// Envoy's drop overload: at most one `{ category, drop_percentage }`, the share of
    /// requests (proxy path) or connects (kernel path) refused (default none).
    #[serde(default, skip_serializing_if = "DropOverloadsConfig::is_empty")]
    pub drop_overloads: DropOverloadsConfig,
}

impl AssignmentPolicyConfig {
    /// The policy as routing takes it, with Envoy's defaults.
    pub fn resolved(&self) -> AssignmentPolicy {
        let default = AssignmentPolicy::default();
        AssignmentPolicy {
            overprovisioning_factor: self
                .overprovisioning_factor
                .map_or(default.overprovisioning_factor, NonZeroU32::get),
            weighted_priority_health: self.weighted_priority_health,
            drop_overload: self.drop_overloads.share(),
        }
    }
}

/// Envoy's `LocalityLbEndpoints`: endpoints that share a locality and a priority.
#[derive(Clone, Debug, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LocalityLbEndpoints {
    /// The endpoints.
    #[serde(default)]
    pub lb_endpoints: Vec<LbEndpoint>,
    /// Failover priority, 0 (default) is the highest; at most 3 on the kernel path.
    #[serde(default)]
    pub priority: u32,
    /// Where these endpoints run (`region`, `zone`, `sub_zone`); default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality: Option<Locality>,
    /// The locality's weight under `common_lb_config.locality_weighted_lb_config`, at least 1;
    /// a locality without one gets no traffic there (Envoy's rule). Default unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancing_weight: Option<NonZeroU32>,
}

/// Envoy's `LbEndpoint`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LbEndpoint {
    /// Where the endpoint is.
    pub endpoint: Endpoint,
    /// Relative weight, at least 1. Default 1.
    #[serde(default = "defaults::weight")]
    pub load_balancing_weight: u32,
    /// Health as the configuration states it (UNKNOWN, HEALTHY, UNHEALTHY, DRAINING, TIMEOUT,
    /// DEGRADED); without active checks it decides routing. Default UNKNOWN (routed).
    #[serde(default)]
    pub health_status: EdsHealth,
    /// Envoy's endpoint metadata. The `envoy.lb` filter's values are the host's metadata, which
    /// discovery-chain subset filters match (`Service.Meta.<key>`).
    #[serde(default, skip_serializing_if = "Metadata::is_empty")]
    pub metadata: Metadata,
}

/// Envoy's `core.v3.Metadata`: values by filter name.
#[derive(Clone, Debug, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    /// Filter name -> key -> value (strings, numbers and booleans; kept as text).
    #[serde(default)]
    pub filter_metadata: BTreeMap<String, BTreeMap<String, serde_json::Value>>,
}

impl Metadata {
    fn is_empty(&self) -> bool {
        self.filter_metadata.is_empty()
    }

    /// The `envoy.lb` values as text, as host metadata.
    pub fn lb(&self) -> BTreeMap<String, String> {
        self.filter_metadata
            .get("envoy.lb")
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| {
                let text = match v {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Number(n) => n.to_string(),
                    serde_json::Value::Bool(b) => b.to_string(),
                    _ => return None,
                };
                Some((k.clone(), text))
            })
            .collect()
    }
}

/// Envoy's `Endpoint`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// The endpoint's address.
    pub address: Address,
    /// A name for the endpoint, shown in `/clusters`; never resolved (a DNS cluster's hosts
    /// carry it instead of the name they were resolved from).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Where and how active health checks reach this endpoint
    /// (`config::endpoint_health`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check_config: Option<super::EndpointHealthCheck>,
}

impl Endpoint {
    /// The health-check target of the endpoint's hosts.
    pub fn health_check(&self) -> crate::host::HealthCheckTarget {
        self.health_check_config
            .as_ref()
            .map(super::EndpointHealthCheck::target)
            .unwrap_or_default()
    }
}

/// Envoy's `core.v3.Address` (only the `socket_address` form).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Address {
    /// An IP (or, for DNS clusters, a hostname) and a port.
    pub socket_address: SocketAddress,
}

/// Envoy's `core.v3.SocketAddress`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SocketAddress {
    /// An IP address for STATIC clusters; a hostname for DNS clusters.
    pub address: String,
    /// The port.
    pub port_value: u16,
    /// Envoy's `TCP` (default) or `UDP`: accepted and, as in Envoy 1.40, not used (a host
    /// serves its service's protocol; Envoy's tcp_proxy connects TCP to a `UDP` endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<SocketProtocol>,
}

/// Envoy's `SocketAddress.Protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub enum SocketProtocol {
    /// The default.
    #[serde(rename = "TCP")]
    Tcp,
    /// UDP.
    #[serde(rename = "UDP")]
    Udp,
}

impl Cluster {
    /// The DNS settings of a STRICT_DNS, LOGICAL_DNS or DNS SRV cluster.
    pub fn dns_settings(&self) -> DnsSettings {
        let mut settings = DnsSettings::default();
        dns_cluster_fields!(@assign settings, self);
        dns_file_fields!(@assign settings, self);
        settings
    }

    /// The health-related fields, as the health module takes them.
    pub fn health_config(&self) -> ClusterHealthConfig {
        let assignment_policy = self
            .load_assignment
            .as_ref()
            .and_then(|a| a.policy.as_ref())
            .map(AssignmentPolicyConfig::resolved)
            .unwrap_or_default();
        health_fields!(@copy self, assignment_policy: assignment_policy)
    }

    /// The names (or IPs) to resolve for a DNS cluster, with each endpoint's attributes.
    pub fn dns_endpoints(&self) -> Vec<DnsEndpoint> {
        self.endpoints()
            .map(|(group, lb)| {
                let sa = &lb.endpoint.address.socket_address;
                DnsEndpoint {
                    weight: lb.load_balancing_weight,
                    priority: group.priority,
                    locality: group.locality.clone().unwrap_or_default(),
                    locality_weight: group.load_balancing_weight.map(NonZeroU32::get),
                    health: lb.health_status,
                    metadata: lb.metadata.lb(),
                    hostname: lb.endpoint.hostname.clone(),
                    health_check: lb.endpoint.health_check(),
                    ..DnsEndpoint::new(sa.address.clone(), sa.port_value)
                }
            })
            .collect()
    }

    /// Every endpoint with its locality group.
    fn endpoints(&self) -> impl Iterator<Item = (&LocalityLbEndpoints, &LbEndpoint)> {
        self.load_assignment
            .iter()
            .flat_map(|a| &a.endpoints)
            .flat_map(|g| g.lb_endpoints.iter().map(move |lb| (g, lb)))
    }

    /// The hosts of a STATIC cluster. Call only on a validated config (addresses are IPs).
    pub fn static_hosts(&self) -> HostSet {
        let mut hosts: HostSet = self
            .endpoints()
            .filter_map(|(group, lb)| {
                let sa = &lb.endpoint.address.socket_address;
                let ip = sa.address.parse::<IpAddr>().ok()?;
                let host = Host {
                    weight: lb.load_balancing_weight,
                    priority: group.priority,
                    locality_weight: group.load_balancing_weight.map(NonZeroU32::get),
                    eds_health: lb.health_status,
                    ..Host::new(SocketAddr::new(ip, sa.port_value))
                };
                Some(host.with_detail(HostDetail {
                    locality: group.locality.clone().unwrap_or_default(),
                    metadata: lb.metadata.lb(),
                    hostname: lb.endpoint.hostname.clone(),
                    health_check: lb.endpoint.health_check(),
                }))
            })
            .collect();
        // Kept by the source for as long as the cluster runs: no spare capacity.
        hosts.shrink_to_fit();
        hosts
    }
}
