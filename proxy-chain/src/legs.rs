//! Flattening of a compiled chain into what a data path acts on: weighted legs, each with its
//! target (service, datacenter, parsed subset filter) and ordered failover targets.

use crate::{
    duration::GoDuration,
    entries::{FailoverPolicy, LoadBalancer, MeshGatewayMode, ServiceRoute},
    error::ChainError,
    filter::{Filter, HealthStatus, Host},
    output::{CompiledDiscoveryChain, DiscoveryGraphNode, NodeType},
};

/// One weighted share of traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct Leg {
    /// Share of traffic in percent (0.01 resolution); legs of one route sum to 100.
    pub weight: f32,
    /// Where the traffic goes.
    pub target: TargetLeg,
    /// Where it goes when `target` has no healthy instance, in order.
    pub failover: Vec<TargetLeg>,
    /// Failover policy, if any.
    pub failover_policy: Option<FailoverPolicy>,
    /// Connect timeout of the resolver.
    pub connect_timeout: GoDuration,
    /// Load balancer of the resolver.
    pub load_balancer: Option<LoadBalancer>,
}

/// A resolved target with its subset filter parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetLeg {
    /// Target ID.
    pub id: String,
    /// Service to query.
    pub service: String,
    /// Subset name (empty for all instances).
    pub service_subset: String,
    /// Namespace.
    pub namespace: String,
    /// Partition.
    pub partition: String,
    /// Datacenter (empty for peered targets).
    pub datacenter: String,
    /// Cluster peer.
    pub peer: String,
    /// TLS SNI.
    pub sni: String,
    /// Outside the mesh.
    pub external: bool,
    /// Mesh gateway mode.
    pub mesh_gateway: MeshGatewayMode,
    /// Subset filter; `None` selects every instance.
    pub filter: Option<Filter>,
    /// Only instances whose checks all pass.
    pub only_passing: bool,
}

impl TargetLeg {
    /// Whether an instance belongs to this target's subset and is healthy enough: every check
    /// passing with `OnlyPassing`, otherwise no check critical or in maintenance (Consul treats
    /// warning as healthy unless `OnlyPassing` is set).
    pub fn admits(&self, host: &Host) -> bool {
        let healthy = if self.only_passing {
            host.checks.iter().all(|c| *c == HealthStatus::Passing)
        } else {
            !host
                .checks
                .iter()
                .any(|c| matches!(c, HealthStatus::Critical | HealthStatus::Maintenance))
        };
        healthy && self.filter.as_ref().is_none_or(|f| f.matches(host))
    }
}

/// The legs of one router route.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteLegs {
    /// The route (match and destination options).
    pub definition: ServiceRoute,
    /// Its legs.
    pub legs: Vec<Leg>,
}

impl CompiledDiscoveryChain {
    /// Legs for traffic that no L7 route matches: the chain's splitter or resolver, or a
    /// router's catch-all route (its last route).
    pub fn legs(&self) -> Result<Vec<Leg>, ChainError> {
        let start = self.node(&self.start_node)?;
        match start.node_type {
            NodeType::Router => match start.routes.last() {
                Some(route) => self.legs_of(&route.next_node, 100.0),
                None => Ok(Vec::new()),
            },
            _ => self.legs_of(&self.start_node, 100.0),
        }
    }

    /// Legs per route when the chain starts at a router (catch-all last); otherwise one entry
    /// holding a catch-all definition and [`CompiledDiscoveryChain::legs`].
    pub fn route_legs(&self) -> Result<Vec<RouteLegs>, ChainError> {
        let start = self.node(&self.start_node)?;
        if start.node_type != NodeType::Router {
            let definition =
                ServiceRoute::catch_all(&self.service_name, &self.namespace, &self.partition);
            return Ok(vec![RouteLegs {
                definition,
                legs: self.legs()?,
            }]);
        }
        start
            .routes
            .iter()
            .map(|r| {
                Ok(RouteLegs {
                    definition: r.definition.clone(),
                    legs: self.legs_of(&r.next_node, 100.0)?,
                })
            })
            .collect()
    }

    fn node(&self, key: &str) -> Result<&DiscoveryGraphNode, ChainError> {
        self.nodes
            .get(key)
            .ok_or_else(|| self.dangling("node", key))
    }

    fn dangling(&self, what: &'static str, key: &str) -> ChainError {
        ChainError::Dangling {
            chain: self.service_name.clone(),
            what,
            key: key.to_owned(),
        }
    }

    /// Legs below a splitter or resolver node, scaled to `share` percent.
    fn legs_of(&self, key: &str, share: f32) -> Result<Vec<Leg>, ChainError> {
        let node = self.node(key)?;
        match (node.node_type, &node.resolver) {
            (NodeType::Resolver, Some(resolver)) => {
                let failover = resolver.failover.as_ref();
                Ok(vec![Leg {
                    weight: share,
                    target: self.target_leg(&resolver.target)?,
                    failover: failover
                        .map(|f| f.targets.iter().map(|t| self.target_leg(t)).collect())
                        .transpose()?
                        .unwrap_or_default(),
                    failover_policy: failover.and_then(|f| f.policy.clone()),
                    connect_timeout: resolver.connect_timeout,
                    load_balancer: node.load_balancer.clone(),
                }])
            }
            (NodeType::Splitter, _) => {
                let mut legs = Vec::new();
                for split in &node.splits {
                    let weight =
                        crate::entries::normalize_split_weight(share * split.weight / 100.0);
                    legs.extend(self.legs_of(&split.next_node, weight)?);
                }
                Ok(legs)
            }
            _ => Err(self.dangling("resolver or splitter node", key)),
        }
    }

    fn target_leg(&self, id: &str) -> Result<TargetLeg, ChainError> {
        let t = self
            .targets
            .get(id)
            .ok_or_else(|| self.dangling("target", id))?;
        let filter = match t.subset.filter.as_str() {
            "" => None,
            text => Some(
                Filter::parse(text).map_err(|source| ChainError::TargetFilter {
                    target: id.to_owned(),
                    source,
                })?,
            ),
        };
        Ok(TargetLeg {
            id: t.id.clone(),
            service: t.service.clone(),
            service_subset: t.service_subset.clone(),
            namespace: t.namespace.clone(),
            partition: t.partition.clone(),
            datacenter: t.datacenter.clone(),
            peer: t.peer.clone(),
            sni: t.sni.clone(),
            external: t.external,
            mesh_gateway: t.mesh_gateway.mode,
            filter,
            only_passing: t.subset.only_passing,
        })
    }
}
