//! A cluster as the proxy sees it: its routable hosts (a watch on the running cluster's
//! routing), a pick per connection or request by its policy ([`pick`]), its HTTP pool, and the
//! per-connection watch that drains or closes connections whose host went away or failed.

mod pick;
#[cfg(test)]
mod tests;

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use proxy_core::{
    health::{DropOverload, PassiveSignal, Routing},
    lb::{self, Balancer},
    upstream::{OpenConnection, Upstream, UpstreamTraffic},
};
use tokio::sync::{mpsc, watch};

use self::pick::{ActiveCounts, Consistent, Rotation};
pub use self::pick::{ActiveLease, random_u64, weighted_pick};
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
    /// The policy the picks follow (the cluster's, or its chain resolver's).
    balancer: Balancer,
    /// RING_HASH and MAGLEV: the ring or table (shared by the handle's clones).
    consistent: Option<Arc<Consistent>>,
    /// A TCP service's `hash_policy` hashes the client's IP address.
    hash_source_ip: bool,
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
            balancer: Balancer::Random,
            consistent: None,
            hash_source_ip: false,
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

    /// The cluster with its own connect timeout and lb policy (with that policy's defaults:
    /// [`with_balancer`](Self::with_balancer) takes its parameters).
    #[must_use]
    pub fn with_policy(
        self,
        connect_timeout: Option<Duration>,
        lb_policy: proxy_core::config::LbPolicy,
    ) -> Self {
        let mut handle = self.with_balancer(Balancer::of_cluster(lb_policy, None, None));
        handle.connect_timeout = connect_timeout;
        handle
    }

    /// The cluster picking by `balancer`: ROUND_ROBIN rotates, LEAST_REQUEST compares open
    /// leases, RING_HASH and MAGLEV hash (Envoy's ring and table), RANDOM picks by weight. The
    /// state is the handle's own (and its clones').
    #[must_use]
    pub fn with_balancer(mut self, balancer: Balancer) -> Self {
        self.balancer = balancer;
        self.rotation = (balancer == Balancer::RoundRobin).then(|| Arc::new(Rotation::default()));
        self.least = matches!(balancer, Balancer::LeastRequest { .. })
            .then(|| Arc::new(ActiveCounts::default()));
        self.consistent = Consistent::new(balancer).map(Arc::new);
        self
    }

    /// The policy the picks follow.
    pub fn balancer(&self) -> Balancer {
        self.balancer
    }

    /// A TCP service whose `hash_policy` hashes the client's IP address
    /// ([`pick_leased_for`](Self::pick_leased_for)).
    #[must_use]
    pub fn with_source_ip_hash(mut self, on: bool) -> Self {
        self.hash_source_ip = on;
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
        let balancer = self.balancer;
        self.with_balancer(balancer)
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
        self.pick_leased_hashed(tried, None)
    }

    /// [`pick_leased`](Self::pick_leased) for a TCP connection from `client`: its IP address
    /// is the hash when the service's `hash_policy` says so (Envoy's tcp_proxy `source_ip`).
    pub fn pick_leased_for(
        &self,
        tried: &[BackendAddr],
        client: &impl std::os::fd::AsFd,
    ) -> Option<(BackendAddr, Option<ActiveLease>)> {
        let hash = self
            .hash_source_ip
            .then(|| socket2::SockRef::from(client).peer_addr().ok()?.as_socket())
            .flatten()
            .map(|peer| lb::xxhash::xxhash64(peer.ip().to_string().as_bytes(), 0));
        self.pick_leased_hashed(tried, hash)
    }

    /// [`pick_leased`](Self::pick_leased) with the request's hash (RING_HASH and MAGLEV; `None`:
    /// the request has none and a random one is taken, as Envoy does).
    pub fn pick_leased_hashed(
        &self,
        tried: &[BackendAddr],
        hash: Option<u64>,
    ) -> Option<(BackendAddr, Option<ActiveLease>)> {
        let host = self.pick_hashed(tried, hash)?;
        let lease = self.least.as_ref().map(|least| {
            *least.lock().entry(host.0).or_default() += 1;
            ActiveLease {
                counts: least.clone(),
                host: host.0,
            }
        });
        Some((host, lease))
    }

    /// The share of requests the host set's `drop_overloads` refuses now.
    pub fn drop_overload(&self) -> DropOverload {
        self.routing.borrow().drop_overload
    }

    /// Whether the cluster has a routable host now (without taking a turn of a rotation).
    pub fn has_routable(&self) -> bool {
        !lb::kernel_levels(&self.routing.borrow()).is_empty()
    }

    /// Picks a host by the handle's policy (priorities and health as the kernel tables see
    /// them), avoiding `tried` when another host is available.
    pub fn pick(&self, tried: &[BackendAddr]) -> Option<BackendAddr> {
        self.pick_hashed(tried, None)
    }

    /// [`pick`](Self::pick) with the request's hash for RING_HASH and MAGLEV (`None`: random).
    pub fn pick_hashed(&self, tried: &[BackendAddr], hash: Option<u64>) -> Option<BackendAddr> {
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
        if let Some(rotation) = &self.rotation {
            return rotation.next(&level, tried).map(BackendAddr);
        }
        if let Some(consistent) = &self.consistent {
            let hash = hash.unwrap_or_else(random_u64);
            return consistent.pick(&level, hash, tried).map(BackendAddr);
        }
        let fresh: Vec<_> = level
            .iter()
            .filter(|(a, _)| !tried.contains(&BackendAddr(*a)))
            .copied()
            .collect();
        let candidates = if fresh.is_empty() { level } else { fresh };
        if let (Some(least), Balancer::LeastRequest { choice_count }) = (&self.least, self.balancer)
        {
            return pick::least_of(&candidates, least, choice_count).map(BackendAddr);
        }
        weighted_pick(&candidates).map(BackendAddr)
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

    /// Reports how an HTTP exchange with `host` ended (a reset before the response as 503, a
    /// request timeout as 504): counted in the cluster's `upstream_rq_<n>xx` and sent to outlier
    /// detection (never blocks).
    pub fn report_response(&self, host: BackendAddr, status: u16) {
        self.traffic.responses.count(status);
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
