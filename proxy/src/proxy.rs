//! The proxy path: a listener for connections that connect4/6 redirected to the daemon (or that
//! iptables `REDIRECT` or a PROXY protocol header brought), forwarding to ORIGINAL_DST, to a
//! cluster's hosts over TCP, or through a service-router's HTTP routes; draining on host
//! removal and on shutdown; Envoy-named stats.
//!
//! Entry point: [`serve`] binds the listeners and returns a [`ProxyHandle`]; the caller keeps it
//! and calls [`ProxyHandle::shutdown`] (two-phase drain) when the daemon stops.
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

mod cluster;
mod copy;
mod drain;
mod engine;
mod http;
mod listener;
mod orig_dst;
mod pool;
mod proxy_protocol;
mod route;
mod splice;
mod stats;
mod tcp;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
};

pub use proxy_core::config::proxy::{
    EventLoop, ProxyConfig, ProxyProtocolMode, SpliceMode, defaults,
};
use tokio::task::JoinHandle;
use tracing::info;

pub use self::{
    cluster::{ClusterHandle, DrainPolicy, HostClose, HostState, host_state},
    copy::{Copied, CopyError, INITIAL_BUFFER_SIZE, LARGE_BUFFER_SIZE},
    drain::{DrainOutcome, DrainTrigger, DrainWatcher},
    orig_dst::{
        BackendAddr, ClientAddr, HostLease, NoOriginalDst, OrigDstAddr, OriginalDst,
        OriginalDstCluster, OriginalDstTable, so_original_dst,
    },
    pool::{Pool, Proto},
    proxy_protocol::{ProxyHeader, ProxyProtocolError, encode_v2, parse as parse_proxy_header},
    route::{RetryPolicy, Route, RouteError, RouteLeg, RouteMatch, RouteTable},
    splice::{SpliceError, SpliceGuard, Splicer},
    stats::ProxyStats,
};

/// What the proxy does with connections to one original destination.
#[derive(Clone)]
pub enum Service {
    /// ORIGINAL_DST: connect to the destination itself. With `http`, requests are proxied one
    /// by one over pooled connections (and `x-envoy-original-dst-host` applies when enabled).
    OriginalDst {
        /// Treat the traffic as HTTP/1.1 or HTTP/2 cleartext.
        http: bool,
    },
    /// TCP to a host of the cluster, drained when the host is removed.
    Tcp(ClusterHandle),
    /// HTTP routed by a compiled service-router chain.
    Http(Arc<RouteTable>),
}

/// Services by the address clients dial (VIP:port), and what to do with other destinations.
#[derive(Clone, Default)]
pub struct ServiceTable {
    by_addr: HashMap<SocketAddr, Service>,
    fallback: Option<Service>,
}

impl ServiceTable {
    /// No services; connections to unknown destinations are refused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the service at `addr`.
    pub fn insert(&mut self, addr: SocketAddr, service: Service) -> &mut Self {
        self.by_addr.insert(canonical(addr), service);
        self
    }

    /// What destinations without a service get (typically `OriginalDst` for iptables users);
    /// without one they are refused and counted `downstream_cx_no_route`.
    pub fn set_fallback(&mut self, service: Service) -> &mut Self {
        self.fallback = Some(service);
        self
    }

    fn get(&self, addr: SocketAddr) -> Option<&Service> {
        self.by_addr
            .get(&canonical(addr))
            .or(self.fallback.as_ref())
    }

    /// Every cluster the services use (for pool sweeps).
    fn clusters(&self) -> Vec<ClusterHandle> {
        let services = self.by_addr.values().chain(self.fallback.as_ref());
        services
            .flat_map(|s| match s {
                Service::Tcp(c) => vec![c.clone()],
                Service::Http(t) => t.clusters(),
                Service::OriginalDst { .. } => vec![],
            })
            .collect()
    }
}

/// The current connection's span, when debug logging is on: `Span::current` asks the
/// subscriber, which every connection would pay for at the default level for nothing.
fn conn_span() -> Option<tracing::Span> {
    tracing::enabled!(tracing::Level::DEBUG).then(tracing::Span::current)
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

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
}

/// State every connection task shares.
pub(crate) struct Shared {
    config: ProxyConfig,
    stats: Arc<ProxyStats>,
    original_dst: Arc<dyn OriginalDst>,
    services: ServiceTable,
    splicer: Option<Arc<dyn Splicer>>,
    orig_dst_cluster: Arc<OriginalDstCluster>,
    /// The bound listener addresses: a destination equal to one of them would loop.
    listeners: Vec<SocketAddr>,
}

impl Shared {
    fn drain_policy(&self) -> DrainPolicy {
        DrainPolicy {
            drain_timeout: self.config.drain_timeout,
            close_on_health_failure: self.config.close_connections_on_host_health_failure,
        }
    }

    /// Whether `dst` is the proxy itself (a connection to it would loop).
    fn is_self(&self, dst: SocketAddr) -> bool {
        let dst = canonical(dst);
        self.listeners
            .iter()
            .any(|l| l.port() == dst.port() && (l.ip() == dst.ip() || l.ip().is_unspecified()))
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
}

/// A cheap handle on the proxy's stats, for the admin interface.
#[derive(Clone)]
pub struct ProxyStatsHandle {
    stats: Arc<ProxyStats>,
    orig_dst_cluster: Arc<OriginalDstCluster>,
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

/// Threads of the epoll engine (0: one per CPU the process may run on).
static ENGINE_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets how many threads the epoll engine of proxies started from now on runs (the daemon's
/// `--concurrency`); by default one per CPU the process may run on.
pub fn set_engine_threads(n: usize) {
    ENGINE_THREADS.store(n, Ordering::Relaxed);
}

fn engine_threads() -> usize {
    match ENGINE_THREADS.load(Ordering::Relaxed) {
        0 => std::thread::available_parallelism().map_or(2, usize::from),
        n => n,
    }
}

/// Binds the configured listeners and starts serving. Must run inside a tokio runtime.
pub async fn serve(config: ProxyConfig, deps: ProxyDeps) -> Result<ProxyHandle, ProxyError> {
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
        .then(engine_threads);
    let mut bound = Vec::new();
    let mut engine_sockets: Vec<Vec<std::net::TcpListener>> = Vec::new();
    let mut local_addrs = Vec::new();
    for &addr in &config.listeners {
        let bind_error = |source| ProxyError::Bind { addr, source };
        match engine_threads {
            Some(n) => {
                let sockets = listener::bind_reuseport(addr, n).map_err(bind_error)?;
                local_addrs.push(sockets[0].local_addr().map_err(bind_error)?);
                engine_sockets.resize_with(sockets.len(), Vec::new);
                for (thread, socket) in engine_sockets.iter_mut().zip(sockets) {
                    thread.push(socket);
                }
            }
            None => {
                let l = listener::bind(addr).map_err(bind_error)?;
                local_addrs.push(l.get_ref().local_addr().map_err(bind_error)?);
                bound.push(l);
            }
        }
    }
    let orig_dst_cluster = Arc::new(OriginalDstCluster::new(config.cleanup_interval));
    let shared = Arc::new(Shared {
        stats: Arc::default(),
        original_dst: deps.original_dst,
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
        }
    }

    /// The ORIGINAL_DST cluster (its hosts, for `/clusters`).
    pub fn original_dst_cluster(&self) -> &Arc<OriginalDstCluster> {
        &self.shared.orig_dst_cluster
    }

    /// Connections open now.
    pub fn active_connections(&self) -> u64 {
        self.shared
            .stats
            .downstream_cx_active
            .load(Ordering::Relaxed)
    }

    /// Graceful shutdown: stop accepting (the listeners close), let connections finish for
    /// `shutdown_timeout` (HTTP connections are asked to close after their current request),
    /// then reset what is left.
    pub async fn shutdown(mut self) -> DrainOutcome {
        let deadline = self.shared.config.shutdown_timeout;
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
