//! A running cluster: its discovery backend feeds its health state, and routable hosts come out.
//!
//! [`Upstream::spawn`] starts the discovery of one configured cluster (STATIC: the configured
//! hosts; STRICT_DNS / LOGICAL_DNS: a resolution task per name) and a task that applies host
//! updates, health-check transitions, passive signals and the outlier sweep to the cluster's
//! [`ClusterHealth`]. Every change of the routable set is published on a watch channel, which the
//! daemon turns into kernel slot tables. The health state sits behind a lock so the admin
//! interface can read host flags and stats at any time.

use std::{
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{
    sync::{broadcast, mpsc, watch},
    task::JoinHandle,
};

use crate::{
    config::{
        CONSUL_CLUSTER, Cluster, ClusterType, CustomClusterType, DNS_SRV_CLUSTER, DnsSrvConfig,
    },
    discovery::{
        HostSet,
        consul::{ConsulConfig, spawn_consul},
        dns::{
            BuildResolverError, DnsCluster, DnsConfigError, HickoryResolver, SrvService, Update,
            spawn_dns_srv, spawn_logical_dns, spawn_strict_dns,
        },
        source::{DiscoverySource, DnsSource},
    },
    health::{
        ClusterHealth, HealthCheckManager, HealthConfigError, HealthEvent, HostStatus,
        PassiveSignal, Routing, SeededRandom,
    },
};

/// Passive signals buffered per cluster before senders wait.
const PASSIVE_QUEUE: usize = 1024;
/// Outlier sweep period when outlier detection is off (the sweep then has nothing to do).
const IDLE_SWEEP: Duration = Duration::from_secs(3600);

/// Why a cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Its health configuration is invalid.
    #[error("cluster {cluster}: {source}")]
    Health {
        /// The cluster.
        cluster: String,
        /// Why.
        #[source]
        source: HealthConfigError,
    },
    /// Its DNS settings are invalid.
    #[error("cluster {cluster}: {source}")]
    Dns {
        /// The cluster.
        cluster: String,
        /// Why.
        #[source]
        source: DnsConfigError,
    },
    /// The resolver could not be built.
    #[error("cluster {cluster}: {source}")]
    Resolver {
        /// The cluster.
        cluster: String,
        /// Why.
        #[source]
        source: BuildResolverError,
    },
    /// A custom backend's settings are invalid or it could not start.
    #[error("cluster {cluster}: {message}")]
    Custom {
        /// The cluster.
        cluster: String,
        /// What went wrong.
        message: String,
    },
    /// The type is not served by this build.
    #[error("cluster {cluster}: type {kind:?} is not implemented yet in this build")]
    Unsupported {
        /// The cluster.
        cluster: String,
        /// Its type.
        kind: ClusterType,
    },
}

/// A running cluster.
pub struct Upstream {
    name: String,
    health: Arc<Mutex<ClusterHealth>>,
    routing: watch::Receiver<Routing>,
    initialized: watch::Receiver<bool>,
    passive: mpsc::Sender<PassiveSignal>,
    dns: Option<Arc<DnsCluster>>,
    feed_stats: Option<FeedStats>,
    drain_on_removal: bool,
    outlier_detection: bool,
    task: JoinHandle<()>,
}

impl Upstream {
    /// Starts discovery and health for `cluster`. Must run inside a tokio runtime.
    pub fn spawn(cluster: &Cluster, manager: &HealthCheckManager) -> Result<Self, UpstreamError> {
        if let Some(custom) = &cluster.custom_cluster_type {
            let source = start_custom(cluster, custom)?;
            let updates = source.updates();
            let stats: FeedStats = Arc::new(move || source.named_stats());
            return Self::spawn_with_feed(cluster, manager, updates, stats);
        }
        let (hosts, dns) = start_source(cluster)?;
        Self::start(cluster, manager, hosts, dns, None)
    }

    /// Starts health for `cluster` over hosts that an external source (EDS, Consul) publishes on
    /// `feed`; `stats` adds the source's stats to the cluster's.
    pub fn spawn_with_feed(
        cluster: &Cluster,
        manager: &HealthCheckManager,
        feed: watch::Receiver<FeedUpdate>,
        stats: FeedStats,
    ) -> Result<Self, UpstreamError> {
        Self::start(
            cluster,
            manager,
            HostFeed::External(feed),
            None,
            Some(stats),
        )
    }

    fn start(
        cluster: &Cluster,
        manager: &HealthCheckManager,
        hosts: HostFeed,
        dns: Option<Arc<DnsCluster>>,
        feed_stats: Option<FeedStats>,
    ) -> Result<Self, UpstreamError> {
        let name = cluster.name.clone();
        let random = Arc::new(SeededRandom::from_entropy());
        let health = ClusterHealth::new(&name, &cluster.health_config(), manager, random).map_err(
            |source| UpstreamError::Health {
                cluster: name.clone(),
                source,
            },
        )?;
        let drain_on_removal = cluster.cluster_type != ClusterType::LogicalDns;
        let outlier_detection = cluster.outlier_detection.is_some();
        let health = Arc::new(Mutex::new(health));
        let (routing_tx, routing) = watch::channel(Routing::default());
        let (passive, passive_rx) = mpsc::channel(PASSIVE_QUEUE);
        let sweep = cluster
            .outlier_detection
            .as_ref()
            .map_or(IDLE_SWEEP, |o| o.interval);
        let (init_tx, initialized) = watch::channel(false);
        let events = manager.subscribe();
        let outputs = Outputs {
            routing: routing_tx,
            initialized: init_tx,
        };
        let task = tokio::spawn(run(
            health.clone(),
            hosts,
            events,
            passive_rx,
            outputs,
            sweep,
        ));
        Ok(Self {
            name,
            health,
            routing,
            initialized,
            passive,
            dns,
            feed_stats,
            drain_on_removal,
            outlier_detection,
            task,
        })
    }

    /// The cluster's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The routable hosts, updated on every change.
    pub fn routing(&self) -> watch::Receiver<Routing> {
        self.routing.clone()
    }

    /// Becomes true once discovery has delivered its first result (for DNS: the first
    /// resolution of any name) and no host is waiting for its first health check; the routing
    /// is meaningful from then on.
    pub fn initialized(&self) -> watch::Receiver<bool> {
        self.initialized.clone()
    }

    /// Where the data path reports connect results for this cluster's hosts.
    pub fn passive(&self) -> mpsc::Sender<PassiveSignal> {
        self.passive.clone()
    }

    /// Whether the cluster has outlier detection: without it, connect results change nothing
    /// and the data path need not report them.
    pub fn outlier_detection(&self) -> bool {
        self.outlier_detection
    }

    /// Whether connections to removed hosts are drained (false for LOGICAL_DNS).
    pub fn drain_on_removal(&self) -> bool {
        self.drain_on_removal
    }

    /// Every host with its flags, as `/clusters` shows them.
    pub fn host_statuses(&self) -> Vec<HostStatus> {
        self.lock().host_statuses()
    }

    /// Envoy-named stats: discovery (`update_*`), membership, health checks, outlier detection.
    pub fn stats(&self) -> Vec<(String, u64)> {
        // Discovery stats first; health's membership gauges win where both name one.
        let mut stats: std::collections::BTreeMap<String, u64> = self
            .dns
            .as_ref()
            .map(|d| d.named_stats())
            .unwrap_or_default()
            .into_iter()
            .collect();
        if let Some(feed) = &self.feed_stats {
            stats.extend(feed());
        }
        stats.extend(self.lock().stats());
        stats.into_iter().collect()
    }

    fn lock(&self) -> MutexGuard<'_, ClusterHealth> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Hosts from a discovery source other than the built-in types (EDS over xDS, Consul, DNS SRV).
pub use crate::discovery::source::SourceUpdate as FeedUpdate;

/// Stats of an external source, as `(cluster.<name>.<stat>, value)` pairs.
pub type FeedStats = Arc<dyn Fn() -> Vec<(String, u64)> + Send + Sync>;

/// Where a cluster's hosts come from.
enum HostFeed {
    /// Fixed hosts; the sender is kept so the channel stays open.
    Static {
        _sender: watch::Sender<HostSet>,
        rx: watch::Receiver<HostSet>,
    },
    /// A DNS cluster's updates (the `Upstream` keeps the cluster, and so its tasks, alive).
    Dns(watch::Receiver<Update>),
    /// An external source.
    External(watch::Receiver<FeedUpdate>),
}

impl HostFeed {
    /// Whether the source has delivered its first result.
    fn initialized(&self) -> bool {
        match self {
            HostFeed::Static { .. } => true,
            HostFeed::Dns(rx) => rx.borrow().initialized,
            HostFeed::External(rx) => rx.borrow().initialized,
        }
    }

    fn current(&mut self) -> HostSet {
        match self {
            HostFeed::Static { rx, .. } => rx.borrow_and_update().clone(),
            HostFeed::Dns(rx) => rx.borrow_and_update().hosts.clone(),
            HostFeed::External(rx) => rx.borrow_and_update().hosts.clone(),
        }
    }

    /// Waits for the next host set; `None` when the source is gone.
    async fn next(&mut self) -> Option<HostSet> {
        match self {
            HostFeed::Static { rx, .. } => {
                rx.changed().await.ok()?;
                Some(rx.borrow_and_update().clone())
            }
            HostFeed::Dns(rx) => {
                rx.changed().await.ok()?;
                Some(rx.borrow_and_update().hosts.clone())
            }
            HostFeed::External(rx) => {
                rx.changed().await.ok()?;
                Some(rx.borrow_and_update().hosts.clone())
            }
        }
    }
}

fn start_source(cluster: &Cluster) -> Result<(HostFeed, Option<Arc<DnsCluster>>), UpstreamError> {
    let name = &cluster.name;
    match cluster.cluster_type {
        ClusterType::Static => {
            let (tx, rx) = watch::channel(cluster.static_hosts());
            Ok((HostFeed::Static { _sender: tx, rx }, None))
        }
        ClusterType::StrictDns | ClusterType::LogicalDns => {
            let settings = cluster.dns_settings();
            let resolver =
                HickoryResolver::new(&settings).map_err(|source| UpstreamError::Resolver {
                    cluster: name.clone(),
                    source,
                })?;
            let endpoints = cluster.dns_endpoints();
            let spawn = if cluster.cluster_type == ClusterType::StrictDns {
                spawn_strict_dns
            } else {
                spawn_logical_dns
            };
            let dns = spawn(name, settings, endpoints, Arc::new(resolver)).map_err(|source| {
                UpstreamError::Dns {
                    cluster: name.clone(),
                    source,
                }
            })?;
            let rx = dns.updates();
            let dns = Arc::new(dns);
            Ok((HostFeed::Dns(rx), Some(dns)))
        }
        // EDS hosts come from the xDS client, which the daemon starts (spawn_with_feed).
        kind => Err(UpstreamError::Unsupported {
            cluster: name.clone(),
            kind,
        }),
    }
}

/// What the event loop publishes.
struct Outputs {
    routing: watch::Sender<Routing>,
    initialized: watch::Sender<bool>,
}

/// Starts a custom backend (`cluster_type: {name, typed_config}`) of a validated config.
fn start_custom(
    cluster: &Cluster,
    custom: &CustomClusterType,
) -> Result<Arc<dyn DiscoverySource>, UpstreamError> {
    let name = &cluster.name;
    let bad = |message: String| UpstreamError::Custom {
        cluster: name.clone(),
        message,
    };
    match custom.name.as_str() {
        CONSUL_CLUSTER => {
            let cfg: ConsulConfig = serde_json::from_value(custom.typed_config.clone())
                .map_err(|e| bad(e.to_string()))?;
            let consul = spawn_consul(name.clone(), cfg).map_err(|e| bad(e.to_string()))?;
            Ok(Arc::new(consul))
        }
        DNS_SRV_CLUSTER => {
            let cfg: DnsSrvConfig = serde_json::from_value(custom.typed_config.clone())
                .map_err(|e| bad(e.to_string()))?;
            let settings = cluster.dns_settings();
            let resolver =
                HickoryResolver::new(&settings).map_err(|source| UpstreamError::Resolver {
                    cluster: name.clone(),
                    source,
                })?;
            let services = cfg
                .service_names
                .iter()
                .map(|n| SrvService::new(n.clone()))
                .collect();
            let dns =
                spawn_dns_srv(name, settings, services, Arc::new(resolver)).map_err(|source| {
                    UpstreamError::Dns {
                        cluster: name.clone(),
                        source,
                    }
                })?;
            Ok(Arc::new(DnsSource::new(dns)))
        }
        other => Err(bad(format!("unknown cluster type {other:?}"))),
    }
}

/// The cluster's event loop.
async fn run(
    health: Arc<Mutex<ClusterHealth>>,
    mut hosts: HostFeed,
    mut events: broadcast::Receiver<HealthEvent>,
    mut passive: mpsc::Receiver<PassiveSignal>,
    out: Outputs,
    sweep: Duration,
) {
    let lock = || health.lock().unwrap_or_else(|e| e.into_inner());
    let initial = hosts.current();
    lock().update_hosts(initial);
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + sweep, sweep);
    // Whether the last event may have changed the routing: a connect success or a traffic note
    // cannot (ejection needs a failure or the sweep), and the proxy reports one per connection,
    // so for them the routing is neither recomputed nor compared.
    let mut changed = true;
    loop {
        if changed {
            publish(&lock(), &out, &hosts);
        }
        changed = true;
        tokio::select! {
            next = hosts.next() => match next {
                Some(set) => lock().update_hosts(set),
                None => return,
            },
            // The cluster's own receiver holds the event; ours only wakes the loop.
            event = events.recv() => match event {
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => { lock().pump_events(); }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            Some(signal) = passive.recv() => changed = on_passive(&mut lock(), signal),
            _ = ticker.tick() => { lock().outlier_tick(); }
        }
    }
}

/// Sends the routing when it changed, and `initialized` once discovery delivered and no host
/// waits for its first health check.
fn publish(h: &ClusterHealth, out: &Outputs, hosts: &HostFeed) {
    let now = h.routing();
    let pending = h.host_statuses().iter().any(|s| s.flags.pending_active_hc);
    out.routing.send_if_modified(|old| {
        let changed = *old != now;
        *old = now;
        changed
    });
    if !*out.initialized.borrow() && hosts.initialized() && !pending {
        out.initialized.send_replace(true);
    }
}

/// Applies a passive signal; returns whether it may have changed the routing (a failure may
/// eject its host).
fn on_passive(h: &mut ClusterHealth, signal: PassiveSignal) -> bool {
    match signal {
        PassiveSignal::ConnectFailure(addr) => {
            h.record_connect_failure(addr);
            true
        }
        PassiveSignal::ConnectSuccess(addr) => {
            h.record_connect_success(addr);
            false
        }
        PassiveSignal::Traffic => {
            h.note_traffic();
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;

    fn cluster(yaml: &str) -> Cluster {
        Config::parse(yaml, Path::new("t.yaml"))
            .expect("valid")
            .clusters
            .remove(0)
    }

    #[tokio::test]
    async fn static_cluster_routes_its_hosts_by_priority() {
        let c = cluster(
            "clusters:\n  - name: c\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } }\n        - priority: 1\n          lb_endpoints:\n            - endpoint: { address: { socket_address: { address: 127.0.0.2, port_value: 1 } } }\n",
        );
        let up = Upstream::spawn(&c, &HealthCheckManager::default()).unwrap();
        let routing = up.routing();
        up.initialized().wait_for(|i| *i).await.unwrap();
        let r = routing.borrow().clone();
        let hosts: Vec<String> = r.routable().iter().map(|h| h.addr.to_string()).collect();
        // Priority 0 is fully healthy, so it takes all the load.
        assert_eq!(hosts, ["127.0.0.1:1"]);
        assert_eq!(up.host_statuses().len(), 2);
        assert!(
            up.stats()
                .iter()
                .any(|(k, v)| k == "cluster.c.membership_total" && *v == 2)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn passive_failures_eject_through_outlier_detection() {
        let c = cluster(
            "clusters:\n  - name: c\n    outlier_detection: { consecutive_5xx: 2, max_ejection_percent: 50 }\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } }\n            - endpoint: { address: { socket_address: { address: 127.0.0.2, port_value: 1 } } }\n",
        );
        let up = Upstream::spawn(&c, &HealthCheckManager::default()).unwrap();
        let mut routing = up.routing();
        routing.wait_for(|r| r.routable().len() == 2).await.unwrap();
        let bad = "127.0.0.2:1".parse().unwrap();
        for _ in 0..2 {
            up.passive()
                .send(PassiveSignal::ConnectFailure(bad))
                .await
                .unwrap();
        }
        let r = routing
            .wait_for(|r| r.routable().len() == 1)
            .await
            .unwrap()
            .clone();
        assert_eq!(r.routable()[0].addr.to_string(), "127.0.0.1:1");
        let flags: Vec<String> = up
            .host_statuses()
            .iter()
            .map(|s| s.flags.render())
            .collect();
        assert!(
            flags.iter().any(|f| f.contains("failed_outlier_check")),
            "{flags:?}"
        );
    }

    #[tokio::test]
    async fn unsupported_type_is_a_clear_error() {
        let mut c = cluster("clusters:\n  - name: c\n");
        c.cluster_type = ClusterType::OriginalDst;
        let err = Upstream::spawn(&c, &HealthCheckManager::default())
            .err()
            .unwrap();
        assert!(err.to_string().contains("not implemented yet"), "{err}");
    }
}
