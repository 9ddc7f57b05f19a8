//! EDS discovery over the xDS v3 protocol with Envoy's semantics: gRPC state-of-the-world and
//! delta streams on the EndpointDiscoveryService or the AggregatedDiscoveryService, and
//! REST-JSON polling.
//!
//! The daemon's configuration holds the `xds` section as an [`XdsConfig`] and each EDS
//! cluster's `eds_cluster_config` as an [`EdsClusterConfig`] (so `Config::parse` reports their
//! errors with file:line:column). [`XdsClients::start`] groups a validated config's EDS clusters
//! by control-plane connection ([`plan`]) and starts one [`EdsClient`] per connection; each
//! cluster's [`EdsSource`] (a [`DiscoverySource`]) shares its connection's client. A reload
//! changes them in place ([`XdsClients::prepare`], [`XdsChange::commit`]): clusters added or
//! removed are subscribed or unsubscribed on the running stream, and the others keep it.
//!
//! Lower level: [`spawn_eds`] starts one connection. The returned [`EdsClient`] owns the
//! connection task (aborted on drop), publishes one [`SourceUpdate`] watch per cluster (the
//! state machine sends on it directly) and exposes Envoy-named stats.
//!
//! ```no_run
//! # async fn wire() -> Result<(), Box<dyn std::error::Error>> {
//! use proxy_core::{
//!     config::sources::xds::{EdsClusterConfig, XdsConfig, plan},
//!     discovery::xds::spawn_eds,
//! };
//!
//! let xds: XdsConfig = serde_norway::from_str(
//!     "node: {id: proxy-1, cluster: edge}\n\
//!      ads_config: {api_type: DELTA_GRPC, server_uri: '127.0.0.1:18000'}",
//! )?;
//! let web: EdsClusterConfig = serde_norway::from_str("eds_config: {ads: {}}")?;
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
//!
//! [`XdsConfig`]: crate::config::sources::xds::XdsConfig
//! [`EdsClusterConfig`]: crate::config::sources::xds::EdsClusterConfig
//! [`plan`]: crate::config::sources::xds::plan
#![forbid(unsafe_code)]

pub mod backoff;
pub mod cds;
pub mod cla;
mod grpc;
pub mod hcm;
pub mod json;
pub mod lds;
pub mod listener;
pub mod node;
pub mod resources;
mod rest;
mod spawn;
mod state;
pub mod stats;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use tokio::{
    sync::{Notify, watch},
    task::AbortHandle,
};

pub use self::{
    backoff::Backoff,
    cla::{ClaError, Rule, Violation, check_constraints, hosts_from_cla},
    rest::EDS_REST_PATH,
    spawn::{spawn_ads, spawn_eds, spawn_eds_within},
    state::{CLA_TYPE_URL, UpdateError},
    stats::{ClusterStatValues, ClusterStats, ControlPlaneStats, version_gauge},
};
use self::{
    resources::{FileNames, ResourceState},
    state::{EdsState, Sink},
};
use super::{DiscoverySource, SourceUpdate};
use crate::{
    config::{
        Config,
        sources::xds::{
            EdsWatch, XdsConfigError, XdsSource,
            clusters::{eds_clusters, static_resolver},
            plan,
        },
    },
    desired::Feed,
};

/// One subscribed cluster's output: its updates and stats.
struct Output {
    rx: watch::Receiver<SourceUpdate>,
    stats: Arc<ClusterStats>,
    /// The resource it reads.
    resource: String,
}

/// The running EDS subscriptions of one control-plane connection. Dropping it stops them.
/// A reload adds and removes clusters on the running stream ([`EdsClient::subscribe`],
/// [`EdsClient::unsubscribe`]); the others keep their state.
pub struct EdsClient {
    source: XdsSource,
    outputs: Mutex<BTreeMap<String, Output>>,
    state: Arc<Mutex<EdsState>>,
    resources_changed: Arc<Notify>,
    /// ADS with CDS or LDS: their state.
    resources: Option<Arc<Mutex<ResourceState>>>,
    control: Arc<ControlPlaneStats>,
    tasks: Vec<AbortHandle>,
}

impl EdsClient {
    fn outputs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Output>> {
        self.outputs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The connection's source.
    pub fn source(&self) -> &XdsSource {
        &self.source
    }

    /// The subscribed cluster names.
    pub fn clusters(&self) -> Vec<String> {
        self.outputs().keys().cloned().collect()
    }

    /// The subscribed clusters and the resources they read.
    pub fn watches(&self) -> Vec<EdsWatch> {
        let outputs = self.outputs();
        outputs
            .iter()
            .map(|(cluster, o)| EdsWatch {
                cluster: cluster.clone(),
                resource: o.resource.clone(),
            })
            .collect()
    }

    /// A receiver of `cluster`'s updates; the current value is the latest state.
    pub fn updates(&self, cluster: &str) -> Option<watch::Receiver<SourceUpdate>> {
        self.outputs().get(cluster).map(|o| o.rx.clone())
    }

    /// `cluster`'s latest published state.
    pub fn current(&self, cluster: &str) -> Option<SourceUpdate> {
        self.outputs().get(cluster).map(|o| o.rx.borrow().clone())
    }

    /// `cluster`'s counters and gauges.
    pub fn cluster_stats(&self, cluster: &str) -> Option<Arc<ClusterStats>> {
        self.outputs().get(cluster).map(|o| Arc::clone(&o.stats))
    }

    /// The connection's stats.
    pub fn control_plane_stats(&self) -> &Arc<ControlPlaneStats> {
        &self.control
    }

    /// Every `(name, value)` pair: `cluster.<name>.*` for each cluster, then `control_plane.*`.
    pub fn named_stats(&self) -> Vec<(String, u64)> {
        let mut named: Vec<(String, u64)> = self
            .outputs()
            .iter()
            .flat_map(|(name, o)| o.stats.named(name))
            .collect();
        named.extend(self.control.named());
        named
    }

    /// Waits until every cluster is initialized (first update, rejection, failure or
    /// `initial_fetch_timeout`).
    pub async fn initialized(&self) {
        let receivers: Vec<_> = self.outputs().values().map(|o| o.rx.clone()).collect();
        for mut rx in receivers {
            // The sender lives in the state; it is only dropped when the cluster goes.
            let _ = rx.wait_for(|update| update.initialized).await;
        }
    }

    /// Subscribes `watch` on the running stream: a resource another cluster reads already
    /// gives its hosts at once; a new one is asked for in the stream's next request. Refused
    /// for a cluster the connection already has.
    pub fn subscribe(&self, watch: EdsWatch) -> Result<(), XdsConfigError> {
        let mut outputs = self.outputs();
        if outputs.contains_key(&watch.cluster) {
            return Err(XdsConfigError::Server {
                field: format!("clusters.{}", watch.cluster),
                reason: "cluster subscribed twice on one connection".into(),
            });
        }
        let (tx, rx) = watch::channel(SourceUpdate::default());
        let stats = Arc::new(ClusterStats::default());
        let sink = Sink {
            cluster: watch.cluster.clone(),
            tx,
            stats: Arc::clone(&stats),
        };
        grpc::lock(&self.state).subscribe(watch.resource.clone(), sink);
        outputs.insert(
            watch.cluster,
            Output {
                rx,
                stats,
                resource: watch.resource,
            },
        );
        self.resources_changed.notify_one();
        Ok(())
    }

    /// Removes `cluster` from the running stream (its updates end); a resource no cluster
    /// reads any more is no longer asked for.
    pub fn unsubscribe(&self, cluster: &str) {
        if self.outputs().remove(cluster).is_some() {
            grpc::lock(&self.state).unsubscribe(cluster);
            self.resources_changed.notify_one();
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
    /// The ADS connection carrying CDS and LDS, when enabled (it also carries the ADS EDS
    /// clusters).
    ads: Option<Arc<EdsClient>>,
    /// Where CDS and LDS publish, kept for a restart.
    feed: Option<Feed>,
}

impl XdsClients {
    /// Starts one client per control-plane connection that the EDS clusters of a validated
    /// `config` need (none without EDS clusters). Must run inside a tokio runtime.
    pub fn start(config: &Config) -> Result<Self, XdsConfigError> {
        Self::start_with(config, None, FileNames::default())
    }

    /// [`XdsClients::start`], and with a `feed`, when `xds.cds_config` or `lds_config` is
    /// set, the ADS connection also subscribes CDS and LDS and publishes them on it (also
    /// without EDS clusters). `file` names what the file alone defines ([`FileNames::of`] the
    /// file's config, not a composed one, or every xDS name would clash with itself).
    pub fn start_with(
        config: &Config,
        feed: Option<Feed>,
        file: FileNames,
    ) -> Result<Self, XdsConfigError> {
        let mut clients = Self {
            feed: feed.clone(),
            ..Self::default()
        };
        let clusters = eds_clusters(config);
        let enabled = config.xds.as_ref().filter(|x| x.resources_enabled());
        let resources = enabled
            .zip(feed)
            .map(|(xds, feed)| ResourceState::new(xds.clone(), file, feed));
        let Some(xds) = config
            .xds
            .as_ref()
            .filter(|_| !clusters.is_empty() || resources.is_some())
        else {
            return Ok(clients);
        };
        let mut groups = plan(xds, &clusters, &static_resolver(config))?;
        let ads = match resources {
            Some(resources) => Some((xds.ads_source(&static_resolver(config))?, resources)),
            None => None,
        };
        if let Some((source, resources)) = ads {
            let watches = take_group(&mut groups, &source);
            let client = spawn_ads(source, watches, Some(config.kernel_maps), resources)?;
            let client = Arc::new(client);
            for name in client.clusters() {
                clients.by_cluster.insert(name, Arc::clone(&client));
            }
            clients.ads = Some(client);
        }
        for (source, watches) in groups {
            let client = Arc::new(spawn_eds_within(source, watches, Some(config.kernel_maps))?);
            for name in client.clusters() {
                clients.by_cluster.insert(name, Arc::clone(&client));
            }
        }
        Ok(clients)
    }

    /// Starts `new`'s connections afresh (a reload that changed the `xds` block), CDS and LDS
    /// on the same feed, with an empty state until the server answers (the daemon keeps the
    /// last overlay until then).
    pub fn restart(&self, new: &Config, file: FileNames) -> Result<Self, XdsConfigError> {
        Self::start_with(new, self.feed.clone(), file)
    }

    /// How many control-plane connections run.
    pub fn connections(&self) -> usize {
        let mut seen: Vec<*const EdsClient> = self.by_cluster.values().map(Arc::as_ptr).collect();
        seen.extend(self.ads.as_ref().map(Arc::as_ptr));
        seen.sort_unstable();
        seen.dedup();
        seen.len()
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

    /// What a reload from `self` (running `old`'s EDS clusters) to the validated `new` changes
    /// on the connections, prepared without touching a running cluster: clusters added on a
    /// connection that runs are subscribed on its stream, connections that are new start.
    /// Clusters that stay keep their subscription and state, also when their cluster is
    /// otherwise changed. `Ok(None)`: the change needs every connection restarted (the `xds`
    /// block, or a staying cluster's `eds_cluster_config`, changed). Removed clusters are
    /// unsubscribed by [`XdsChange::commit`]; a change dropped uncommitted takes back what it
    /// subscribed.
    pub fn prepare(&self, old: &Config, new: &Config) -> Result<Option<XdsChange>, XdsConfigError> {
        if restart_needed(old, new) {
            return Ok(None);
        }
        let new_eds = eds_clusters(new);
        let mut change = XdsChange::default();
        change.ads.clone_from(&self.ads);
        change.feed.clone_from(&self.feed);
        let Some(xds) = new.xds.as_ref().filter(|_| !new_eds.is_empty()) else {
            change.removed = self
                .by_cluster
                .iter()
                .map(|(n, c)| (Arc::clone(c), n.clone()))
                .collect();
            return Ok(Some(change));
        };
        let running: Vec<Arc<EdsClient>> = {
            let mut all: Vec<Arc<EdsClient>> = self.by_cluster.values().cloned().collect();
            all.extend(self.ads.clone());
            all.sort_by_key(|c| Arc::as_ptr(c) as usize);
            all.dedup_by_key(|c| Arc::as_ptr(c) as usize);
            all
        };
        for (source, watches) in plan(xds, &new_eds, &static_resolver(new))? {
            if let Some(client) = running.iter().find(|c| *c.source() == source) {
                self.keep_or_subscribe(client, watches, &mut change)?;
            } else {
                let client = Arc::new(spawn_eds_within(source, watches, Some(new.kernel_maps))?);
                change.started += 1;
                for name in client.clusters() {
                    change.next.insert(name, Arc::clone(&client));
                }
            }
        }
        change.removed = self
            .by_cluster
            .iter()
            .filter(|(name, _)| !change.next.contains_key(*name))
            .map(|(name, client)| (Arc::clone(client), name.clone()))
            .collect();
        Ok(Some(change))
    }

    /// `watches` on the running `client`: the clusters it has stay, the others are
    /// subscribed (recorded in `change` to be taken back if it is not committed).
    fn keep_or_subscribe(
        &self,
        client: &Arc<EdsClient>,
        watches: Vec<EdsWatch>,
        change: &mut XdsChange,
    ) -> Result<(), XdsConfigError> {
        for watch in watches {
            let kept = self.by_cluster.get(&watch.cluster);
            if kept.is_some_and(|c| Arc::ptr_eq(c, client)) {
                change.next.insert(watch.cluster, Arc::clone(client));
                continue;
            }
            client.subscribe(watch.clone())?;
            change
                .added
                .push((Arc::clone(client), watch.cluster.clone()));
            change.next.insert(watch.cluster, Arc::clone(client));
        }
        Ok(())
    }

    /// The sources as they are once `change` is committed (for starting the reload's
    /// clusters before the first change).
    pub fn preview(change: &XdsChange) -> Self {
        Self {
            by_cluster: change.next.clone(),
            ads: change.ads.clone(),
            feed: None,
        }
    }

    /// The file was reloaded: the CDS and LDS state checks clashes and warming against the
    /// names it defines now (the file's alone). `Err`: an accepted xDS resource clashes with
    /// the new file; nothing changed.
    pub fn set_file(&self, file: FileNames) -> Result<(), resources::ResponseError> {
        match self.ads.as_ref().and_then(|c| c.resources.as_ref()) {
            Some(state) => grpc::lock_resources(state).set_file(file),
            None => Ok(()),
        }
    }
}

/// The watches of the group on `source`, taken out of `groups` (none if no group has it).
fn take_group(groups: &mut Vec<(XdsSource, Vec<EdsWatch>)>, source: &XdsSource) -> Vec<EdsWatch> {
    match groups.iter().position(|(s, _)| s == source) {
        Some(i) => groups.remove(i).1,
        None => Vec::new(),
    }
}

/// Whether going from `old` to `new` needs every xDS connection restarted: the `xds` block
/// changed, or a cluster in both has another `eds_cluster_config` (its resource or source).
/// Otherwise a reload adds and removes clusters on the running streams
/// ([`XdsClients::prepare`]).
pub fn restart_needed(old: &Config, new: &Config) -> bool {
    let old_eds = eds_clusters(old);
    let kept_changed = eds_clusters(new)
        .iter()
        .any(|(name, eds)| old_eds.iter().any(|(n, e)| n == name && e != eds));
    format!("{:?}", old.xds) != format!("{:?}", new.xds) || kept_changed
}

/// A prepared change of the running connections ([`XdsClients::prepare`]).
#[derive(Default)]
pub struct XdsChange {
    /// Every EDS cluster of the new configuration and its connection.
    next: BTreeMap<String, Arc<EdsClient>>,
    /// Subscribed on a running connection by the preparation.
    added: Vec<(Arc<EdsClient>, String)>,
    /// To unsubscribe at the commit.
    removed: Vec<(Arc<EdsClient>, String)>,
    /// New connections.
    started: usize,
    /// The ADS connection with CDS and LDS, kept.
    ads: Option<Arc<EdsClient>>,
    /// Where CDS and LDS publish, kept.
    feed: Option<Feed>,
    committed: bool,
}

impl XdsChange {
    /// One line: what changes on the connections.
    pub fn summary(&self) -> String {
        format!(
            "xDS: {} cluster(s) subscribed and {} unsubscribed on running streams, {} connection(s) started",
            self.added.len(),
            self.removed.len(),
            self.started
        )
    }

    /// Whether nothing changes.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.started == 0
    }

    /// Applies the change: removed clusters leave their streams (call it once their clusters
    /// stopped); returns the connections as they now run.
    pub fn commit(mut self) -> XdsClients {
        self.committed = true;
        for (client, cluster) in &self.removed {
            client.unsubscribe(cluster);
        }
        XdsClients {
            by_cluster: std::mem::take(&mut self.next),
            ads: self.ads.take(),
            feed: self.feed.take(),
        }
    }
}

impl Drop for XdsChange {
    fn drop(&mut self) {
        if !self.committed {
            for (client, cluster) in &self.added {
                client.unsubscribe(cluster);
            }
        }
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

#[cfg(test)]
mod tests;
