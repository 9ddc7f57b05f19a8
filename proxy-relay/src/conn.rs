//! How a relayed TCP connection starts, written once for both drivers (the epoll engine,
//! `engine.rs`, and the tokio path, `listener.rs` with `tcp.rs`): which [`Action`] its original
//! destination asks for ([`Actions::lookup`]), the accounting of an admitted connection as an
//! owned guard ([`Admitted`]), the host it goes to ([`choose`]), the outcome of an upstream
//! connect ([`connect_failed`], [`connected`]), and why the proxy ends one ([`ProxyClose`]).
//! The connect (first bytes too) and its retries: `connect_attempts.rs`; bytes and end: `flow.rs`.

use std::{
    collections::HashMap, io, net::SocketAddr, ops::Deref, os::fd::AsFd, sync::atomic::AtomicU64,
    time::Duration,
};

use proxy_core::upstream::{OpenConnection, breakers::Breakers};
use tracing::debug;

use crate::{
    addr::{BackendAddr, OrigDstAddr, canonical},
    cluster::{ActiveLease, ClusterHandle},
    flow,
    orig_dst::HostLease,
    service::{Service, ServiceTable},
    shared::Shared,
    stats::ProxyStats,
};

/// What a connection to one original destination does. `C` is how the driver names a
/// cluster: the tokio path holds its handle, the engine an index into its own list.
pub(crate) enum Action<C> {
    /// TCP to a host of the cluster.
    Cluster(C),
    /// TCP to the original destination itself (ORIGINAL_DST).
    Original,
    /// HTTP (ORIGINAL_DST with `http`, or routes): served by the tokio path's HTTP server.
    Http(Service),
}

/// The services compiled to actions by original destination, with the fallback.
pub(crate) struct Actions<C> {
    by_addr: HashMap<SocketAddr, Action<C>>,
    fallback: Option<Action<C>>,
}

impl<C> Actions<C> {
    /// The actions of `services`; `cluster` names each TCP service's cluster for the driver.
    pub(crate) fn compile(
        services: &ServiceTable,
        mut cluster: impl FnMut(&ClusterHandle) -> C,
    ) -> Self {
        let mut action = |service: &Service| match service {
            Service::Tcp(c) => Action::Cluster(cluster(c)),
            Service::OriginalDst { http: false } => Action::Original,
            http => Action::Http(http.clone()),
        };
        let by_addr = services
            .by_addr
            .iter()
            .map(|(a, s)| (canonical(*a), action(s)))
            .collect();
        let fallback = services.fallback.as_ref().map(action);
        Self { by_addr, fallback }
    }

    /// What a connection to `orig` does (an IPv4-mapped address finds its IPv4 entry); the
    /// fallback for a destination without a service; `None`: refused
    /// (`downstream_cx_no_route`).
    pub(crate) fn lookup(&self, orig: OrigDstAddr) -> Option<&Action<C>> {
        self.by_addr
            .get(&canonical(orig.0))
            .or(self.fallback.as_ref())
    }
}

/// One admitted downstream connection: counted in `downstream_cx_total` and
/// `downstream_cx_active` when made, and when dropped (on whatever path the connection ends,
/// refused or relayed) one less active and one more `downstream_cx_destroy`. `S` is how the
/// holder reaches the stats: a borrow in a task, an `Arc` where the guard is stored (the
/// engine's connection slots) or handed on.
pub(crate) struct Admitted<S: Deref<Target = ProxyStats>>(S);

impl<S: Deref<Target = ProxyStats>> Admitted<S> {
    /// Counts a new connection.
    pub(crate) fn new(stats: S) -> Self {
        ProxyStats::inc(&stats.downstream_cx_total);
        ProxyStats::inc(&stats.downstream_cx_active);
        Self(stats)
    }
}

impl<S: Deref<Target = ProxyStats>> Drop for Admitted<S> {
    fn drop(&mut self) {
        self.0
            .downstream_cx_active
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        ProxyStats::inc(&self.0.downstream_cx_destroy);
    }
}

/// Where a TCP connection goes.
#[derive(Clone, Copy)]
pub(crate) enum Target<'a> {
    /// ORIGINAL_DST: the destination itself.
    Original(OrigDstAddr),
    /// A host of the cluster.
    Cluster(&'a ClusterHandle),
}

impl<'a> Target<'a> {
    /// The cluster, when the target is one.
    pub(crate) fn cluster(self) -> Option<&'a ClusterHandle> {
        match self {
            Self::Cluster(c) => Some(c),
            Self::Original(_) => None,
        }
    }
}

/// The host a connection goes to; for ORIGINAL_DST, the lease that keeps the host known to the
/// cluster while the connection lasts.
pub(crate) struct Chosen {
    pub(crate) host: BackendAddr,
    pub(crate) lease: Option<HostLease>,
    /// LEAST_REQUEST: the connection's place in its host's open count.
    pub(crate) active: Option<ActiveLease>,
    /// A cluster's host: the connection's place in `upstream_cx_active`.
    pub(crate) open: Option<OpenConnection>,
}

/// The host for `target`, another than those in `tried` while the cluster has one, or `None`
/// when the cluster has no healthy host: then counted (`upstream_cx_none_healthy`) and the
/// client reset.
pub(crate) fn choose(
    target: Target<'_>,
    tried: &[BackendAddr],
    client: &impl AsFd,
    shared: &Shared,
) -> Option<Chosen> {
    match target {
        Target::Original(orig) => {
            let host = BackendAddr(orig.0);
            let lease = Some(shared.orig_dst_cluster.lease(host));
            Some(Chosen {
                host,
                lease,
                active: None,
                open: None,
            })
        }
        Target::Cluster(cluster) => {
            // Envoy's tcp_proxy checks max_connections before it picks a host.
            if at_max_connections(cluster) {
                return overflow(cluster);
            }
            let Some((host, active)) = cluster.pick_leased_for(tried, client) else {
                ProxyStats::inc(&shared.stats.upstream_cx_none_healthy);
                debug!(cluster = cluster.name(), "no healthy host: refused");
                flow::abort(client);
                return None;
            };
            // A connect of another task may have taken the last place meanwhile.
            let Some(open) = cluster.try_open_connection(host) else {
                return overflow(cluster);
            };
            Some(Chosen {
                host,
                lease: None,
                active,
                open: Some(open),
            })
        }
    }
}

/// The cluster has `max_connections` open: counted in the cluster's `upstream_cx_overflow`,
/// and the client is closed, not reset (the caller drops it: a FIN unless it sent bytes not
/// read yet), as Envoy's tcp_proxy closes the downstream connection.
fn overflow(cluster: &ClusterHandle) -> Option<Chosen> {
    Breakers::overflowed(&cluster.traffic().breakers().cx_overflow);
    debug!(
        cluster = cluster.name(),
        "cluster at max_connections: closed"
    );
    None
}

/// Whether the cluster has its circuit breakers' `max_connections` open.
pub(crate) fn at_max_connections(cluster: &ClusterHandle) -> bool {
    let traffic = cluster.traffic();
    traffic.cx_active() >= traffic.breakers().limits().max_connections
}

/// Why an upstream connect failed.
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// It failed (refused, unreachable).
    Error(io::Error),
    /// No answer within `connect_timeout`.
    TimedOut(Duration),
}

/// An upstream connect failed: counted (`upstream_cx_connect_fail`, and
/// `upstream_cx_connect_timeout` for a timeout) and reported to the cluster's outlier
/// detection. Whether another host is tried or the client reset is `connect_attempts.rs`'s to say.
pub(crate) fn connect_failed(
    failure: &ConnectFailure,
    host: BackendAddr,
    cluster: Option<&ClusterHandle>,
    stats: &ProxyStats,
) {
    if let ConnectFailure::TimedOut(_) = failure {
        ProxyStats::inc(&stats.upstream_cx_connect_timeout);
    }
    ProxyStats::inc(&stats.upstream_cx_connect_fail);
    if let Some(cluster) = cluster {
        cluster.report_connect(host, false);
    }
    match failure {
        ConnectFailure::Error(err) => debug!(%host, %err, "upstream connect failed"),
        ConnectFailure::TimedOut(after) => debug!(%host, ?after, "upstream connect timed out"),
    }
}

/// A connect succeeded: timed from `open` into `upstream_cx_connect_ms`, told to outlier detection.
pub(crate) fn connected(
    host: BackendAddr,
    cluster: Option<&ClusterHandle>,
    open: Option<&OpenConnection>,
) {
    if let Some(open) = open {
        open.connected();
    }
    if let Some(cluster) = cluster {
        cluster.report_connect(host, true);
    }
}

/// Why the proxy itself closed (reset) a relayed connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProxyClose {
    /// The host was removed and the drain timeout passed.
    Drained,
    /// The host failed health checking (`close_connections_on_host_health_failure`).
    HealthFailure,
    /// Shutdown's deadline passed (or the proxy stopped).
    Shutdown,
}

impl ProxyClose {
    /// The counter this end adds to.
    pub(crate) fn counter(self, stats: &ProxyStats) -> &AtomicU64 {
        match self {
            Self::Drained => &stats.upstream_cx_drain_close,
            Self::HealthFailure => &stats.upstream_cx_health_close,
            Self::Shutdown => &stats.upstream_cx_shutdown_close,
        }
    }

    /// Counts this end in `stats`.
    pub(crate) fn count(self, stats: &ProxyStats) {
        ProxyStats::inc(self.counter(stats));
    }

    /// Why, for the log.
    pub(crate) fn why(self) -> &'static str {
        match self {
            Self::Drained => "host removed and drain timeout passed",
            Self::HealthFailure => "host failed health checking",
            Self::Shutdown => "shutdown deadline passed",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{Arc, atomic::Ordering},
        time::Duration,
    };

    use proxy_core::health::Routing;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
        sync::watch,
    };

    use super::*;
    use crate::{EventLoop, OriginalDst, ProxyConfig, ProxyDeps};

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn gauges(stats: &ProxyStats) -> (u64, u64, u64) {
        (
            stats.downstream_cx_total.load(Ordering::Relaxed),
            stats.downstream_cx_active.load(Ordering::Relaxed),
            stats.downstream_cx_destroy.load(Ordering::Relaxed),
        )
    }

    #[test]
    fn lookup_finds_ipv4_mapped_destinations_and_falls_back() {
        let mut services = ServiceTable::new();
        services.insert(addr("10.0.0.1:80"), Service::OriginalDst { http: false });
        let actions = Actions::compile(&services, |_| ());
        let mapped = OrigDstAddr(addr("[::ffff:10.0.0.1]:80"));
        assert!(matches!(actions.lookup(mapped), Some(Action::Original)));
        let other = OrigDstAddr(addr("10.0.0.2:80"));
        assert!(actions.lookup(other).is_none(), "no fallback: refused");

        services.set_fallback(Service::OriginalDst { http: true });
        let actions = Actions::compile(&services, |_| ());
        assert!(matches!(actions.lookup(mapped), Some(Action::Original)));
        assert!(matches!(
            actions.lookup(other),
            Some(Action::Http(Service::OriginalDst { http: true }))
        ));
    }

    #[test]
    fn lookup_names_clusters_as_the_driver_does() {
        let (_tx, rx) = watch::channel(Routing::compute(&[], 50.0));
        let cluster = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
        let mut services = ServiceTable::new();
        services.insert(addr("[::ffff:10.0.0.1]:80"), Service::Tcp(cluster.clone()));
        services.set_fallback(Service::Tcp(cluster));
        let mut named = 0;
        let actions = Actions::compile(&services, |c| {
            named += 1;
            format!("{}#{named}", c.name())
        });
        // Inserted as IPv4-mapped, found by its IPv4 spelling.
        let Some(Action::Cluster(name)) = actions.lookup(OrigDstAddr(addr("10.0.0.1:80"))) else {
            panic!("the cluster's action was not found");
        };
        assert_eq!(name, "c#1");
        let Some(Action::Cluster(name)) = actions.lookup(OrigDstAddr(addr("10.0.0.9:80"))) else {
            panic!("the fallback was not used");
        };
        assert_eq!(name, "c#2");
    }

    #[test]
    fn the_guard_gives_the_gauge_back_on_every_path() {
        fn refused_early(stats: &ProxyStats, fail: bool) -> Result<(), &'static str> {
            let _admitted = Admitted::new(stats);
            if fail {
                return Err("refused");
            }
            Ok(())
        }
        let stats = ProxyStats::default();
        assert_eq!(refused_early(&stats, true), Err("refused"));
        assert_eq!(refused_early(&stats, false), Ok(()));
        assert_eq!(gauges(&stats), (2, 0, 2));

        let shared = Arc::new(ProxyStats::default());
        let held = Admitted::new(shared.clone());
        assert_eq!(gauges(&shared), (1, 1, 0), "counted while held");
        let moved = std::thread::spawn(move || drop(held));
        moved.join().unwrap();
        assert_eq!(
            gauges(&shared),
            (1, 0, 1),
            "given back where it was dropped"
        );
    }

    #[test]
    fn each_end_has_its_own_counter() {
        let stats = ProxyStats::default();
        ProxyClose::Drained.count(&stats);
        ProxyClose::HealthFailure.count(&stats);
        ProxyClose::HealthFailure.count(&stats);
        ProxyClose::Shutdown.count(&stats);
        ProxyClose::Shutdown.count(&stats);
        ProxyClose::Shutdown.count(&stats);
        let counts = (
            stats.upstream_cx_drain_close.load(Ordering::Relaxed),
            stats.upstream_cx_health_close.load(Ordering::Relaxed),
            stats.upstream_cx_shutdown_close.load(Ordering::Relaxed),
        );
        assert_eq!(counts, (1, 2, 3));
    }

    /// Every connection was redirected to `.0`.
    struct RedirectedTo(SocketAddr);

    impl OriginalDst for RedirectedTo {
        fn lookup(&self, _: SocketAddr, _: SocketAddr) -> Option<SocketAddr> {
            Some(self.0)
        }
    }

    /// Serves `services` with every connection redirected to `dst` on `event_loop`, makes one
    /// connection that sends `ping`, and returns what came back and the stats once it closed.
    async fn one_connection(
        event_loop: EventLoop,
        dst: SocketAddr,
        services: ServiceTable,
    ) -> (Vec<u8>, Vec<(String, u64)>) {
        let config = ProxyConfig {
            listeners: vec![addr("127.0.0.1:0")],
            event_loop,
            engine_threads: std::num::NonZeroUsize::new(1),
            ..ProxyConfig::default()
        };
        let deps = ProxyDeps {
            original_dst: Arc::new(RedirectedTo(dst)),
            services,
            splicer: None,
        };
        let proxy = crate::serve(config, deps).await.expect("serving");
        let mut got = Vec::new();
        // A refused connection may be reset before the connect returns or the write: errors
        // are not the test's, the stats are (and a relayed one must echo).
        if let Ok(mut client) = TcpStream::connect(proxy.local_addrs()[0]).await {
            let _ = client.write_all(b"ping").await;
            let _ = client.shutdown().await;
            let read = client.read_to_end(&mut got);
            let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut stats = proxy.stats();
        while stat(&stats, "downstream_cx_destroy") == 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
            stats = proxy.stats();
        }
        proxy.shutdown().await;
        (got, stats)
    }

    fn stat(stats: &[(String, u64)], name: &str) -> u64 {
        stats.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| *v)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_drivers_count_refused_failed_and_relayed_connections_alike() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let dead = crate::testing::dead_addr();
        let original = || {
            let mut t = ServiceTable::new();
            t.set_fallback(Service::OriginalDst { http: false });
            t
        };
        let empty_cluster = || {
            let (_tx, rx) = watch::channel(Routing::compute(&[], 50.0));
            let mut t = ServiceTable::new();
            t.set_fallback(Service::Tcp(ClusterHandle::new(
                "empty",
                rx,
                true,
                Duration::from_secs(1),
            )));
            t
        };
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            let (got, stats) = one_connection(event_loop, echo_addr, original()).await;
            assert_eq!(got, b"ping", "{event_loop:?}: relayed");
            let (_, no_route) = one_connection(event_loop, echo_addr, ServiceTable::new()).await;
            let (_, none_healthy) = one_connection(event_loop, echo_addr, empty_cluster()).await;
            let (_, refused) = one_connection(event_loop, dead, original()).await;
            for (case, stats, counter) in [
                ("relayed", &stats, "upstream_cx_total"),
                ("no route", &no_route, "downstream_cx_no_route"),
                ("no healthy host", &none_healthy, "upstream_cx_none_healthy"),
                ("connect refused", &refused, "upstream_cx_connect_fail"),
            ] {
                let counted = (
                    stat(stats, "downstream_cx_total"),
                    stat(stats, "downstream_cx_active"),
                    stat(stats, "downstream_cx_destroy"),
                    stat(stats, counter),
                );
                assert_eq!(counted, (1, 0, 1, 1), "{event_loop:?}, {case}");
            }
        }
    }

    /// `max_connections` as Envoy's tcp_proxy holds a cluster to it: a connection over it is
    /// closed before any host is picked or connected, counted in `upstream_cx_overflow`; the
    /// place frees when a connection closes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_drivers_refuse_a_connection_over_max_connections() {
        use proxy_core::{config::circuit_breakers::Limits, health::HostClass, host::Host};
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let limits = Limits {
            max_connections: 1,
            ..Limits::default()
        };
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            let hosts = [(Host::new(echo_addr), HostClass::Healthy)];
            let (tx, rx) = watch::channel(Routing::compute(&hosts, 50.0));
            let handle =
                ClusterHandle::new("c", rx, true, Duration::from_secs(1)).with_limits(limits);
            let table = || {
                let mut t = ServiceTable::new();
                t.set_fallback(Service::Tcp(handle.clone()));
                t
            };
            let other = handle.open_connection(BackendAddr(echo_addr));
            let (got, stats) = one_connection(event_loop, echo_addr, table()).await;
            let t = handle.traffic();
            let overflow = t.breakers().cx_overflow.load(Ordering::Relaxed);
            assert_eq!(
                (got.len(), overflow, t.cx_total.load(Ordering::Relaxed)),
                (0, 1, 0),
                "{event_loop:?}: refused before a connect"
            );
            assert_eq!(stat(&stats, "downstream_cx_destroy"), 1, "{event_loop:?}");
            drop(other);
            let (got, _) = one_connection(event_loop, echo_addr, table()).await;
            assert_eq!(
                got, b"ping",
                "{event_loop:?}: the closed one's place is free"
            );
            assert_eq!(t.breakers().cx_overflow.load(Ordering::Relaxed), 1);
            assert_eq!(t.cx_active(), 0, "{event_loop:?}: nothing leaks");
            drop(tx);
        }
    }

    /// The per-cluster counters (Envoy's `cluster.<name>.upstream_cx_*`, `lb_healthy_panic`)
    /// move alike in both drivers, on the handle of the cluster the connection went to.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_drivers_count_per_cluster() {
        use proxy_core::{health::HostClass, host::Host};
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let dead = crate::testing::dead_addr();
        let cluster = |hosts: &[(SocketAddr, HostClass)]| {
            let hosts: Vec<_> = hosts.iter().map(|&(a, c)| (Host::new(a), c)).collect();
            let (tx, rx) = watch::channel(Routing::compute(&hosts, 50.0));
            std::mem::forget(tx);
            let handle = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
            let mut t = ServiceTable::new();
            t.set_fallback(Service::Tcp(handle.clone()));
            (t, handle)
        };
        let count = |h: &ClusterHandle| {
            let t = h.traffic();
            [
                t.cx_total.load(Ordering::Relaxed),
                t.cx_connect_fail.load(Ordering::Relaxed),
                t.cx_none_healthy.load(Ordering::Relaxed),
                t.lb_healthy_panic.load(Ordering::Relaxed),
            ]
        };
        let other: SocketAddr = "127.0.0.1:9".parse().unwrap();
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            let (t, ok) = cluster(&[(echo_addr, HostClass::Healthy)]);
            one_connection(event_loop, echo_addr, t).await;
            assert_eq!(count(&ok), [1, 0, 0, 0], "{event_loop:?}: relayed");
            let (t, failed) = cluster(&[(dead, HostClass::Healthy)]);
            one_connection(event_loop, dead, t).await;
            assert_eq!(count(&failed), [1, 1, 0, 0], "{event_loop:?}: refused");
            let (t, empty) = cluster(&[]);
            one_connection(event_loop, echo_addr, t).await;
            assert_eq!(count(&empty), [0, 0, 1, 0], "{event_loop:?}: no host");
            // One healthy host of three is below the 50 % threshold: panic mode routes to all.
            let (t, panic) = cluster(&[
                (echo_addr, HostClass::Healthy),
                (other, HostClass::Unhealthy),
                (dead, HostClass::Unhealthy),
            ]);
            one_connection(event_loop, echo_addr, t).await;
            let [total, _, none, in_panic] = count(&panic);
            assert_eq!((total, none, in_panic), (1, 0, 1), "{event_loop:?}: panic");
        }
    }
}
