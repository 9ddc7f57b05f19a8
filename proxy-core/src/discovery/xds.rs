//! EDS discovery over the xDS v3 protocol with Envoy's semantics: gRPC state-of-the-world and
//! delta streams on the EndpointDiscoveryService or the AggregatedDiscoveryService, and
//! REST-JSON polling.
//!
//! The daemon's configuration holds the `xds` section as an [`XdsConfig`] and each EDS
//! cluster's `eds_cluster_config` as an [`EdsClusterConfig`] (so `Config::parse` reports their
//! errors with file:line:column). [`XdsClients::start`] groups a validated config's EDS clusters
//! by control-plane connection ([`plan`]) and starts one [`EdsClient`] per connection; each
//! cluster's [`EdsSource`] (a [`DiscoverySource`]) shares its connection's client.
//!
//! Lower level: [`spawn_eds`] starts one connection. The returned [`EdsClient`] owns the
//! connection task (aborted on drop), publishes one [`SourceUpdate`] watch per cluster (the
//! state machine sends on it directly) and exposes Envoy-named stats.
//!
//! ```no_run
//! # async fn wire() -> Result<(), Box<dyn std::error::Error>> {
//! use proxy_core::discovery::xds::{EdsClusterConfig, XdsConfig, plan, spawn_eds};
//!
//! let xds: XdsConfig = serde_yaml::from_str(
//!     "node: {id: proxy-1, cluster: edge}\n\
//!      ads_config: {api_type: DELTA_GRPC, server_uri: '127.0.0.1:18000'}",
//! )?;
//! let web: EdsClusterConfig = serde_yaml::from_str("eds_config: {ads: {}}")?;
//! let clusters = vec![("web".to_owned(), web)];
//! let mut clients = Vec::new();
//! for (source, watches) in plan(&xds, &clusters, &|_| None)? {
//!     clients.push(spawn_eds(source, watches)?);
//! }
//! let mut updates = clients[0].updates("web").expect("subscribed");
//! while updates.changed().await.is_ok() {
//!     let update = updates.borrow_and_update().clone();
//!     // Program update.hosts; drain connections to update.removed.
//! }
//! # Ok(())
//! # }
//! ```
//!
//! See [`cla`] for validation and the host mapping, [`stats`] for the counting rules, and the
//! `grpc` and `rest` modules' docs for the protocol.
#![forbid(unsafe_code)]

pub mod backoff;
pub mod cla;
pub mod config;
mod grpc;
pub mod json;
mod rest;
mod state;
pub mod stats;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use envoy_types::pb::envoy::config::core::v3::Node;
use tokio::{sync::watch, task::AbortHandle};

pub use self::{
    backoff::Backoff,
    cla::{ClaError, Rule, Violation, check_constraints, hosts_from_cla},
    config::{
        AggregatedConfigSource, ApiConfigSource, ApiType, ApiVersion, BackoffConfig, ConfigSource,
        EdsClusterConfig, EdsWatch, EnvoyGrpc, GoogleGrpc, GrpcApi, GrpcService, NodeConfig,
        Transport, XdsConfig, XdsConfigError, XdsSource, plan,
    },
    rest::EDS_REST_PATH,
    state::{CLA_TYPE_URL, UpdateError},
    stats::{ClusterStatValues, ClusterStats, ControlPlaneStats, version_gauge},
};
use self::{
    grpc::GrpcSubscription,
    rest::RestSubscription,
    state::{EdsState, Sink},
};
use super::{DiscoverySource, SourceUpdate};
use crate::config::{ClusterType, Config};

/// The running EDS subscriptions of one control-plane connection. Dropping it stops them.
pub struct EdsClient {
    outputs: BTreeMap<String, (watch::Receiver<SourceUpdate>, Arc<ClusterStats>)>,
    control: Arc<ControlPlaneStats>,
    tasks: Vec<AbortHandle>,
}

impl EdsClient {
    /// The subscribed cluster names.
    pub fn clusters(&self) -> impl Iterator<Item = &str> {
        self.outputs.keys().map(String::as_str)
    }

    /// A receiver of `cluster`'s updates; the current value is the latest state.
    pub fn updates(&self, cluster: &str) -> Option<watch::Receiver<SourceUpdate>> {
        self.outputs.get(cluster).map(|(rx, _)| rx.clone())
    }

    /// `cluster`'s latest published state.
    pub fn current(&self, cluster: &str) -> Option<SourceUpdate> {
        self.outputs.get(cluster).map(|(rx, _)| rx.borrow().clone())
    }

    /// `cluster`'s counters and gauges.
    pub fn cluster_stats(&self, cluster: &str) -> Option<&Arc<ClusterStats>> {
        self.outputs.get(cluster).map(|(_, stats)| stats)
    }

    /// The connection's stats.
    pub fn control_plane_stats(&self) -> &Arc<ControlPlaneStats> {
        &self.control
    }

    /// Every `(name, value)` pair: `cluster.<name>.*` for each cluster, then `control_plane.*`.
    pub fn named_stats(&self) -> Vec<(String, u64)> {
        let clusters = self
            .outputs
            .iter()
            .flat_map(|(name, (_, stats))| stats.named(name));
        clusters.chain(self.control.named()).collect()
    }

    /// Waits until every cluster is initialized (first update, rejection, failure or
    /// `initial_fetch_timeout`).
    pub async fn initialized(&self) {
        for (rx, _) in self.outputs.values() {
            // The sender lives in the task; it is only dropped when the task is aborted.
            let _ = rx.clone().wait_for(|update| update.initialized).await;
        }
    }
}

impl Drop for EdsClient {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The running xDS connections of a configuration, by EDS cluster. Dropping it (and every
/// [`EdsSource`] taken from it) stops them.
#[derive(Default)]
pub struct XdsClients {
    by_cluster: BTreeMap<String, Arc<EdsClient>>,
    connections: usize,
}

impl XdsClients {
    /// Starts one client per control-plane connection that the EDS clusters of a validated
    /// `config` need (none without EDS clusters). Must run inside a tokio runtime.
    pub fn start(config: &Config) -> Result<Self, XdsConfigError> {
        let mut clients = Self::default();
        let clusters = eds_clusters(config);
        let Some(xds) = config.xds.as_ref().filter(|_| !clusters.is_empty()) else {
            return Ok(clients);
        };
        for (source, watches) in plan(xds, &clusters, &static_resolver(config))? {
            let client = Arc::new(spawn_eds(source, watches)?);
            for name in client.clusters() {
                clients
                    .by_cluster
                    .insert(name.to_owned(), Arc::clone(&client));
            }
            clients.connections += 1;
        }
        Ok(clients)
    }

    /// How many control-plane connections run.
    pub fn connections(&self) -> usize {
        self.connections
    }

    /// The source of EDS cluster `cluster`, if a connection subscribes it.
    pub fn source(&self, cluster: &str) -> Option<EdsSource> {
        let client = self.by_cluster.get(cluster)?;
        Some(EdsSource {
            cluster: cluster.to_owned(),
            updates: client.updates(cluster)?,
            client: Arc::clone(client),
        })
    }
}

/// Every EDS cluster of `config` with its `eds_cluster_config` (validation made it present).
pub fn eds_clusters(config: &Config) -> Vec<(String, EdsClusterConfig)> {
    config
        .clusters
        .iter()
        .filter(|c| c.cluster_type == ClusterType::Eds && c.custom_cluster_type.is_none())
        .filter_map(|c| Some((c.name.clone(), c.eds_cluster_config.clone()?)))
        .collect()
}

/// How `envoy_grpc: {cluster_name}` and REST `cluster_names` reach their server: the address of
/// the named STATIC cluster's first host.
pub fn static_resolver(config: &Config) -> impl Fn(&str) -> Option<SocketAddr> + '_ {
    |name| {
        config
            .cluster(name)
            .and_then(|c| c.static_hosts().first().map(|h| h.addr))
    }
}

/// One EDS cluster's source: its subscription on a shared control-plane connection. The
/// connection's state machine publishes on the receiver this hands out.
pub struct EdsSource {
    cluster: String,
    updates: watch::Receiver<SourceUpdate>,
    client: Arc<EdsClient>,
}

impl DiscoverySource for EdsSource {
    fn cluster_name(&self) -> &str {
        &self.cluster
    }

    fn updates(&self) -> watch::Receiver<SourceUpdate> {
        self.updates.clone()
    }

    /// The cluster's `cluster.<name>.*` stats (the connection's `control_plane.*` are not
    /// per cluster).
    fn named_stats(&self) -> Vec<(String, u64)> {
        self.client
            .cluster_stats(&self.cluster)
            .map(|stats| stats.named(&self.cluster))
            .unwrap_or_default()
    }
}

/// Starts the subscriptions of `watches` on `source`. Must be called within a tokio runtime.
/// A cluster name may appear once; several clusters may share a resource name.
pub fn spawn_eds(source: XdsSource, watches: Vec<EdsWatch>) -> Result<EdsClient, XdsConfigError> {
    let mut outputs = BTreeMap::new();
    let mut sinks = Vec::new();
    for watch in watches {
        let (tx, rx) = watch::channel(SourceUpdate::default());
        let stats = Arc::new(ClusterStats::default());
        if outputs
            .insert(watch.cluster.clone(), (rx, Arc::clone(&stats)))
            .is_some()
        {
            return Err(XdsConfigError::Server {
                field: format!("clusters.{}", watch.cluster),
                reason: "cluster subscribed twice on one connection".into(),
            });
        }
        sinks.push((watch.resource, Sink { tx, stats }));
    }
    let state = Arc::new(Mutex::new(EdsState::new(sinks)));
    let control = Arc::new(ControlPlaneStats::default());
    let backoff = Backoff::new(source.backoff.0, source.backoff.1);
    let node = Node {
        id: source.node.id.clone(),
        cluster: source.node.cluster.clone(),
        // The product, as Envoy sends "envoy"; control planes log and may match on it.
        user_agent_name: "proxy".to_owned(),
        ..Default::default()
    };
    let main = match source.transport {
        Transport::Grpc { uri, api, delta } => {
            let sub = GrpcSubscription {
                uri,
                api,
                delta,
                node,
                state: Arc::clone(&state),
                control: Arc::clone(&control),
            };
            tokio::spawn(grpc::run(sub, backoff))
        }
        Transport::Rest {
            uri,
            refresh_delay,
            request_timeout,
        } => {
            let sub = RestSubscription {
                uri,
                refresh_delay,
                request_timeout,
                node: source.node,
                state: Arc::clone(&state),
                control: Arc::clone(&control),
            };
            tokio::spawn(rest::run(sub, backoff))
        }
    };
    let mut tasks = vec![main.abort_handle()];
    if !source.initial_fetch_timeout.is_zero() {
        let timeout = source.initial_fetch_timeout;
        let timer = tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            grpc::lock(&state).on_init_timeout();
        });
        tasks.push(timer.abort_handle());
    }
    Ok(EdsClient {
        outputs,
        control,
        tasks,
    })
}

#[cfg(test)]
mod tests;
