//! A running cluster, and its one event loop: the cluster's discovery source feeds its health
//! state, and routable hosts come out.
//!
//! [`Upstream::spawn_in`] starts the cluster's source through [`discovery::start`] (which picks
//! it from the cluster's type) and a task, `run`, that applies host updates (read straight from
//! the source's own watch channel), health-check transitions (from the cluster's one
//! subscription to the [`HealthCheckManager`]), passive signals and the outlier sweep to the
//! cluster's [`ClusterHealth`]. Every change of the routable set is published on a watch
//! channel, which the daemon turns into kernel slot tables, and on the cluster's views: routing
//! narrowed by a function (a Consul chain target's subset), which the same loop keeps current
//! ([`Upstream::routing_view`]), so no task exists only to forward one channel into another.
//! The health state sits behind a lock so the admin interface can read host flags and stats at
//! any time.

pub mod breakers;
mod histogram;
mod traffic;

use std::{
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    sync::{broadcast, mpsc, watch},
    task::JoinHandle,
};

pub use self::{
    histogram::{BUCKETS_MS, Histogram, HistogramSnapshot, Responses},
    traffic::{HostTraffic, OpenConnection, UpstreamTraffic},
};
use crate::{
    config::{Cluster, host_guard::HostGuard},
    discovery::{self, DiscoverySource, SourceError, SourceUpdate, xds::XdsClients},
    health::{
        ClusterHealth, HealthCheckManager, HealthConfigError, HealthEvent, HostStatus,
        PassiveSignal, Routing, SeededRandom,
    },
    host::HostSet,
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
    /// Its discovery source could not start.
    #[error(transparent)]
    Discovery(#[from] SourceError),
}

/// A running cluster.
pub struct Upstream {
    name: String,
    health: Arc<Mutex<ClusterHealth>>,
    routing: watch::Receiver<Routing>,
    initialized: watch::Receiver<bool>,
    passive: mpsc::Sender<PassiveSignal>,
    /// Where views are handed to the event loop, which owns them.
    views: mpsc::UnboundedSender<View>,
    /// Kept for its stats and so its tasks run as long as the cluster does.
    source: Box<dyn DiscoverySource>,
    outlier_detection: bool,
    /// Hosts of the source's last update that the guard left out (gauge).
    refused: Arc<AtomicU64>,
    /// Host sets skipped because they do not fit the kernel maps (counter).
    too_large: Arc<AtomicU64>,
    /// The proxy path's connections to the cluster's hosts.
    traffic: Arc<UpstreamTraffic>,
    task: JoinHandle<()>,
}

/// The cluster's circuit breakers, each priority's limits from its `circuit_breakers`.
fn breakers(cluster: &Cluster) -> breakers::Breakers {
    use crate::config::circuit_breakers::{CircuitBreakers, Priority};
    let config = cluster.circuit_breakers.as_ref();
    breakers::Breakers::new(CircuitBreakers::limits(config, Priority::Default))
        .with_high(CircuitBreakers::limits(config, Priority::High))
}

impl Upstream {
    /// Starts discovery and health for a cluster of any type but EDS (whose subscription lives
    /// on a shared connection: use [`Upstream::spawn_in`]). Must run inside a tokio runtime.
    pub fn spawn(cluster: &Cluster, manager: &HealthCheckManager) -> Result<Self, UpstreamError> {
        Self::spawn_in(
            cluster,
            manager,
            &XdsClients::default(),
            &HostGuard::default(),
        )
    }

    /// Starts discovery and health for `cluster`; an EDS cluster subscribes through `xds`;
    /// hosts `guard` refuses are left out. Must run inside a tokio runtime.
    pub fn spawn_in(
        cluster: &Cluster,
        manager: &HealthCheckManager,
        xds: &XdsClients,
        guard: &HostGuard,
    ) -> Result<Self, UpstreamError> {
        let source = discovery::start(cluster, xds)?;
        Self::with_source(cluster, manager, source, guard)
    }

    /// Starts health for `cluster` over the hosts `source` publishes, less those `guard`
    /// refuses.
    pub fn with_source(
        cluster: &Cluster,
        manager: &HealthCheckManager,
        source: Box<dyn DiscoverySource>,
        guard: &HostGuard,
    ) -> Result<Self, UpstreamError> {
        Self::with_source_zoned(cluster, manager, source, guard, None)
    }

    /// [`spawn_in`](Self::spawn_in) for a zone-aware cluster: its routing follows `zone`'s
    /// local cluster too.
    pub fn spawn_zoned(
        cluster: &Cluster,
        manager: &HealthCheckManager,
        xds: &XdsClients,
        guard: &HostGuard,
        zone: Option<ZoneInput>,
    ) -> Result<Self, UpstreamError> {
        let source = discovery::start(cluster, xds)?;
        Self::with_source_zoned(cluster, manager, source, guard, zone)
    }

    /// [`with_source`](Self::with_source), with zone-aware routing when `zone` is given.
    pub fn with_source_zoned(
        cluster: &Cluster,
        manager: &HealthCheckManager,
        source: Box<dyn DiscoverySource>,
        guard: &HostGuard,
        zone: Option<ZoneInput>,
    ) -> Result<Self, UpstreamError> {
        let name = cluster.name.clone();
        let random = Arc::new(SeededRandom::from_entropy());
        let health = ClusterHealth::new(&name, &cluster.health_config(), manager, random).map_err(
            |source| UpstreamError::Health {
                cluster: name.clone(),
                source,
            },
        )?;
        let outlier_detection = cluster.outlier_detection.is_some();
        let health = Arc::new(Mutex::new(health));
        let (routing_tx, routing) = watch::channel(Routing::default());
        let (passive, passive_rx) = mpsc::channel(PASSIVE_QUEUE);
        let sweep = cluster
            .outlier_detection
            .as_ref()
            .map_or(IDLE_SWEEP, |o| o.interval);
        let (init_tx, initialized) = watch::channel(false);
        let (views, views_rx) = mpsc::unbounded_channel();
        let refused = Arc::new(AtomicU64::new(0));
        let too_large = Arc::new(AtomicU64::new(0));
        let traffic = Arc::new(UpstreamTraffic::with_breakers(breakers(cluster)));
        let inputs = Inputs {
            hosts: source.updates(),
            guard: Guarded {
                guard: guard.clone(),
                cluster: name.clone(),
                refused: refused.clone(),
                too_large: too_large.clone(),
                traffic: traffic.clone(),
            },
            // The cluster's one subscription, taken before its first hosts register probes.
            events: manager.subscribe(),
            passive: passive_rx,
            views: views_rx,
            zone,
        };
        let outputs = Outputs {
            routing: routing_tx,
            initialized: init_tx,
        };
        let task = tokio::spawn(run(health.clone(), inputs, outputs, sweep));
        Ok(Self {
            name,
            health,
            routing,
            initialized,
            passive,
            views,
            source,
            outlier_detection,
            refused,
            too_large,
            traffic,
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

    /// The routable hosts as `narrow` makes them, updated by the cluster's event loop whenever
    /// the cluster's routing changes (the view changes only when the narrowed routing does).
    /// The loop forgets the view once every receiver of it is dropped; when the cluster stops,
    /// the view keeps its last value and `changed()` on it fails.
    pub fn routing_view<F>(&self, narrow: F) -> watch::Receiver<Routing>
    where
        F: Fn(&Routing) -> Routing + Send + 'static,
    {
        let (tx, rx) = watch::channel(narrow(&self.routing.borrow()));
        // A loop that has ended drops the view, as it would have at its end.
        let _ = self.views.send(View {
            tx,
            narrow: Box::new(narrow),
        });
        rx
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
        self.source.drain_on_change()
    }

    /// Every host with its flags, as `/clusters` shows them.
    pub fn host_statuses(&self) -> Vec<HostStatus> {
        self.lock().host_statuses()
    }

    /// The counters of the proxy path's connections to the cluster's hosts.
    pub fn traffic(&self) -> Arc<UpstreamTraffic> {
        self.traffic.clone()
    }

    /// Envoy-named stats: discovery (`update_*`), membership, health checks, outlier detection.
    pub fn stats(&self) -> Vec<(String, u64)> {
        // Discovery stats first; health's membership gauges win where both name one.
        let mut stats: std::collections::BTreeMap<String, u64> =
            self.source.named_stats().into_iter().collect();
        stats.extend(self.lock().stats());
        stats.insert(
            format!("cluster.{}.hosts_refused", self.name),
            self.refused.load(Ordering::Relaxed),
        );
        stats.insert(
            format!("cluster.{}.update_too_large", self.name),
            self.too_large.load(Ordering::Relaxed),
        );
        for (name, value) in self.traffic.named() {
            stats.insert(format!("cluster.{}.{name}", self.name), value);
        }
        for (code, value) in self.traffic.responses.codes() {
            stats.insert(format!("cluster.{}.upstream_rq_{code}", self.name), value);
        }
        stats.into_iter().collect()
    }

    /// Envoy-named histograms of the proxy path's traffic (`cluster.<name>.upstream_cx_connect_ms`,
    /// `cluster.<name>.upstream_rq_time`).
    pub fn histograms(&self) -> Vec<(String, HistogramSnapshot)> {
        self.traffic
            .histograms()
            .into_iter()
            .map(|(name, h)| (format!("cluster.{}.{name}", self.name), h))
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, ClusterHealth> {
        self.health
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the event loop reads: the source's own channel, the cluster's subscription to health
/// events, the data path's passive signals, views to keep, and for zone-aware routing the
/// local cluster's routing.
struct Inputs {
    hosts: watch::Receiver<SourceUpdate>,
    guard: Guarded,
    events: broadcast::Receiver<HealthEvent>,
    passive: mpsc::Receiver<PassiveSignal>,
    views: mpsc::UnboundedReceiver<View>,
    zone: Option<ZoneInput>,
}

/// What a zone-aware cluster routes by: the local cluster's routing (`cluster_manager.
/// local_cluster_name`) and this node's place with the cluster's settings.
pub struct ZoneInput {
    /// The local cluster's routing.
    pub local: watch::Receiver<Routing>,
    /// This node's locality and the cluster's `zone_aware_lb_config`.
    pub settings: crate::lb::zone::ZoneSettings,
}

/// Waits for the local cluster's routing to change; never when there is none (or it is gone).
async fn local_changed(zone: &mut Option<ZoneInput>) {
    let ok = match zone {
        Some(z) => z.local.changed().await.is_ok(),
        None => false,
    };
    if !ok {
        std::future::pending::<()>().await;
    }
}

/// The cluster's host guard, with what it reports to.
struct Guarded {
    guard: HostGuard,
    cluster: String,
    refused: Arc<AtomicU64>,
    /// Host sets skipped because they do not fit the kernel maps (counter).
    too_large: Arc<AtomicU64>,
    /// Per-host counters of hosts no longer discovered are forgotten here.
    traffic: Arc<UpstreamTraffic>,
}

impl Guarded {
    /// `hosts` less what the guard refuses; a change in what is refused is logged. Per-host
    /// counters of hosts left out (and with no open connection) are forgotten. `None`: the set
    /// does not fit the kernel maps, and the cluster keeps its last hosts (counted, logged).
    fn apply(&self, hosts: HostSet) -> Option<HostSet> {
        let (kept, refused) = self.guard.filter(hosts);
        if let Some(why) = self.guard.too_many(kept.len()) {
            self.too_large.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(cluster = %self.cluster, reason = %why, "host set skipped: the cluster's last hosts are kept");
            return None;
        }
        let before = self.refused.swap(refused.len() as u64, Ordering::Relaxed);
        if before != refused.len() as u64 {
            for (addr, why) in &refused {
                tracing::warn!(cluster = %self.cluster, %addr, why, "host refused: not a usable address; the cluster's other hosts are used");
            }
        }
        let discovered: std::collections::HashSet<_> = kept.iter().map(|h| h.addr).collect();
        self.traffic.retain_hosts(|addr| discovered.contains(&addr));
        Some(kept)
    }
}

/// A narrowed view of the cluster's routing ([`Upstream::routing_view`]).
struct View {
    tx: watch::Sender<Routing>,
    narrow: Box<dyn Fn(&Routing) -> Routing + Send>,
}

impl View {
    /// Shows `routing` narrowed; readers wake only when that differs from what they saw.
    fn update(&self, routing: &Routing) {
        let now = (self.narrow)(routing);
        self.tx.send_if_modified(|old| {
            let changed = *old != now;
            *old = now;
            changed
        });
    }
}

/// What the event loop publishes.
struct Outputs {
    routing: watch::Sender<Routing>,
    initialized: watch::Sender<bool>,
}

/// The cluster's event loop. Ends when the source's sender is gone or the manager stops.
async fn run(health: Arc<Mutex<ClusterHealth>>, inputs: Inputs, out: Outputs, sweep: Duration) {
    let Inputs {
        mut hosts,
        guard,
        mut events,
        mut passive,
        views: mut new_views,
        mut zone,
    } = inputs;
    let mut views: Vec<View> = Vec::new();
    let lock = || {
        health
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    let (initial, policy) = {
        let update = hosts.borrow_and_update();
        (guard.apply(update.hosts.clone()), update.policy)
    };
    lock().set_policy(policy);
    lock().update_hosts(initial.unwrap_or_default());
    let mut ticker = tokio::time::interval_at(
        crate::time::after_tokio(tokio::time::Instant::now(), sweep),
        sweep,
    );
    // Whether the last event may have changed the routing: a connect success or a traffic note
    // cannot (ejection needs a failure or the sweep), and the proxy reports one per connection,
    // so for them the routing is neither recomputed nor compared.
    let mut changed = true;
    loop {
        let zoned = zone.as_ref().map(|z| (z, &*guard.traffic));
        if changed && publish(&lock(), &out, hosts.borrow().initialized, zoned) {
            // Views whose readers are all gone are forgotten here and when a view is added.
            views.retain(|view| !view.tx.is_closed());
            for view in &views {
                view.update(&out.routing.borrow());
            }
        }
        changed = true;
        tokio::select! {
            next = hosts.changed() => match next {
                Ok(()) => {
                    let (set, policy) = {
                        let update = hosts.borrow_and_update();
                        (guard.apply(update.hosts.clone()), update.policy)
                    };
                    if let Some(set) = set {
                        let mut health = lock();
                        health.set_policy(policy);
                        health.update_hosts(set);
                    }
                }
                Err(_) => return,
            },
            event = events.recv() => match event {
                Ok(event) => {
                    let mut health = lock();
                    health.on_event(&event);
                    health.pump_events(&mut events);
                }
                Err(broadcast::error::RecvError::Lagged(_)) => lock().resync(),
                Err(broadcast::error::RecvError::Closed) => return,
            },
            Some(signal) = passive.recv() => changed = on_passive(&mut lock(), signal),
            Some(view) = new_views.recv() => {
                // Made from the routing when it was asked for, which may have moved since.
                view.update(&out.routing.borrow());
                views.retain(|view| !view.tx.is_closed());
                views.push(view);
                changed = false;
            }
            _ = ticker.tick() => { lock().outlier_tick(); }
            () = local_changed(&mut zone) => {}
        }
    }
}

/// Sends the routing when it changed, and `initialized` once discovery delivered and no host
/// waits for its first health check. Returns whether the routing changed.
fn publish(
    h: &ClusterHealth,
    out: &Outputs,
    discovered: bool,
    zone: Option<(&ZoneInput, &UpstreamTraffic)>,
) -> bool {
    let mut now = h.routing();
    if let Some((zone, traffic)) = zone {
        let shares = crate::lb::zone::zone_shares(&now, &zone.local.borrow(), &zone.settings);
        let stat = match shares.state {
            crate::lb::zone::ZoneState::TooSmall => Some(&traffic.lb_zone_cluster_too_small),
            crate::lb::zone::ZoneState::LocalClusterNotOk => Some(&traffic.lb_local_cluster_not_ok),
            _ => None,
        };
        if out.routing.borrow().zone.as_ref() != Some(&shares) {
            traffic
                .lb_recalculate_zone_structures
                .fetch_add(1, Ordering::Relaxed);
            if let Some(stat) = stat {
                stat.fetch_add(1, Ordering::Relaxed);
            }
        }
        now.zone = Some(shares);
    }
    let pending = h.host_statuses().iter().any(|s| s.flags.pending_active_hc);
    let changed = out.routing.send_if_modified(|old| {
        let changed = *old != now;
        *old = now;
        changed
    });
    if !*out.initialized.borrow() && discovered && !pending {
        out.initialized.send_replace(true);
    }
    changed
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
        PassiveSignal::Response(addr, status) => {
            h.record_result(addr, crate::health::PassiveResult(status));
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use tokio::time::sleep;

    use super::*;
    use crate::{
        config::{ClusterType, Config},
        health::{
            CheckOutcome, ExtremeRandom, FailureKind,
            tests::support::{Script, ScriptFactory, addr, secs},
        },
        host::Host,
    };

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

    /// A source the test drives: it publishes whatever the test sends.
    struct Scripted(watch::Sender<SourceUpdate>);

    impl DiscoverySource for Scripted {
        fn cluster_name(&self) -> &'static str {
            "c"
        }

        fn updates(&self) -> watch::Receiver<SourceUpdate> {
            self.0.subscribe()
        }

        fn named_stats(&self) -> Vec<(String, u64)> {
            Vec::new()
        }
    }

    fn routable(rx: &watch::Receiver<Routing>) -> Vec<std::net::SocketAddr> {
        rx.borrow().routable().iter().map(|h| h.addr).collect()
    }

    /// `routing` with only the hosts `keep` admits, at every priority.
    fn only(routing: &Routing, keep: &[std::net::SocketAddr]) -> Routing {
        routing.filtered(|h| keep.contains(&h.addr))
    }

    #[tokio::test(start_paused = true)]
    async fn a_view_follows_the_routing_narrowed_and_is_forgotten_when_dropped() {
        let c = cluster("clusters:\n  - name: c\n");
        let mut first = SourceUpdate::default();
        first.advance(vec![Host::new(addr(1)), Host::new(addr(2))]);
        let (hosts, _) = watch::channel(first);
        let up = Upstream::with_source(
            &c,
            &HealthCheckManager::default(),
            Box::new(Scripted(hosts.clone())),
            &HostGuard::default(),
        )
        .unwrap();
        let routing = up.routing();
        // The narrowing function holds `alive`: once the loop forgets the view, it is dropped.
        let alive = Arc::new(());
        let held = Arc::clone(&alive);
        let mut view = up.routing_view(move |r| {
            let _ = &held;
            only(r, &[addr(2), addr(3)])
        });
        sleep(Duration::from_millis(10)).await;
        assert_eq!(routable(&routing), vec![addr(1), addr(2)]);
        assert_eq!(routable(&view), vec![addr(2)], "narrowed");

        view.borrow_and_update();
        hosts.send_modify(|u| u.advance(vec![Host::new(addr(1)), Host::new(addr(3))]));
        sleep(Duration::from_millis(10)).await;
        assert!(view.has_changed().unwrap(), "readers are woken");
        assert_eq!(routable(&routing), vec![addr(1), addr(3)]);
        assert_eq!(routable(&view), vec![addr(3)], "follows the cluster");

        view.borrow_and_update();
        hosts.send_modify(|u| u.advance(vec![Host::new(addr(3)), Host::new(addr(4))]));
        sleep(Duration::from_millis(10)).await;
        assert_eq!(routable(&routing), vec![addr(3), addr(4)]);
        assert!(
            !view.has_changed().unwrap(),
            "the narrowed routing did not change"
        );

        assert_eq!(Arc::strong_count(&alive), 2, "the loop keeps the view");
        drop(view);
        hosts.send_modify(|u| u.advance(vec![Host::new(addr(5))]));
        sleep(Duration::from_millis(10)).await;
        assert_eq!(routable(&routing), vec![addr(5)]);
        assert_eq!(
            Arc::strong_count(&alive),
            1,
            "a view without readers is forgotten"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_loop_wires_discovery_probes_and_passive_signals() {
        let script = Arc::new(Script::default());
        let factory = Arc::new(ScriptFactory(Arc::clone(&script)));
        let mgr = HealthCheckManager::new(factory, Arc::new(ExtremeRandom { max: false }));
        let c = cluster(
            "clusters:\n  - name: c\n    health_checks: [{timeout: 1s, interval: 5s, unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {}}]\n    outlier_detection: {consecutive_5xx: 2, max_ejection_percent: 100}\n    common_lb_config: {healthy_panic_threshold: {value: 0}}\n",
        );
        let mut first = SourceUpdate::default();
        first.advance(vec![Host::new(addr(1)), Host::new(addr(2))]);
        let (hosts, _) = watch::channel(first);
        let source = Box::new(Scripted(hosts.clone()));
        let up = Upstream::with_source(&c, &mgr, source, &HostGuard::default()).unwrap();
        let routing = up.routing();
        let passive = up.passive();
        passive.send(PassiveSignal::Traffic).await.unwrap();
        sleep(Duration::from_millis(10)).await;
        assert_eq!(routable(&routing), vec![addr(1), addr(2)]);
        assert!(
            *up.initialized().borrow(),
            "discovered, and every host checked once"
        );

        // Passive: two connect failures eject host 2 for 30 s; the 10 s sweep (ticks at 10, 20,
        // 30, 40 s from the start) returns it at 40 s, the first tick 30 s after the ejection.
        for _ in 0..2 {
            passive
                .send(PassiveSignal::ConnectFailure(addr(2)))
                .await
                .unwrap();
        }
        sleep(Duration::from_millis(10)).await;
        assert_eq!(routable(&routing), vec![addr(1)]);
        // Active checks keep passing, but only a health *transition* unejects, so it stays out.
        sleep(secs(35)).await;
        assert_eq!(routable(&routing), vec![addr(1)]);
        sleep(secs(6)).await;
        assert_eq!(routable(&routing), vec![addr(1), addr(2)]);

        // Active: host 1 fails; with traffic it is checked every 5 s.
        script.set(addr(1), CheckOutcome::Failed(FailureKind::Network));
        sleep(secs(6)).await;
        assert_eq!(routable(&routing), vec![addr(2)]);

        // Discovery drops host 1 (failed: deleted, probe stopped) and host 2 (healthy: kept).
        hosts.send_modify(|u| u.advance(vec![Host::new(addr(3))]));
        sleep(Duration::from_millis(10)).await;
        assert_eq!(mgr.probe_count(), 2, "probes for 2 (pending removal) and 3");
        sleep(Duration::from_millis(10)).await;
        assert_eq!(routable(&routing), vec![addr(2), addr(3)]);

        drop(up);
        drop(hosts);
        sleep(Duration::from_millis(10)).await;
        assert_eq!(
            mgr.probe_count(),
            0,
            "dropping the cluster stops its probes"
        );
    }

    /// Whatever the source, hosts that are never usable, or the daemon itself, are left out of
    /// the cluster and counted in `hosts_refused`; the rest are routed.
    #[tokio::test]
    async fn refused_hosts_are_left_out_and_counted() {
        let c = cluster("clusters:\n  - name: c\n");
        let own: std::net::SocketAddr = "127.0.0.1:15000".parse().unwrap();
        let mut first = SourceUpdate::default();
        first.advance(vec![
            Host::new(addr(1)),
            Host::new("0.0.0.0:80".parse().unwrap()),
            Host::new(own),
        ]);
        let (hosts, _) = watch::channel(first);
        let up = Upstream::with_source(
            &c,
            &HealthCheckManager::default(),
            Box::new(Scripted(hosts.clone())),
            &HostGuard::new(vec![own]),
        )
        .unwrap();
        let mut routing = up.routing();
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            routing.wait_for(|r| !r.routable().is_empty()),
        )
        .await;
        assert_eq!(routable(&routing), [addr(1)]);
        let refused = up
            .stats()
            .into_iter()
            .find(|(k, _)| k == "cluster.c.hosts_refused")
            .map(|(_, v)| v);
        assert_eq!(refused, Some(2));
    }

    /// Whatever the source (DNS, Consul), a host set larger than the kernel maps take is
    /// skipped: the cluster keeps its last hosts, and `update_too_large` counts the skip.
    #[tokio::test(start_paused = true)]
    async fn a_host_set_too_large_for_the_kernel_maps_is_skipped_and_counted() {
        let yaml = "kernel_maps: { backends: 16 }\nclusters:\n  - name: c\n";
        let config = Config::parse(yaml, Path::new("t.yaml")).expect("valid");
        let set = |n: u8| (1..=n).map(|i| Host::new(addr(i))).collect::<Vec<_>>();
        let mut first = SourceUpdate::default();
        first.advance(set(8));
        let (hosts, _) = watch::channel(first);
        let up = Upstream::with_source(
            &config.clusters[0],
            &HealthCheckManager::default(),
            Box::new(Scripted(hosts.clone())),
            &HostGuard::for_config(&config),
        )
        .unwrap();
        let mut routing = up.routing();
        let eight = routing.wait_for(|r| r.routable().len() == 8).await.is_ok();
        assert!(eight, "8 hosts: half of 16 backends fits");
        let too_large = |up: &Upstream| {
            let mut stats = up.stats().into_iter();
            stats
                .find(|(k, _)| k == "cluster.c.update_too_large")
                .map(|(_, v)| v)
        };
        assert_eq!(too_large(&up), Some(0));
        hosts.send_modify(|u| u.advance(set(9)));
        // Paused time advances only once every task is idle: the loop has taken the update.
        sleep(Duration::from_millis(10)).await;
        assert_eq!(too_large(&up), Some(1), "9 hosts: skipped");
        assert_eq!(
            routable(&routing),
            set(8).iter().map(|h| h.addr).collect::<Vec<_>>()
        );
        hosts.send_modify(|u| u.advance(set(1)));
        let one = routing.wait_for(|r| r.routable().len() == 1).await.is_ok();
        assert!(one, "a set that fits is taken again");
    }
}
