//! The admin HTTP interface, on loopback by default: `/ready`, `/stats`, `/config_dump`.
//!
//! A deliberately small HTTP/1.1 server (GET only, one request per connection): the admin
//! interface is for operators and probes, not for traffic.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use proxy_core::config::Config;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};
use tracing::debug;

use crate::dataplane::Dataplane;

/// Largest request head accepted.
const MAX_REQUEST: usize = 8 * 1024;
/// A client that sends nothing for this long is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What the admin handlers read.
#[derive(Clone)]
pub struct State {
    config: Arc<Config>,
    dataplane: Arc<Mutex<Option<Dataplane>>>,
}

impl State {
    /// State over the running configuration and data path.
    pub fn new(config: Config, dataplane: Arc<Mutex<Option<Dataplane>>>) -> Self {
        Self { config: Arc::new(config), dataplane }
    }
}

/// Binds `addr` and serves until the returned task is aborted.
pub async fn serve(addr: SocketAddr, state: State) -> std::io::Result<JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else { continue };
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
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or("/"));
    let path = target.split('?').next().unwrap_or(target);
    let (status, content_type, body) = if method != "GET" {
        (405, "text/plain", "only GET is supported\n".to_owned())
    } else {
        route(path, state)
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

fn route(path: &str, state: &State) -> (u16, &'static str, String) {
    match path {
        "/ready" => {
            if state.dataplane.lock().is_ok_and(|dp| dp.is_some()) {
                (200, "text/plain", "LIVE\n".to_owned())
            } else {
                (503, "text/plain", "NOT READY\n".to_owned())
            }
        }
        "/stats" => (200, "text/plain", stats(state)),
        "/config_dump" => match serde_json::to_string_pretty(&*state.config) {
            Ok(json) => (200, "application/json", json + "\n"),
            Err(err) => (500, "text/plain", format!("{err}\n")),
        },
        _ => (
            404,
            "text/plain",
            "not found; try /ready, /stats, /config_dump\n".to_owned(),
        ),
    }
}

/// Kernel counters as `bpf.<counter>: <value>` lines, Envoy's `/stats` text format.
fn stats(state: &State) -> String {
    let mut out = String::new();
    if let Ok(guard) = state.dataplane.lock()
        && let Some(dp) = guard.as_ref()
    {
        for (name, value) in dp.counters() {
            let _ = writeln!(out, "bpf.{name}: {value}");
        }
    }
    let _ = writeln!(out, "server.services: {}", state.config.services.len());
    let _ = writeln!(out, "server.clusters: {}", state.config.clusters.len());
    out
}
