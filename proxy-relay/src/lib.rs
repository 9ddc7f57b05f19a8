//! The userspace proxy path: a listener for connections that connect4/6 redirected to the daemon (or that
//! iptables `REDIRECT` or a PROXY protocol header brought), forwarding to ORIGINAL_DST, to a
//! cluster's hosts over TCP, or through a service-router's HTTP routes; draining on host
//! removal and on shutdown; Envoy-named stats.
//!
//! Entry point: [`serve`] binds the listeners and returns a [`ProxyHandle`]; the caller keeps it
//! and calls [`ProxyHandle::shutdown`] (two-phase drain) when the daemon stops.
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

#![deny(unsafe_code)]

mod addr;
mod client;
mod cluster;
mod conn;
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
    sync::{Arc, atomic::Ordering},
};

pub use proxy_core::config::proxy::{
    EventLoop, ProxyConfig, ProxyProtocolMode, SpliceMode, defaults,
};
use tokio::task::JoinHandle;
use tracing::info;

use self::{addr::canonical, shared::Shared};
pub use self::{
    addr::{BackendAddr, ClientAddr, OrigDstAddr},
    cluster::{ActiveLease, ClusterHandle, DrainPolicy, HostClose, HostState, host_state},
    drain::{DrainOutcome, DrainTrigger, DrainWatcher},
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

/// Threads of the epoll engine: `engine_threads` of the config, or one per CPU the process may
/// run on.
fn engine_threads(config: &ProxyConfig) -> usize {
    config.engine_threads.map_or_else(
        || std::thread::available_parallelism().map_or(2, usize::from),
        usize::from,
    )
}

/// Binds the configured listeners and starts serving. Must run inside a tokio runtime.
#[expect(
    clippy::unused_async,
    reason = "the signature says it must run inside a tokio runtime (it spawns tasks)"
)]
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
        .then(|| engine_threads(&config));
    let mut bound = Vec::new();
    let mut engine_sockets: Vec<Vec<std::net::TcpListener>> = Vec::new();
    let mut local_addrs = Vec::new();
    for &addr in &config.listeners {
        let bind_error = |source| ProxyError::Bind { addr, source };
        if let Some(n) = engine_threads {
            let sockets = listener::bind_reuseport(addr, n).map_err(bind_error)?;
            local_addrs.push(sockets[0].local_addr().map_err(bind_error)?);
            engine_sockets.resize_with(sockets.len(), Vec::new);
            for (thread, socket) in engine_sockets.iter_mut().zip(sockets) {
                thread.push(socket);
            }
        } else {
            let l = listener::bind(addr).map_err(bind_error)?;
            local_addrs.push(l.get_ref().local_addr().map_err(bind_error)?);
            bound.push(l);
        }
    }
    let orig_dst_cluster = Arc::new(OriginalDstCluster::new(config.cleanup_interval));
    let shared = Arc::new(Shared {
        stats: Arc::default(),
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
}
