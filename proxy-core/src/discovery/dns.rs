//! DNS-based discovery: STRICT_DNS, LOGICAL_DNS (Envoy semantics) and a DNS SRV backend.
//!
//! Wiring: validate a [`DnsSettings`], build a resolver ([`HickoryResolver::new`]), then call
//! [`spawn_strict_dns`], [`spawn_logical_dns`] or [`spawn_dns_srv`] inside a tokio runtime. The
//! returned [`DnsCluster`] owns one task per target (aborted when it is dropped), is a
//! [`DiscoverySource`]: its tasks publish [`SourceUpdate`]s on the watch channel its consumers
//! read, and it exposes Envoy-named stats. Resolution never happens on the
//! connect path: consumers read the latest published hosts.
//!
//! ```no_run
//! # async fn wire() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//!
//! use proxy_core::{
//!     config::sources::dns::{DnsEndpoint, DnsSettings},
//!     discovery::dns::{HickoryResolver, spawn_strict_dns},
//! };
//!
//! let settings: DnsSettings = serde_norway::from_str("dns_refresh_rate: 1s\nrespect_dns_ttl: true")?;
//! settings.validate()?;
//! let resolver = Arc::new(HickoryResolver::new(&settings)?);
//! let endpoints = vec![DnsEndpoint::new("web.svc.test", 8080)];
//! let cluster = spawn_strict_dns("web", settings, endpoints, resolver)?;
//! let mut updates = cluster.updates();
//! while updates.changed().await.is_ok() {
//!     let update = updates.borrow_and_update().clone();
//!     // Program update.hosts; drain connections to update.removed if cluster.drain_on_change().
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Behaviour mirrored from Envoy's `strict_dns_cluster.cc`, `logical_dns_cluster.cc` and
//! `dns_cluster.cc`:
//! * every resolution counts `update_attempt`, then `update_success` or `update_failure`;
//! * STRICT_DNS: each distinct `address:port` of a name is a host with the endpoint's weight,
//!   priority, metadata and health (an address two names return is two hosts, each name keeping
//!   its own, as Envoy's `ResolveTarget`s do); a successful empty answer means no hosts from that
//!   name; a failure keeps them; an unchanged set counts `update_no_rebuild` and publishes
//!   nothing;
//! * LOGICAL_DNS: the first address is the only host; a successful but empty answer is counted
//!   as a failure and keeps the previous host (Envoy: "does not stabilize back to 0 hosts");
//!   a change of the first address (or of the rest of the list) republishes, but
//!   [`DnsCluster::drain_on_change`] is false: existing connections are never drained;
//! * refresh after success: the TTL when `respect_dns_ttl`, the answer is non-empty and the TTL
//!   (minimum for strict and SRV, first record for logical) is not 0, else `dns_refresh_rate`;
//!   plus a random `[0, dns_jitter)` (Envoy adds jitter after successes only);
//! * refresh after failure: [`FailureBackoff`] (jittered exponential, shared by the cluster's
//!   targets, reset by any success) or `dns_refresh_rate` when `dns_failure_refresh_rate` is
//!   unset;
//! * initialized after the first resolution of any target, success or failure, or at once
//!   when there are no targets.
//!
//! One addition of this daemon's, `dns_stale_bound` (unset: Envoy's behaviour above): a target
//! whose lookups fail (for LOGICAL_DNS, empty answers too) keeps its hosts for at most that long
//! after its first failure, then they are dropped and published as an empty answer's would be;
//! the next success restores them. `dns_stale_names`, `dns_stale_served_ms` and
//! `dns_stale_expired` count it.

mod backoff;
mod engine;
mod fake;
mod hickory;
mod resolver;
mod stats;
mod target;
#[cfg(test)]
mod tests;
mod transport;

use std::sync::Arc;

use tokio::{sync::watch, task::AbortHandle};

pub use self::{
    backoff::FailureBackoff,
    fake::{FakeResolver, QueryType},
    hickory::{BuildResolverError, HickoryResolver, address_records, srv_records},
    resolver::{
        AddressFamily, AddressRecord, BoxFuture, DnsResolve, ResolveError, SrvRecord,
        resolve_addresses,
    },
    stats::{DnsClusterStats, StatValues},
    target::SrvService,
};
use self::{
    engine::{Engine, Mode, run_target},
    target::Target,
};
use super::{DiscoverySource, SourceUpdate};
use crate::config::sources::dns::{DnsConfigError, DnsEndpoint, DnsSettings};

/// A running DNS cluster. Dropping it stops its resolution tasks.
pub struct DnsCluster {
    name: String,
    updates: watch::Receiver<SourceUpdate>,
    stats: Arc<DnsClusterStats>,
    drain_on_change: bool,
    tasks: Vec<AbortHandle>,
}

impl DnsCluster {
    /// The cluster name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A receiver of host-set updates; the current value is the latest state. Its first
    /// `changed()` completes at once if anything was published since the cluster was spawned.
    pub fn updates(&self) -> watch::Receiver<SourceUpdate> {
        self.updates.clone()
    }

    /// The latest published state.
    pub fn current(&self) -> SourceUpdate {
        self.updates.borrow().clone()
    }

    /// Waits until the cluster is initialized (first resolution of any target finished).
    pub async fn initialized(&self) {
        let mut updates = self.updates.clone();
        // The sender lives in the tasks' engine; it is only dropped when they are aborted.
        let _ = updates.wait_for(|update| update.initialized).await;
    }

    /// Counters and gauges.
    pub fn stats(&self) -> &Arc<DnsClusterStats> {
        &self.stats
    }

    /// `(cluster.<name>.<stat>, value)` pairs.
    pub fn named_stats(&self) -> Vec<(String, u64)> {
        self.stats.named(&self.name)
    }

    /// Whether removed hosts' connections are drained: false for LOGICAL_DNS only.
    pub fn drain_on_change(&self) -> bool {
        self.drain_on_change
    }
}

impl DiscoverySource for DnsCluster {
    fn cluster_name(&self) -> &str {
        &self.name
    }

    fn updates(&self) -> watch::Receiver<SourceUpdate> {
        self.updates.clone()
    }

    fn named_stats(&self) -> Vec<(String, u64)> {
        self.stats.named(&self.name)
    }

    fn drain_on_change(&self) -> bool {
        self.drain_on_change
    }
}

impl Drop for DnsCluster {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts a STRICT_DNS cluster: one target per endpoint. Must be called within a tokio runtime.
pub fn spawn_strict_dns(
    name: impl Into<String>,
    settings: DnsSettings,
    endpoints: Vec<DnsEndpoint>,
    resolver: Arc<dyn DnsResolve>,
) -> Result<DnsCluster, DnsConfigError> {
    check_endpoints(&endpoints)?;
    let targets = endpoints.into_iter().map(Target::Endpoint).collect();
    spawn(name.into(), settings, Mode::Strict, targets, resolver)
}

/// Starts a LOGICAL_DNS cluster. Envoy requires exactly one endpoint; its priority is forced to
/// 0 (as Envoy does). Must be called within a tokio runtime.
pub fn spawn_logical_dns(
    name: impl Into<String>,
    settings: DnsSettings,
    endpoints: Vec<DnsEndpoint>,
    resolver: Arc<dyn DnsResolve>,
) -> Result<DnsCluster, DnsConfigError> {
    let [mut endpoint] = <[DnsEndpoint; 1]>::try_from(endpoints).map_err(|endpoints| {
        DnsConfigError::LogicalNotSingleHost {
            count: endpoints.len(),
        }
    })?;
    check_endpoints(std::slice::from_ref(&endpoint))?;
    endpoint.priority = 0;
    spawn(
        name.into(),
        settings,
        Mode::Logical,
        vec![Target::Endpoint(endpoint)],
        resolver,
    )
}

/// Starts a DNS SRV cluster: one target per service name. Must be called within a tokio runtime.
pub fn spawn_dns_srv(
    name: impl Into<String>,
    settings: DnsSettings,
    services: Vec<SrvService>,
    resolver: Arc<dyn DnsResolve>,
) -> Result<DnsCluster, DnsConfigError> {
    for (index, service) in services.iter().enumerate() {
        if service.name.is_empty() {
            return Err(DnsConfigError::EmptyName {
                field: format!("services[{index}].name"),
            });
        }
    }
    let targets = services.into_iter().map(Target::Srv).collect();
    spawn(name.into(), settings, Mode::Strict, targets, resolver)
}

fn check_endpoints(endpoints: &[DnsEndpoint]) -> Result<(), DnsConfigError> {
    match endpoints.iter().position(|e| e.address.is_empty()) {
        Some(index) => Err(DnsConfigError::EmptyName {
            field: format!("load_assignment.endpoints[{index}].address"),
        }),
        None => Ok(()),
    }
}

#[expect(
    clippy::needless_pass_by_value,
    reason = "each target task takes a clone of the resolver; the caller gives its Arc up"
)]
fn spawn(
    name: String,
    settings: DnsSettings,
    mode: Mode,
    targets: Vec<Target>,
    resolver: Arc<dyn DnsResolve>,
) -> Result<DnsCluster, DnsConfigError> {
    settings.validate()?;
    let engine = Arc::new(Engine::new(name.clone(), settings, mode, targets.len()));
    if targets.is_empty() {
        engine.initialize_empty();
    }
    let updates = engine.subscribe();
    let stats = engine.stats.clone();
    let tasks = targets
        .into_iter()
        .enumerate()
        .map(|(index, target)| {
            let task = run_target(engine.clone(), index, target, resolver.clone());
            tokio::spawn(task).abort_handle()
        })
        .collect();
    Ok(DnsCluster {
        name,
        updates,
        stats,
        drain_on_change: mode == Mode::Strict,
        tasks,
    })
}
