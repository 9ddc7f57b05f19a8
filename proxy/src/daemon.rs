//! The run loop: configuration in, data path attached, clusters discovered and health-checked,
//! the proxy path started when services use it, services published on every change of their
//! routable hosts, admin served, clean stop.

mod ending;
mod proxy_path;
mod publish;
mod reload;
mod running;
mod signals;
pub mod sources;
pub mod state;
pub(crate) mod takeover;
mod zones;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::{Arc, Mutex},
};

use anyhow::Context as _;
use proxy_common::service::ServiceKey;
use proxy_core::{
    config::Config,
    desired::{INITIAL_FETCH_TIMEOUT, Overlay, Source},
    discovery::{
        consul::entries::{ConsulEntries, spawn_consul_entries},
        xds::XdsClients,
    },
    health::HealthCheckManager,
    kernel::{ServiceTemplate, needs_sockops},
};
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tracing::{error, info, warn};

use self::{
    publish::{check_kernel_support, reap, sweep_after_first_publish},
    running::{Context, Running, host_guard, spawn_traffic, start_upstreams},
    signals::{Signal, Signals},
    state::{Failed, abandon, release},
};
pub use self::{
    signals::hold_signals,
    state::{Fatal, Live, SharedDataplane, service_addr, service_key},
    takeover::{
        TakeoverError, remove_stale_socket as remove_stale_takeover_socket,
        socket_path as takeover_socket_path,
    },
};
use crate::{
    admin::{self, ReloadRequest},
    dataplane::{self, DataplaneOptions},
    notify::{Notifier, Watchdog},
    privileges,
};

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
    // What runs until the dynamic sources answer: the file composed alone (a chain that needs
    // Consul's entries is left out until they come).
    let file = config;
    let config = running::compose(&file, &BTreeMap::new(), None)
        .map_err(|refused| anyhow::anyhow!("{refused}"))?;
    let workers = workers.unwrap_or_else(default_workers);
    launch.concurrency = workers;
    let stored = crate::fd_store::take_passed().context("the service manager's descriptors")?;
    launch.notifier = Arc::new(notifier().with_passed(stored));
    launch.notifier.status("attaching the data path");
    info!(instance = %config.instance, workers, "starting: attaching the data path");
    let fatal = Fatal::install();
    let templates = ServiceTemplate::all(&config);
    let opts = DataplaneOptions {
        cgroup: dataplane::resolve_cgroup(&config.cgroup)?,
        bpffs: PathBuf::from(&config.bpffs),
        instance: config.instance.clone(),
        follow_sockets: follow_sockets(&file, &config, &templates),
        kernel_log: config.kernel_log,
        kernel_maps: config.kernel_maps,
    };
    // `--takeover`: the running daemon hands over before the instance's lock is taken.
    let inherited =
        takeover::request(&file, launch.takeover).context("taking over from the running daemon")?;
    let dp: SharedDataplane = Arc::new(Mutex::new(Some(
        takeover::open_dataplane(&opts, inherited.is_some()).context("attaching the data path")?,
    )));
    let privileged = || -> anyhow::Result<()> {
        check_kernel_support(&templates, &dp)?;
        configure_splice(&config, &dp)?;
        let have = privileges::ThreadCaps::current()?;
        privileges::enter(&privileges::SteadyState::of(&config, &have)?)
            .context("dropping privileges after attaching the data path")?;
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
        // Boxed: the run's state machine is over clippy's large-future bound (16 KiB).
        let result = Box::pin(run_async(
            file,
            config,
            templates,
            dp.clone(),
            fatal,
            launch,
            inherited,
        ))
        .await;
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

/// The service manager's notifier: the one `NOTIFY_SOCKET` names (none when unset, or when it
/// cannot be used: a WARN says why, and the daemon runs on).
fn notifier() -> Notifier {
    Notifier::from_env().unwrap_or_else(|err| {
        warn!(%err, "not notifying the service manager");
        Notifier::default()
    })
}

/// Whether the data path follows sockets (sockops), which cannot be attached after the start:
/// for what `config` (the file composed alone) runs, for the proxy path the `file` declares,
/// and for what xDS's clusters and listeners may bring later (proxy-mode HTTP listeners,
/// outlier detection, LEAST_REQUEST).
fn follow_sockets(file: &Config, config: &Config, templates: &[ServiceTemplate]) -> bool {
    let xds_resources = file
        .xds
        .as_ref()
        .is_some_and(|xds| xds.cds_config.is_some() || xds.lds_config.is_some());
    needs_sockops(config, templates) || file.declares_proxy() || xds_resources
}

/// One worker per CPU in the daemon's affinity mask (`sched_getaffinity`, which is what
/// `available_parallelism` reads), or 2 if that cannot be read.
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

async fn run_async(
    file: Config,
    config: Config,
    templates: Vec<ServiceTemplate>,
    dp: SharedDataplane,
    fatal: Fatal,
    launch: admin::Launch,
    inherited: Option<takeover::Inherited>,
) -> anyhow::Result<()> {
    // Takes the signals `hold_signals` kept pending since the start: they are delivered to
    // this thread (the one `block_on` runs on, never a worker) now that tokio handles them.
    let mut signals = Signals::install()?;
    signals::release_held()?;
    let config_path = launch.config_path.clone();
    // First, so that records of the start (a connect refused before its service is published)
    // are shown too.
    let kernel_log = take_kernel_log(&dp).map(|log| tokio::spawn(crate::kernel_log::run(log)));
    let ctx = Context {
        follow_sockets: follow_sockets(&file, &config, &templates),
        manager: HealthCheckManager::default(),
        guard: host_guard(&config),
        dp: dp.clone(),
        published: watch::channel(BTreeSet::new()).0,
        run_flags: launch.run_flags.clone(),
    };
    // The dynamic sources publish their overlays here; the loop below applies each change.
    let (feeds, mut sources) = sources::channels();
    // Stopped when dropped, at the end of the run.
    let consul_entries = start_consul_entries(&config, &feeds)?;
    let file_names = proxy_core::discovery::xds::resources::FileNames::of(&config);
    let xds = XdsClients::start_with(&config, Some(feeds.xds.clone()), file_names)
        .context("starting the xDS clients")?;
    let upstreams = start_upstreams(&config, &ctx, &xds, None, &BTreeMap::new())?;
    // The proxy listener is live and known to the kernel before a service is published in
    // proxy mode.
    let adopt = proxy_path::Adopt::new(inherited, &launch.notifier);
    let proxy = proxy_path::start(&config, file.declares_proxy(), &upstreams, &dp, adopt)
        .await
        .context("starting the proxy path")?;
    let mut running = Running {
        file,
        overlays: BTreeMap::new(),
        config: Arc::new(config),
        upstreams,
        xds,
        publishers: BTreeMap::new(),
        proxy,
        draining: Vec::new(),
    };
    for (svc, spec) in running.config.services.clone().iter().zip(templates) {
        running.spawn_publisher(svc, spec, &ctx);
    }
    let notifier = Arc::clone(&launch.notifier);
    apply_first_states(&mut running, &mut sources, &ctx, &notifier).await;
    let (live_tx, live_rx) = watch::channel(running.live());
    let (reload_tx, mut reload_rx) = mpsc::channel::<ReloadRequest>(4);
    let state = admin_state(&running, &ctx, &fatal, launch)
        .with_reload(live_rx.clone(), reload_tx)
        .with_consul_entries(consul_entries.as_ref().map(ConsulEntries::stats_handle));
    // Takeover: a new daemon may ask for the instance from now on (a reload keeps its sockets).
    // The socket is there before the admin answers, so `/ready` never reports a daemon that
    // `proxy run --takeover` cannot yet reach.
    let mut takeover = takeover::Server::start(&running.config, running.proxy.as_ref());
    let admin_address = running.config.admin.address.clone();
    let server = serve_admin(&mut running, state, &dp).await?;
    // The sweep after the first publish keeps exactly the services in force, the sources'
    // first states included.
    let keys: Vec<ServiceKey> = running.config.services.iter().map(service_key).collect();
    notifier.status(&format!("publishing {} services", keys.len()));
    sweep_after_first_publish(&keys, &dp, ctx.published.subscribe()).await;
    let passive = tokio::spawn(crate::passive::run(dp.clone(), live_rx));
    let reaper = tokio::spawn(reap(dp.clone()));
    let mut traffic = spawn_traffic(&running.config, &ctx);
    info!(admin = %admin_address, services = running.config.services.len(), "ready");
    notifier.ready(&serving(&running));
    let mut watchdog = Watchdog::new(&notifier);
    let committed = loop {
        let change = tokio::select! {
            () = watchdog.tick() => continue,
            signal = signals.wait() => match signal {
                Signal::Stop => break None,
                Signal::Reload => Change::Reload(None),
            },
            committed = takeover.committed() => break Some(committed),
            Some(request) = reload_rx.recv() => {
                info!("admin: reload requested");
                Change::Reload(Some(request))
            }
            (source, overlay) = sources.changed() => Change::Overlay(source, overlay),
            what = fatal.clone().wait() => {
                // /ready is down already (the admin reads the same record). No clean-up: the
                // data path keeps serving what was published, and the next start adopts it.
                error!(%what, "a part of the daemon failed; exiting with the data path left pinned for the next start");
                return Err(Failed(what).into());
            }
        };
        let (outcome, request) = apply_watched(
            &mut running,
            change,
            config_path.as_deref(),
            &ctx,
            &mut watchdog,
        )
        .await;
        if outcome.is_ok() {
            live_tx.send_replace(running.live());
            traffic.abort();
            traffic = spawn_traffic(&running.config, &ctx);
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
    finish(committed, takeover, running, &dp, &notifier).await
}

/// The Consul config entry watch publishing on its feed, when `consul_config_entries` is set.
fn start_consul_entries(
    config: &Config,
    feeds: &sources::Feeds,
) -> anyhow::Result<Option<ConsulEntries>> {
    let Some(entries) = &config.consul_config_entries else {
        return Ok(None);
    };
    let watch = spawn_consul_entries(entries, feeds.consul_entries.clone())
        .context("starting the Consul config entry watch")?;
    Ok(Some(watch))
}

/// What the run loop applies: the file re-read (SIGHUP, or the admin's request, answered with
/// the outcome), or a dynamic source's new overlay.
enum Change {
    Reload(Option<ReloadRequest>),
    Overlay(Source, Overlay),
}

/// Applies one change to the run, logged; returns the outcome and who waits for it.
async fn apply(
    running: &mut Running,
    change: Change,
    config_path: Option<&std::path::Path>,
    ctx: &Context,
) -> (Result<String, admin::ReloadRefused>, Option<ReloadRequest>) {
    match change {
        Change::Reload(request) => {
            let outcome = running.reload(config_path, ctx).await;
            match &outcome {
                Ok(summary) => info!(%summary, "configuration reloaded"),
                Err(refused) => {
                    error!(%refused, "reload refused; the configuration in force stays");
                }
            }
            (outcome, request)
        }
        Change::Overlay(source, overlay) => {
            let outcome = running.take_overlay(source, overlay, ctx).await;
            match &outcome {
                Ok(summary) => info!(%source, %summary, "applied a change from a dynamic source"),
                Err(refused) => {
                    error!(%source, %refused, "a change from a dynamic source was refused; its last state stays in force");
                }
            }
            (outcome, None)
        }
    }
}

/// The admin's view of the run.
fn admin_state(
    running: &Running,
    ctx: &Context,
    fatal: &Fatal,
    launch: admin::Launch,
) -> admin::State {
    let mut state = admin::State::new(
        Arc::clone(&running.config),
        ctx.dp.clone(),
        running.upstreams.clone(),
        ctx.published.subscribe(),
    );
    if let Some(proxy) = &running.proxy {
        state = state.with_proxy(proxy.stats_handle());
    }
    state.with_fatal(fatal.clone()).with_launch(launch)
}

/// The first state of every dynamic source the configuration turns on, applied before the sweep
/// of what the previous run published and before `/ready`.
async fn apply_first_states(
    running: &mut Running,
    sources: &mut sources::Sources,
    ctx: &Context,
    notifier: &Notifier,
) {
    notifier.status("waiting for the dynamic sources' first state");
    let expected = proxy_core::desired::expected(&running.config);
    let firsts = sources.first(&expected, INITIAL_FETCH_TIMEOUT).await;
    for (source, overlay) in firsts {
        let _ = apply(running, Change::Overlay(source, overlay), None, ctx).await;
    }
}

/// Serves the admin interface; when it cannot listen, the proxy path started for this run stops.
async fn serve_admin(
    running: &mut Running,
    state: admin::State,
    dp: &SharedDataplane,
) -> anyhow::Result<admin::Server> {
    let address = running.config.admin.address.clone();
    match admin::serve(&address, state).await {
        Ok(server) => Ok(server),
        Err(err) => {
            if let Some(proxy) = running.proxy.take() {
                proxy_path::stop(proxy, dp, false).await;
            }
            Err(err).context(format!("admin listener on {address}"))
        }
    }
}

/// Applies one change while the watchdog keeps being fed; a reload is announced to the service
/// manager (`RELOADING=1`, then `READY=1` whatever its outcome: the daemon serves either way).
async fn apply_watched(
    running: &mut Running,
    change: Change,
    config_path: Option<&std::path::Path>,
    ctx: &Context,
    watchdog: &mut Watchdog<'_>,
) -> (Result<String, admin::ReloadRefused>, Option<ReloadRequest>) {
    let reload = matches!(change, Change::Reload(_));
    if reload {
        watchdog.notifier().reloading();
    }
    let applied = watchdog
        .during(apply(running, change, config_path, ctx))
        .await;
    if reload {
        watchdog.notifier().ready(&serving(running));
    }
    applied
}

/// `STATUS=` while serving.
fn serving(running: &Running) -> String {
    format!("serving {} services", running.config.services.len())
}

/// The end of the run. After a takeover's commit: hand the instance over
/// ([`takeover::hand_over`]), the clusters serving the drain. Otherwise the stop: drain the
/// proxy path and leave the kernel serving the last published state for the next start.
async fn finish(
    committed: Option<takeover::Committed>,
    takeover: takeover::Server,
    mut running: Running,
    dp: &SharedDataplane,
    notifier: &Notifier,
) -> anyhow::Result<()> {
    notifier.stopping(if committed.is_some() {
        "handing the instance over to the new daemon"
    } else {
        "stopping: draining the proxy path"
    });
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
        proxy_path::stop(proxy, dp, notifier.keeps_listeners()).await;
    }
    running.stop().await;
    // The kernel keeps serving the last published state; the next start adopts it.
    release(dp);
    Ok(())
}

/// The reader of the kernel's log records, when `kernel_log` is not off.
fn take_kernel_log(dp: &SharedDataplane) -> Option<crate::kernel_log::KernelLog> {
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    guard.as_mut()?.take_kernel_log()
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
