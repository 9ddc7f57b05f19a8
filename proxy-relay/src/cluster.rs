//! A cluster as the proxy sees it: its routable hosts (a watch on the running cluster's
//! routing), a weighted pick per connection or request, its HTTP pool, and the per-connection
//! watch that drains or closes connections whose host went away or failed.

use std::{
    cell::Cell,
    hash::{BuildHasher, RandomState},
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use proxy_core::{
    health::{PassiveSignal, Routing},
    lb,
    upstream::{OpenConnection, Upstream, UpstreamTraffic},
};
use tokio::sync::{mpsc, watch};

use crate::{addr::BackendAddr, pool::Pool};

/// Where a host stands in its cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostState {
    /// Receives new connections.
    Routable,
    /// Still discovered, but failed health checking or was ejected.
    Unhealthy,
    /// No longer discovered (removed by STRICT_DNS, EDS, ...).
    Removed,
}

/// The state of `host` in `routing`.
pub fn host_state(routing: &Routing, host: SocketAddr) -> HostState {
    let routable = routing.routable();
    if routable.iter().any(|h| h.addr == host) {
        return HostState::Routable;
    }
    let known = routing.priorities.iter().any(|p| {
        p.all
            .iter()
            .chain(&p.healthy)
            .chain(&p.degraded)
            .any(|h| h.addr == host)
    });
    if known {
        HostState::Unhealthy
    } else {
        HostState::Removed
    }
}

/// What a connection to a host does after a routing change ([`ClusterHandle::verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostVerdict {
    /// Nothing: it goes on (a drain deadline, if one ran, is off).
    Keep,
    /// It closes now (the host failed health checking).
    Close,
    /// It closes when the drain timeout has passed, unless the host comes back.
    Drain,
}

/// Why the proxy closed a connection to a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostClose {
    /// The host was removed and the drain timeout passed.
    Drained,
    /// The host failed health checking (`close_connections_on_host_health_failure`).
    HealthFailure,
}

/// How connections to a cluster's hosts end when the hosts change.
#[derive(Debug, Clone, Copy)]
pub struct DrainPolicy {
    /// Time a removed host's connections get.
    pub drain_timeout: Duration,
    /// Close at once when the host fails health checking.
    pub close_on_health_failure: bool,
}

/// A cluster's hosts, for the proxy.
#[derive(Clone)]
pub struct ClusterHandle {
    name: Arc<str>,
    routing: watch::Receiver<Routing>,
    drain_on_removal: bool,
    passive: Option<mpsc::Sender<PassiveSignal>>,
    pool: Arc<Pool>,
    /// The cluster's own `connect_timeout`, when it has one.
    connect_timeout: Option<Duration>,
    /// ROUND_ROBIN: the rotation every pick takes its turn of (shared by the handle's clones).
    rotation: Option<Arc<Rotation>>,
    /// The cluster's upstream counters (shared by every handle on the running cluster).
    traffic: Arc<UpstreamTraffic>,
    /// LEAST_REQUEST: the proxy's open connections per host (shared by the handle's clones).
    least: Option<Arc<ActiveCounts>>,
    /// The cluster's own `close_connections_on_host_health_failure`, when it has one (else the
    /// proxy's, in [`DrainPolicy`]).
    close_on_health_failure: Option<bool>,
    /// The service's `max_connect_attempts`: connects one TCP connection may make.
    connect_attempts: u32,
}

/// Open connections (or requests) per host, for LEAST_REQUEST.
#[derive(Default)]
struct ActiveCounts(Mutex<std::collections::HashMap<SocketAddr, u64>>);

impl ActiveCounts {
    fn of(&self, host: SocketAddr) -> u64 {
        self.lock().get(&host).copied().unwrap_or(0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<SocketAddr, u64>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A connection's (or request's) place in its host's open count (LEAST_REQUEST), given back
/// when dropped.
pub struct ActiveLease {
    counts: Arc<ActiveCounts>,
    host: SocketAddr,
}

impl Drop for ActiveLease {
    fn drop(&mut self) {
        let mut counts = self.counts.lock();
        if let Some(n) = counts.get_mut(&self.host) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.host);
            }
        }
    }
}

/// ROUND_ROBIN on the proxy path: the kernel's rotation (the same smooth weighted table,
/// [`lb::round_robin_table`]) with one turn counter per cluster handle.
#[derive(Default)]
struct Rotation {
    turn: AtomicU64,
    table: Mutex<RotationTable>,
}

/// A rotation's table and the level (hosts and weights) it was built from.
#[derive(Default)]
struct RotationTable {
    level: Vec<(SocketAddr, u32)>,
    hosts: Vec<SocketAddr>,
}

impl Rotation {
    /// The next host of `level` in turn, skipping `tried` while a fresh one is left.
    fn next(&self, level: &[(SocketAddr, u32)], tried: &[BackendAddr]) -> Option<SocketAddr> {
        let mut cached = self
            .table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cached.level != level {
            let hosts: Vec<lb::SlotHost> = level
                .iter()
                .enumerate()
                .map(|(i, &(addr, weight))| lb::SlotHost {
                    id: i as u32,
                    addr,
                    weight: weight.max(1),
                })
                .collect();
            let table = lb::round_robin_table(&hosts, proxy_common::service::SLOTS)
                .into_iter()
                .map(|id| level[id as usize].0)
                .collect();
            *cached = RotationTable {
                level: level.to_vec(),
                hosts: table,
            };
        }
        let table = &cached.hosts;
        let len = table.len() as u64;
        if len == 0 {
            return None;
        }
        let mut turn = self.turn.fetch_add(1, Ordering::Relaxed);
        for _ in 0..len {
            let host = table[(turn % len) as usize];
            if !tried.contains(&BackendAddr(host)) {
                return Some(host);
            }
            turn = self.turn.fetch_add(1, Ordering::Relaxed);
        }
        Some(table[(turn % len) as usize])
    }
}

impl ClusterHandle {
    /// A cluster whose routing comes from `routing`; `drain_on_removal` is false for
    /// LOGICAL_DNS (its connections are never drained). `pool_idle_timeout` bounds idle pooled
    /// HTTP connections.
    pub fn new(
        name: &str,
        routing: watch::Receiver<Routing>,
        drain_on_removal: bool,
        pool_idle_timeout: Duration,
    ) -> Self {
        Self {
            name: name.into(),
            routing,
            drain_on_removal,
            passive: None,
            pool: Arc::new(Pool::new(pool_idle_timeout)),
            connect_timeout: None,
            rotation: None,
            traffic: Arc::default(),
            least: None,
            close_on_health_failure: None,
            connect_attempts: 1,
        }
    }

    /// The cluster as a service with `max_connect_attempts` sees it: a TCP connection may make
    /// that many connects, each to a host not tried yet while there is one (0 is taken as 1).
    #[must_use]
    pub fn with_connect_attempts(mut self, attempts: u32) -> Self {
        self.connect_attempts = attempts.max(1);
        self
    }

    /// The connects one TCP connection to the cluster may make (1: no retry).
    pub fn connect_attempts(&self) -> u32 {
        self.connect_attempts
    }

    /// The cluster with its own `close_connections_on_host_health_failure` (`None`: the
    /// proxy's).
    #[must_use]
    pub fn with_close_on_health_failure(mut self, close: Option<bool>) -> Self {
        self.close_on_health_failure = close;
        self
    }

    /// The cluster with its own connect timeout and lb policy (`ROUND_ROBIN` rotates; every
    /// other policy picks at random by weight, as the kernel's RANDOM does).
    pub fn with_policy(
        mut self,
        connect_timeout: Option<Duration>,
        lb_policy: proxy_core::config::LbPolicy,
    ) -> Self {
        self.connect_timeout = connect_timeout;
        self.rotation = (lb_policy == proxy_core::config::LbPolicy::RoundRobin)
            .then(|| Arc::new(Rotation::default()));
        self.least = (lb_policy == proxy_core::config::LbPolicy::LeastRequest)
            .then(|| Arc::new(ActiveCounts::default()));
        self
    }

    /// How long a connect to one of the cluster's hosts may take: its own `connect_timeout`,
    /// else `default` (`proxy.connect_timeout`).
    pub fn connect_timeout(&self, default: Duration) -> Duration {
        self.connect_timeout.unwrap_or(default)
    }

    /// The proxy's view of a running cluster: its routing, its drain rule, and, when the cluster
    /// has outlier detection, its passive health channel (connect results feed it).
    pub fn from_upstream(upstream: &Upstream, pool_idle_timeout: Duration) -> Self {
        let mut c = Self::new(
            upstream.name(),
            upstream.routing(),
            upstream.drain_on_removal(),
            pool_idle_timeout,
        );
        // Without outlier detection connect results change nothing: none are sent (one
        // message and one wakeup of the cluster's task per connection saved).
        c.passive = upstream.outlier_detection().then(|| upstream.passive());
        c.traffic = upstream.traffic();
        c
    }

    /// The same cluster seen through another routing, e.g. narrowed to a chain target's
    /// subset: drain rule and passive channel stay the cluster's; it gets its own HTTP pool
    /// (a pool is swept by its handle's routing).
    pub fn with_routing(
        mut self,
        routing: watch::Receiver<Routing>,
        pool_idle_timeout: Duration,
    ) -> Self {
        self.routing = routing;
        self.pool = Arc::new(Pool::new(pool_idle_timeout));
        if self.rotation.is_some() {
            self.rotation = Some(Arc::new(Rotation::default()));
        }
        self
    }

    /// The cluster's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its pooled HTTP connections.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Whether `other` sees the same routing (the same cluster, not narrowed differently).
    pub fn same_routing(&self, other: &Self) -> bool {
        self.routing.same_channel(&other.routing)
    }

    /// A receiver of the routing, for a task that follows its changes.
    pub fn routing_watch(&self) -> watch::Receiver<Routing> {
        self.routing.clone()
    }

    /// Whether connections to a removed host are drained (not for LOGICAL_DNS).
    pub fn drains_on_removal(&self) -> bool {
        self.drain_on_removal
    }

    /// Counts a request that found no routable host in this cluster (or in any of its leg's).
    pub fn count_none_healthy(&self) {
        self.traffic.cx_none_healthy.fetch_add(1, Ordering::Relaxed);
    }

    /// The cluster's upstream counters.
    pub fn traffic(&self) -> &UpstreamTraffic {
        &self.traffic
    }

    /// A TCP connection's connects all failed (`upstream_cx_connect_attempts_exceeded`).
    pub fn count_connect_attempts_exceeded(&self) {
        self.traffic
            .cx_connect_attempts_exceeded
            .fetch_add(1, Ordering::Relaxed);
    }

    /// A connection to `host` opens: counted in the cluster's and the host's
    /// `upstream_cx_active` until the guard is dropped (hold it as long as the socket).
    pub fn open_connection(&self, host: BackendAddr) -> OpenConnection {
        self.traffic.open(host.0)
    }

    /// The cluster with fresh counters held to `limits` (tests: a running cluster's come from
    /// its `circuit_breakers`).
    #[cfg(test)]
    #[must_use]
    pub(crate) fn with_limits(
        mut self,
        limits: proxy_core::config::circuit_breakers::Limits,
    ) -> Self {
        self.traffic = Arc::new(UpstreamTraffic::with_limits(limits));
        self
    }

    /// [`ClusterHandle::open_connection`], unless the cluster has `max_connections` open.
    pub fn try_open_connection(&self, host: BackendAddr) -> Option<OpenConnection> {
        self.traffic.try_open(host.0)
    }

    /// [`ClusterHandle::pick`] for a connection or request that lasts: with LEAST_REQUEST, the
    /// lease counts it in its host's open connections until it is dropped.
    pub fn pick_leased(&self, tried: &[BackendAddr]) -> Option<(BackendAddr, Option<ActiveLease>)> {
        let host = self.pick(tried)?;
        let lease = self.least.as_ref().map(|least| {
            *least.lock().entry(host.0).or_default() += 1;
            ActiveLease {
                counts: least.clone(),
                host: host.0,
            }
        });
        Some((host, lease))
    }

    /// Whether the cluster has a routable host now (without taking a turn of a rotation).
    pub fn has_routable(&self) -> bool {
        !lb::kernel_levels(&self.routing.borrow()).is_empty()
    }

    /// Picks a host by weight (priorities and health as the kernel tables see them), avoiding
    /// `tried` when another host is available.
    pub fn pick(&self, tried: &[BackendAddr]) -> Option<BackendAddr> {
        let routing = self.routing.borrow().clone();
        let Some(level) = lb::kernel_levels(&routing).into_iter().next() else {
            self.traffic.cx_none_healthy.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        if routing.in_panic() {
            self.traffic
                .lb_healthy_panic
                .fetch_add(1, Ordering::Relaxed);
        }
        let fresh: Vec<_> = level
            .iter()
            .filter(|(a, _)| !tried.contains(&BackendAddr(*a)))
            .copied()
            .collect();
        if let Some(rotation) = &self.rotation {
            return rotation.next(&level, tried).map(BackendAddr);
        }
        let candidates = if fresh.is_empty() { level } else { fresh };
        let first = weighted_pick(&candidates)?;
        if let Some(least) = &self.least {
            // The power of two choices, drawn with replacement as Envoy's: the first on a tie.
            let second = weighted_pick(&candidates)?;
            if least.of(second) < least.of(first) {
                return Some(BackendAddr(second));
            }
        }
        Some(BackendAddr(first))
    }

    /// The host's state now.
    pub fn host_state(&self, host: BackendAddr) -> HostState {
        host_state(&self.routing.borrow(), host.0)
    }

    /// Reports a connect result: counted in the cluster's upstream counters and sent to its
    /// outlier detection (never blocks).
    pub fn report_connect(&self, host: BackendAddr, ok: bool) {
        self.traffic.connect_result(host.0, ok);
        if let Some(tx) = &self.passive {
            let signal = if ok {
                PassiveSignal::ConnectSuccess(host.0)
            } else {
                PassiveSignal::ConnectFailure(host.0)
            };
            let _ = tx.try_send(signal);
        }
    }

    /// Reports the connect of an HTTP exchange: counted like
    /// [`report_connect`](Self::report_connect), but only a failure goes to outlier detection;
    /// the exchange's response is its success or failure
    /// ([`report_response`](Self::report_response)), as in Envoy's router.
    pub fn report_http_connect(&self, host: BackendAddr, ok: bool) {
        self.traffic.connect_result(host.0, ok);
        if ok {
            return;
        }
        if let Some(tx) = &self.passive {
            let _ = tx.try_send(PassiveSignal::ConnectFailure(host.0));
        }
    }

    /// Reports how an HTTP exchange with `host` ended (a reset before the response as 503) to
    /// outlier detection (never blocks).
    pub fn report_response(&self, host: BackendAddr, status: u16) {
        if let Some(tx) = &self.passive {
            let _ = tx.try_send(PassiveSignal::Response(host.0, status));
        }
    }

    /// Drops pooled connections of hosts that are no longer routable, and expired ones.
    pub fn sweep_pool(&self) {
        let routing = self.routing.borrow().clone();
        self.pool
            .retain(|h| host_state(&routing, h.0) == HostState::Routable);
        self.pool.expire_idle();
    }

    /// What a connection to a host in `state` does under `policy`: the one rule both TCP
    /// drivers apply when the routing changes.
    pub(crate) fn verdict(&self, state: HostState, policy: DrainPolicy) -> HostVerdict {
        match state {
            HostState::Unhealthy
                if self
                    .close_on_health_failure
                    .unwrap_or(policy.close_on_health_failure) =>
            {
                HostVerdict::Close
            }
            HostState::Removed if self.drain_on_removal => HostVerdict::Drain,
            _ => HostVerdict::Keep,
        }
    }

    /// Resolves when a connection to `host` must close: `drain_timeout` after the host was
    /// removed (never for LOGICAL_DNS), or as soon as it is unhealthy when the policy says so.
    /// A host that comes back before the deadline cancels the drain.
    pub async fn host_closed(&self, host: BackendAddr, policy: DrainPolicy) -> HostClose {
        let mut routing = self.routing.clone();
        loop {
            let state = host_state(&routing.borrow_and_update(), host.0);
            match self.verdict(state, policy) {
                HostVerdict::Close => return HostClose::HealthFailure,
                HostVerdict::Drain => {
                    let deadline = tokio::time::sleep(policy.drain_timeout);
                    tokio::pin!(deadline);
                    loop {
                        tokio::select! {
                            () = &mut deadline => return HostClose::Drained,
                            changed = routing.changed() => {
                                if changed.is_err() {
                                    // The cluster is gone: nothing will bring the host back.
                                    deadline.as_mut().await;
                                    return HostClose::Drained;
                                }
                                if host_state(&routing.borrow_and_update(), host.0) != HostState::Removed {
                                    break;
                                }
                            }
                        }
                    }
                    continue;
                }
                HostVerdict::Keep => {}
            }
            if routing.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// A weighted random choice.
pub fn weighted_pick(hosts: &[(SocketAddr, u32)]) -> Option<SocketAddr> {
    let total: u64 = hosts.iter().map(|(_, w)| u64::from((*w).max(1))).sum();
    if total == 0 {
        return None;
    }
    let mut r = random_u64() % total;
    for (addr, w) in hosts {
        let w = u64::from((*w).max(1));
        if r < w {
            return Some(*addr);
        }
        r -= w;
    }
    hosts.last().map(|(a, _)| *a)
}

/// A fast per-thread pseudo-random number (xorshift64*), seeded from the std hasher's keys.
pub fn random_u64() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(RandomState::new().hash_one(0x5eed_u64) | 1);
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

#[cfg(test)]
mod tests {
    use proxy_core::{
        health::{HostClass, Routing},
        host::Host,
    };

    use super::*;

    fn routing(hosts: &[(&str, HostClass)]) -> Routing {
        let hosts: Vec<(Host, HostClass)> = hosts
            .iter()
            .map(|(a, c)| (Host::new(a.parse().unwrap()), *c))
            .collect();
        Routing::compute(&hosts, 50.0)
    }

    fn addr(s: &str) -> BackendAddr {
        BackendAddr(s.parse().unwrap())
    }

    const POLICY: DrainPolicy = DrainPolicy {
        drain_timeout: Duration::from_secs(10),
        close_on_health_failure: false,
    };

    #[test]
    fn states() {
        let r = routing(&[
            ("127.0.0.1:1", HostClass::Healthy),
            ("127.0.0.2:1", HostClass::Healthy),
            ("127.0.0.3:1", HostClass::Unhealthy),
        ]);
        assert_eq!(
            host_state(&r, "127.0.0.1:1".parse().unwrap()),
            HostState::Routable
        );
        assert_eq!(
            host_state(&r, "127.0.0.3:1".parse().unwrap()),
            HostState::Unhealthy
        );
        assert_eq!(
            host_state(&r, "127.0.0.9:1".parse().unwrap()),
            HostState::Removed
        );
    }

    #[test]
    fn pick_follows_weights_and_avoids_tried() {
        let hosts = [
            ("127.0.0.1:1".parse().unwrap(), 3),
            ("127.0.0.2:1".parse().unwrap(), 1),
        ];
        let n = 4000;
        let first = (0..n)
            .filter(|_| weighted_pick(&hosts) == Some(hosts[0].0))
            .count();
        // Expect 3000; 5 sigma of a binomial(4000, 0.75) is about 137.
        assert!((2860..3140).contains(&first), "{first}");
        let (_tx, rx) = watch::channel(routing(&[
            ("127.0.0.1:1", HostClass::Healthy),
            ("127.0.0.2:1", HostClass::Healthy),
        ]));
        let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
        for _ in 0..50 {
            assert_eq!(c.pick(&[addr("127.0.0.1:1")]), Some(addr("127.0.0.2:1")));
        }
        // Every host tried: pick among all again.
        assert!(
            c.pick(&[addr("127.0.0.1:1"), addr("127.0.0.2:1")])
                .is_some()
        );
    }

    #[test]
    fn round_robin_rotates_exactly_and_follows_the_hosts() {
        use proxy_core::config::LbPolicy;
        let (tx, rx) = watch::channel(routing(&[
            ("127.0.0.1:1", HostClass::Healthy),
            ("127.0.0.2:1", HostClass::Healthy),
            ("127.0.0.3:1", HostClass::Healthy),
        ]));
        let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1))
            .with_policy(Some(Duration::from_millis(250)), LbPolicy::RoundRobin);
        assert_eq!(
            c.connect_timeout(Duration::from_secs(5)),
            Duration::from_millis(250)
        );
        // Clones share the rotation (the engine's threads each hold one).
        let d = c.clone();
        let picks: Vec<_> = (0..9)
            .map(|i| if i % 2 == 0 { &c } else { &d }.pick(&[]).unwrap())
            .collect();
        for host in ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"] {
            assert_eq!(picks.iter().filter(|&&p| p == addr(host)).count(), 3);
        }
        // Three in a row are three different hosts.
        for w in picks.windows(3) {
            assert!(w[0] != w[1] && w[1] != w[2] && w[0] != w[2], "{picks:?}");
        }
        // A retry skips the host it tried, and the checks before a pick take no turn.
        assert!(c.has_routable());
        let next = c.pick(&[]).unwrap();
        assert_ne!(c.pick(&[next]), Some(next));
        // The rotation follows the hosts.
        tx.send_replace(routing(&[("127.0.0.9:1", HostClass::Healthy)]));
        assert_eq!(c.pick(&[]), Some(addr("127.0.0.9:1")));
        // Without its own timeout a cluster takes the proxy's; RANDOM does not rotate.
        let (_tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
        let r = ClusterHandle::new("r", rx, true, Duration::from_secs(1))
            .with_policy(None, LbPolicy::Random);
        assert_eq!(
            r.connect_timeout(Duration::from_secs(5)),
            Duration::from_secs(5)
        );
        assert!(r.rotation.is_none());
    }

    #[test]
    fn least_request_prefers_the_host_with_fewer_open_leases() {
        use proxy_core::config::LbPolicy;
        let (_tx, rx) = watch::channel(routing(&[
            ("127.0.0.1:1", HostClass::Healthy),
            ("127.0.0.2:1", HostClass::Healthy),
        ]));
        let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1))
            .with_policy(None, LbPolicy::LeastRequest);
        // A hundred leases held on host 1 (taken until one lands there).
        let mut held = Vec::new();
        while held.len() < 100 {
            let (host, lease) = c.pick_leased(&[]).unwrap();
            if host == addr("127.0.0.1:1") {
                held.push(lease.expect("LEAST_REQUEST leases"));
            }
        }
        // Host 1 is chosen only when both draws fall on it: about a quarter.
        let n = 4000;
        let on_loaded = (0..n)
            .filter(|_| c.pick_leased(&[]).unwrap().0 == addr("127.0.0.1:1"))
            .count();
        // Expect 1000; 5 sigma of binomial(4000, 1/4) is about 137.
        assert!((860..1140).contains(&on_loaded), "{on_loaded}");
        // Given back: the counts are even again, and host 1 gets about half.
        drop(held);
        let on_first = (0..n)
            .filter(|_| c.pick(&[]).unwrap() == addr("127.0.0.1:1"))
            .count();
        assert!((1840..2160).contains(&on_first), "{on_first}");
        // Other policies hand out no lease.
        let (_tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
        let r = ClusterHandle::new("r", rx, true, Duration::from_secs(1));
        assert!(r.pick_leased(&[]).unwrap().1.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn removed_host_drains_until_the_deadline() {
        let (tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
        let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
        let start = tokio::time::Instant::now();
        let closed = tokio::spawn({
            let c = c.clone();
            async move { c.host_closed(addr("127.0.0.1:1"), POLICY).await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        tx.send_replace(routing(&[("127.0.0.2:1", HostClass::Healthy)]));
        assert_eq!(closed.await.unwrap(), HostClose::Drained);
        assert_eq!(start.elapsed(), Duration::from_secs(13));
        // New picks go elsewhere at once.
        assert_eq!(c.pick(&[]), Some(addr("127.0.0.2:1")));
    }

    #[tokio::test(start_paused = true)]
    async fn host_back_before_the_deadline_cancels_the_drain() {
        let (tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
        let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
        let closed = tokio::spawn({
            let c = c.clone();
            async move { c.host_closed(addr("127.0.0.1:1"), POLICY).await }
        });
        tx.send_replace(routing(&[]));
        tokio::time::sleep(Duration::from_secs(5)).await;
        tx.send_replace(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!closed.is_finished());
        closed.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn logical_dns_never_drains_and_health_failure_closes_when_configured() {
        let (tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
        let logical = ClusterHandle::new("l", rx.clone(), false, Duration::from_secs(1));
        let never =
            tokio::spawn(async move { logical.host_closed(addr("127.0.0.1:1"), POLICY).await });
        let strict = ClusterHandle::new("s", rx, true, Duration::from_secs(1));
        let policy = DrainPolicy {
            close_on_health_failure: true,
            ..POLICY
        };
        let health =
            tokio::spawn(async move { strict.host_closed(addr("127.0.0.1:1"), policy).await });
        tokio::time::sleep(Duration::from_millis(1)).await;
        tx.send_replace(routing(&[
            ("127.0.0.1:1", HostClass::Unhealthy),
            ("127.0.0.2:1", HostClass::Healthy),
            ("127.0.0.3:1", HostClass::Healthy),
        ]));
        assert_eq!(health.await.unwrap(), HostClose::HealthFailure);
        tx.send_replace(routing(&[]));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!never.is_finished());
        never.abort();
    }

    /// A cluster's own `close_connections_on_host_health_failure` wins over the proxy's, both
    /// ways; unset, the proxy's applies.
    #[test]
    fn the_clusters_close_on_health_failure_wins_over_the_proxys() {
        let (_tx, rx) = watch::channel(routing(&[]));
        let c = |own| {
            ClusterHandle::new("c", rx.clone(), true, Duration::from_secs(1))
                .with_close_on_health_failure(own)
        };
        let proxy = |close| DrainPolicy {
            close_on_health_failure: close,
            ..POLICY
        };
        let verdict = |own, close| c(own).verdict(HostState::Unhealthy, proxy(close));
        assert_eq!(verdict(None, false), HostVerdict::Keep);
        assert_eq!(verdict(None, true), HostVerdict::Close);
        assert_eq!(verdict(Some(true), false), HostVerdict::Close);
        assert_eq!(verdict(Some(false), true), HostVerdict::Keep);
        // A healthy host is kept whatever the setting.
        assert_eq!(
            c(Some(true)).verdict(HostState::Routable, proxy(true)),
            HostVerdict::Keep
        );
    }

    fn upstream(outlier_detection: &str) -> proxy_core::upstream::Upstream {
        let yaml = format!(
            "clusters:\n  - name: c\n{outlier_detection}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 1 }} }} }}\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.2, port_value: 1 }} }} }}\n"
        );
        let config = proxy_core::config::Config::parse(&yaml, std::path::Path::new("t.yaml"))
            .expect("valid config");
        let manager = proxy_core::health::HealthCheckManager::default();
        proxy_core::upstream::Upstream::spawn(&config.clusters[0], &manager).expect("spawns")
    }

    #[tokio::test]
    async fn connect_failures_eject_through_outlier_detection() {
        // Two hosts: ejecting one is 50 % of the cluster, which the cap must allow.
        let up = upstream(
            "    outlier_detection: { consecutive_5xx: 2, interval: 0.1s, max_ejection_percent: 50 }\n",
        );
        up.initialized().wait_for(|i| *i).await.unwrap();
        let c = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
        let bad = addr("127.0.0.2:1");
        c.report_connect(bad, false);
        c.report_connect(bad, false);
        let mut routing = up.routing();
        tokio::time::timeout(
            Duration::from_secs(5),
            routing.wait_for(|r| r.routable().iter().all(|h| h.addr != bad.0)),
        )
        .await
        .expect("the failing host is ejected")
        .unwrap();
        for _ in 0..20 {
            assert_eq!(c.pick(&[]), Some(addr("127.0.0.1:1")));
        }
    }

    /// HTTP exchanges are judged by their status: two 5xx in a row eject even with a successful
    /// connect between them (a connect of an HTTP exchange reports only its failure).
    #[tokio::test]
    async fn http_5xx_responses_eject_and_connect_successes_do_not_reset_the_run() {
        let up = upstream(
            "    outlier_detection: { consecutive_5xx: 2, interval: 0.1s, max_ejection_percent: 50 }\n",
        );
        up.initialized().wait_for(|i| *i).await.unwrap();
        let c = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
        let bad = addr("127.0.0.2:1");
        c.report_response(bad, 500);
        c.report_http_connect(bad, true);
        c.report_response(bad, 502);
        // The connect is counted like any other, for the cluster and the host.
        let counted = up.traffic().host(bad.0);
        assert_eq!((counted.cx_total, counted.cx_connect_fail), (1, 0));
        let mut routing = up.routing();
        tokio::time::timeout(
            Duration::from_secs(5),
            routing.wait_for(|r| r.routable().iter().all(|h| h.addr != bad.0)),
        )
        .await
        .expect("the host answering 5xx is ejected")
        .unwrap();
        // A 2xx between two 5xx ends the run: the other host stays.
        let good = addr("127.0.0.1:1");
        c.report_response(good, 500);
        c.report_response(good, 200);
        c.report_response(good, 500);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            up.routing()
                .borrow()
                .routable()
                .iter()
                .any(|h| h.addr == good.0)
        );
    }

    #[tokio::test]
    async fn without_outlier_detection_nothing_is_reported() {
        let up = upstream("");
        up.initialized().wait_for(|i| *i).await.unwrap();
        let c = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
        assert!(
            c.passive.is_none(),
            "no channel: connect results change nothing"
        );
        // Reporting is then a no-op, and both hosts stay routable.
        c.report_connect(addr("127.0.0.2:1"), false);
        c.report_connect(addr("127.0.0.2:1"), false);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(up.routing().borrow().routable().len(), 2);
    }
}
