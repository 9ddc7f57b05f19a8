//! Starting and stopping the proxy path inside the daemon: the service table from the
//! configuration (TCP to a cluster, HTTP routes of a discovery chain, ORIGINAL_DST), the
//! listener, and the kernel's redirect target; and the proxy path's traits implemented for the
//! data path's types (the kernel's original-destination map, proxy-pair splicing).
//!
//! Order matters for the kernel: the listener is bound and published (`abi::maps::SETTINGS`)
//! once the clusters have their first hosts, and on shutdown the listener is withdrawn first,
//! then the proxy accepts for [`WITHDRAW_GRACE`] more before it stops: a connect is redirected
//! to a listener that takes it, or (no listener there) served by the kernel as its
//! `SERVICE_F_NO_PROXY_*` flag says, or refused; never sent to a listener about to close.
//! Between two daemons (a restart, or a `kill -9` and the next start) the kernel serves a
//! proxy-mode TCP service straight to its hosts. Under a service manager that keeps the
//! listener in its file-descriptor store (`crate::fd_store`) the listener never closes: the
//! stop leaves it published, connects wait in its queue, and the next daemon accepts them.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context as _;
use proxy_chain::TargetLeg;
use proxy_common::socket::PairFlow;
use proxy_core::{
    chain,
    config::{Config, ServiceMode},
    lb::Balancer,
    upstream::Upstream,
};
use proxy_relay::{
    self as proxy_path, ClusterHandle, OriginalDst, PairSide, ProxyConfig, ProxyDeps, ProxyHandle,
    RouteTable, Service, ServiceTable, SpliceControl, SpliceError, SpliceGuard, SpliceMode,
    Splicer, UpgradePolicy,
};
use tokio::net::TcpStream;
use tracing::{info, warn};

use super::{SharedDataplane, takeover::Inherited};
use crate::{
    dataplane::{OriginalDestinations, PairGuard, PairSplicer},
    notify::Notifier,
};

/// Listening sockets the proxy path may start on instead of binding its own.
pub struct Adopt<'a> {
    /// The sockets a takeover handed over.
    pub inherited: Option<Inherited>,
    /// The service manager, with the sockets its file-descriptor store passed back.
    pub manager: &'a Notifier,
}

impl<'a> Adopt<'a> {
    /// What the proxy path may start on.
    pub fn new(inherited: Option<Inherited>, manager: &'a Notifier) -> Self {
        Self { inherited, manager }
    }
}

/// Starts the proxy path when the configuration uses it or its file declares it (`declared`:
/// a proxy-mode service waits for a dynamic source; `None` otherwise), and points the
/// kernel's proxy-mode redirect at its listeners, once the clusters have their first hosts
/// (bounded by `FIRST_PUBLISH_WAIT`). After a takeover (`inherited`) it accepts on the sockets
/// the previous daemon handed over (which accepts on them meanwhile), and then tells that
/// daemon to drain; after a restart under a service manager, on the sockets its store kept.
/// The listener then goes (back) into `manager`'s store when it has one.
pub async fn start(
    config: &Config,
    declared: bool,
    upstreams: &BTreeMap<String, Arc<Upstream>>,
    dp: &SharedDataplane,
    Adopt {
        mut inherited,
        manager,
    }: Adopt<'_>,
) -> anyhow::Result<Option<ProxyHandle>> {
    let stored = manager.take_passed();
    if !(config.uses_proxy() || declared) {
        if let Some(inherited) = inherited {
            inherited.serving();
        }
        // Nothing listens: a stored listener of an earlier configuration leaves the store.
        manager.store_listeners(&[]);
        return Ok(None);
    }
    let proxy_config = config.effective_proxy();
    let deps = deps(config, upstreams, dp, &proxy_config)?;
    // Accepting before the clusters have hosts would reset connections: after a takeover the
    // previous daemon accepts meanwhile, after a restart or a first start the kernel serves
    // the services' hosts itself (or nothing redirects yet). The kernel finds a listener as
    // soon as it is bound (a killed daemon left its address in the settings).
    clusters_initialized(upstreams).await;
    let handle = match inherited.as_mut().map(Inherited::take_listeners) {
        Some(sockets) => proxy_path::serve_inherited(proxy_config, deps, sockets).await?,
        None if !stored.is_empty() => proxy_path::serve_stored(proxy_config, deps, stored).await?,
        None => proxy_path::serve(proxy_config, deps).await?,
    };
    let sockets = handle.handover().sockets();
    match sockets {
        Ok(sockets) => {
            manager.store_listeners(&sockets);
        }
        Err(err) => warn!(%err, "cannot store the proxy listener with the service manager"),
    }
    let (v4, v6) = first_per_family(handle.local_addrs());
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dp = guard.as_mut().context("the data path is not attached")?;
    for addr in [v4, v6].into_iter().flatten() {
        dp.set_proxy_listener(addr)
            .with_context(|| format!("publishing the proxy listener {addr} to the kernel"))?;
    }
    info!(listeners = ?handle.local_addrs(), "proxy path ready");
    if let Some(inherited) = inherited {
        inherited.serving();
    }
    Ok(Some(handle))
}

/// What the proxy path of `config` needs: its service table over `upstreams`, and the data
/// path's original destinations and splicer.
fn deps(
    config: &Config,
    upstreams: &BTreeMap<String, Arc<Upstream>>,
    dp: &SharedDataplane,
    proxy_config: &ProxyConfig,
) -> anyhow::Result<ProxyDeps> {
    let services = service_table(config, upstreams, proxy_config)?;
    let guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dp = guard.as_ref().context("the data path is not attached")?;
    let splicer: Option<Arc<dyn Splicer>> = match proxy_config.splice {
        SpliceMode::Copy => None,
        SpliceMode::Kernel => Some(Arc::new(
            dp.pair_splicer()
                .context("proxy.splice: kernel needs the kernel's proxy-pair splicing")?,
        )),
    };
    Ok(ProxyDeps {
        original_dst: Arc::new(dp.original_destinations()),
        services,
        splicer,
    })
}

/// A reload that changed the proxy path's services: a proxy with the table of `config` over
/// `upstreams` (the clusters as they will run after the reload) takes over `running`'s
/// listening sockets, stats and handover place. `running` is left to drain
/// ([`ProxyHandle::shutdown`]); on error nothing changed. The listener addresses stay (a
/// change of `proxy` needs a restart), so the kernel's redirect target stays too.
///
/// The successor serves only once every cluster it reads has its first discovery result
/// (bounded by `FIRST_PUBLISH_WAIT`), as Envoy warms a changed cluster before it replaces the
/// old one: until then `running` serves on its routes. A cluster that has not delivered yet has
/// no host, and a connection the successor took then would be reset.
pub async fn successor(
    running: &mut ProxyHandle,
    config: &Config,
    upstreams: &BTreeMap<String, Arc<Upstream>>,
    dp: &SharedDataplane,
) -> anyhow::Result<ProxyHandle> {
    clusters_initialized(upstreams).await;
    let deps = deps(config, upstreams, dp, &config.effective_proxy())?;
    running
        .successor(deps)
        .await
        .context("starting the proxy path with the new services")
}

/// Waits (at most `FIRST_PUBLISH_WAIT`) until every cluster has its first discovery result.
async fn clusters_initialized(upstreams: &BTreeMap<String, Arc<Upstream>>) {
    let all = async {
        for upstream in upstreams.values() {
            let _ = upstream.initialized().wait_for(|i| *i).await;
        }
    };
    if tokio::time::timeout(super::publish::FIRST_PUBLISH_WAIT, all)
        .await
        .is_err()
    {
        warn!(
            "clusters not initialized within {:?}; the proxy path serves with what they have",
            super::publish::FIRST_PUBLISH_WAIT
        );
    }
}

/// How long the proxy accepts after its listener was withdrawn from the kernel. A connect that
/// read the listener just before lands in its accept queue a moment later (one program run and
/// a loopback handshake); closing the listener then would reset it.
pub const WITHDRAW_GRACE: Duration = Duration::from_millis(50);

/// Withdraws the kernel's redirect target (from now on the kernel serves proxy-mode connects
/// itself where it can, see `SERVICE_F_NO_PROXY_HOSTS`, and refuses the others), accepts for
/// [`WITHDRAW_GRACE`] more, then drains the proxy's connections until its shutdown deadline.
///
/// With `stored` (the service manager keeps the listening sockets open) the redirect target
/// stays: the proxy stops accepting at once and drains, and connects from then on wait in the
/// sockets' queues for the next daemon, which takes the sockets from the store. Closing this
/// daemon's descriptors closes no socket, so nothing queued is reset.
pub async fn stop(handle: ProxyHandle, dp: &SharedDataplane, stored: bool) {
    if stored {
        info!("the service manager keeps the proxy listener: connects wait for the next daemon");
        let outcome = handle.shutdown().await;
        info!(?outcome, "proxy path drained");
        return;
    }
    {
        let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(dp) = guard.as_mut() {
            for ipv6 in [false, true] {
                if let Err(err) = dp.runtime().clear_proxy_listener(ipv6) {
                    warn!(%err, ipv6, "withdrawing the proxy listener from the kernel failed");
                }
            }
        }
    }
    tokio::time::sleep(WITHDRAW_GRACE).await;
    let outcome = handle.shutdown().await;
    info!(?outcome, "proxy path drained");
}

/// The first IPv4 and the first IPv6 listener address: connect4 redirects to the one, connect6
/// to the other.
fn first_per_family(addrs: &[SocketAddr]) -> (Option<SocketAddr>, Option<SocketAddr>) {
    (
        addrs.iter().copied().find(SocketAddr::is_ipv4),
        addrs.iter().copied().find(SocketAddr::is_ipv6),
    )
}

/// What the proxy does for each proxy-mode service, and for other destinations.
fn service_table(
    config: &Config,
    upstreams: &BTreeMap<String, Arc<Upstream>>,
    proxy: &ProxyConfig,
) -> anyhow::Result<ServiceTable> {
    let mut table = ServiceTable::new();
    for svc in config
        .services
        .iter()
        .filter(|s| s.mode == ServiceMode::Proxy)
    {
        let service = match config.chains.get(&svc.name) {
            Some(compiled) => {
                let cluster_of = |t: &TargetLeg| target_handle(config, upstreams, proxy, t);
                let routes = RouteTable::from_chain(compiled, &cluster_of)
                    .with_context(|| format!("service {}: HTTP routes of its chain", svc.name))?
                    .with_upgrades(UpgradePolicy::from_config(&svc.upgrade_configs))
                    .with_hash_policy(&svc.hash_policy);
                Service::Http(Arc::new(routes))
            }
            None => match cluster_service(config, upstreams, proxy, &svc.cluster)? {
                // Validation leaves a TCP service only source-IP hash policies.
                Service::Tcp(c) => Service::Tcp(
                    c.with_connect_attempts(svc.connect_attempts())
                        .with_source_ip_hash(!svc.hash_policy.is_empty()),
                ),
                other => other,
            },
        };
        table.insert(SocketAddr::new(svc.address, svc.port), service);
    }
    if let Some(name) = &proxy.fallback_cluster {
        table.set_fallback(cluster_service(config, upstreams, proxy, name)?);
    }
    Ok(table)
}

/// A service served by one cluster: ORIGINAL_DST, or TCP to the cluster's hosts.
fn cluster_service(
    config: &Config,
    upstreams: &BTreeMap<String, Arc<Upstream>>,
    proxy: &ProxyConfig,
    cluster: &str,
) -> anyhow::Result<Service> {
    if config.is_original_dst(cluster) {
        return Ok(Service::OriginalDst {
            http: proxy.use_http_header,
        });
    }
    let upstream = upstreams
        .get(cluster)
        .with_context(|| format!("cluster {cluster} is not running"))?;
    Ok(Service::Tcp(handle(config, upstream, proxy)))
}

/// The proxy's handle on a running cluster, with the cluster's connect timeout and lb policy.
fn handle(config: &Config, upstream: &Upstream, proxy: &ProxyConfig) -> ClusterHandle {
    let handle = ClusterHandle::from_upstream(upstream, proxy.pool_idle_timeout);
    match config.cluster(upstream.name()) {
        Some(c) => handle
            .with_policy(c.connect_timeout, c.lb_policy)
            .with_balancer(Balancer::of_cluster(
                c.lb_policy,
                c.ring_hash_lb_config.as_ref(),
                c.maglev_lb_config.as_ref(),
            ))
            .with_close_on_health_failure(c.close_connections_on_host_health_failure),
        None => handle,
    }
}

/// The hosts of one chain target: its cluster, narrowed to the target's subset and Consul's
/// health rule when it has a filter or `OnlyPassing` (a view the cluster's event loop keeps
/// current, [`Upstream::routing_view`]).
fn target_handle(
    config: &Config,
    upstreams: &BTreeMap<String, Arc<Upstream>>,
    proxy: &ProxyConfig,
    target: &TargetLeg,
) -> Option<ClusterHandle> {
    let has = |c: &str| upstreams.contains_key(c);
    let cluster = chain::target_cluster(target, &config.datacenter, &has).ok()?;
    let upstream = upstreams.get(&cluster)?;
    let handle = handle(config, upstream, proxy);
    if target.filter.is_none() && !target.only_passing {
        return Some(handle);
    }
    let target = target.clone();
    let routing = upstream.routing_view(move |routing| chain::target_routing(&target, routing));
    Some(handle.with_routing(routing, proxy.pool_idle_timeout))
}

/// The kernel's map (connect4/6 record the destination, sockops re-keys it by 4-tuple).
impl OriginalDst for OriginalDestinations {
    fn lookup(&self, peer: SocketAddr, local: SocketAddr) -> Option<SocketAddr> {
        OriginalDestinations::lookup(self, peer, local)
    }
}

/// The kernel's proxy-pair splicing.
impl Splicer for PairSplicer {
    fn splice(&self, client: &TcpStream, upstream: &TcpStream) -> Result<SpliceGuard, SpliceError> {
        PairSplicer::splice(self, client, upstream)
            .map(SpliceGuard::new)
            .map_err(Into::into)
    }
}

impl SpliceControl for PairGuard {
    fn flow(&self, side: PairSide) -> std::io::Result<PairFlow> {
        PairGuard::flow(self, side).map_err(std::io::Error::other)
    }

    fn regrant(&self, side: PairSide, sent: u64, drained: u64) -> std::io::Result<()> {
        PairGuard::regrant(self, side, sent, drained).map_err(std::io::Error::other)
    }
}
