//! Compilation of config entries into a [`CompiledDiscoveryChain`], following Consul's
//! `discoverychain.Compile`: router → splitter → resolver graph, redirects, default subsets,
//! failover, splitter flattening, pruning and overrides.
//!
//! Tenancy follows Consul CE: router and splitter node names use the `default` namespace and
//! partition, and services are identified by name alone.
//!
//! `CustomizationHash` is the first 8 hex digits of a 64-bit FNV-1a hash over the overrides that
//! changed the result (mesh gateway mode, protocol, connect timeout in nanoseconds). Consul uses
//! `hashstructure` over a Go struct, so the value differs from Consul's; it is equally stable and
//! equally empty when no override applied.

mod graph;
mod reads;
mod resolve;

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet, HashSet},
};

pub use self::reads::EntryReads;
use self::reads::Reader;
use crate::{
    duration::GoDuration,
    entries::{Entries, MeshGatewayMode, ProxyDefaults, ServiceRoute},
    error::ChainError,
    output::{
        CompiledDiscoveryChain, DiscoveryGraphNode, DiscoveryRoute, DiscoveryTarget, NodeType,
        node_key,
    },
};

/// Default connect timeout when a resolver sets none.
pub const DEFAULT_CONNECT_TIMEOUT: GoDuration = GoDuration::from_secs(5);

/// Namespace and partition names under Consul CE.
const DEFAULT_TENANCY: &str = "default";

/// What to compile and where; mirrors Consul's `CompileRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileRequest {
    /// Service at the top of the chain.
    pub service_name: String,
    /// Namespace the chain is evaluated in.
    pub evaluate_in_namespace: String,
    /// Partition the chain is evaluated in.
    pub evaluate_in_partition: String,
    /// Datacenter the chain is evaluated in.
    pub evaluate_in_datacenter: String,
    /// Trust domain used in SNI names.
    pub evaluate_in_trust_domain: String,
    /// Datacenter the compiled chain is used from (Consul 1.8.7's `UseInDatacenter`; its HTTP
    /// API sets the agent's datacenter, while `compile-dc` sets `evaluate_in_datacenter`).
    /// Targets in this datacenter get no mesh gateway mode.
    pub use_in_datacenter: String,
    /// Mesh gateway mode forced on every target in another datacenter than
    /// `use_in_datacenter` (`Default` = no override).
    pub override_mesh_gateway: MeshGatewayMode,
    /// Protocol forced on the chain (empty = no override); a non-HTTP protocol drops routers and
    /// splitters.
    pub override_protocol: String,
    /// Connect timeout forced on every resolver (zero = no override).
    pub override_connect_timeout: GoDuration,
    /// Not in Consul: accept service-splitters on non-HTTP (tcp) chains, for connection-level
    /// splits. Routers still need an HTTP protocol. Off by default, so the default stays
    /// Consul-compatible.
    pub allow_tcp_splitting: bool,
}

impl CompileRequest {
    /// A request in the `default` namespace and partition, evaluated in and used from
    /// `datacenter`, without overrides.
    pub fn new(service: &str, datacenter: &str, trust_domain: &str) -> Self {
        CompileRequest {
            service_name: service.to_owned(),
            evaluate_in_namespace: DEFAULT_TENANCY.to_owned(),
            evaluate_in_partition: DEFAULT_TENANCY.to_owned(),
            evaluate_in_datacenter: datacenter.to_owned(),
            evaluate_in_trust_domain: trust_domain.to_owned(),
            use_in_datacenter: datacenter.to_owned(),
            override_mesh_gateway: MeshGatewayMode::Default,
            override_protocol: String::new(),
            override_connect_timeout: GoDuration::ZERO,
            allow_tcp_splitting: false,
        }
    }

    fn check(&self) -> Result<(), ChainError> {
        if self.service_name.is_empty() {
            Err(ChainError::ServiceNameRequired)
        } else if self.evaluate_in_namespace.is_empty() {
            Err(ChainError::NamespaceRequired)
        } else if self.evaluate_in_partition.is_empty() {
            Err(ChainError::PartitionRequired)
        } else if self.evaluate_in_datacenter.is_empty() {
            Err(ChainError::DatacenterRequired)
        } else if self.evaluate_in_trust_domain.is_empty() {
            Err(ChainError::TrustDomainRequired)
        } else if self.use_in_datacenter.is_empty() {
            Err(ChainError::UseInDatacenterRequired)
        } else {
            Ok(())
        }
    }
}

/// Compiles the chain for `req.service_name` from `entries`.
pub fn compile(
    req: &CompileRequest,
    entries: &Entries,
) -> Result<CompiledDiscoveryChain, ChainError> {
    compile_reading(req, entries).0
}

/// [`compile`], and the entries it read: the same request gives the same result from any set
/// of entries that agrees with `entries` on those ([`EntryReads::same_in`]).
pub fn compile_reading(
    req: &CompileRequest,
    entries: &Entries,
) -> (Result<CompiledDiscoveryChain, ChainError>, EntryReads) {
    let reads = RefCell::new(EntryReads::default());
    let result = req.check().and_then(|()| {
        let mut compiler = Compiler::new(req, Reader::new(entries, &reads));
        compiler.assemble_chain()?;
        compiler.detect_circular_references()?;
        compiler.flatten_adjacent_splitters();
        compiler.remove_unused_nodes();
        compiler.finish()
    });
    (result, reads.into_inner())
}

/// Which overrides changed the result.
#[derive(Debug, Default)]
struct Customized {
    mesh_gateway: bool,
    protocol: bool,
    connect_timeout: bool,
}

/// Single-use compilation state (Consul's `compiler`).
struct Compiler<'a> {
    req: &'a CompileRequest,
    entries: Reader<'a>,
    /// `OverrideProtocol` is not HTTP-like: routers and splitters are ignored.
    disable_advanced: bool,
    /// A router or splitter is part of the chain.
    uses_advanced: bool,
    customized: Customized,
    protocol: String,
    start_node: String,
    nodes: BTreeMap<String, DiscoveryGraphNode>,
    /// Splitter node names already built (recorded before recursing, so loops terminate).
    splitters_built: HashSet<String>,
    /// Splitters being built, one inside the other (bounded: [`MAX_SPLITTER_DEPTH`]).
    splitter_depth: usize,
    /// Target IDs whose resolver node is built.
    resolved: HashSet<String>,
    targets: BTreeMap<String, DiscoveryTarget>,
    retained_targets: BTreeSet<String>,
}

/// How many splitters may lead into one another. Consul's compiler has no bound (Go stacks
/// grow); here each level is a stack frame, and a chain of thousands of splitters, which config
/// entries can describe, would overflow the stack. No real chain comes near.
pub(crate) const MAX_SPLITTER_DEPTH: usize = 64;

/// HTTP, HTTP/2 and gRPC chains may route and split.
fn is_http_like(protocol: &str) -> bool {
    matches!(protocol, "http" | "http2" | "grpc")
}

impl<'a> Compiler<'a> {
    fn new(req: &'a CompileRequest, entries: Reader<'a>) -> Self {
        Compiler {
            req,
            entries,
            disable_advanced: !req.override_protocol.is_empty()
                && !is_http_like(&req.override_protocol),
            uses_advanced: false,
            customized: Customized::default(),
            protocol: String::new(),
            start_node: String::new(),
            nodes: BTreeMap::new(),
            splitters_built: HashSet::new(),
            splitter_depth: 0,
            resolved: HashSet::new(),
            targets: BTreeMap::new(),
            retained_targets: BTreeSet::new(),
        }
    }

    /// Records the protocol of `service` (service-defaults, else proxy-defaults, else tcp) and
    /// rejects a second, different one.
    fn record_service_protocol(&mut self, service: &str) -> Result<(), ChainError> {
        let protocol = match self.entries.service_defaults(service) {
            Some(defaults) => defaults.protocol.clone(),
            None => self
                .entries
                .proxy_defaults()
                .and_then(ProxyDefaults::protocol)
                .unwrap_or_default(),
        };
        let protocol = if protocol.is_empty() {
            "tcp".to_owned()
        } else {
            protocol.to_lowercase()
        };
        if self.protocol.is_empty() {
            self.protocol = protocol;
        } else if self.protocol != protocol {
            return Err(ChainError::InconsistentProtocols {
                chain: self.req.service_name.clone(),
                service: service.to_owned(),
                protocol,
                expected: self.protocol.clone(),
            });
        }
        Ok(())
    }

    /// Builds the graph from the top: the chain service's router, else its splitter or resolver.
    fn assemble_chain(&mut self) -> Result<(), ChainError> {
        let service = self.req.service_name.clone();
        let entries = self.entries;
        let mut router = entries.router(&service);
        if router.is_some() && self.disable_advanced {
            router = None;
            self.customized.protocol = true;
        }
        let Some(router) = router else {
            let target = self.new_target(resolve::TargetOpts::service(&service));
            self.start_node = self.splitter_or_resolver_node(&target)?;
            return Ok(());
        };
        let router_name = tenancy_name(&router.name);
        self.uses_advanced = true;
        self.record_service_protocol(&router.name)?;
        let mut routes = Vec::with_capacity(router.routes.len() + 1);
        for route in &router.routes {
            let next_node = self.route_destination(route)?;
            routes.push(DiscoveryRoute {
                definition: route.clone(),
                next_node,
            });
        }
        let catch_all = resolve::TargetOpts {
            namespace: DEFAULT_TENANCY.to_owned(),
            partition: DEFAULT_TENANCY.to_owned(),
            ..resolve::TargetOpts::service(&router.name)
        };
        let target = self.new_target(catch_all);
        let next_node = self.splitter_or_resolver_node(&target)?;
        let definition = ServiceRoute::catch_all(&router.name, DEFAULT_TENANCY, DEFAULT_TENANCY);
        routes.push(DiscoveryRoute {
            definition,
            next_node,
        });
        let node = DiscoveryGraphNode {
            node_type: NodeType::Router,
            name: router_name,
            routes,
            splits: Vec::new(),
            resolver: None,
            load_balancer: None,
        };
        self.start_node = node.map_key();
        self.nodes.insert(node.map_key(), node);
        Ok(())
    }

    /// Next node of one route: a subset goes straight to a resolver, anything else may split.
    fn route_destination(&mut self, route: &ServiceRoute) -> Result<String, ChainError> {
        let dest = route.destination.clone().unwrap_or_default();
        let or = |value: &str, default: &str| {
            if value.is_empty() {
                default.to_owned()
            } else {
                value.to_owned()
            }
        };
        let opts = resolve::TargetOpts {
            service: or(&dest.service, &self.req.service_name),
            namespace: or(&dest.namespace, DEFAULT_TENANCY),
            partition: or(&dest.partition, DEFAULT_TENANCY),
            service_subset: dest.service_subset.clone(),
            ..Default::default()
        };
        let target = self.new_target(opts);
        if dest.service_subset.is_empty() {
            self.splitter_or_resolver_node(&target)
        } else {
            let resolved = self.resolver_node(target, false)?;
            Ok(node_key(NodeType::Resolver, &resolved))
        }
    }

    /// The splitter node for the target's service, else its resolver node.
    fn splitter_or_resolver_node(&mut self, target_id: &str) -> Result<String, ChainError> {
        let service = self.targets[target_id].service.clone();
        if let Some(key) = self.splitter_node(&service)? {
            return Ok(key);
        }
        let resolved = self.resolver_node(target_id.to_owned(), false)?;
        Ok(node_key(NodeType::Resolver, &resolved))
    }

    /// Final checks and the output struct.
    fn finish(mut self) -> Result<CompiledDiscoveryChain, ChainError> {
        let retained = std::mem::take(&mut self.retained_targets);
        self.targets.retain(|id, _| retained.contains(id));
        let has_router = self.nodes.keys().any(|k| k.starts_with("router:"));
        let tolerated = self.req.allow_tcp_splitting && !has_router;
        if !is_http_like(&self.protocol) && self.uses_advanced && !tolerated {
            return Err(ChainError::AdvancedRoutingProtocol {
                chain: self.req.service_name.clone(),
                protocol: self.protocol.clone(),
            });
        }
        if !self.req.override_protocol.is_empty() && self.req.override_protocol != self.protocol {
            self.protocol = self.req.override_protocol.clone();
            self.customized.protocol = true;
        }
        let service_defaults = self.entries.service_defaults(&self.req.service_name);
        let mut envoy_extensions = self
            .entries
            .proxy_defaults()
            .map(|p| p.envoy_extensions.clone())
            .unwrap_or_default();
        envoy_extensions.extend(
            service_defaults
                .iter()
                .flat_map(|s| s.envoy_extensions.iter().cloned()),
        );
        Ok(CompiledDiscoveryChain {
            service_name: self.req.service_name.clone(),
            namespace: self.req.evaluate_in_namespace.clone(),
            partition: self.req.evaluate_in_partition.clone(),
            datacenter: self.req.evaluate_in_datacenter.clone(),
            customization_hash: self.customization_hash(),
            default: self.is_default_chain(),
            protocol: self.protocol.clone(),
            service_meta: service_defaults.map(|s| s.meta.clone()).unwrap_or_default(),
            envoy_extensions,
            start_node: self.start_node,
            nodes: self.nodes,
            targets: self.targets,
        })
    }

    /// Only a default resolver for the requested service itself makes a default chain.
    fn is_default_chain(&self) -> bool {
        let Some(node) = self.nodes.get(&self.start_node) else {
            return true;
        };
        let Some(resolver) = node.resolver.as_ref().filter(|r| r.default) else {
            return false;
        };
        self.targets.get(&resolver.target).is_some_and(|t| {
            t.service == self.req.service_name
                && t.namespace == self.req.evaluate_in_namespace
                && t.partition == self.req.evaluate_in_partition
        })
    }

    fn customization_hash(&self) -> String {
        let c = &self.customized;
        if !(c.mesh_gateway || c.protocol || c.connect_timeout) {
            return String::new();
        }
        let mesh = if c.mesh_gateway {
            self.req.override_mesh_gateway.as_str()
        } else {
            ""
        };
        let protocol = if c.protocol {
            self.req.override_protocol.as_str()
        } else {
            ""
        };
        let timeout = if c.connect_timeout {
            self.req.override_connect_timeout.as_nanos()
        } else {
            0
        };
        let canonical =
            format!("mesh-gateway={mesh}\nprotocol={protocol}\nconnect-timeout={timeout}\n");
        let hash = canonical.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        format!("{hash:016x}")[..8].to_owned()
    }
}

/// Router and splitter node name under CE tenancy.
fn tenancy_name(service: &str) -> String {
    format!("{service}.{DEFAULT_TENANCY}.{DEFAULT_TENANCY}")
}
