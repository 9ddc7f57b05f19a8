//! Executing a compiled Consul discovery chain on the kernel path.
//!
//! Each compiled target resolves to a cluster (the target's service name in the local
//! datacenter, `<service>.<datacenter>` for another datacenter), a subset filter over host
//! metadata and health, and its failover targets. [`ChainPlan::levels`] turns the current routing
//! of those clusters into the weighted kernel levels of one service:
//!
//! * one leg (no splitter): level 0 is the primary target's hosts, levels 1.. its failover
//!   targets in order; the kernel uses the first level with a routable host;
//! * several legs (a splitter): level 0 holds every leg, each host weighted by its leg's share;
//!   a leg whose primary has no routable host uses its first failover target that has one.
//!   A leg left without any host keeps its share as refusals (what Consul does: that share of
//!   traffic fails), unless `health_aware_splits` is on, which gives it to the other legs.
//!
//! Beyond Consul, each behind an explicit opt-in in [`ChainOptions`]: connection-level splits
//! for tcp services (Consul refuses splitters without an HTTP protocol), health-aware splits
//! (consul#10857), and failover when the healthy share of a target drops below a threshold
//! (consul#6276; Consul fails over only when no instance is healthy).

mod each;
mod memo;
mod policy;
mod unapplied;

use std::{collections::BTreeSet, net::SocketAddr};

use proxy_chain::{CompiledDiscoveryChain, TargetLeg, filter::HealthStatus};
use serde::{Deserialize, Serialize};

pub use self::{
    each::{
        ChainFailure, ChainServiceError, CompiledChains, UnusableEntry, compile_each,
        compile_each_after, compile_service, runs_in,
    },
    memo::ChainMemo,
    policy::{PolicyError, resolver_policy},
};
use crate::{
    health::Routing,
    host::{EdsHealth, Host},
    lb,
};

/// A share of traffic that must fail: the publisher writes it as refusing slots.
pub const REFUSE: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// Weight units per percent of traffic when legs are merged into one level.
const UNITS_PER_PERCENT: f64 = 10_000.0;

/// Opt-in behaviour beyond Consul's. All off by default: the default is Consul-compatible.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChainOptions {
    /// Accept service-splitters on tcp services and split connections by weight (Consul only
    /// splits http, http2 and grpc). Routers still need HTTP and the proxy path.
    #[serde(default)]
    pub tcp_splits: bool,
    /// A split leg with no routable host gives its share to the other legs (consul#10857)
    /// instead of failing that share of connections.
    #[serde(default)]
    pub health_aware_splits: bool,
    /// Fail over from a target when less than this percentage of its instances is healthy
    /// (consul#6276). 0 (default): only when none is.
    #[serde(default)]
    pub failover_threshold_percent: u32,
}

/// Why a chain cannot run on the kernel path.
#[derive(Debug, thiserror::Error)]
pub enum ChainExecError {
    /// The chain itself is inconsistent (from proxy-chain).
    #[error(transparent)]
    Chain(#[from] proxy_chain::ChainError),
    /// A target names a service for which no cluster is configured.
    #[error("target {target} needs a cluster named {cluster:?}")]
    NoCluster {
        /// The target ID.
        target: String,
        /// The cluster it maps to.
        cluster: String,
    },
    /// L7 routes need the proxy path.
    #[error("the chain starts at a service-router; HTTP routes need the proxy path (mode: proxy)")]
    NeedsProxyPath,
    /// The proxy path routes chains per request, which needs an HTTP protocol.
    #[error(
        "mode: proxy runs a discovery chain as HTTP routes, but its protocol is {0:?}; set \
         Protocol http, http2 or grpc in service-defaults or proxy-defaults, or use mode: direct"
    )]
    ProxyNeedsHttp(String),
    /// Peered or external targets cannot be reached by this daemon.
    #[error("target {0} is peered or external; only local clusters can serve it")]
    Unreachable(String),
    /// The resolvers' `LoadBalancer` cannot be served on the kernel path.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The service sets `hash_key`, but the chain's policy does not hash.
    #[error(
        "the service sets hash_key, but its chain's load-balancing policy is {0:?}, which does          not hash; set LoadBalancer Policy maglev or ring_hash in the service-resolver (or the          clusters' lb_policy), or remove hash_key"
    )]
    HashKeyWithoutHashing(crate::config::LbPolicy),
    /// An entry field the chain carries that neither path applies.
    #[error("{node}: {field} is not applied by this daemon; {advice}")]
    Unapplied {
        /// The chain node, or the entries, that carry it.
        node: String,
        /// The field, in Consul's name.
        field: &'static str,
        /// What to do instead.
        advice: &'static str,
    },
}

/// One target: where its hosts come from and which of them it takes.
#[derive(Clone, Debug)]
pub struct PlannedTarget {
    /// The cluster serving the target.
    pub cluster: String,
    /// The compiled target (ID, subset filter, OnlyPassing).
    pub target: TargetLeg,
}

/// One weighted leg: its primary target first, then its failover targets in order.
#[derive(Clone, Debug)]
pub struct PlannedLeg {
    /// Share of traffic, percent.
    pub weight: f64,
    /// Primary, then failovers.
    pub targets: Vec<PlannedTarget>,
}

/// A chain ready to execute.
#[derive(Clone, Debug)]
pub struct ChainPlan {
    /// The legs, summing to 100 %.
    pub legs: Vec<PlannedLeg>,
    /// Options in force.
    pub options: ChainOptions,
    /// The policy the chain's resolvers set (`LoadBalancer`), over the clusters' `lb_policy`;
    /// `None` when none sets one.
    pub policy: Option<crate::config::LbPolicy>,
}

impl ChainPlan {
    /// Maps a compiled chain to clusters. `has_cluster` says whether a cluster name exists.
    pub fn new(
        chain: &CompiledDiscoveryChain,
        local_dc: &str,
        options: ChainOptions,
        has_cluster: impl Fn(&str) -> bool,
    ) -> Result<Self, ChainExecError> {
        if chain.start_node.starts_with("router:") {
            return Err(ChainExecError::NeedsProxyPath);
        }
        let to_planned = |t: &TargetLeg| -> Result<PlannedTarget, ChainExecError> {
            let cluster = target_cluster(t, local_dc, &has_cluster)?;
            Ok(PlannedTarget {
                cluster,
                target: t.clone(),
            })
        };
        let compiled = chain.legs()?;
        let policy = resolver_policy(&compiled)?;
        let legs = compiled
            .iter()
            .map(|leg| {
                let targets = std::iter::once(&leg.target)
                    .chain(&leg.failover)
                    .map(to_planned)
                    .collect::<Result<_, _>>()?;
                Ok(PlannedLeg {
                    weight: f64::from(leg.weight),
                    targets,
                })
            })
            .collect::<Result<_, ChainExecError>>()?;
        Ok(Self {
            legs,
            options,
            policy,
        })
    }

    /// Every cluster the plan reads.
    pub fn clusters(&self) -> BTreeSet<String> {
        self.legs
            .iter()
            .flat_map(|l| l.targets.iter().map(|t| t.cluster.clone()))
            .collect()
    }

    /// Kernel levels from the current routing of the plan's clusters.
    pub fn levels(&self, routing: &dyn Fn(&str) -> Option<Routing>) -> Vec<Vec<(SocketAddr, u32)>> {
        if let [leg] = self.legs.as_slice() {
            return leg
                .targets
                .iter()
                .map(|t| self.target_hosts(t, routing))
                .filter(|hosts| !hosts.is_empty())
                .collect();
        }
        let mut level = Vec::new();
        let mut refused = 0.0;
        for leg in &self.legs {
            let hosts = leg
                .targets
                .iter()
                .map(|t| self.target_hosts(t, routing))
                .find(|hosts| !hosts.is_empty());
            match hosts {
                Some(hosts) => level.extend(scale(&hosts, leg.weight)),
                None => refused += leg.weight,
            }
        }
        if refused > 0.0 && !self.options.health_aware_splits && !level.is_empty() {
            level.push((
                REFUSE,
                (refused * UNITS_PER_PERCENT).round().max(1.0) as u32,
            ));
        }
        if level.is_empty() {
            Vec::new()
        } else {
            vec![level]
        }
    }

    /// The routable hosts of a target's subset with their load weights, or none when the target
    /// is below the failover threshold.
    fn target_hosts(
        &self,
        t: &PlannedTarget,
        routing: &dyn Fn(&str) -> Option<Routing>,
    ) -> Vec<(SocketAddr, u32)> {
        let Some(routing) = routing(&t.cluster) else {
            return Vec::new();
        };
        // A target with no healthy instance in its subset fails over, as Envoy's aggregate
        // cluster does (the cluster's own panic mode does not keep it); with the opt-in
        // threshold, so does one whose healthy share is below it.
        let in_subset = |h: &&Host| {
            t.target
                .filter
                .as_ref()
                .is_none_or(|f| f.matches(&as_chain_host(h)))
        };
        let all = routing
            .priorities
            .iter()
            .flat_map(|p| &p.all)
            .filter(in_subset)
            .count();
        let usable = routing
            .priorities
            .iter()
            .flat_map(|p| p.healthy.iter().chain(&p.degraded))
            .filter(in_subset)
            .count();
        let threshold = self.options.failover_threshold_percent as usize;
        if usable == 0 || usable * 100 < threshold * all {
            return Vec::new();
        }
        let Some(level) = lb::kernel_levels(&routing).into_iter().next() else {
            return Vec::new();
        };
        let hosts: std::collections::HashMap<SocketAddr, &Host> = routing
            .priorities
            .iter()
            .flat_map(|p| p.all.iter())
            .map(|h| (h.addr, h))
            .collect();
        level
            .into_iter()
            .filter(|(addr, _)| {
                hosts
                    .get(addr)
                    .is_some_and(|h| t.target.admits(&as_chain_host(h)))
            })
            .collect()
    }
}

/// The cluster serving a target: its service in the local datacenter, `<service>.<datacenter>`
/// for another one. Peered and external targets, and targets without such a cluster, are errors.
pub fn target_cluster(
    t: &TargetLeg,
    local_dc: &str,
    has_cluster: &dyn Fn(&str) -> bool,
) -> Result<String, ChainExecError> {
    if !t.peer.is_empty() || t.external {
        return Err(ChainExecError::Unreachable(t.id.clone()));
    }
    let cluster = if t.datacenter == local_dc || t.datacenter.is_empty() {
        t.service.clone()
    } else {
        format!("{}.{}", t.service, t.datacenter)
    };
    if !has_cluster(&cluster) {
        return Err(ChainExecError::NoCluster {
            target: t.id.clone(),
            cluster,
        });
    }
    Ok(cluster)
}

/// Every cluster a chain run by the proxy path reads (the targets of all its routes, splits
/// and failovers); errors as [`target_cluster`], and when the chain is not HTTP.
pub fn route_clusters(
    chain: &CompiledDiscoveryChain,
    local_dc: &str,
    has_cluster: &dyn Fn(&str) -> bool,
) -> Result<BTreeSet<String>, ChainExecError> {
    if !matches!(chain.protocol.as_str(), "http" | "http2" | "grpc") {
        return Err(ChainExecError::ProxyNeedsHttp(chain.protocol.clone()));
    }
    let mut out = BTreeSet::new();
    for route in chain.route_legs()? {
        for leg in &route.legs {
            for t in std::iter::once(&leg.target).chain(&leg.failover) {
                out.insert(target_cluster(t, local_dc, has_cluster)?);
            }
        }
    }
    Ok(out)
}

/// A cluster's routing narrowed to the hosts a target admits (its subset filter and Consul's
/// health rule), for the proxy path's per-request host choice. Load shares stay those of the
/// whole cluster; a priority left without hosts routes nothing.
pub fn target_routing(target: &TargetLeg, routing: &Routing) -> Routing {
    routing.filtered(|h| target.admits(&as_chain_host(h)))
}

/// Scales hosts' weights so that together they carry `percent` of traffic.
fn scale(hosts: &[(SocketAddr, u32)], percent: f64) -> Vec<(SocketAddr, u32)> {
    let total: f64 = hosts.iter().map(|(_, w)| f64::from(*w)).sum();
    hosts
        .iter()
        .map(|(a, w)| {
            (
                *a,
                ((percent * UNITS_PER_PERCENT * f64::from(*w) / total)
                    .round()
                    .max(1.0)) as u32,
            )
        })
        .collect()
}

/// A host as Consul's filter expressions see it: metadata as `Service.Meta`, discovery health
/// as the check status.
fn as_chain_host(h: &Host) -> proxy_chain::Host {
    let status = match h.eds_health {
        EdsHealth::Unknown | EdsHealth::Healthy => HealthStatus::Passing,
        EdsHealth::Degraded => HealthStatus::Warning,
        _ => HealthStatus::Critical,
    };
    proxy_chain::Host {
        service_address: h.addr.ip().to_string(),
        service_port: h.addr.port(),
        service_meta: h.metadata().clone(),
        checks: vec![status],
        ..Default::default()
    }
}

#[cfg(test)]
mod tests;
