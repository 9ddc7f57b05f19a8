//! The configuration in force and what it started: clusters, xDS connections, one publisher
//! per service, the proxy path; and the reload that applies a new configuration's difference to
//! them (what changes is planned by [`super::reload`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use proxy_common::service::ServiceKey;
use proxy_core::{
    config::{Config, Service, host_guard::HostGuard},
    desired::{Overlay, Source},
    discovery::xds::{XdsClients, resources::FileNames},
    health::HealthCheckManager,
    kernel::{ServiceTemplate, needs_sockops},
    upstream::Upstream,
};
use tokio::{sync::watch, task::JoinHandle};
use tracing::{info, warn};

use super::{
    proxy_path,
    publish::{ClusterInput, check_kernel_support, publish_loop, sweep_after_first_publish},
    reload,
    state::{Live, PublishedTx, SharedDataplane, service_key},
};
use crate::admin::ReloadRefused;

/// The traffic feed of health checking for the services of `config`.
pub(super) fn spawn_traffic(config: &Config, ctx: &Context) -> JoinHandle<()> {
    let watched = crate::traffic::watched(config);
    tokio::spawn(crate::traffic::run(
        ctx.dp.clone(),
        ctx.manager.clone(),
        watched,
    ))
}

/// What every configuration of the run shares: the data path and how it was attached, the
/// health checker, the host guard, the record of published services.
pub(super) struct Context {
    /// Whether this run attached sockops (a reload cannot add it).
    pub(super) follow_sockets: bool,
    pub(super) manager: HealthCheckManager,
    pub(super) guard: HostGuard,
    pub(super) dp: SharedDataplane,
    pub(super) published: PublishedTx,
    /// `proxy run`'s flags, applied over every file a reload reads.
    pub(super) run_flags: crate::RunFlags,
}

/// The configuration in force and what it started.
pub(super) struct Running {
    /// The configuration file as last loaded: what the sources' overlays compose with.
    pub(super) file: Config,
    /// Each dynamic source's last overlay that composed (a refused one is not kept).
    pub(super) overlays: BTreeMap<Source, Overlay>,
    /// The composition in force: the file and every overlay (shared with the admin's view).
    pub(super) config: Arc<Config>,
    pub(super) upstreams: BTreeMap<String, Arc<Upstream>>,
    pub(super) xds: XdsClients,
    /// Each service's publisher, by kernel key.
    pub(super) publishers: BTreeMap<ServiceKey, JoinHandle<()>>,
    /// The proxy path, when the configuration uses it.
    pub(super) proxy: Option<proxy_relay::ProxyHandle>,
    /// Proxies a reload replaced, draining their live connections (each until its
    /// `shutdown_timeout` at most).
    pub(super) draining: Vec<JoinHandle<()>>,
}

impl Running {
    pub(super) fn live(&self) -> Live {
        Live {
            config: Arc::clone(&self.config),
            upstreams: self.upstreams.clone(),
        }
    }

    /// Starts the publisher of `svc` (its kernel entry is rewritten whenever a cluster it reads
    /// changes).
    pub(super) fn spawn_publisher(&mut self, svc: &Service, spec: ServiceTemplate, ctx: &Context) {
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
        // A proxy-mode service is a redirect in the kernel, and the proxy reads its clusters;
        // its hosts are in the kernel entry too where the kernel connects to them while no
        // proxy listens (a restart's gap). An HTTP-routed one has none.
        let kernel_clusters = if spec.reads_hosts() {
            clusters
        } else {
            Vec::new()
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
            (ctx.dp.clone(), ctx.published.clone()),
            self.config.proxy.drain_timeout,
        ));
        self.publishers.insert(key, task);
    }

    /// SIGHUP or `POST /reload`: re-reads the configuration file and applies what changed.
    /// Nothing changes unless the whole difference can be applied: a file that does not
    /// validate, a change that needs a restart, or a cluster that cannot start is refused
    /// first. Clusters and services that did not change keep running untouched: their health
    /// state, DNS timers, Consul watches and xDS streams, and their kernel entries.
    pub(super) async fn reload(
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
        let mut file = loaded.map_err(|err| ReloadRefused::Invalid(err.to_string()))?;
        // The thread count, the user and the seccomp switch come from the command line when
        // it sets them, as at the start.
        file.proxy.engine_threads = self.config.proxy.engine_threads;
        ctx.run_flags.apply(&mut file);
        let new = compose(&file, &self.overlays, Some(self.config.as_ref()))?;
        let summary = self.apply(new, file.declares_proxy(), ctx).await?;
        // xDS checks its names against the file's (composition already refused a clash).
        if let Err(err) = self.xds.set_file(FileNames::of(&file)) {
            tracing::warn!(%err, "xDS keeps the previous file's names");
        }
        self.file = file;
        Ok(summary)
    }

    /// A source published a new overlay: the file and every source's overlay, this one
    /// replaced, composed and applied as a reload applies a file. Refused, the source's last
    /// overlay stays in force.
    pub(super) async fn take_overlay(
        &mut self,
        source: Source,
        overlay: Overlay,
        ctx: &Context,
    ) -> Result<String, ReloadRefused> {
        let mut overlays = self.overlays.clone();
        overlays.insert(source, overlay);
        let new = compose(&self.file, &overlays, Some(self.config.as_ref()))?;
        let summary = self.apply(new, self.file.declares_proxy(), ctx).await?;
        self.overlays = overlays;
        Ok(summary)
    }

    /// Applies the difference from the configuration in force to `new` (composed and
    /// validated), whose file declares a proxy path or not (`declared`, see
    /// [`reload::ProxyPath`]). Nothing changes unless all of it can be applied.
    async fn apply(
        &mut self,
        new: Config,
        declared: bool,
        ctx: &Context,
    ) -> Result<String, ReloadRefused> {
        let templates = ServiceTemplate::all(&new);
        let proxy = reload::ProxyPath {
            running: self.proxy.is_some(),
            declared,
        };
        let plan = reload::plan(
            &self.config,
            &new,
            ctx.follow_sockets,
            needs_sockops(&new, &templates),
            proxy,
            service_key,
        )
        .map_err(|err| ReloadRefused::NeedsRestart(err.to_string()))?;
        check_kernel_support(&templates, &ctx.dp)
            .map_err(|err| ReloadRefused::NeedsRestart(format!("{err:#}")))?;
        if plan.is_empty() {
            self.config = Arc::new(new);
            return Ok(format!("no change ({})", plan.summary()));
        }
        // Everything that can fail happens before the first change.
        let xds_failed = |err| ReloadRefused::Failed(format!("starting the xDS clients: {err}"));
        // A restart, or clusters added on the running streams (taken back if the reload is
        // refused below) and removed at the commit.
        let (fresh_xds, xds_change) = if plan.xds_restart {
            let file = FileNames::of(&self.file);
            (
                Some(self.xds.restart(&new, file).map_err(xds_failed)?),
                None,
            )
        } else {
            let change = self.xds.prepare(&self.config, &new).map_err(xds_failed)?;
            (change.as_ref().map(XdsClients::preview), change)
        };
        let started = start_upstreams(
            &new,
            ctx,
            fresh_xds.as_ref().unwrap_or(&self.xds),
            Some(&plan.start),
            &self.upstreams,
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
        self.config = Arc::new(new);
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
    pub(super) async fn stop(self) {
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

/// `file` with `overlays` (in the order of their sources), or why they do not compose; a chain
/// that does not compile keeps the one in force (`previous`) or is left out, and is logged.
pub(super) fn compose(
    file: &Config,
    overlays: &BTreeMap<Source, Overlay>,
    previous: Option<&Config>,
) -> Result<Config, ReloadRefused> {
    let composed = file
        .compose(
            overlays.iter().map(|(source, overlay)| (*source, overlay)),
            previous,
        )
        .map_err(|err| ReloadRefused::Invalid(err.to_string()))?;
    for failure in &composed.chain_failures {
        let kept = composed.chains.contains_key(&failure.service);
        warn!(service = %failure.service, reason = %failure.reason,
            "a chain cannot be compiled from the current entries; {}",
            if kept { "the service keeps the chain in force" } else { "the service is left out" });
    }
    Ok(composed)
}

/// No source may point the data path at the daemon itself.
pub(super) fn host_guard(config: &Config) -> HostGuard {
    HostGuard::for_config(config)
}

/// Starts discovery and health for the clusters of `config` named in `only`, or for all of
/// them (`None`, the start of a run); EDS clusters subscribe over their xDS connection. A
/// change that starts no cluster passes an empty set and starts nothing: every running cluster
/// keeps its discovery, health state and the publishers that read it.
pub(super) fn start_upstreams(
    config: &Config,
    ctx: &Context,
    xds: &XdsClients,
    only: Option<&BTreeSet<String>>,
    running: &BTreeMap<String, Arc<Upstream>>,
) -> anyhow::Result<BTreeMap<String, Arc<Upstream>>> {
    let mut upstreams: BTreeMap<String, Arc<Upstream>> = BTreeMap::new();
    // The local cluster first: zone-aware clusters follow its routing.
    let local = config
        .cluster_manager
        .as_ref()
        .map(|cm| cm.local_cluster_name.as_str());
    let mut order: Vec<&proxy_core::config::Cluster> = config.clusters.iter().collect();
    order.sort_by_key(|c| Some(c.name.as_str()) != local);
    for cluster in order {
        // ORIGINAL_DST hosts are the proxied connections' destinations, kept by the proxy path.
        if config.is_original_dst(&cluster.name)
            || only.is_some_and(|only| !only.contains(&cluster.name))
        {
            continue;
        }
        let zone = super::zones::zone_input(config, cluster, &upstreams, running)?;
        let upstream = Upstream::spawn_zoned(cluster, &ctx.manager, xds, &ctx.guard, zone)?;
        upstreams.insert(cluster.name.clone(), Arc::new(upstream));
    }
    Ok(upstreams)
}
