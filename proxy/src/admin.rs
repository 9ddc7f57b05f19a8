//! The admin HTTP interface, where Envoy users look for it: `/ready`, `/stats`,
//! `/stats/prometheus`, `/reset_counters`, `/clusters`, `/listeners`, `/routing`,
//! `/config_dump`, `/chain/<service>`, `/server_info`, `/logging`, `/healthcheck/fail`,
//! `/healthcheck/ok` and `/reload`, listed at `/` (the table is in `routes`).
//!
//! Two listeners. `admin.address` (loopback TCP by default) serves what shows; anyone on the
//! host can connect to it, so it answers only requests whose `Host` names it, and refuses
//! what changes the daemon's state with a 403 unless the operator turned that on
//! (`guard`). The control socket, a unix socket of mode 0600, serves everything to its owner
//! (`proxy reload`, `proxy status`), with its own connection budget and rendering turns, so
//! nothing done on TCP can keep it from answering.
//!
//! HTTP/1.1 by hyper, one request per connection: the admin interface is for operators and
//! probes, not for traffic. Each listener bounds its own cost (`accept`): a budget of
//! connections in which a new one sheds the oldest idle one, a request head of at most
//! 8 KiB that must arrive within 2 s, a connection closed after 5 minutes whatever it does.
//! `/ready` and the other constant-cost answers are given at once; the pages whose cost grows
//! with the configuration (stats, clusters, config and chain dumps) render on tokio's blocking
//! threads, never on the workers that run discovery, health checks and the proxy, and at most
//! [`RENDERING`] at a time per listener; a request that waits [`TURN_TIMEOUT`] for its turn is
//! answered 503.

mod accept;
mod guard;
mod info;
mod listen;
mod render;
mod routes;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::Path,
    sync::{Arc, PoisonError, atomic::AtomicBool},
    time::Duration,
};

use http_body_util::Full;
use hyper::{
    Request, StatusCode,
    body::{Bytes, Incoming},
    header::{ALLOW, CONTENT_TYPE, HeaderValue},
};
use proxy_common::service::ServiceKey;
use proxy_core::{
    config::{AdminAddress, Config},
    upstream::Upstream,
};
use tokio::{
    sync::{Semaphore, mpsc, oneshot, watch},
    task::JoinHandle,
};
use tracing::info;

pub use self::{
    info::Launch,
    listen::{ListenError, remove_stale_socket},
};
use crate::{
    daemon::state::{Live, SharedDataplane},
    dataplane::Dataplane,
};

/// Pages rendered at once per listener (the others wait their turn).
const RENDERING: usize = 2;
/// How long a page waits for a rendering turn before it is answered 503.
const TURN_TIMEOUT: Duration = Duration::from_secs(5);

/// How long `POST /reload` waits for the daemon to apply a configuration (a new cluster's first
/// hosts are awaited, up to the daemon's first-publish wait).
const RELOAD_TIMEOUT: Duration = Duration::from_secs(60);

/// The keys of the services published at least once under the configuration in force.
pub type Published = watch::Receiver<BTreeSet<ServiceKey>>;

/// Why a reload changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadRefused {
    /// The file does not parse or validate (`file:line:column` and the field).
    #[error("{0}")]
    Invalid(String),
    /// The change needs a restart (the fields named).
    #[error("{0}")]
    NeedsRestart(String),
    /// The daemon could not apply it (a cluster's discovery could not start).
    #[error("{0}")]
    Failed(String),
}

/// A reload request to the daemon: the answer goes back on the channel.
pub type ReloadRequest = oneshot::Sender<Result<String, ReloadRefused>>;

/// What the admin handlers read.
#[derive(Clone)]
pub struct State {
    config: Arc<Config>,
    dataplane: SharedDataplane,
    upstreams: BTreeMap<String, Arc<Upstream>>,
    published: Published,
    /// The configuration in force, when a reload can replace it.
    live: Option<watch::Receiver<Live>>,
    /// Where `POST /reload` asks the daemon.
    reloads: Option<mpsc::Sender<ReloadRequest>>,
    proxy: Option<proxy_relay::ProxyStatsHandle>,
    /// The Consul config entry watch's stats (`consul_entries.*`), when it runs.
    consul_entries: Option<Arc<proxy_core::discovery::consul::entries::EntriesStats>>,
    fatal: Option<crate::daemon::state::Fatal>,
    /// Turns to render a page ([`RENDERING`]).
    rendering: Arc<Semaphore>,
    /// Set by `/healthcheck/fail`, cleared by `/healthcheck/ok`.
    health_failed: Arc<AtomicBool>,
    /// How the daemon was started (`/server_info`, `/logging`).
    launch: Launch,
    /// The counters at the last `/reset_counters`.
    counter_baseline: Arc<render::CounterBaseline>,
    /// Unit tests have no data path; this stands in for an attached one.
    #[cfg(test)]
    assume_attached: bool,
}

impl State {
    /// State over the running configuration, data path and clusters; `published` counts the
    /// services published at least once.
    pub fn new(
        config: impl Into<Arc<Config>>,
        dataplane: SharedDataplane,
        upstreams: BTreeMap<String, Arc<Upstream>>,
        published: Published,
    ) -> Self {
        Self {
            config: config.into(),
            dataplane,
            upstreams,
            published,
            live: None,
            reloads: None,
            proxy: None,
            consul_entries: None,
            fatal: None,
            rendering: Arc::new(Semaphore::new(RENDERING)),
            health_failed: Arc::new(AtomicBool::new(false)),
            launch: Launch::default(),
            counter_baseline: Arc::default(),
            #[cfg(test)]
            assume_attached: false,
        }
    }

    /// How the daemon was started, for `/server_info`; its log filter for `/logging`.
    pub fn with_launch(mut self, launch: Launch) -> Self {
        self.launch = launch;
        self
    }

    /// Adds the proxy path's stats (`proxy.*`) and ORIGINAL_DST hosts.
    pub fn with_proxy(mut self, proxy: proxy_relay::ProxyStatsHandle) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// Adds the Consul config entry watch's stats (`consul_entries.*`).
    pub fn with_consul_entries(
        mut self,
        stats: Option<Arc<proxy_core::discovery::consul::entries::EntriesStats>>,
    ) -> Self {
        self.consul_entries = stats;
        self
    }

    /// `/ready` goes down when a part of the daemon panicked (`fatal`).
    pub fn with_fatal(mut self, fatal: crate::daemon::state::Fatal) -> Self {
        self.fatal = Some(fatal);
        self
    }

    /// Follows the configuration in force (`live`), and serves `POST /reload` by asking the
    /// daemon on `reloads`.
    pub fn with_reload(
        mut self,
        live: watch::Receiver<Live>,
        reloads: mpsc::Sender<ReloadRequest>,
    ) -> Self {
        self.live = Some(live);
        self.reloads = Some(reloads);
        self
    }

    /// This state with the configuration in force now (what one request reads throughout).
    fn current(&self) -> Self {
        let mut now = self.clone();
        if let Some(live) = &self.live {
            let live = live.borrow();
            now.config = Arc::clone(&live.config);
            now.upstreams = live.upstreams.clone();
        }
        now
    }

    /// Whether a part of the daemon panicked.
    fn failed(&self) -> bool {
        self.fatal.as_ref().is_some_and(|f| f.cause().is_some())
    }

    /// Every service published once, nothing failed (`/healthcheck/fail` aside).
    fn ready(&self) -> bool {
        if self.failed() {
            return false;
        }
        let attached = self.dataplane.lock().is_ok_and(|dp| dp.is_some());
        #[cfg(test)]
        let attached = attached || self.assume_attached;
        let published = self.published.borrow();
        attached
            && self
                .config
                .services
                .iter()
                .all(|svc| published.contains(&crate::daemon::state::service_key(svc)))
    }

    /// What `read` finds in the data path for each service, by service name (nothing before
    /// the data path is attached; a service `read` has nothing for is left out).
    fn per_service<T>(
        &self,
        read: impl Fn(&crate::dataplane::Dataplane, &proxy_common::service::ServiceKey) -> Option<T>,
    ) -> Vec<(&str, T)> {
        let guard = self
            .dataplane
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(dp) = guard.as_ref() else {
            return Vec::new();
        };
        self.config
            .services
            .iter()
            .filter_map(|svc| {
                let found = read(dp, &crate::daemon::state::service_key(svc))?;
                Some((svc.name.as_str(), found))
            })
            .collect()
    }

    /// Each published service's kernel counters, by service name.
    fn service_counters(&self) -> Vec<(&str, proxy_common::counters::ServiceCounts)> {
        self.per_service(crate::dataplane::Dataplane::service_counts)
    }

    /// The kernel's connection counts of each service held to `max_connections`.
    fn cx_counts(&self) -> Vec<(&str, proxy_common::limit::CxOpen)> {
        self.per_service(crate::dataplane::Dataplane::cx_counts)
    }

    /// The connects the kernel dropped for each service with a drop overload.
    fn drop_counts(&self) -> Vec<(&str, u64)> {
        self.per_service(crate::dataplane::Dataplane::drop_count)
    }

    /// Each service's publish record: whether it runs on an older host set, and failures.
    fn publish_states(&self) -> Vec<(&str, crate::dataplane::PublishState)> {
        self.per_service(|dp, key| Some(dp.publish_state(key)))
    }

    /// The cluster whose connections are service `name`'s on the kernel path: its only cluster,
    /// for a direct-mode service that is not a chain.
    fn kernel_cluster(&self, name: &str) -> Option<&str> {
        let svc = self.config.services.iter().find(|s| s.name == name)?;
        if svc.mode != proxy_core::config::ServiceMode::Direct || svc.chain.is_some() {
            return None;
        }
        Some(svc.cluster.as_str())
    }

    /// Kernel counters, summed over CPUs.
    fn kernel_counters(&self) -> Vec<(&'static str, u64)> {
        let guard = self
            .dataplane
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().map(Dataplane::counters).unwrap_or_default()
    }
}

/// The running admin server; [`Server::stop`] ends it and removes its unix socket files.
pub struct Server {
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    /// Stops accepting, drops the connections in flight, removes the socket files (which the
    /// accept loops own).
    pub async fn stop(self) {
        for task in &self.tasks {
            task.abort();
        }
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Binds `addr` (a unix socket: mode 0600, a stale socket file replaced) and the control
/// socket of `state`'s configuration (`admin.control_socket`), and serves until
/// [`Server::stop`].
pub async fn serve(addr: &AdminAddress, state: State) -> Result<Server, ListenError> {
    let control = state.config.admin.control_path(&state.config.instance);
    serve_with(addr, &control, state).await
}

/// [`serve`] with the control socket at `control`.
async fn serve_with(
    addr: &AdminAddress,
    control: &Path,
    state: State,
) -> Result<Server, ListenError> {
    listen::prepare_dir(control)?;
    let control_listener = listen::bind(&AdminAddress::Unix(control.to_owned())).await?;
    let listener = listen::bind(addr).await?;
    let access = match addr {
        AdminAddress::Tcp(address) => guard::Access::Tcp {
            address: *address,
            mutations: state.config.admin.allow_tcp_mutations,
            control: control.display().to_string(),
        },
        AdminAddress::Unix(_) => guard::Access::Owner,
    };
    // The control socket renders in turns of its own: pages asked on TCP never delay it.
    let control_state = State {
        rendering: Arc::new(Semaphore::new(RENDERING)),
        ..state.clone()
    };
    info!(control = %control.display(), "admin control socket ready");
    Ok(Server {
        tasks: vec![
            tokio::spawn(accept::run(listener, accept::CONNECTIONS, access, state)),
            tokio::spawn(accept::run(
                control_listener,
                accept::CONTROL_CONNECTIONS,
                guard::Access::Owner,
                control_state,
            )),
        ],
    })
}

/// Answers one request on a listener with `access` (`local`: the address a TCP client
/// connected to): a refusal, at once, or rendered in turn on a blocking thread.
async fn respond(
    request: &Request<Incoming>,
    access: &guard::Access,
    local: Option<SocketAddr>,
    state: &State,
) -> Response {
    if let Err(refused) = guard::admit(request, access, local) {
        return refused;
    }
    let path = request.uri().path();
    let query = request.uri().query().unwrap_or_default();
    let state = &state.current();
    if path == "/reload" {
        reload(state).await
    } else if routes::is_page(path) {
        render_in_turn(path, query, state).await
    } else {
        routes::answer(request.method(), path, query, state)
    }
}

/// `POST /reload`: the daemon re-reads its configuration file and applies the difference.
/// 200 with what changed; 400 for a file that does not validate, 409 for a change that needs a
/// restart, 500 when applying failed (each changes nothing), 503 when reloads are not served.
async fn reload(state: &State) -> Response {
    let Some(reloads) = &state.reloads else {
        return Response::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "reload is not available on this server\n",
        );
    };
    let (tx, rx) = oneshot::channel();
    if reloads.send(tx).await.is_err() {
        return Response::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the daemon is stopping; nothing was reloaded\n",
        );
    }
    match tokio::time::timeout(RELOAD_TIMEOUT, rx).await {
        Ok(Ok(Ok(summary))) => Response::text(StatusCode::OK, format!("{summary}\n")),
        Ok(Ok(Err(refused))) => {
            let (status, text) = match refused {
                ReloadRefused::Invalid(why) => (StatusCode::BAD_REQUEST, why),
                ReloadRefused::NeedsRestart(why) => (StatusCode::CONFLICT, why),
                ReloadRefused::Failed(why) => (StatusCode::INTERNAL_SERVER_ERROR, why),
            };
            Response::text(status, format!("error: {text}\n"))
        }
        Ok(Err(_)) => Response::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the daemon stopped before answering\n",
        ),
        Err(_) => Response::text(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "no answer within {RELOAD_TIMEOUT:?}; the reload may still complete (see the daemon's log)\n"
            ),
        ),
    }
}

/// Renders a page on a blocking thread once a turn is free (within [`TURN_TIMEOUT`]).
async fn render_in_turn(path: &str, query: &str, state: &State) -> Response {
    let turn = tokio::time::timeout(TURN_TIMEOUT, state.rendering.clone().acquire_owned()).await;
    let Ok(Ok(turn)) = turn else {
        return Response::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy: other admin requests are being rendered; try again\n",
        );
    };
    let (path, query, state) = (path.to_owned(), query.to_owned(), state.clone());
    let rendered = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        routes::page(&path, &query, &state)
    })
    .await;
    rendered.unwrap_or_else(|err| {
        Response::text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering failed: {err}\n"),
        )
    })
}

/// A response: status, content type, body, and the `Allow` header of a 405.
struct Response {
    status: StatusCode,
    content_type: &'static str,
    body: String,
    allow: Option<&'static str>,
}

impl Response {
    fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
            allow: None,
        }
    }

    /// Prometheus' text exposition, under its content type.
    fn prometheus(body: String) -> Self {
        Self {
            status: StatusCode::OK,
            content_type: prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            body,
            allow: None,
        }
    }

    fn json(value: &impl serde::Serialize) -> Self {
        match serde_json::to_string_pretty(value) {
            Ok(body) => Self {
                status: StatusCode::OK,
                content_type: "application/json",
                body: body + "\n",
                allow: None,
            },
            Err(err) => Self::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n")),
        }
    }

    fn into_http(self) -> hyper::Response<Full<Bytes>> {
        let mut response = hyper::Response::new(Full::new(Bytes::from(self.body)));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        if let Some(allow) = self.allow {
            headers.insert(ALLOW, HeaderValue::from_static(allow));
        }
        response
    }
}
