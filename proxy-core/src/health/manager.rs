//! Node-wide probe registry: one probe per distinct (address, effective check), shared by every
//! cluster that contains the host (Envoy runs one per cluster and host, envoy#10498).
//!
//! Clusters [`register`](HealthCheckManager::register) a host and get a [`ProbeId`] plus the
//! probe's current health; they [`subscribe`](HealthCheckManager::subscribe) to
//! [`HealthEvent`]s, published whenever a probe's [`HostHealth`] changes. A probe is refcounted
//! per cluster and its task is aborted when the last cluster unregisters. "Effective check"
//! means after defaults: an HTTP check without `host` sends the cluster name, so two clusters
//! share an HTTP probe only when they send the same `Host` (set `host` explicitly to share).
//! Every check a shared probe runs is counted in the `health_check.*` stats of each cluster
//! using it, as if each had run it.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use tokio::{sync::broadcast, task::JoinHandle};
use tracing::{Instrument, info, info_span};

use super::{
    checker::{Checker, CheckerFactory, NetworkCheckers},
    random::{Random, SeededRandom},
    spec::HealthCheckSpec,
    state::{
        CheckOutcome, FailureKind, HealthState, HostHealth, Transition, base_interval,
        initial_delay, with_jitter,
    },
    stats::HealthCheckStats,
};

/// Capacity of the transition broadcast; a receiver that lags resynchronises with
/// [`HealthCheckManager::health`].
const EVENT_CAPACITY: usize = 1024;

/// Identifies one shared probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProbeId(u64);

/// A probe's health changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthEvent {
    /// The probe.
    pub probe: ProbeId,
    /// The probed address.
    pub addr: SocketAddr,
    /// The new health.
    pub health: HostHealth,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ProbeKey {
    addr: SocketAddr,
    spec: Arc<HealthCheckSpec>,
}

/// State a probe task shares with the registry.
#[derive(Debug, Default)]
struct ProbeShared {
    health: Mutex<HostHealth>,
    had_traffic: AtomicBool,
    /// The stats of each cluster instance using the probe, with its registrations: a cluster
    /// replaced by a reload registers its new instance before the old one goes, and each counts
    /// into its own stats.
    stats: Mutex<Vec<StatsUser>>,
}

#[derive(Debug)]
struct StatsUser {
    stats: Arc<HealthCheckStats>,
    uses: usize,
}

struct Probe {
    id: ProbeId,
    /// Cluster name -> registrations from that cluster.
    users: HashMap<String, usize>,
    shared: Arc<ProbeShared>,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct Registry {
    probes: HashMap<ProbeKey, Probe>,
    keys: HashMap<ProbeId, ProbeKey>,
    clusters_with_traffic: HashSet<String>,
}

struct Inner {
    registry: Mutex<Registry>,
    events: broadcast::Sender<HealthEvent>,
    factory: Arc<dyn CheckerFactory>,
    random: Arc<dyn Random>,
    next_id: AtomicU64,
}

/// The node's probe registry. Cheap to clone; all clones share the probes.
#[derive(Clone)]
pub struct HealthCheckManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HealthCheckManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthCheckManager")
            .field("probes", &self.probe_count())
            .finish()
    }
}

impl Default for HealthCheckManager {
    fn default() -> Self {
        Self::new(
            Arc::new(NetworkCheckers),
            Arc::new(SeededRandom::from_entropy()),
        )
    }
}

impl HealthCheckManager {
    /// A manager building checkers with `factory` and drawing jitter from `random`.
    pub fn new(factory: Arc<dyn CheckerFactory>, random: Arc<dyn Random>) -> Self {
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let inner = Inner {
            registry: Mutex::default(),
            events,
            factory,
            random,
            next_id: AtomicU64::new(1),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Transitions of every probe; filter by the [`ProbeId`]s you registered.
    pub fn subscribe(&self) -> broadcast::Receiver<HealthEvent> {
        self.inner.events.subscribe()
    }

    /// Adds `cluster` as a user of the probe for (`addr`, `spec`), starting it if new. Must be
    /// called inside a tokio runtime. Returns the probe and its current health.
    pub fn register(
        &self,
        cluster: &str,
        addr: SocketAddr,
        spec: &Arc<HealthCheckSpec>,
        stats: &Arc<HealthCheckStats>,
    ) -> (ProbeId, HostHealth) {
        let key = ProbeKey {
            addr,
            spec: Arc::clone(spec),
        };
        let mut guard = self.registry();
        let reg = &mut *guard;
        let traffic = reg.clusters_with_traffic.contains(cluster);
        if !reg.probes.contains_key(&key) {
            let probe = self.start_probe(&key, traffic);
            reg.keys.insert(probe.id, key.clone());
            reg.probes.insert(key.clone(), probe);
        }
        let probe = reg.probes.get_mut(&key).expect("inserted above");
        let uses = probe.users.entry(cluster.to_owned()).or_default();
        *uses += 1;
        if *uses == 1 && traffic {
            probe.shared.had_traffic.store(true, Ordering::Relaxed);
        }
        let mut users = lock(&probe.shared.stats);
        match users.iter_mut().find(|u| Arc::ptr_eq(&u.stats, stats)) {
            Some(user) => user.uses += 1,
            None => users.push(StatsUser {
                stats: Arc::clone(stats),
                uses: 1,
            }),
        }
        drop(users);
        (probe.id, *lock(&probe.shared.health))
    }

    /// Drops one registration of `cluster` (counting into `stats`) on `probe`; the probe stops
    /// with its last user.
    pub fn unregister(&self, cluster: &str, probe: ProbeId, stats: &Arc<HealthCheckStats>) {
        let mut reg = self.registry();
        let Some(key) = reg.keys.get(&probe).cloned() else {
            return;
        };
        let Some(entry) = reg.probes.get_mut(&key) else {
            return;
        };
        if let Some(uses) = entry.users.get_mut(cluster) {
            *uses -= 1;
            if *uses == 0 {
                entry.users.remove(cluster);
            }
        }
        let mut users = lock(&entry.shared.stats);
        if let Some(i) = users.iter().position(|u| Arc::ptr_eq(&u.stats, stats)) {
            users[i].uses -= 1;
            if users[i].uses == 0 {
                users.swap_remove(i);
            }
        }
        drop(users);
        if entry.users.is_empty() {
            entry.task.abort();
            reg.probes.remove(&key);
            reg.keys.remove(&probe);
            info!(addr = %key.addr, "health probe stopped: no cluster uses it");
        }
    }

    /// Records that `cluster` has carried traffic: its probes leave `no_traffic_interval`.
    pub fn note_traffic(&self, cluster: &str) {
        let mut reg = self.registry();
        if !reg.clusters_with_traffic.insert(cluster.to_owned()) {
            return;
        }
        for probe in reg
            .probes
            .values()
            .filter(|p| p.users.contains_key(cluster))
        {
            probe.shared.had_traffic.store(true, Ordering::Relaxed);
        }
    }

    /// Current health of a probe.
    pub fn health(&self, probe: ProbeId) -> Option<HostHealth> {
        let reg = self.registry();
        let key = reg.keys.get(&probe)?;
        reg.probes.get(key).map(|p| *lock(&p.shared.health))
    }

    /// Number of running probes.
    pub fn probe_count(&self) -> usize {
        self.registry().probes.len()
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        lock(&self.inner.registry)
    }

    fn start_probe(&self, key: &ProbeKey, had_traffic: bool) -> Probe {
        let id = ProbeId(self.inner.next_id.fetch_add(1, Ordering::Relaxed));
        let shared = Arc::new(ProbeShared {
            health: Mutex::new(HostHealth::new_host()),
            had_traffic: AtomicBool::new(had_traffic),
            stats: Mutex::default(),
        });
        let run = ProbeRun {
            id,
            addr: key.addr,
            spec: Arc::clone(&key.spec),
            checker: self.inner.factory.build(&key.spec),
            shared: Arc::clone(&shared),
            events: self.inner.events.clone(),
            random: Arc::clone(&self.inner.random),
        };
        let span = info_span!("health_probe", addr = %key.addr, probe = id.0);
        let task = tokio::spawn(run.run().instrument(span));
        Probe {
            id,
            users: HashMap::new(),
            shared,
            task,
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let reg = lock(&self.registry);
        for probe in reg.probes.values() {
            probe.task.abort();
        }
    }
}

/// Everything one probe task owns.
struct ProbeRun {
    id: ProbeId,
    addr: SocketAddr,
    spec: Arc<HealthCheckSpec>,
    checker: Arc<dyn Checker>,
    shared: Arc<ProbeShared>,
    events: broadcast::Sender<HealthEvent>,
    random: Arc<dyn Random>,
}

impl ProbeRun {
    async fn run(self) {
        let delay = initial_delay(&self.spec, &*self.random);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let mut state = HealthState::default();
        loop {
            self.each_stats(|s| {
                s.attempt.fetch_add(1, Ordering::Relaxed);
            });
            let outcome = tokio::time::timeout(self.spec.timeout, self.checker.check(self.addr))
                .await
                .unwrap_or(CheckOutcome::Failed(FailureKind::Timeout));
            self.each_stats(|s| s.record(outcome));
            let transition = state.apply(outcome, &self.spec);
            if transition == Transition::Changed {
                self.publish(state.health());
            }
            let succeeded = !matches!(outcome, CheckOutcome::Failed(_));
            let traffic = self.shared.had_traffic.load(Ordering::Relaxed);
            let base = base_interval(&self.spec, traffic, succeeded, transition);
            tokio::time::sleep(with_jitter(base, &self.spec, &*self.random)).await;
        }
    }

    fn publish(&self, health: HostHealth) {
        *lock(&self.shared.health) = health;
        info!(
            failed = health.failed,
            degraded = health.degraded,
            "host health changed"
        );
        // No receiver is fine: clusters that join later read the current health on register.
        let _ = self.events.send(HealthEvent {
            probe: self.id,
            addr: self.addr,
            health,
        });
    }

    fn each_stats(&self, f: impl Fn(&HealthCheckStats)) {
        for user in lock(&self.shared.stats).iter() {
            f(&user.stats);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
