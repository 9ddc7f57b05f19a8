//! The compiled chain in Consul's `CompiledDiscoveryChain` JSON shape: PascalCase names, Go's
//! `omitempty` rules, maps in sorted key order, and fields in Go's marshalling order (including
//! the re-marshalled `ConnectTimeout` string that Go places first on resolvers and targets).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::{
    duration::{GoDuration, serialize_nanos},
    entries::{
        FailoverPolicy, LoadBalancer, MeshGatewayConfig, ResolverSubset, ServiceRoute,
        ServiceSplit, TransparentProxyConfig, is_false, serialize_weight,
    },
};

/// A compiled discovery chain.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct CompiledDiscoveryChain {
    /// The service the chain was compiled for.
    pub service_name: String,
    /// Namespace the chain was compiled in.
    pub namespace: String,
    /// Partition the chain was compiled in.
    pub partition: String,
    /// Datacenter the chain was compiled in.
    pub datacenter: String,
    /// First 8 hex digits of a hash of the overrides that changed the result (see
    /// [`crate::compile`] for how it differs from Consul's).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub customization_hash: String,
    /// No routing, splitting or non-default resolution of the requested service.
    #[serde(skip_serializing_if = "is_false")]
    pub default: bool,
    /// The one protocol of every service in the chain.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub protocol: String,
    /// `Meta` of the chain service's service-defaults.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub service_meta: BTreeMap<String, String>,
    /// Envoy extensions from proxy-defaults then service-defaults, verbatim.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub envoy_extensions: Vec<serde_json::Value>,
    /// Key of the first node.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub start_node: String,
    /// Nodes keyed by `<type>:<name>`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub nodes: BTreeMap<String, DiscoveryGraphNode>,
    /// Targets keyed by target ID.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub targets: BTreeMap<String, DiscoveryTarget>,
}

/// Node type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum NodeType {
    /// Routes requests by L7 match.
    #[serde(rename = "router")]
    Router,
    /// Splits requests by weight.
    #[serde(rename = "splitter")]
    Splitter,
    /// Resolves one target.
    #[serde(rename = "resolver")]
    Resolver,
}

impl NodeType {
    /// Consul's spelling, used in node keys.
    pub const fn as_str(self) -> &'static str {
        match self {
            NodeType::Router => "router",
            NodeType::Splitter => "splitter",
            NodeType::Resolver => "resolver",
        }
    }
}

/// One node of the graph.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DiscoveryGraphNode {
    /// Node type.
    #[serde(rename = "Type")]
    pub node_type: NodeType,
    /// Name: `<service>.<ns>.<partition>` for routers and splitters, the target ID for
    /// resolvers.
    pub name: String,
    /// Router routes, catch-all last.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<DiscoveryRoute>,
    /// Splitter legs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub splits: Vec<DiscoverySplit>,
    /// Resolver details.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolver: Option<DiscoveryResolver>,
    /// Load balancer of a resolver, or the first hash-based one below a splitter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_balancer: Option<LoadBalancer>,
}

impl DiscoveryGraphNode {
    /// `<type>:<name>`.
    pub fn map_key(&self) -> String {
        node_key(self.node_type, &self.name)
    }
}

/// `<type>:<name>`.
pub fn node_key(node_type: NodeType, name: &str) -> String {
    format!("{}:{name}", node_type.as_str())
}

/// A compiled route.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DiscoveryRoute {
    /// The route as configured.
    pub definition: ServiceRoute,
    /// Key of the node matching requests go to.
    pub next_node: String,
}

/// A compiled split leg.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DiscoverySplit {
    /// The innermost split's definition with its ancestors' header changes merged in.
    pub definition: ServiceSplit,
    /// Effective weight after flattening nested splitters (0.01 resolution).
    #[serde(
        serialize_with = "serialize_weight",
        skip_serializing_if = "is_zero_f32"
    )]
    pub weight: f32,
    /// Key of the node this leg goes to.
    pub next_node: String,
}

/// A compiled resolver.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DiscoveryResolver {
    /// Connect timeout (Go duration string).
    #[serde(skip_serializing_if = "GoDuration::is_zero")]
    pub connect_timeout: GoDuration,
    /// The resolver entry had no settings.
    #[serde(skip_serializing_if = "is_false")]
    pub default: bool,
    /// Request timeout; Consul writes it as integer nanoseconds here.
    #[serde(
        serialize_with = "serialize_nanos",
        skip_serializing_if = "GoDuration::is_zero"
    )]
    pub request_timeout: GoDuration,
    /// Target ID.
    pub target: String,
    /// Failover targets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover: Option<DiscoveryFailover>,
}

/// Compiled failover.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DiscoveryFailover {
    /// Target IDs in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<String>,
    /// Policy from the failover section or proxy-defaults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<FailoverPolicy>,
}

/// A compiled target: one catalog query plus how to connect.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct DiscoveryTarget {
    /// Connect timeout (Go duration string).
    #[serde(skip_serializing_if = "GoDuration::is_zero")]
    pub connect_timeout: GoDuration,
    /// Target ID.
    #[serde(rename = "ID")]
    pub id: String,
    /// Service.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// Subset.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service_subset: String,
    /// Namespace.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Partition.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    /// Datacenter.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub datacenter: String,
    /// Cluster peer.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub peer: String,
    /// Mesh gateway mode.
    pub mesh_gateway: MeshGatewayConfig,
    /// Subset definition.
    pub subset: ResolverSubset,
    /// Transparent proxy settings.
    pub transparent_proxy: TransparentProxyConfig,
    /// Outside the mesh (external SNI).
    #[serde(skip_serializing_if = "is_false")]
    pub external: bool,
    /// TLS SNI.
    #[serde(rename = "SNI", skip_serializing_if = "String::is_empty")]
    pub sni: String,
    /// Unique name (the mesh SNI even when `SNI` is external).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
}

fn is_zero_f32(v: &f32) -> bool {
    *v == 0.0
}
