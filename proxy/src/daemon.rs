//! The run loop: configuration in, data path attached, clusters discovered and health-checked,
//! the proxy path started when services use it, services published on every change of their
//! routable hosts, admin served, clean stop.

mod proxy_path;
mod reload;
mod takeover;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context as _;
use proxy_common::service::{
    PROTO_TCP, PROTO_UDP, SERVICE_F_LEAST_REQUEST, SERVICE_F_MAGLEV, SERVICE_F_PANIC,
    SERVICE_F_PASSIVE, SERVICE_F_PROXY, SERVICE_F_ROUND_ROBIN, ServiceKey,
};
use proxy_core::{
    chain::{self, ChainPlan},
    config::{Config, LbPolicy, Protocol, Service, ServiceMode},
    discovery::{guard::HostGuard, xds::XdsClients},
    health::{HealthCheckManager, Routing},
    lb,
    upstream::Upstream,
};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tracing::{error, info, warn};

pub use self::takeover::{TakeoverError, remove_stale_socket as remove_stale_takeover_socket};
use crate::{
    admin::{self, ReloadRefused, ReloadRequest},
    dataplane::{self, Dataplane, DataplaneOptions, ServiceSpec},
    privileges,
};

/// How long start-up waits for every service's first publish before it removes what a previous
/// run left behind; a service whose cluster is still resolving is published when it is ready.
const FIRST_PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// The data path, shared by the publishers and the admin interface; `None` after shutdown.
pub type SharedDataplane = Arc<Mutex<Option<Dataplane>>>;

/// The configuration in force and its running clusters, as the admin interface and the passive
/// feed read them; a reload replaces both.
#[derive(Clone)]
pub struct Live {
    pub config: Arc<Config>,
    pub upstreams: BTreeMap<String, Arc<Upstream>>,
}

/// The keys of the services published at least once (under any configuration of this run).
type PublishedTx = watch::Sender<BTreeSet<ServiceKey>>;

/// Runs the daemon until SIGINT or SIGTERM, then drains the proxy path and exits, leaving the
/// kernel's data path attached and serving the last published state for the next start
/// (`proxy uninstall` removes it). With `launch.takeover` it first takes the instance over from
/// the daemon running it, and it hands the instance over in turn when a new daemon asks
/// (`takeover`: no refused connect on the proxy path either way).
/// `workers` is the runtime's thread count; by default one per CPU the daemon may run on.
///
/// The data path is attached on the calling thread before any other thread exists, and the
/// process then drops every capability it no longer needs (`crate::privileges`): capabilities
/// are per thread, so the runtime's and the proxy engine's threads start with the reduced sets.
/// `launch` is what `/server_info` shows and the log filter `/logging` changes.
pub fn run(
    mut config: Config,
    workers: Option<usize>,
    mut launch: admin::Launch,
) -> anyhow::Result<()> {
    // The proxy's epoll engine runs as many threads as the runtime.
    config.proxy.engine_threads = workers.and_then(std::num::NonZeroUsize::new);
    let workers = workers.unwrap_or_else(default_workers);
    launch.concurrency = workers;
    tracing::debug!(workers, "runtime");
    let fatal = Fatal::install();
    let templates = SpecTemplate::all(&config);
    let opts = DataplaneOptions {
        cgroup: dataplane::resolve_cgroup(&config.cgroup)?,
        bpffs: PathBuf::from(&config.bpffs),
        instance: config.instance.clone(),
        follow_sockets: needs_sockops(&config, &templates),
        kernel_log: config.kernel_log,
    };
    // `--takeover`: the running daemon hands over before the instance's lock is taken.
    let inherited = takeover::request(&config, launch.takeover)
        .context("taking over from the running daemon")?;
    let dp: SharedDataplane = Arc::new(Mutex::new(Some(
        takeover::open_dataplane(&opts, inherited.is_some()).context("attaching the data path")?,
    )));
    let privileged = || -> anyhow::Result<()> {
        check_round_robin(&templates, &dp)?;
        configure_splice(&config, &dp)?;
        let have = privileges::ThreadCaps::current()?;
        privileges::drop_to(&privileges::needed(&config, &have))
            .context("dropping capabilities after attaching the data path")?;
        Ok(())
    };
    let runtime = privileged().and_then(|()| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .context("starting the tokio runtime")
    });
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(err) => {
            abandon(&dp);
            return Err(err);
        }
    };
    runtime.block_on(async {
        let result = run_async(config, templates, dp.clone(), fatal, launch, inherited).await;
        // An early error removes what this run created and keeps what it adopted. The stop
        // released the data path already; after a failed part (`Fatal`) it stays serving too,
        // released here so that no handle's drop detaches anything (sk_msg) on the way out.
        match &result {
            Err(err) if !err.is::<Failed>() => abandon(&dp),
            _ => release(&dp),
        }
        result
    })
}

/// The error `run` returns after a part of the daemon failed: the data path stays pinned.
#[derive(Debug, thiserror::Error)]
#[error("a part of the daemon failed ({0}); the data path stays pinned for the next start")]
struct Failed(String);

/// Any panic, on any thread or task of the daemon (an engine thread, a cluster's loop, a
/// publisher): a bug, after which part of the daemon no longer runs while the rest would report
/// ready. The panic hook records it; the daemon then takes `/ready` down, logs what panicked
/// and exits non-zero, leaving the kernel's data path pinned with the last published state (as
/// after `kill -9`), which the next start adopts.
#[derive(Clone)]
pub struct Fatal(watch::Receiver<Option<String>>);

impl Fatal {
    /// Installs the process's panic hook (it runs the default one, which prints the panic,
    /// first). `run` does this; call it once per process.
    pub fn install() -> Self {
        let (tx, rx) = watch::channel(None);
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            default(info);
            let thread = std::thread::current();
            let what = format!(
                "thread {} panicked: {info}",
                thread.name().unwrap_or("unnamed")
            );
            tx.send_if_modified(|first| {
                // The first panic is the cause; later ones follow from it.
                first.is_none().then(|| *first = Some(what)).is_some()
            });
        }));
        Self(rx)
    }

    /// What panicked, once something did.
    pub fn cause(&self) -> Option<String> {
        self.0.borrow().clone()
    }

    /// Resolves with what panicked.
    async fn wait(mut self) -> String {
        loop {
            if let Some(what) = self.cause() {
                return what;
            }
            if self.0.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// One worker per CPU in the daemon's affinity mask (`sched_getaffinity`, which is what
/// `available_parallelism` reads), or 2 if that cannot be read.
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

async fn run_async(
    config: Config,
    templates: Vec<SpecTemplate>,
    dp: SharedDataplane,
    fatal: Fatal,
    launch: admin::Launch,
    inherited: Option<takeover::Inherited>,
) -> anyhow::Result<()> {
    let mut signals = Signals::install()?;
    let config_path = launch.config_path.clone();
    // First, so that records of the start (a connect refused before its service is published)
    // are shown too.
    let kernel_log = take_kernel_log(&dp).map(|log| tokio::spawn(crate::kernel_log::run(log)));
    // The sweep after the first publish keeps exactly these services.
    let keys: Vec<ServiceKey> = templates.iter().map(|t| t.key).collect();
    let ctx = Context {
        follow_sockets: needs_sockops(&config, &templates),
        manager: HealthCheckManager::default(),
        guard: host_guard(&config),
        dp: dp.clone(),
        published: watch::channel(BTreeSet::new()).0,
    };
    let xds = XdsClients::start(&config).context("starting the xDS clients")?;
    let upstreams = start_upstreams(&config, &ctx, &xds, &BTreeSet::new())?;
    // The proxy listener is live and known to the kernel before a service is published in
    // proxy mode.
    let proxy = proxy_path::start(&config, &upstreams, &dp, inherited)
        .await
        .context("starting the proxy path")?;
    let mut running = Running {
        config,
        upstreams,
        xds,
        publishers: BTreeMap::new(),
        proxy,
        draining: Vec::new(),
    };
    for (svc, spec) in running.config.services.clone().iter().zip(templates) {
        running.spawn_publisher(svc, spec, &ctx);
    }
    let (live_tx, live_rx) = watch::channel(running.live());
    let (reload_tx, mut reload_rx) = mpsc::channel::<ReloadRequest>(4);
    let mut state = admin::State::new(
        running.config.clone(),
        dp.clone(),
        running.upstreams.clone(),
        ctx.published.subscribe(),
    )
    .with_reload(live_rx.clone(), reload_tx);
    if let Some(proxy) = &running.proxy {
        state = state.with_proxy(proxy.stats_handle());
    }
    state = state.with_fatal(fatal.clone()).with_launch(launch);
    let admin_address = running.config.admin.address.clone();
    let server = match admin::serve(&admin_address, state).await {
        Ok(server) => server,
        Err(err) => {
            if let Some(proxy) = running.proxy.take() {
                proxy_path::stop(proxy, &dp).await;
            }
            return Err(err).context(format!("admin listener on {admin_address}"));
        }
    };
    sweep_after_first_publish(&keys, &dp, ctx.published.subscribe()).await;
    let passive = tokio::spawn(crate::passive::run(dp.clone(), live_rx));
    let reaper = tokio::spawn(reap(dp.clone()));
    let mut traffic = spawn_traffic(&running.config, &ctx);
    // Takeover: a new daemon may ask for the instance from now on (a reload keeps its sockets).
    let mut takeover = takeover::Server::start(&running.config, running.proxy.as_ref());
    info!(admin = %admin_address, services = running.config.services.len(), "ready");
    let committed = loop {
        let request = tokio::select! {
            signal = signals.wait() => match signal {
                Signal::Stop => break None,
                Signal::Reload => None,
            },
            committed = takeover.committed() => break Some(committed),
            Some(request) = reload_rx.recv() => {
                info!("admin: reload requested");
                Some(request)
            }
            what = fatal.clone().wait() => {
                // /ready is down already (the admin reads the same record). No clean-up: the
                // data path keeps serving what was published, and the next start adopts it.
                error!(%what, "a part of the daemon failed; exiting with the data path left pinned for the next start");
                return Err(Failed(what).into());
            }
        };
        let outcome = running.reload(config_path.as_deref(), &ctx).await;
        match &outcome {
            Ok(summary) => {
                info!(%summary, "configuration reloaded");
                live_tx.send_replace(running.live());
                traffic.abort();
                traffic = spawn_traffic(&running.config, &ctx);
            }
            Err(refused) => error!(%refused, "reload refused; the configuration in force stays"),
        }
        // Applied or refused, the reload built a second configuration and dropped one; the
        // memory goes back before the answer, so what a caller measures then is what stays.
        let _ = tokio::task::spawn_blocking(crate::sys::release_free_memory).await;
        if let Some(request) = request {
            let _ = request.send(outcome);
        }
    };
    // Removes the admin socket file, when the admin interface is on one.
    server.stop().await;
    passive.abort();
    reaper.abort();
    traffic.abort();
    if let Some(kernel_log) = kernel_log {
        kernel_log.abort();
    }
    finish(committed, takeover, running, &dp).await
}

/// The end of the run. After a takeover's commit: hand the instance over
/// ([`takeover::hand_over`]), the clusters serving the drain. Otherwise the stop: drain the
/// proxy path and leave the kernel serving the last published state for the next start.
async fn finish(
    committed: Option<takeover::Committed>,
    takeover: takeover::Server,
    mut running: Running,
    dp: &SharedDataplane,
) -> anyhow::Result<()> {
    let proxy = running.proxy.take();
    if let Some(committed) = committed {
        // Nothing of this daemon publishes from here.
        running.publishers.values().for_each(JoinHandle::abort);
        let handed = takeover::hand_over(committed, takeover, proxy, dp).await;
        running.stop().await;
        return handed;
    }
    drop(takeover);
    if let Some(proxy) = proxy {
        proxy_path::stop(proxy, dp).await;
    }
    running.stop().await;
    // The kernel keeps serving the last published state; the next start adopts it.
    release(dp);
    Ok(())
}

/// The traffic feed of health checking for the services of `config`.
fn spawn_traffic(config: &Config, ctx: &Context) -> JoinHandle<()> {
    let watched = crate::traffic::watched(config);
    tokio::spawn(crate::traffic::run(
        ctx.dp.clone(),
        ctx.manager.clone(),
        watched,
    ))
}

/// The reader of the kernel's log records, when `kernel_log` is not off.
fn take_kernel_log(dp: &SharedDataplane) -> Option<crate::kernel_log::KernelLog> {
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    guard.as_mut()?.take_kernel_log()
}

/// What every configuration of the run shares: the data path and how it was attached, the
/// health checker, the host guard, the record of published services.
struct Context {
    /// Whether this run attached sockops (a reload cannot add it).
    follow_sockets: bool,
    manager: HealthCheckManager,
    guard: HostGuard,
    dp: SharedDataplane,
    published: PublishedTx,
}

/// The configuration in force and what it started.
struct Running {
    config: Config,
    upstreams: BTreeMap<String, Arc<Upstream>>,
    xds: XdsClients,
    /// Each service's publisher, by kernel key.
    publishers: BTreeMap<ServiceKey, JoinHandle<()>>,
    /// The proxy path, when the configuration uses it.
    proxy: Option<proxy_relay::ProxyHandle>,
    /// Proxies a reload replaced, draining their live connections (each until its
    /// `shutdown_timeout` at most).
    draining: Vec<JoinHandle<()>>,
}

impl Running {
    fn live(&self) -> Live {
        Live {
            config: Arc::new(self.config.clone()),
            upstreams: self.upstreams.clone(),
        }
    }

    /// Starts the publisher of `svc` (its kernel entry is rewritten whenever a cluster it reads
    /// changes).
    fn spawn_publisher(&mut self, svc: &Service, spec: SpecTemplate, ctx: &Context) {
        let clusters = self.config.service_clusters(svc);
        // Both paths wait for the clusters behind the service before its first publish: the
        // kernel's levels are built from them, and a proxy-mode service's redirect sends
        // connections to a proxy that reads them (a connection it took before their first
        // hosts would be reset). /ready, which waits for every first publish, then means that
        // every service serves.
        let warm: Vec<watch::Receiver<bool>> = clusters
            .iter()
            .filter_map(|name| Some(self.upstreams.get(name)?.initialized()))
            .collect();
        // A proxy-mode service is only a redirect in the kernel: the proxy reads its clusters.
        let kernel_clusters = match svc.mode {
            ServiceMode::Direct => clusters,
            ServiceMode::Proxy => Vec::new(),
        };
        let inputs: Vec<ClusterInput> = kernel_clusters
            .into_iter()
            .filter_map(|name| {
                let routing = self.upstreams.get(&name)?.routing();
                Some(ClusterInput { name, routing })
            })
            .collect();
        let key = spec.key;
        let task = tokio::spawn(publish_loop(
            spec,
            inputs,
            warm,
            ctx.dp.clone(),
            ctx.published.clone(),
        ));
        self.publishers.insert(key, task);
    }

    /// SIGHUP or `POST /reload`: re-reads the configuration file and applies what changed.
    /// Nothing changes unless the whole difference can be applied: a file that does not
    /// validate, a change that needs a restart, or a cluster that cannot start is refused
    /// first. Clusters and services that did not change keep running untouched: their health
    /// state, DNS timers, Consul watches and xDS streams, and their kernel entries.
    async fn reload(
        &mut self,
        path: Option<&std::path::Path>,
        ctx: &Context,
    ) -> Result<String, ReloadRefused> {
        let Some(path) = path.map(std::path::Path::to_owned) else {
            return Err(ReloadRefused::Failed(
                "the daemon was started without --config: there is no file to re-read".to_owned(),
            ));
        };
        let loaded = tokio::task::spawn_blocking(move || crate::load_config(&path))
            .await
            .map_err(|err| ReloadRefused::Failed(format!("reading the configuration: {err}")))?;
        let mut new = loaded.map_err(|err| ReloadRefused::Invalid(err.to_string()))?;
        // The thread count comes from the command line, not the file.
        new.proxy.engine_threads = self.config.proxy.engine_threads;
        let templates = SpecTemplate::all(&new);
        let plan = reload::plan(
            &self.config,
            &new,
            ctx.follow_sockets,
            needs_sockops(&new, &templates),
            service_key,
        )
        .map_err(|err| ReloadRefused::NeedsRestart(err.to_string()))?;
        check_round_robin(&templates, &ctx.dp)
            .map_err(|err| ReloadRefused::NeedsRestart(format!("{err:#}")))?;
        if plan.is_empty() {
            self.config = new;
            return Ok(format!("no change ({})", plan.summary()));
        }
        // Everything that can fail happens before the first change.
        let xds_failed = |err| ReloadRefused::Failed(format!("starting the xDS clients: {err}"));
        // A restart, or clusters added on the running streams (taken back if the reload is
        // refused below) and removed at the commit.
        let (fresh_xds, xds_change) = if plan.xds_restart {
            (Some(XdsClients::start(&new).map_err(xds_failed)?), None)
        } else {
            let change = self.xds.prepare(&self.config, &new).map_err(xds_failed)?;
            (change.as_ref().map(XdsClients::preview), change)
        };
        let started = start_upstreams(
            &new,
            ctx,
            fresh_xds.as_ref().unwrap_or(&self.xds),
            &plan.start,
        )
        .map_err(|err| ReloadRefused::Failed(format!("{err:#}")))?;
        let successor = match (&mut self.proxy, plan.proxy_path) {
            (Some(proxy), true) => {
                // The clusters as they run after the reload.
                let mut after = self.upstreams.clone();
                after.retain(|name, _| !plan.stop.contains(name));
                after.extend(started.iter().map(|(k, v)| (k.clone(), v.clone())));
                let next = proxy_path::successor(proxy, &new, &after, &ctx.dp)
                    .await
                    .map_err(|err| ReloadRefused::Failed(format!("{err:#}")))?;
                Some(next)
            }
            _ => None,
        };
        // Apply: the publishers that go stop first (a stopped publisher writes nothing more),
        // then the new clusters replace the old, then the new publishers write over the old
        // entries (one generation flip each: the kernel never sees a half-written set).
        for key in plan.publish.iter().chain(&plan.remove) {
            if let Some(task) = self.publishers.remove(key) {
                task.abort();
                let _ = task.await;
            }
        }
        for name in &plan.stop {
            self.upstreams.remove(name);
        }
        self.upstreams.extend(started);
        if let Some(next) = successor {
            // New proxy-mode connections take the new table from here (the successor serves
            // on the same sockets); the old proxy's live connections drain on theirs.
            if let Some(old) = self.proxy.replace(next) {
                self.draining.retain(|task| !task.is_finished());
                self.draining.push(tokio::spawn(async move {
                    let outcome = old.shutdown().await;
                    info!(
                        ?outcome,
                        "the proxy path's previous services drained after a reload"
                    );
                }));
            }
        }
        let xds_summary = xds_change.as_ref().map(|c| (c.is_empty(), c.summary()));
        match xds_change {
            // The removed clusters stopped above: their subscriptions go now.
            Some(change) => self.xds = change.commit(),
            None => {
                if let Some(xds) = fresh_xds {
                    self.xds = xds;
                }
            }
        }
        self.config = new;
        let services = self.config.services.clone();
        for (svc, spec) in services.iter().zip(templates) {
            if plan.publish.contains(&spec.key) {
                self.spawn_publisher(svc, spec, ctx);
            }
        }
        ctx.published
            .send_modify(|published| published.retain(|k| !plan.remove.contains(k)));
        let keys: Vec<ServiceKey> = services.iter().map(service_key).collect();
        // Removed services go once the new set is in (bounded, as at start).
        sweep_after_first_publish(&keys, &ctx.dp, ctx.published.subscribe()).await;
        Ok(match xds_summary {
            Some((false, xds)) => format!("{}; {xds}", plan.summary()),
            _ => plan.summary(),
        })
    }

    /// Stops every publisher, cluster and xDS connection, after the drains of proxies a
    /// reload replaced (each bounded by its `shutdown_timeout`).
    async fn stop(self) {
        for task in self.publishers.values() {
            task.abort();
        }
        for task in self.publishers.into_values() {
            let _ = task.await;
        }
        for task in self.draining {
            let _ = task.await;
        }
        drop(self.upstreams);
        drop(self.xds);
    }
}

/// No source may point the data path at the daemon itself.
fn host_guard(config: &Config) -> HostGuard {
    let mut own: Vec<SocketAddr> = config.admin.address.tcp().into_iter().collect();
    own.extend(&config.proxy.listeners);
    HostGuard::new(own)
}

/// Starts discovery and health for the clusters of `config` named in `only` (all when it is
/// empty); EDS clusters subscribe over their xDS connection.
fn start_upstreams(
    config: &Config,
    ctx: &Context,
    xds: &XdsClients,
    only: &BTreeSet<String>,
) -> anyhow::Result<BTreeMap<String, Arc<Upstream>>> {
    let mut upstreams = BTreeMap::new();
    for cluster in &config.clusters {
        // ORIGINAL_DST hosts are the proxied connections' destinations, kept by the proxy path.
        if config.is_original_dst(&cluster.name)
            || (!only.is_empty() && !only.contains(&cluster.name))
        {
            continue;
        }
        let upstream = Upstream::spawn_in(cluster, &ctx.manager, xds, &ctx.guard)?;
        upstreams.insert(cluster.name.clone(), Arc::new(upstream));
    }
    Ok(upstreams)
}

/// Waits until every service was published once (bounded), then removes services, tables and
/// backends a previous run left that this configuration does not have (its services are
/// `keys`), and the pins an earlier version of the daemon left (`proxy_common::abi::RETIRED`).
/// Until then, an adopted previous state keeps serving, and a rollback to the earlier version
/// would still find its maps.
async fn sweep_after_first_publish(
    keys: &[ServiceKey],
    dp: &SharedDataplane,
    mut published: watch::Receiver<BTreeSet<ServiceKey>>,
) {
    // Checked after every first publish: keys found in are not looked up again. Looking every
    // key up each time is quadratic in services, and ran on the workers the publishers need.
    let mut found = 0;
    let all_in = |set: &BTreeSet<ServiceKey>| {
        while keys.get(found).is_some_and(|k| set.contains(k)) {
            found += 1;
        }
        found == keys.len()
    };
    let waited = tokio::time::timeout(FIRST_PUBLISH_WAIT, published.wait_for(all_in)).await;
    if waited.is_err() {
        warn!("not every service was published within {FIRST_PUBLISH_WAIT:?}; sweeping anyway");
    }
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(dp) = guard.as_mut() {
        if let Err(err) = dp.publisher().sweep(keys) {
            warn!(%err, "sweeping state of a previous run failed");
        }
        dp.remove_retired_pins();
    }
}

/// One cluster a service's kernel entry reads.
struct ClusterInput {
    name: String,
    routing: watch::Receiver<Routing>,
}

/// Publishes one service whenever the routing of a cluster it reads changes (the publisher
/// itself skips writes when the kernel already has exactly this).
/// Until `warm` (the service's clusters' `initialized`) all hold, an adopted previous state (or
/// nothing) is better than an empty host set; after `FIRST_PUBLISH_WAIT`, it publishes what
/// there is.
async fn publish_loop(
    template: SpecTemplate,
    mut inputs: Vec<ClusterInput>,
    mut warm: Vec<watch::Receiver<bool>>,
    dp: SharedDataplane,
    published: PublishedTx,
) {
    let all_initialized = async {
        for initialized in &mut warm {
            let _ = initialized.wait_for(|i| *i).await;
        }
    };
    if tokio::time::timeout(FIRST_PUBLISH_WAIT, all_initialized)
        .await
        .is_err()
    {
        warn!(service = %template.name, "clusters not initialized within {FIRST_PUBLISH_WAIT:?}; publishing what they have");
    }
    let mut first = true;
    loop {
        let spec = template.with(&inputs);
        let result = {
            let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match guard.as_mut() {
                Some(dp) => dp.publisher().publish(&spec).map(Some),
                None => return,
            }
        };
        match result {
            Ok(_) if first => {
                first = false;
                published.send_modify(|set| {
                    set.insert(spec.key);
                });
            }
            Ok(_) => {}
            Err(err) => {
                warn!(service = %spec.name, %err, "publish failed; the previous host set stays live");
            }
        }
        if !any_changed(&mut inputs).await {
            return;
        }
        // Coalesce a burst of changes into one publish: what changed meanwhile is read now.
        for input in &mut inputs {
            input.routing.borrow_and_update();
        }
    }
}

/// Waits on every input's own routing receiver until one changes; false once every input's
/// cluster is gone (at once when there is none).
async fn any_changed(inputs: &mut [ClusterInput]) -> bool {
    let mut waits: Vec<_> = inputs
        .iter_mut()
        .map(|input| Some(Box::pin(input.routing.changed())))
        .collect();
    std::future::poll_fn(|cx| {
        let mut open = false;
        for slot in &mut waits {
            let Some(wait) = slot else { continue };
            match wait.as_mut().poll(cx) {
                std::task::Poll::Ready(Ok(())) => return std::task::Poll::Ready(true),
                // That cluster stopped; a finished future must not be polled again.
                std::task::Poll::Ready(Err(_)) => *slot = None,
                std::task::Poll::Pending => open = true,
            }
        }
        if open {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(false)
        }
    })
    .await
}

/// The parts of a service's kernel entry that do not depend on its hosts.
struct SpecTemplate {
    name: String,
    key: ServiceKey,
    flags: u32,
    /// The chain's plan, for a chain service.
    plan: Option<ChainPlan>,
    /// Where a refused share of connections is sent: the unspecified address of the service's
    /// family, port 0, which the kernel's connect refuses (ECONNREFUSED).
    refuse: SocketAddr,
}

impl SpecTemplate {
    /// The templates of every service of `config`, in its order.
    fn all(config: &Config) -> Vec<Self> {
        config
            .services
            .iter()
            .map(|svc| Self::new(svc, config))
            .collect()
    }

    fn new(svc: &Service, config: &Config) -> Self {
        let names = config.service_clusters(svc);
        let clusters: Vec<_> = names.iter().filter_map(|c| config.cluster(c)).collect();
        let maglev = clusters.iter().any(|c| c.lb_policy == LbPolicy::Maglev);
        // Consistent hashing wins over rotation when a chain mixes the two. A proxy-mode
        // service's kernel entry only redirects: the proxy rotates (`ClusterHandle`).
        let round_robin = !maglev
            && svc.mode == ServiceMode::Direct
            && clusters.iter().any(|c| c.lb_policy == LbPolicy::RoundRobin);
        // Least request needs sockops to count each backend's connections; the proxy counts its
        // own for proxy-mode services.
        let least = !maglev
            && !round_robin
            && svc.mode == ServiceMode::Direct
            && clusters
                .iter()
                .any(|c| c.lb_policy == LbPolicy::LeastRequest);
        // Only outlier detection reads the kernel's passive signal: without it sockops does not
        // follow the service's connections at all.
        let passive = clusters.iter().any(|c| c.outlier_detection.is_some());
        let unspecified = match svc.address {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let mut flags = if maglev { SERVICE_F_MAGLEV } else { 0 };
        if round_robin {
            flags |= SERVICE_F_ROUND_ROBIN;
        }
        if least {
            flags |= SERVICE_F_LEAST_REQUEST;
        }
        if svc.mode == ServiceMode::Proxy {
            flags |= SERVICE_F_PROXY;
        }
        if passive {
            flags |= SERVICE_F_PASSIVE;
        }
        Self {
            name: svc.name.clone(),
            key: service_key(svc),
            flags,
            plan: config.chain_plan(svc),
            refuse: SocketAddr::new(unspecified, 0),
        }
    }

    fn with(&self, inputs: &[ClusterInput]) -> ServiceSpec {
        let routing_of = |name: &str| {
            inputs
                .iter()
                .find(|i| i.name == name)
                .map(|i| i.routing.borrow().clone())
        };
        let mut priorities = match &self.plan {
            Some(plan) => plan.levels(&routing_of),
            None => inputs
                .first()
                .map(|i| lb::kernel_levels(&i.routing.borrow()))
                .unwrap_or_default(),
        };
        for level in &mut priorities {
            for (addr, _) in level.iter_mut() {
                if *addr == chain::REFUSE {
                    *addr = self.refuse;
                }
            }
        }
        let panic = inputs.iter().any(|i| i.routing.borrow().in_panic());
        ServiceSpec {
            name: self.name.clone(),
            key: self.key,
            flags: if panic {
                self.flags | SERVICE_F_PANIC
            } else {
                self.flags
            },
            priorities,
        }
    }
}

/// Whether the data path needs sockops: a service whose connections it follows (proxy mode,
/// or a cluster with outlier detection), or splicing of local socket pairs. Without any, sockops
/// is not attached and the cgroup's connections pay connect4 alone.
fn needs_sockops(config: &Config, templates: &[SpecTemplate]) -> bool {
    config.splice
        || templates
            .iter()
            .any(|t| t.flags & (SERVICE_F_PROXY | SERVICE_F_PASSIVE | SERVICE_F_LEAST_REQUEST) != 0)
}

/// Refuses to start when a direct-mode service asks for ROUND_ROBIN and the kernel refused the
/// programs that rotate (before 5.12): said at start, not at the service's first publish.
fn check_round_robin(templates: &[SpecTemplate], dp: &SharedDataplane) -> anyhow::Result<()> {
    let guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(dp) = guard.as_ref() else {
        return Ok(());
    };
    if dp.round_robin() {
        return Ok(());
    }
    match templates
        .iter()
        .find(|t| t.flags & SERVICE_F_ROUND_ROBIN != 0)
    {
        Some(t) => Err(dataplane::DataplaneError::NoRoundRobin {
            service: t.name.clone(),
        }
        .into()),
        None => Ok(()),
    }
}

/// Switches sk_msg splicing of local socket pairs on when the configuration asks for it.
fn configure_splice(config: &Config, dp: &SharedDataplane) -> anyhow::Result<()> {
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(dp) = guard.as_mut() {
        dp.set_splice(config.splice)
            .context("setting the splice switch")?;
    }
    Ok(())
}

/// Takes the data path out of the shared slot (publishers and the admin find `None` from now
/// on).
fn take(dp: &SharedDataplane) -> Option<Dataplane> {
    dp.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

/// The stop: the data path stays attached and pinned ([`Dataplane::release`]).
/// Frees retired generations whose grace period passed, once a second. Publishing frees them
/// too, but the generations the last publishes of a burst retired (a reload's, say) would
/// otherwise wait for the next publish.
async fn reap(dp: SharedDataplane) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match guard.as_mut() {
            Some(dp) => dp.publisher().reap(false),
            None => return,
        }
    }
}

fn release(dp: &SharedDataplane) {
    if let Some(dp) = take(dp) {
        dp.release();
    }
}

/// A failed start ([`Dataplane::abandon`]).
fn abandon(dp: &SharedDataplane) {
    if let Some(dp) = take(dp) {
        dp.abandon();
    }
}

/// What a caught signal asks for.
enum Signal {
    Stop,
    Reload,
}

/// SIGINT and SIGTERM, caught from the start of the run: a signal that arrives while the
/// daemon is still starting (even right after `/ready` turned 200) is kept and makes it stop
/// cleanly (drain the proxy path, leave the data path serving) instead of dying on the default
/// action in the middle of a publish or a drain. SIGHUP reloads the configuration file.
/// SIGUSR1, SIGUSR2 and SIGALRM, whose default action would also kill it that way, are caught
/// and logged.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
    alrm: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt()).context("catching SIGINT")?,
            term: signal(SignalKind::terminate()).context("catching SIGTERM")?,
            hup: signal(SignalKind::hangup()).context("catching SIGHUP")?,
            usr1: signal(SignalKind::user_defined1()).context("catching SIGUSR1")?,
            usr2: signal(SignalKind::user_defined2()).context("catching SIGUSR2")?,
            alrm: signal(SignalKind::alarm()).context("catching SIGALRM")?,
        })
    }

    /// Waits for SIGINT or SIGTERM (stop) or SIGHUP (reload); the others are logged on the way.
    async fn wait(&mut self) -> Signal {
        loop {
            tokio::select! {
                _ = self.int.recv() => {
                    info!("SIGINT: shutting down");
                    return Signal::Stop;
                }
                _ = self.term.recv() => {
                    info!("SIGTERM: shutting down");
                    return Signal::Stop;
                }
                _ = self.hup.recv() => {
                    info!("SIGHUP: reloading the configuration");
                    return Signal::Reload;
                }
                _ = self.usr1.recv() => warn!("SIGUSR1: ignored (it has no meaning here)"),
                _ = self.usr2.recv() => warn!("SIGUSR2: ignored (it has no meaning here)"),
                _ = self.alrm.recv() => warn!("SIGALRM: ignored (it has no meaning here)"),
            }
        }
    }
}

/// The kernel's key of a service.
pub fn service_key(svc: &Service) -> ServiceKey {
    let proto = match svc.protocol {
        Protocol::Tcp => PROTO_TCP,
        Protocol::Udp => PROTO_UDP,
    };
    dataplane::publish_key(svc.address, svc.port, proto)
}

/// A service's address as `ip:port`, for tables.
pub fn service_addr(svc: &Service) -> SocketAddr {
    SocketAddr::new(svc.address, svc.port)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn kernel_flags_follow_the_clusters() {
        let endpoint = "    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\n";
        let yaml = format!(
            "clusters:\n  - name: plain\n{endpoint}  - name: watched\n    outlier_detection: {{ consecutive_5xx: 3 }}\n{endpoint}  - name: hashed\n    lb_policy: MAGLEV\n{endpoint}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: plain }}\n  - {{ name: b, address: 127.77.0.2, port: 80, cluster: watched }}\n  - {{ name: c, address: 127.77.0.3, port: 80, cluster: hashed }}\n  - {{ name: d, address: 127.77.0.4, port: 80, cluster: watched, mode: proxy }}\n"
        );
        let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
        let flags: Vec<u32> = config
            .services
            .iter()
            .map(|s| SpecTemplate::new(s, &config).flags)
            .collect();
        assert_eq!(
            flags,
            [
                0,
                SERVICE_F_PASSIVE,
                SERVICE_F_MAGLEV,
                SERVICE_F_PASSIVE | SERVICE_F_PROXY
            ]
        );
    }

    #[test]
    fn sockops_is_attached_only_where_something_needs_it() {
        let endpoint = "    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\n";
        let clusters = format!(
            "clusters:\n  - name: plain\n{endpoint}  - name: watched\n    outlier_detection: {{ consecutive_5xx: 3 }}\n{endpoint}"
        );
        let needs = |extra: &str, services: &str| {
            let yaml = format!("{extra}{clusters}services:\n{services}");
            let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
            needs_sockops(&config, &SpecTemplate::all(&config))
        };
        let plain = "  - { name: a, address: 127.77.0.1, port: 80, cluster: plain }\n";
        assert!(!needs("", plain), "plain kernel-path services only");
        assert!(needs("splice: true\n", plain), "splicing");
        let watched = "  - { name: b, address: 127.77.0.2, port: 80, cluster: watched }\n";
        assert!(needs("", &format!("{plain}{watched}")), "outlier detection");
        let proxied =
            "  - { name: c, address: 127.77.0.3, port: 80, cluster: plain, mode: proxy }\n";
        let listener = "proxy: { listeners: [\"127.0.0.1:15001\"] }\n";
        assert!(needs(listener, &format!("{plain}{proxied}")), "proxy mode");
    }

    #[tokio::test]
    async fn any_changed_wakes_on_any_input_and_ends_with_them() {
        let input = |name: &str| {
            let (tx, routing) = watch::channel(Routing::default());
            let name = name.to_owned();
            (tx, ClusterInput { name, routing })
        };
        assert!(!any_changed(&mut []).await, "no input: nothing to wait for");
        let (a_tx, a) = input("a");
        let (b_tx, b) = input("b");
        let mut inputs = vec![a, b];
        b_tx.send_replace(Routing::default());
        assert!(any_changed(&mut inputs).await, "b changed");
        inputs[1].routing.borrow_and_update();
        drop(a_tx);
        b_tx.send_replace(Routing::default());
        assert!(
            any_changed(&mut inputs).await,
            "b still runs after a stopped"
        );
        inputs[1].routing.borrow_and_update();
        drop(b_tx);
        assert!(!any_changed(&mut inputs).await, "every cluster stopped");
    }
}
