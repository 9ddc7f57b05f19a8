//! The admin HTTP interface, on loopback by default: `/ready`, `/stats`, `/stats/prometheus`,
//! `/clusters` (Envoy's text format, or `?format=json`), `/config_dump`, and `/chain/<service>`
//! (the service's compiled discovery chain in Consul's `CompiledDiscoveryChain` JSON).
//!
//! A deliberately small HTTP/1.1 server (GET only, one request per connection): the admin
//! interface is for operators and probes, not for traffic. Any local process can reach it, so
//! it bounds its own cost: `/ready` is answered at once; every other page renders on tokio's
//! blocking threads, never on the workers that run discovery, health checks and the proxy,
//! and at most [`RENDERING`] at a time; a request that waits [`READ_TIMEOUT`] for its turn is
//! answered 503.

mod render;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, PoisonError},
    time::Duration,
};

use proxy_core::{config::Config, upstream::Upstream};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::{Semaphore, watch},
    task::JoinHandle,
};
use tracing::debug;

use crate::{daemon::SharedDataplane, dataplane::Dataplane};

/// Pages rendered at once (the others wait their turn).
const RENDERING: usize = 2;
/// Largest request head accepted.
const MAX_REQUEST: usize = 8 * 1024;
/// A client that sends nothing for this long is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

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
        }
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

    fn ready(&self) -> bool {
        if self.fatal.as_ref().is_some_and(|f| f.cause().is_some()) {
            return false;
        }
        let attached = self.dataplane.lock().is_ok_and(|dp| dp.is_some());
        attached && *self.published.borrow() >= self.config.services.len()
    }

    /// Kernel counters, summed over CPUs.
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

    fn kernel_counters(&self) -> Vec<(&'static str, u64)> {
        let guard = self
            .dataplane
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().map(Dataplane::counters).unwrap_or_default()
    }
}

/// Binds `addr` and serves until the returned task is aborted.
pub async fn serve(addr: SocketAddr, state: State) -> std::io::Result<JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                continue;
            };
            let state = state.clone();
            tokio::spawn(async move {
                if let Err(err) = handle(stream, &state).await {
                    debug!(%peer, %err, "admin request failed");
                }
            });
        }
    }))
}

async fn handle(mut stream: TcpStream, state: &State) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < MAX_REQUEST {
        let n = tokio::time::timeout(READ_TIMEOUT, stream.read(&mut chunk))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.lines().next().unwrap_or_default().split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or("/"),
    );
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let response = if method != "GET" {
        Response::text(405, "only GET is supported\n")
    } else if path == "/ready" {
        route(path, query, state)
    } else {
        render_in_turn(path, query, state).await
    };
    stream.write_all(&response.bytes()).await?;
    stream.shutdown().await
}

/// Renders a page on a blocking thread once a turn is free (within [`READ_TIMEOUT`]).
async fn render_in_turn(path: &str, query: &str, state: &State) -> Response {
    let turn = tokio::time::timeout(READ_TIMEOUT, state.rendering.clone().acquire_owned()).await;
    let Ok(Ok(turn)) = turn else {
        return Response::text(
            503,
            "busy: other admin requests are being rendered; try again\n",
        );
    };
    let (path, query, state) = (path.to_owned(), query.to_owned(), state.clone());
    let rendered = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        route(&path, &query, &state)
    })
    .await;
    rendered.unwrap_or_else(|err| Response::text(500, format!("rendering failed: {err}\n")))
}

/// A response: status, content type, body.
struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
}

impl Response {
    fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    fn json(value: &impl serde::Serialize) -> Self {
        match serde_json::to_string_pretty(value) {
            Ok(body) => Self {
                status: 200,
                content_type: "application/json",
                body: body + "\n",
            },
            Err(err) => Self::text(500, format!("{err}\n")),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let reason = match self.status {
            200 => "OK",
            404 => "Not Found",
            405 => "Method Not Allowed",
            500 => "Internal Server Error",
            _ => "Service Unavailable",
        };
        format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
            self.status,
            self.content_type,
            self.body.len(),
            self.body
        )
        .into_bytes()
    }
}

fn route(path: &str, query: &str, state: &State) -> Response {
    let json = query.split('&').any(|kv| kv == "format=json");
    match path {
        "/ready" if state.ready() => Response::text(200, "LIVE\n"),
        "/ready" => Response::text(503, "NOT READY\n"),
        "/stats" if json => Response::json(&render::stats_map(state)),
        "/stats" => Response::text(200, render::stats_text(state)),
        "/stats/prometheus" => Response::text(200, render::prometheus(state)),
        "/clusters" if json => Response::json(&render::clusters_json(state)),
        "/clusters" => Response::text(200, render::clusters_text(state)),
        "/config_dump" => Response::json(&*state.config),
        _ if path.starts_with("/chain/") => {
            let service = &path["/chain/".len()..];
            match state.config.chains.get(service) {
                Some(chain) => Response::json(chain),
                None => {
                    Response::text(404, format!("no discovery chain for service {service:?}\n"))
                }
            }
        }
        _ => Response::text(
            404,
            "not found; try /ready, /stats, /stats/prometheus, /clusters, /config_dump, /chain/<service>\n",
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn state() -> State {
        let config = Config::parse("{}", std::path::Path::new("t.yaml")).expect("empty config");
        State::new(
            config,
            Arc::new(Mutex::new(None)),
            BTreeMap::new(),
            watch::channel(0).1,
        )
    }

    async fn get(addr: SocketAddr, path: &str) -> (String, Duration) {
        let started = std::time::Instant::now();
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).await.unwrap();
        (answer, started.elapsed())
    }

    /// With every rendering turn taken (as by slow pages at scale), `/ready` still answers at
    /// once and a page waits its turn, then gets 503, instead of tying up the runtime.
    #[tokio::test]
    async fn ready_answers_at_once_while_pages_wait_their_turn() {
        let state = state();
        let held = state
            .rendering
            .clone()
            .acquire_many_owned(RENDERING as u32)
            .await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let server = serve(addr, state.clone()).await.unwrap();
        let (ready, took) = get(addr, "/ready").await;
        assert!(ready.starts_with("HTTP/1.1 503"), "not attached: {ready}");
        assert!(took < Duration::from_secs(1), "{took:?}");
        let (page, took) = get(addr, "/stats").await;
        assert!(page.contains("busy: other admin requests"), "{page}");
        assert!(took >= READ_TIMEOUT, "{took:?}");
        drop(held);
        let (page, _) = get(addr, "/stats").await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        server.abort();
    }
}
