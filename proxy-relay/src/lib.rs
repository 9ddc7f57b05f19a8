//! The userspace proxy path: a listener for connections that connect4/6 redirected to the daemon (or that
//! iptables `REDIRECT` or a PROXY protocol header brought), forwarding to ORIGINAL_DST, to a
//! cluster's hosts over TCP, or through a service-router's HTTP routes; draining on host
//! removal and on shutdown; Envoy-named stats.
//!
//! Entry point: [`serve`] binds the listeners and returns a [`ProxyHandle`]; the caller keeps it
//! and calls [`ProxyHandle::shutdown`] (two-phase drain) when the daemon stops. A daemon that
//! takes over from another one starts on the listening sockets that one handed over instead
//! ([`serve_inherited`]), and hands its own over with [`ProxyHandle::handover`]; after a restart
//! under a service manager that kept them, on its stored ones ([`serve_stored`]).
//!
//! The crate knows nothing of the kernel programs: the daemon passes in what it has of them
//! behind three traits, [`OriginalDst`] (the kernel's original-destination map), [`Splicer`] and
//! [`SpliceControl`] (proxy-pair splicing). It builds and tests without the eBPF toolchain.
//! Every raw socket and epoll call is in the `sys` module, the crate's only `unsafe` code.
//!
//! ```text
//! accept() -> original destination (PROXY header | kernel map by 4-tuple | SO_ORIGINAL_DST)
//!          -> unknown: reset, `downstream_cx_no_original_dst`   (never an open relay)
//!          -> ServiceTable[destination]:
//!               OriginalDst{http: false} -> connect to the destination, copy loop or splice
//!               Tcp(cluster)             -> weighted host pick, copy loop or splice, drain on
//!                                           removal
//!               OriginalDst{http: true}  -> hyper: per request, pooled, x-envoy-original-dst-host
//!               Http(routes)             -> hyper: route match, leg, host, retries, timeout
//! ```

mod addr;
mod client;
mod cluster;
mod conn;
mod connect_attempts;
mod copy;
mod drain;
mod engine;
mod flow;
mod http;
mod listener;
mod orig_dst;
mod pool;
mod proxy_protocol;
mod route;
mod service;
mod shared;
mod splice;
mod stats;
#[allow(
    unsafe_code,
    reason = "the crate's raw socket and epoll calls, each with its SAFETY note"
)]
mod sys;
mod tcp;

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError, atomic::Ordering},
};

pub use proxy_core::config::proxy::{
    EventLoop, ProxyConfig, ProxyProtocolMode, SpliceMode, defaults,
};
use tokio::task::JoinHandle;
use tracing::info;

use self::{addr::canonical, listener::Sockets, shared::Shared};
pub use self::{
    addr::{BackendAddr, ClientAddr, OrigDstAddr},
    cluster::{ActiveLease, ClusterHandle, DrainPolicy, HostClose, HostState, host_state},
    drain::{DrainOutcome, DrainTrigger, DrainWatcher},
    http::upgrade::UpgradePolicy,
    orig_dst::{
        HostLease, NoOriginalDst, OriginalDst, OriginalDstCluster, OriginalDstTable,
        so_original_dst,
    },
    pool::{Pool, Proto},
    proxy_protocol::{ProxyHeader, ProxyProtocolError, encode_v2, parse as parse_proxy_header},
    route::{RetryPolicy, Route, RouteError, RouteLeg, RouteMatch, RouteTable},
    service::{Service, ServiceTable},
    splice::{PairSide, SpliceControl, SpliceError, SpliceGuard, Splicer},
    stats::ProxyStats,
};

/// What the proxy needs from the rest of the daemon.
pub struct ProxyDeps {
    /// Original destinations of redirected connections: the kernel's map
    /// (`dataplane::OriginalDestinations` implements [`OriginalDst`]).
    pub original_dst: Arc<dyn OriginalDst>,
    /// Services by destination.
    pub services: ServiceTable,
    /// Moves the bytes of TCP connections inside the kernel (`splice: kernel`;
    /// `dataplane::PairSplicer` implements [`Splicer`]). Required in kernel mode; unused in
    /// copy mode.
    pub splicer: Option<Arc<dyn Splicer>>,
}

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A listener address could not be bound.
    #[error(
        "binding the proxy listener {addr}: {source} (is another proxy or daemon instance using it?)"
    )]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `splice: kernel` was configured without a splicer.
    #[error(
        "splice: kernel needs the data path's proxy-pair splicer, and none was given (the kernel may lack it: see the daemon log, or use `splice: copy`)"
    )]
    SpliceUnavailable,
    /// No listener address was configured.
    #[error("no proxy listener address configured")]
    NoListener,
    /// The epoll engine's threads could not start.
    #[error("starting the proxy's epoll engine: {0}")]
    Engine(#[source] std::io::Error),
    /// A configured listener address has no socket among those handed over.
    #[error(
        "no handed-over listening socket for the proxy listener {addr} (the daemon taken over listens elsewhere)"
    )]
    NotHandedOver {
        /// The configured address.
        addr: SocketAddr,
    },
    /// Handed-over sockets that no configured listener address uses.
    #[error(
        "handed-over listening sockets on {addrs:?} match no configured proxy listener address"
    )]
    HandedOverUnused {
        /// Their addresses.
        addrs: Vec<SocketAddr>,
    },
    /// A handed-over descriptor is not a listening TCP socket, or could not be set up.
    #[error("a handed-over proxy listener socket: {0}")]
    HandedOverSocket(#[source] std::io::Error),
}

/// The listening sockets of a running proxy, for handing over to the daemon that takes over
/// ([`ProxyHandle::handover`]). Empty once the proxy's shutdown began: a draining proxy's
/// listeners close.
#[derive(Clone, Default)]
pub struct Handover(Arc<Mutex<Vec<std::net::TcpListener>>>);

impl Handover {
    /// New descriptors of every listening socket (all `SO_REUSEPORT` sockets of each address);
    /// empty once the proxy drains.
    pub fn sockets(&self) -> std::io::Result<Vec<std::net::TcpListener>> {
        self.lock()
            .iter()
            .map(std::net::TcpListener::try_clone)
            .collect()
    }

    fn close(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<std::net::TcpListener>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A running proxy.
pub struct ProxyHandle {
    shared: Arc<Shared>,
    trigger: Option<DrainTrigger>,
    accept_tasks: Vec<JoinHandle<()>>,
    background: Vec<JoinHandle<()>>,
    engine: Option<engine::Engine>,
    local_addrs: Vec<SocketAddr>,
    handover: Handover,
}

/// A cheap handle on the proxy's stats, for the admin interface.
#[derive(Clone)]
pub struct ProxyStatsHandle {
    stats: Arc<ProxyStats>,
    orig_dst_cluster: Arc<OriginalDstCluster>,
    listeners: Vec<SocketAddr>,
}

impl ProxyStatsHandle {
    /// The ORIGINAL_DST cluster's hosts now.
    pub fn original_dst_hosts(&self) -> Vec<SocketAddr> {
        self.orig_dst_cluster
            .hosts()
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    /// The addresses the proxy listens on.
    pub fn listeners(&self) -> &[SocketAddr] {
        &self.listeners
    }

    /// The description of the stat `name` (as [`stats`](Self::stats) names it), for a
    /// `# HELP` line.
    pub fn help(name: &str) -> Option<&'static str> {
        match name {
            "original_dst_hosts" => Some("Hosts of the ORIGINAL_DST cluster now."),
            _ => ProxyStats::help(name),
        }
    }

    /// Every stat as (Envoy-style name, value); `original_dst_hosts` is the ORIGINAL_DST
    /// cluster's host count.
    pub fn stats(&self) -> Vec<(String, u64)> {
        let mut out = self.stats.snapshot();
        out.push((
            "original_dst_hosts".to_owned(),
            self.orig_dst_cluster.hosts().len() as u64,
        ));
        out
    }
}

/// Threads of the epoll engine: `engine_threads` of the config, or one per CPU the process may
/// run on.
fn engine_threads(config: &ProxyConfig) -> usize {
    config.engine_threads.map_or_else(
        || std::thread::available_parallelism().map_or(2, usize::from),
        usize::from,
    )
}

/// Binds the configured listeners and starts serving. Must run inside a tokio runtime.
pub async fn serve(config: ProxyConfig, deps: ProxyDeps) -> Result<ProxyHandle, ProxyError> {
    start(config, deps, Sockets::Bind).await
}

/// Starts serving on listening sockets another daemon handed over (a takeover) instead of
/// binding: every configured listener address must have its sockets there (port 0 takes the
/// port they have), and every socket must belong to a configured address. All are accepted
/// from, so no connection queued on one of them is lost; the epoll engine spreads them over
/// its threads and, when they are `SO_REUSEPORT` sockets and fewer than its threads, binds one
/// more per thread. Must run inside a tokio runtime.
pub async fn serve_inherited(
    config: ProxyConfig,
    deps: ProxyDeps,
    sockets: Vec<std::net::TcpListener>,
) -> Result<ProxyHandle, ProxyError> {
    start(config, deps, Sockets::HandedOver(sockets)).await
}

/// Starts serving on the listening sockets the service manager kept across a restart (its
/// file-descriptor store) where they are of configured listener addresses (port 0 takes the
/// port they have); configured addresses without one are bound, and sockets of addresses no
/// longer configured are closed. No connection queued on a taken one is lost. Must run inside
/// a tokio runtime.
pub async fn serve_stored(
    config: ProxyConfig,
    deps: ProxyDeps,
    sockets: Vec<std::net::TcpListener>,
) -> Result<ProxyHandle, ProxyError> {
    start(config, deps, Sockets::Stored(sockets)).await
}

#[expect(
    clippy::unused_async,
    reason = "the signature says it must run inside a tokio runtime (it spawns tasks)"
)]
async fn start(
    config: ProxyConfig,
    deps: ProxyDeps,
    sockets: Sockets,
) -> Result<ProxyHandle, ProxyError> {
    start_with(config, deps, sockets, None)
}

/// What a successor takes over from the proxy it replaces ([`ProxyHandle::successor`]).
struct Continued {
    stats: Arc<ProxyStats>,
    orig_dst_cluster: Arc<OriginalDstCluster>,
    handover: Handover,
}

fn start_with(
    config: ProxyConfig,
    deps: ProxyDeps,
    sockets: Sockets,
    continued: Option<Continued>,
) -> Result<ProxyHandle, ProxyError> {
    if config.splice == SpliceMode::Kernel && deps.splicer.is_none() {
        return Err(ProxyError::SpliceUnavailable);
    }
    if config.listeners.is_empty() {
        return Err(ProxyError::NoListener);
    }
    // Plain TCP runs on the epoll engine; PROXY protocol listeners and kernel splicing keep
    // the tokio path (HTTP services are handed to it from the engine's accept).
    let engine_threads = (config.event_loop == EventLoop::Epoll
        && config.splice == SpliceMode::Copy
        && config.proxy_protocol == ProxyProtocolMode::Off)
        .then(|| engine_threads(&config));
    let listener::Bound {
        tokio: bound,
        engine: engine_sockets,
        local_addrs,
        handover,
    } = listener::Bound::new(&config.listeners, engine_threads, sockets)?;
    let (stats, orig_dst_cluster, handover) = match continued {
        Some(c) => {
            // The successor's sockets are what a takeover hands over from now on.
            *c.handover.lock() = handover;
            (c.stats, c.orig_dst_cluster, c.handover)
        }
        None => (
            Arc::default(),
            Arc::new(OriginalDstCluster::new(config.cleanup_interval)),
            Handover(Arc::new(Mutex::new(handover))),
        ),
    };
    let shared = Arc::new(Shared {
        stats,
        original_dst: deps.original_dst,
        actions: conn::Actions::compile(&deps.services, ClusterHandle::clone),
        services: deps.services,
        splicer: deps.splicer,
        orig_dst_cluster: orig_dst_cluster.clone(),
        listeners: local_addrs.iter().copied().map(canonical).collect(),
        config,
    });
    let (trigger, watcher) = drain::channel();
    let accept_tasks = bound
        .into_iter()
        .map(|l| tokio::spawn(listener::accept_loop(l, shared.clone(), watcher.clone())))
        .collect();
    let mut background = vec![
        tokio::spawn(orig_dst_cluster.run_cleanup()),
        tokio::spawn(sweep_pools(shared.clone())),
    ];
    let engine = if engine_sockets.is_empty() {
        None
    } else {
        let (engine, tasks) = engine::Engine::start(engine_sockets, shared.clone(), &watcher)
            .map_err(ProxyError::Engine)?;
        background.extend(tasks);
        Some(engine)
    };
    drop(watcher);
    info!(listeners = ?local_addrs, "proxy listening");
    Ok(ProxyHandle {
        shared,
        trigger: Some(trigger),
        accept_tasks,
        background,
        engine,
        local_addrs,
        handover,
    })
}

/// Sweeps the clusters' HTTP pools every `cleanup_interval`: connections of hosts that are no
/// longer routable and idle ones past the pool timeout go.
async fn sweep_pools(shared: Arc<Shared>) {
    let clusters = shared.services.clusters();
    let mut tick = tokio::time::interval(shared.config.cleanup_interval);
    loop {
        tick.tick().await;
        for c in &clusters {
            c.sweep_pool();
        }
    }
}

impl ProxyHandle {
    /// The bound listener addresses (port 0 in the config becomes the real port here).
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    /// Every stat as (Envoy-style name, value).
    pub fn stats(&self) -> Vec<(String, u64)> {
        self.stats_handle().stats()
    }

    /// A handle on the stats that outlives borrows of the proxy (for the admin interface).
    pub fn stats_handle(&self) -> ProxyStatsHandle {
        ProxyStatsHandle {
            stats: self.shared.stats.clone(),
            orig_dst_cluster: self.shared.orig_dst_cluster.clone(),
            listeners: self.local_addrs.clone(),
        }
    }

    /// The ORIGINAL_DST cluster (its hosts, for `/clusters`).
    pub fn original_dst_cluster(&self) -> &Arc<OriginalDstCluster> {
        &self.shared.orig_dst_cluster
    }

    /// The listening sockets, for handing over to a daemon that takes over from this one.
    pub fn handover(&self) -> Handover {
        self.handover.clone()
    }

    /// Connections open now.
    pub fn active_connections(&self) -> u64 {
        self.shared
            .stats
            .downstream_cx_active
            .load(Ordering::Relaxed)
    }

    /// A proxy with a new service table (a reload), serving on this one's listening sockets
    /// from now on, with its config, its stats and ORIGINAL_DST hosts (the counters go on, and
    /// handles taken from this one keep reading them), and its place for a takeover's
    /// handover. This one stops accepting at once and is left to [`shutdown`](Self::shutdown),
    /// which drains its live connections: they keep the routes they started with. On error
    /// nothing changed and this one serves on. Must run inside a tokio runtime.
    #[expect(
        clippy::unused_async,
        reason = "the signature says it must run inside a tokio runtime (it spawns tasks)"
    )]
    pub async fn successor(&mut self, deps: ProxyDeps) -> Result<ProxyHandle, ProxyError> {
        let sockets = self
            .handover
            .sockets()
            .map_err(ProxyError::HandedOverSocket)?;
        let continued = Continued {
            stats: self.shared.stats.clone(),
            orig_dst_cluster: self.shared.orig_dst_cluster.clone(),
            handover: Handover::default(),
        };
        let mut next = start_with(
            self.shared.config.clone(),
            deps,
            Sockets::HandedOver(sockets),
            Some(continued),
        )?;
        // Only now that it serves: this one's place for the handover (a takeover server holds
        // it) lists the successor's sockets and moves to it; this one's drain then closes an
        // empty list.
        let theirs = std::mem::take(&mut *next.handover.lock());
        *self.handover.lock() = theirs;
        std::mem::swap(&mut self.handover, &mut next.handover);
        // This one stops accepting at once: from here new connections reach the successor
        // only (one this one accepted a moment before is served on its table).
        if let Some(trigger) = &self.trigger {
            trigger.begin();
        }
        Ok(next)
    }

    /// Graceful shutdown: stop accepting (the listeners close), let connections finish for
    /// `shutdown_timeout` (HTTP connections are asked to close after their current request),
    /// then reset what is left.
    pub async fn shutdown(mut self) -> DrainOutcome {
        let deadline = self.shared.config.shutdown_timeout;
        // The handover's descriptors must not keep the listeners open while they drain.
        self.handover.close();
        let outcome = match self.trigger.take() {
            Some(trigger) => trigger.drain(deadline).await,
            None => DrainOutcome::Graceful,
        };
        for t in self.accept_tasks.drain(..).chain(self.background.drain(..)) {
            t.abort();
        }
        if let Some(engine) = self.engine.take() {
            engine.stop();
        }
        info!(?outcome, "proxy stopped");
        outcome
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        // Without a graceful shutdown: stop accepting; the dropped trigger closes connections.
        for t in self.accept_tasks.iter().chain(&self.background) {
            t.abort();
        }
        if let Some(engine) = &self.engine {
            engine.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::*;

    fn deps() -> ProxyDeps {
        ProxyDeps {
            original_dst: Arc::new(NoOriginalDst),
            services: ServiceTable::new(),
            splicer: None,
        }
    }

    #[test]
    fn the_engine_runs_one_thread_per_cpu_by_default() {
        let cpus = std::thread::available_parallelism().map_or(2, usize::from);
        assert_eq!(engine_threads(&ProxyConfig::default()), cpus);
    }

    #[tokio::test]
    async fn the_engine_runs_the_configured_thread_count() {
        let config = ProxyConfig {
            listeners: vec![SocketAddr::from(([127, 0, 0, 1], 0))],
            engine_threads: NonZeroUsize::new(3),
            ..ProxyConfig::default()
        };
        let handle = serve(config, deps()).await.expect("serving");
        let threads = handle.engine.as_ref().map(engine::Engine::threads);
        assert_eq!(threads, Some(3), "one engine thread per configured thread");
        handle.shutdown().await;
    }

    fn on(addr: SocketAddr, threads: usize) -> ProxyConfig {
        ProxyConfig {
            listeners: vec![addr],
            engine_threads: NonZeroUsize::new(threads),
            ..ProxyConfig::default()
        }
    }

    /// A server that writes `name` on each connection, then echoes.
    async fn named_server(name: &'static str) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt as _;
                    if s.write_all(name.as_bytes()).await.is_ok() {
                        let (mut r, mut w) = s.split();
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                    }
                });
            }
        });
        addr
    }

    /// Every connection was redirected to `.0`.
    struct To(SocketAddr);

    impl OriginalDst for To {
        fn lookup(&self, _: SocketAddr, _: SocketAddr) -> Option<SocketAddr> {
            Some(self.0)
        }
    }

    /// `vip` served by a one-host cluster whose host is `host`.
    fn table(vip: SocketAddr, host: SocketAddr) -> ServiceTable {
        use proxy_core::{
            health::{HostClass, Routing},
            host::Host,
        };
        let routing = Routing::compute(&[(Host::new(host), HostClass::Healthy)], 50.0);
        // The sender may go: the cluster keeps its last routing.
        let (_tx, rx) = tokio::sync::watch::channel(routing);
        let cluster = ClusterHandle::new("c", rx, true, std::time::Duration::from_secs(1));
        let mut t = ServiceTable::new();
        t.insert(vip, Service::Tcp(cluster));
        t
    }

    /// Connects to the proxy and reads the backend's name.
    async fn dial(proxy: SocketAddr) -> (tokio::net::TcpStream, String) {
        use tokio::io::AsyncReadExt as _;
        let mut s = tokio::net::TcpStream::connect(proxy)
            .await
            .expect("connect");
        let mut name = [0u8; 1];
        tokio::time::timeout(std::time::Duration::from_secs(5), s.read_exact(&mut name))
            .await
            .expect("the backend's name in time")
            .expect("the backend's name");
        (s, String::from_utf8_lossy(&name).into_owned())
    }

    /// A reload of the proxy path's services: the successor routes new connections with its
    /// table, on the same listening sockets; a connection of the old table goes on through the
    /// old one's drain; the stats go on counting in one place; a takeover's handover (taken
    /// before the reload) lists the successor's sockets, and the old one's list is empty.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_successor_routes_with_its_table_while_the_old_one_drains() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (a, b) = (named_server("A").await, named_server("B").await);
        let vip = SocketAddr::from(([10, 0, 0, 1], 80));
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            let config = ProxyConfig {
                listeners: vec![SocketAddr::from(([127, 0, 0, 1], 0))],
                event_loop,
                engine_threads: NonZeroUsize::new(2),
                ..ProxyConfig::default()
            };
            let deps = |host| ProxyDeps {
                original_dst: Arc::new(To(vip)),
                services: table(vip, host),
                splicer: None,
            };
            let mut first = serve(config, deps(a)).await.expect("serving");
            let listen = first.local_addrs()[0];
            let handover = first.handover();
            let stats = first.stats_handle();
            let (mut old_conn, name) = dial(listen).await;
            assert_eq!(name, "A", "{event_loop:?}");
            let second = first
                .successor(deps(b))
                .await
                .expect("the successor serves");
            assert_eq!(second.local_addrs(), [listen], "{event_loop:?}");
            let listed = handover.sockets().unwrap().len();
            assert!(listed > 0, "{event_loop:?}: the successor's sockets");
            assert_eq!(listed, second.handover().sockets().unwrap().len());
            assert!(
                first.handover().sockets().unwrap().is_empty(),
                "{event_loop:?}"
            );
            let draining = tokio::spawn(first.shutdown());
            // Until the old one has stopped accepting (its threads take the drain command),
            // it may still take a connection from the shared sockets, with its own table.
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
            let (mut early, mut in_a_row) = (0, 0);
            while in_a_row < 5 {
                early += 1;
                in_a_row = if dial(listen).await.1 == "B" {
                    in_a_row + 1
                } else {
                    0
                };
                assert!(tokio::time::Instant::now() < deadline, "{event_loop:?}");
            }
            for _ in 0..20 {
                let (_, name) = dial(listen).await;
                assert_eq!(
                    name, "B",
                    "{event_loop:?}: new connections take the new table"
                );
            }
            // The connection of the old table still relays.
            old_conn.write_all(b"x").await.unwrap();
            let mut echoed = [0u8; 1];
            old_conn.read_exact(&mut echoed).await.unwrap();
            assert_eq!(&echoed, b"x", "{event_loop:?}");
            drop(old_conn);
            let outcome = tokio::time::timeout(std::time::Duration::from_secs(10), draining)
                .await
                .expect("the old one drains once its connection ends")
                .unwrap();
            assert_eq!(outcome, DrainOutcome::Graceful, "{event_loop:?}");
            let total = stats
                .stats()
                .into_iter()
                .find_map(|(n, v)| (n == "downstream_cx_total").then_some(v));
            assert_eq!(
                total,
                Some(21 + early),
                "{event_loop:?}: one count across both"
            );
            second.shutdown().await;
        }
    }

    /// A takeover in one process: the second proxy serves on the first one's sockets (and adds
    /// `SO_REUSEPORT` sockets for its extra engine threads); the first one's drain does not
    /// close them.
    #[tokio::test]
    async fn a_second_proxy_serves_on_handed_over_sockets() {
        let first = serve(on(SocketAddr::from(([127, 0, 0, 1], 0)), 1), deps())
            .await
            .expect("serving");
        let addr = first.local_addrs()[0];
        let sockets = first.handover().sockets().expect("duplicates");
        assert_eq!(sockets.len(), 1);
        let config = on(SocketAddr::from(([127, 0, 0, 1], 0)), 3);
        let second = serve_inherited(config, deps(), sockets)
            .await
            .expect("serving on handed-over sockets");
        assert_eq!(
            second.local_addrs(),
            [addr],
            "port 0 takes the handed-over port"
        );
        assert_eq!(second.handover().sockets().expect("duplicates").len(), 3);
        first.shutdown().await;
        // Without an original destination the proxy resets the connection (at times before
        // the connect is seen to complete): accepted and counted by the second one, never
        // refused by the kernel.
        for _ in 0..5 {
            match tokio::net::TcpStream::connect(addr).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                Err(e) => panic!("connect: {e}"),
            }
        }
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let counted = || {
            second
                .stats()
                .into_iter()
                .find_map(|(n, v)| (n == "downstream_cx_no_original_dst").then_some(v))
        };
        while counted() != Some(5) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(counted(), Some(5));
        second.shutdown().await;
    }

    #[tokio::test]
    async fn handed_over_sockets_must_match_the_configured_listeners() {
        let first = serve(on(SocketAddr::from(([127, 0, 0, 1], 0)), 1), deps())
            .await
            .expect("serving");
        let addr = first.local_addrs()[0];
        let elsewhere = SocketAddr::from(([127, 0, 0, 2], addr.port()));
        let sockets = first.handover().sockets().expect("duplicates");
        let err = serve_inherited(on(elsewhere, 1), deps(), sockets)
            .await
            .err()
            .expect("refused");
        assert!(matches!(err, ProxyError::NotHandedOver { .. }), "{err}");
        let mut config = on(addr, 1);
        config.listeners.clear();
        let sockets = first.handover().sockets().expect("duplicates");
        let err = serve_inherited(config, deps(), sockets).await.err();
        assert!(matches!(err, Some(ProxyError::NoListener)), "{err:?}");
        let other = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut sockets = first.handover().sockets().expect("duplicates");
        sockets.push(other);
        let err = serve_inherited(on(addr, 1), deps(), sockets).await.err();
        assert!(
            matches!(err, Some(ProxyError::HandedOverUnused { .. })),
            "{err:?}"
        );
        first.shutdown().await;
        assert!(
            refused(addr).await,
            "the listener closes once its last holder drains"
        );
    }

    /// A restart under a service manager that stores the listener: while no proxy accepts,
    /// a connect waits in the stored socket's queue; the next proxy takes the stored socket of
    /// its configured address (and the queued connection), binds a configured address that
    /// has none, and closes a stored socket no longer configured.
    #[tokio::test]
    async fn stored_sockets_serve_where_configured_and_the_others_close() {
        let first = serve(on(SocketAddr::from(([127, 0, 0, 1], 0)), 2), deps())
            .await
            .expect("serving");
        let addr = first.local_addrs()[0];
        // The manager's copies.
        let mut stored = first.handover().sockets().expect("duplicates");
        first.shutdown().await;
        let queued = tokio::net::TcpStream::connect(addr)
            .await
            .expect("queued while no proxy accepts, not refused");
        let gone = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let gone_addr = gone.local_addr().expect("its address");
        stored.push(gone);
        let mut config = on(addr, 2);
        config.listeners.push(SocketAddr::from(([127, 0, 0, 3], 0)));
        let second = serve_stored(config, deps(), stored)
            .await
            .expect("serving on the stored sockets");
        assert_eq!(second.local_addrs().len(), 2);
        assert_eq!(second.local_addrs()[0], addr);
        assert!(refused(gone_addr).await, "not configured: closed");
        assert!(!refused(second.local_addrs()[1]).await, "bound");
        // The queued connection has no original destination: the second proxy took it.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let counted = || {
            second
                .stats()
                .into_iter()
                .find_map(|(n, v)| (n == "downstream_cx_no_original_dst").then_some(v))
        };
        while counted() < Some(2) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(counted(), Some(2), "the queued connect and the bound one");
        drop(queued);
        second.shutdown().await;
    }

    /// Whether a connect to `addr` is refused (ECONNREFUSED: nothing listens there). Any other
    /// outcome means a listener took it: a proxy resets a connection without an original
    /// destination at once, and the client may see that reset (ECONNRESET) before its connect
    /// completes.
    async fn refused(addr: SocketAddr) -> bool {
        matches!(
            tokio::net::TcpStream::connect(addr).await,
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused
        )
    }
}

/// Helpers shared by the crate's unit tests.
#[cfg(test)]
mod testing {
    use std::net::SocketAddr;

    /// A loopback address where nothing listens: connects to it are refused. Its socket stays
    /// bound (never listening) for the life of the test process, so no other socket (a proxy
    /// listener bound to port 0 by another test) can take the port, as one could after a bind
    /// and close.
    pub(crate) fn dead_addr() -> SocketAddr {
        static HELD: std::sync::Mutex<Vec<tokio::net::TcpSocket>> =
            std::sync::Mutex::new(Vec::new());
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind");
        let addr = socket.local_addr().expect("its address");
        HELD.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(socket);
        addr
    }
}
