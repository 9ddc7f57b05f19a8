//! Envoy's per-cluster and per-host upstream counters for the connections the daemon's proxy
//! makes to a cluster's hosts. The kernel path's connections are the application's own; the
//! admin adds them from the kernel's per-service counters under the cluster names, and has no
//! per-host or active-connection figures for them.
//!
//! `upstream_cx_active` is a gauge held by [`OpenConnection`] guards: one exists per open
//! upstream connection and gives its count back when dropped, so no path can forget to.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use super::{
    breakers::Breakers,
    histogram::{Histogram, HistogramSnapshot, Responses},
};
use crate::config::circuit_breakers::Limits;

/// A cluster's upstream counters (cluster-wide and per host).
#[derive(Debug, Default)]
pub struct UpstreamTraffic {
    /// Connects started to a host (`upstream_cx_total`).
    pub cx_total: AtomicU64,
    /// Connects that failed or timed out (`upstream_cx_connect_fail`).
    pub cx_connect_fail: AtomicU64,
    /// Connections whose connects all failed, `max_connect_attempts` of them, before the client
    /// was reset (`upstream_cx_connect_attempts_exceeded`).
    pub cx_connect_attempts_exceeded: AtomicU64,
    /// Choices that found no routable host (`upstream_cx_none_healthy`).
    pub cx_none_healthy: AtomicU64,
    /// HTTP requests refused by the host set's `drop_overloads` (`upstream_rq_drop_overload`,
    /// which Envoy keeps for its load reports).
    pub rq_drop_overload: AtomicU64,
    /// Choices made in panic mode (`lb_healthy_panic`).
    pub lb_healthy_panic: AtomicU64,
    /// Zone-aware routing recomputed (`lb_recalculate_zone_structures`).
    pub lb_recalculate_zone_structures: AtomicU64,
    /// Recomputations that found too few healthy hosts (`lb_zone_cluster_too_small`).
    pub lb_zone_cluster_too_small: AtomicU64,
    /// Recomputations that found the local cluster unusable: no host in this node's locality,
    /// or in panic (`lb_local_cluster_not_ok`).
    pub lb_local_cluster_not_ok: AtomicU64,
    /// Time from a connect's start to its success (`upstream_cx_connect_ms`).
    pub cx_connect_ms: Histogram,
    /// HTTP responses by class, and the request time (`upstream_rq_<n>xx`, `upstream_rq_time`).
    pub responses: Responses,
    /// Upstream connections open now (`upstream_cx_active`); moved only by [`OpenConnection`].
    cx_active: AtomicU64,
    /// Per host, by address (Envoy's `host_statuses[].stats`).
    hosts: Mutex<HashMap<SocketAddr, HostTraffic>>,
    /// The cluster's circuit breakers (`max_connections` bounds `cx_active`).
    breakers: Arc<Breakers>,
}

/// One host's counters, as `/clusters` shows them (`cx_total`, `cx_connect_fail`, `cx_active`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HostTraffic {
    /// Connects started to the host.
    pub cx_total: u64,
    /// Connects to it that failed or timed out.
    pub cx_connect_fail: u64,
    /// Connections to it open now (gauge).
    pub cx_active: u64,
}

/// An open upstream connection of a cluster: counted in `upstream_cx_active` (the cluster's
/// and its host's) from [`UpstreamTraffic::open`] until dropped.
#[derive(Debug)]
pub struct OpenConnection {
    traffic: Arc<UpstreamTraffic>,
    host: SocketAddr,
    /// When the connect started.
    opened: Instant,
}

impl OpenConnection {
    /// The connect succeeded: its time since the guard was taken goes to
    /// `upstream_cx_connect_ms`. Call once, when the connect completes.
    pub fn connected(&self) {
        self.traffic.cx_connect_ms.record(self.opened.elapsed());
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.traffic.cx_active.fetch_sub(1, Ordering::Relaxed);
        if let Some(host) = self.traffic.lock_hosts().get_mut(&self.host) {
            host.cx_active = host.cx_active.saturating_sub(1);
        }
        self.traffic.breakers.wake();
    }
}

impl UpstreamTraffic {
    /// A cluster's counters, its connections and requests held to `limits`.
    pub fn with_limits(limits: Limits) -> Self {
        Self::with_breakers(Breakers::new(limits))
    }

    /// Fresh counters held to `breakers`.
    pub fn with_breakers(breakers: Breakers) -> Self {
        Self {
            breakers: Arc::new(breakers),
            ..Self::default()
        }
    }

    /// The cluster's circuit breakers.
    pub fn breakers(&self) -> &Arc<Breakers> {
        &self.breakers
    }

    /// A connection to `host` opens, as [`UpstreamTraffic::open`], unless the cluster has
    /// `max_connections` open already (`None`; the caller counts `upstream_cx_overflow`).
    pub fn try_open(self: &Arc<Self>, host: SocketAddr) -> Option<OpenConnection> {
        let max = self.breakers.limits().max_connections;
        self.cx_active
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(self.opened(host))
    }

    /// Counts a connect result for `host`, in the cluster's and the host's counters.
    pub fn connect_result(&self, host: SocketAddr, ok: bool) {
        self.cx_total.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.cx_connect_fail.fetch_add(1, Ordering::Relaxed);
        }
        let mut hosts = self.lock_hosts();
        let counts = hosts.entry(host).or_default();
        counts.cx_total += 1;
        counts.cx_connect_fail += u64::from(!ok);
    }

    /// A connection to `host` opens (its connect is starting): counted as active until the
    /// returned guard is dropped.
    pub fn open(self: &Arc<Self>, host: SocketAddr) -> OpenConnection {
        self.cx_active.fetch_add(1, Ordering::Relaxed);
        self.opened(host)
    }

    /// The guard of a connection counted in `cx_active`, counted for its host.
    fn opened(self: &Arc<Self>, host: SocketAddr) -> OpenConnection {
        self.lock_hosts().entry(host).or_default().cx_active += 1;
        OpenConnection {
            traffic: self.clone(),
            host,
            opened: Instant::now(),
        }
    }

    /// Upstream connections open now.
    pub fn cx_active(&self) -> u64 {
        self.cx_active.load(Ordering::Relaxed)
    }

    /// `host`'s counters (all zero for a host the proxy never connected to).
    pub fn host(&self, host: SocketAddr) -> HostTraffic {
        self.lock_hosts().get(&host).copied().unwrap_or_default()
    }

    /// Forgets the counters of hosts that `keep` rejects and that have no open connection, so
    /// hosts that come and go do not accumulate (Envoy's per-host stats go with the host).
    pub fn retain_hosts(&self, keep: impl Fn(SocketAddr) -> bool) {
        self.lock_hosts()
            .retain(|addr, counts| counts.cx_active > 0 || keep(*addr));
    }

    /// The cluster-wide stats with Envoy's names, without the `cluster.<name>.` prefix: the
    /// counters, then the circuit breakers'.
    pub fn named(&self) -> Vec<(&'static str, u64)> {
        let mut named = vec![
            ("upstream_cx_total", self.cx_total.load(Ordering::Relaxed)),
            (
                "upstream_cx_connect_fail",
                self.cx_connect_fail.load(Ordering::Relaxed),
            ),
            (
                "upstream_cx_connect_attempts_exceeded",
                self.cx_connect_attempts_exceeded.load(Ordering::Relaxed),
            ),
            ("upstream_cx_active", self.cx_active()),
            (
                "upstream_cx_none_healthy",
                self.cx_none_healthy.load(Ordering::Relaxed),
            ),
            (
                "upstream_rq_drop_overload",
                self.rq_drop_overload.load(Ordering::Relaxed),
            ),
            (
                "lb_healthy_panic",
                self.lb_healthy_panic.load(Ordering::Relaxed),
            ),
            (
                "lb_recalculate_zone_structures",
                self.lb_recalculate_zone_structures.load(Ordering::Relaxed),
            ),
            (
                "lb_zone_cluster_too_small",
                self.lb_zone_cluster_too_small.load(Ordering::Relaxed),
            ),
            (
                "lb_local_cluster_not_ok",
                self.lb_local_cluster_not_ok.load(Ordering::Relaxed),
            ),
        ];
        named.extend(self.responses.named());
        named.extend(self.breakers.named(self.cx_active()));
        named
    }

    /// The histograms with Envoy's names, without the `cluster.<name>.` prefix.
    pub fn histograms(&self) -> [(&'static str, HistogramSnapshot); 2] {
        [
            ("upstream_cx_connect_ms", self.cx_connect_ms.snapshot()),
            ("upstream_rq_time", self.responses.time.snapshot()),
        ]
    }

    fn lock_hosts(&self) -> MutexGuard<'_, HashMap<SocketAddr, HostTraffic>> {
        self.hosts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn active_follows_the_guards_per_cluster_and_per_host() {
        let traffic = Arc::new(UpstreamTraffic::default());
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.2:1"));
        let first = traffic.open(a);
        let second = traffic.open(a);
        let third = traffic.open(b);
        assert_eq!(traffic.cx_active(), 3);
        assert_eq!(traffic.host(a).cx_active, 2);
        drop(first);
        drop(third);
        assert_eq!(traffic.cx_active(), 1);
        assert_eq!(
            (traffic.host(a).cx_active, traffic.host(b).cx_active),
            (1, 0)
        );
        // A host gone from discovery keeps its entry while a connection to it is open.
        traffic.retain_hosts(|_| false);
        assert_eq!(traffic.host(a).cx_active, 1);
        drop(second);
        assert_eq!(traffic.cx_active(), 0);
        traffic.retain_hosts(|_| false);
        assert_eq!(traffic.host(a), HostTraffic::default());
    }

    #[test]
    fn max_connections_bounds_the_open_connections_and_frees_on_close() {
        let limits = Limits {
            max_connections: 2,
            ..Limits::default()
        };
        let traffic = Arc::new(UpstreamTraffic::with_limits(limits));
        let a = addr("127.0.0.1:1");
        let first = traffic.try_open(a).expect("first");
        // An unconditional open (a host without any connection) counts against the limit.
        let second = traffic.open(a);
        assert!(traffic.try_open(a).is_none());
        let named: HashMap<_, _> = traffic.named().into_iter().collect();
        assert_eq!(named["circuit_breakers.default.cx_open"], 1);
        drop(first);
        let third = traffic.try_open(a).expect("a freed place");
        assert_eq!((traffic.cx_active(), traffic.host(a).cx_active), (2, 2));
        drop((second, third));
        assert_eq!(traffic.cx_active(), 0);
    }

    #[test]
    fn connect_results_count_per_cluster_and_per_host() {
        let traffic = UpstreamTraffic::default();
        let (a, b) = (addr("127.0.0.1:1"), addr("[::1]:1"));
        traffic.connect_result(a, true);
        traffic.connect_result(a, false);
        traffic.connect_result(b, true);
        assert_eq!(
            traffic.host(a),
            HostTraffic {
                cx_total: 2,
                cx_connect_fail: 1,
                cx_active: 0
            }
        );
        assert_eq!(traffic.host(b).cx_total, 1);
        let named: HashMap<_, _> = traffic.named().into_iter().collect();
        assert_eq!(named["upstream_cx_total"], 3);
        assert_eq!(named["upstream_cx_connect_fail"], 1);
        assert_eq!(named["upstream_cx_active"], 0);
    }
}
