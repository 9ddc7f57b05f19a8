//! The admin HTTP interface, where Envoy users look for it: on loopback (or a unix socket) it
//! serves `/ready`, `/stats`, `/stats/prometheus`, `/clusters`, `/routing`, `/config_dump`,
//! `/chain/<service>`, `/server_info`, `/logging`, `/healthcheck/fail` and `/healthcheck/ok`,
//! and lists them at `/` (the table is in `routes`).
//!
//! HTTP/1.1 by hyper, one request per connection: the admin interface is for operators and
//! probes, not for traffic. Anyone who can connect can ask, so it bounds its own cost: at most
//! [`CONNECTIONS`] connections at a time (the others wait in the listen queue), a request head
//! of at most [`MAX_REQUEST`] bytes that must arrive within [`READ_TIMEOUT`], a connection
//! closed after [`CONNECTION_LIFETIME`] whatever it does. `/ready` and the other constant-cost
//! answers are given at once; the pages whose cost grows with the configuration (stats,
//! clusters, config and chain dumps) render on tokio's blocking threads, never on the workers
//! that run discovery, health checks and the proxy, and at most [`RENDERING`] at a time; a
//! request that waits [`TURN_TIMEOUT`] for its turn is answered 503.

mod info;
mod listen;
mod render;
mod routes;
#[cfg(test)]
mod tests;

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{Arc, PoisonError, atomic::AtomicBool},
    time::Duration,
};

use http_body_util::Full;
use hyper::{
    Request, StatusCode,
    body::{Bytes, Incoming},
    header::{ALLOW, CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use proxy_core::{
    config::{AdminAddress, Config},
    upstream::Upstream,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{OwnedSemaphorePermit, Semaphore, watch},
    task::JoinHandle,
};
use tracing::debug;

pub use self::{info::Launch, listen::ListenError};
use crate::{daemon::SharedDataplane, dataplane::Dataplane};

/// Pages rendered at once (the others wait their turn).
const RENDERING: usize = 2;
/// Connections served at once; more wait in the listen queue.
const CONNECTIONS: usize = 32;
/// Largest request head accepted (hyper's smallest read buffer); a larger one is answered 431.
const MAX_REQUEST: usize = 8 * 1024;
/// A client whose request head is not complete after this long is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a page waits for a rendering turn before it is answered 503.
const TURN_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection is kept, whatever it does (a client that does not read its answer
/// gives its slot back then). Generous: `proxy status` waits up to a minute for a large page.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);
/// Pause after a failed `accept` (out of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What the admin handlers read.
#[derive(Clone)]
pub struct State {
    config: Arc<Config>,
    dataplane: SharedDataplane,
    upstreams: BTreeMap<String, Arc<Upstream>>,
    published: watch::Receiver<usize>,
    proxy: Option<proxy_relay::ProxyStatsHandle>,
    fatal: Option<crate::daemon::Fatal>,
    /// Turns to render a page ([`RENDERING`]).
    rendering: Arc<Semaphore>,
    /// Set by `/healthcheck/fail`, cleared by `/healthcheck/ok`.
    health_failed: Arc<AtomicBool>,
    /// How the daemon was started (`/server_info`, `/logging`).
    launch: Launch,
    /// Unit tests have no data path; this stands in for an attached one.
    #[cfg(test)]
    assume_attached: bool,
}

impl State {
    /// State over the running configuration, data path and clusters; `published` counts the
    /// services published at least once.
    pub fn new(
        config: Config,
        dataplane: SharedDataplane,
        upstreams: BTreeMap<String, Arc<Upstream>>,
        published: watch::Receiver<usize>,
    ) -> Self {
        Self {
            config: Arc::new(config),
            dataplane,
            upstreams,
            published,
            proxy: None,
            fatal: None,
            rendering: Arc::new(Semaphore::new(RENDERING)),
            health_failed: Arc::new(AtomicBool::new(false)),
            launch: Launch::default(),
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

    /// `/ready` goes down when a part of the daemon panicked (`fatal`).
    pub fn with_fatal(mut self, fatal: crate::daemon::Fatal) -> Self {
        self.fatal = Some(fatal);
        self
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
        attached && *self.published.borrow() >= self.config.services.len()
    }

    /// Each published service's kernel counters, by service name.
    fn service_counters(&self) -> Vec<(&str, proxy_common::counters::ServiceCounts)> {
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
                let counts = dp.service_counts(&crate::daemon::service_key(svc))?;
                Some((svc.name.as_str(), counts))
            })
            .collect()
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

/// The running admin server; [`Server::stop`] ends it and removes its unix socket file.
pub struct Server {
    task: JoinHandle<()>,
}

impl Server {
    /// Stops accepting, drops the connections in flight, removes the socket file (which the
    /// accept loop owns).
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// Binds `addr` (a unix socket: mode 0600, a stale socket file replaced) and serves until
/// [`Server::stop`].
pub async fn serve(addr: &AdminAddress, state: State) -> Result<Server, ListenError> {
    let listener = listen::bind(addr).await?;
    let connections = Arc::new(Semaphore::new(CONNECTIONS));
    Ok(Server {
        task: tokio::spawn(accept_loop(listener, connections, state)),
    })
}

async fn accept_loop(listener: listen::Listener, connections: Arc<Semaphore>, state: State) {
    loop {
        let Ok(slot) = connections.clone().acquire_owned().await else {
            return;
        };
        let accepted = match &listener {
            listen::Listener::Tcp(tcp) => tcp
                .accept()
                .await
                .map(|(stream, _)| spawn_connection(stream, slot, state.clone())),
            listen::Listener::Unix { listener, .. } => listener
                .accept()
                .await
                .map(|(stream, _)| spawn_connection(stream, slot, state.clone())),
        };
        if let Err(err) = accepted {
            debug!(%err, "admin accept failed");
            tokio::time::sleep(ACCEPT_BACKOFF).await;
        }
    }
}

/// Serves one connection (one request) in its own task, holding its connection slot.
fn spawn_connection<S>(stream: S, slot: OwnedSemaphorePermit, state: State)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let _slot = slot;
        let service = service_fn(move |request| {
            let state = state.clone();
            async move { Ok::<_, Infallible>(respond(&request, &state).await.into_http()) }
        });
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(READ_TIMEOUT)
            .max_buf_size(MAX_REQUEST)
            .keep_alive(false)
            .serve_connection(TokioIo::new(stream), service);
        match tokio::time::timeout(CONNECTION_LIFETIME, connection).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => debug!(%err, "admin connection failed"),
            Err(_) => debug!("admin connection closed after {CONNECTION_LIFETIME:?}"),
        }
    });
}

/// Answers one request: at once, or rendered in turn on a blocking thread.
async fn respond(request: &Request<Incoming>, state: &State) -> Response {
    let path = request.uri().path();
    let query = request.uri().query().unwrap_or_default();
    if routes::is_page(path) {
        render_in_turn(path, query, state).await
    } else {
        routes::answer(request.method(), path, query, state)
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
