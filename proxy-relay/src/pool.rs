//! Upstream HTTP connections, pooled per host and protocol.
//!
//! HTTP/1.1: a connection serves one request at a time; it goes back to the pool once its
//! response body has been read to the end (hyper's `ready()`), and is taken out again for the
//! next request. HTTP/2 (cleartext, prior knowledge): one connection per host is shared by all
//! requests. Idle connections expire after the pool's idle timeout, and connections to hosts
//! that left their cluster are dropped at the next sweep (requests in flight finish).

use std::{
    collections::HashMap,
    io,
    pin::Pin,
    sync::{Arc, Mutex, atomic::Ordering},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use proxy_core::upstream::OpenConnection;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
    time::Instant,
};
use tracing::debug;

use crate::{addr::BackendAddr, stats::ProxyStats};

/// Request and response bodies on the proxy's HTTP path (their error ends the stream: a
/// downstream body error aborts the upstream request, an upstream or timeout error aborts the
/// downstream response).
pub type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Upstream protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    /// HTTP/1.1.
    Http1,
    /// HTTP/2 over cleartext TCP, prior knowledge.
    Http2,
}

/// A ready-to-use upstream connection.
pub enum Sender {
    /// HTTP/1.1: exclusive while a request is in flight.
    Http1(http1::SendRequest<Body>),
    /// HTTP/2: shared.
    Http2(http2::SendRequest<Body>),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::Http1(s) => s.is_closed(),
            Sender::Http2(s) => s.is_closed(),
        }
    }
}

/// Why no upstream connection could be had.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP connect failed.
    #[error("connecting to {host}: {source}")]
    Connect {
        /// The host.
        host: BackendAddr,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// TCP connect timed out.
    #[error("connecting to {host}: no answer within {timeout:?} (is the host up and reachable?)")]
    Timeout {
        /// The host.
        host: BackendAddr,
        /// The timeout.
        timeout: Duration,
    },
    /// The HTTP handshake failed.
    #[error("HTTP handshake with {host}: {source}")]
    Handshake {
        /// The host.
        host: BackendAddr,
        /// Why.
        #[source]
        source: hyper::Error,
    },
}

impl ConnectError {
    /// Whether the TCP connect itself failed (a retry on `connect-failure` applies).
    pub fn is_connect_failure(&self) -> bool {
        matches!(
            self,
            ConnectError::Connect { .. } | ConnectError::Timeout { .. }
        )
    }
}

struct Idle {
    sender: Sender,
    since: Instant,
}

/// Idle upstream connections by host and protocol.
pub struct Pool {
    idle: Mutex<HashMap<(BackendAddr, Proto), Vec<Idle>>>,
    idle_timeout: Duration,
    /// Woken when a connection is handed back or registered (requests waiting for one).
    returned: tokio::sync::Notify,
}

impl Pool {
    /// An empty pool whose idle connections live at most `idle_timeout`.
    pub fn new(idle_timeout: Duration) -> Self {
        Self {
            idle: Mutex::default(),
            idle_timeout,
            returned: tokio::sync::Notify::new(),
        }
    }

    /// Completes when a connection is handed back or registered after this call (enable it
    /// before looking, so no return is missed).
    pub fn returned(&self) -> tokio::sync::futures::Notified<'_> {
        self.returned.notified()
    }

    /// A pooled connection to `host`, if one is idle (HTTP/1.1) or open (HTTP/2).
    pub fn take(&self, host: BackendAddr, proto: Proto) -> Option<Sender> {
        let mut idle = self.lock();
        let list = idle.get_mut(&(host, proto))?;
        list.retain(|i| !i.sender.is_closed());
        match proto {
            Proto::Http1 => list.pop().map(|i| i.sender),
            Proto::Http2 => list.last_mut().map(|i| {
                i.since = Instant::now();
                match &i.sender {
                    Sender::Http2(s) => Sender::Http2(s.clone()),
                    Sender::Http1(_) => unreachable!("HTTP/1.1 sender in the HTTP/2 list"),
                }
            }),
        }
    }

    /// Returns (HTTP/1.1) or registers (HTTP/2) a connection.
    pub fn put(&self, host: BackendAddr, sender: Sender) {
        let proto = match sender {
            Sender::Http1(_) => Proto::Http1,
            Sender::Http2(_) => Proto::Http2,
        };
        self.lock().entry((host, proto)).or_default().push(Idle {
            sender,
            since: Instant::now(),
        });
        self.returned.notify_waiters();
    }

    /// Drops the connections of hosts `keep` rejects.
    pub fn retain(&self, keep: impl Fn(BackendAddr) -> bool) {
        self.lock().retain(|(host, _), _| keep(*host));
    }

    /// Drops connections idle longer than the idle timeout, and closed ones.
    pub fn expire_idle(&self) {
        let now = Instant::now();
        let mut idle = self.lock();
        for list in idle.values_mut() {
            list.retain(|i| {
                !i.sender.is_closed() && now.duration_since(i.since) < self.idle_timeout
            });
        }
        idle.retain(|_, list| !list.is_empty());
    }

    /// Idle (HTTP/1.1) and open (HTTP/2) pooled connections.
    pub fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Whether nothing is pooled.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(BackendAddr, Proto), Vec<Idle>>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Opens a new upstream connection and does the HTTP handshake; counts `upstream_cx_total`,
/// `upstream_cx_connect_fail` and the bytes it moves. An HTTP/2 connection is registered in
/// `pool` right away (it is shared). `open`, a cluster's connection count, lives as long as the
/// socket does (`upstream_cx_active`).
pub async fn connect(
    host: BackendAddr,
    proto: Proto,
    timeout: Duration,
    stats: &Arc<ProxyStats>,
    pool: &Pool,
    open: Option<OpenConnection>,
) -> Result<Sender, ConnectError> {
    let stream = connect_tcp(host, timeout, stats).await?;
    let io = TokioIo::new(Metered {
        inner: stream,
        stats: stats.clone(),
        _open: open,
    });
    let handshake = |source| ConnectError::Handshake { host, source };
    match proto {
        Proto::Http1 => {
            let (sender, conn) = http1::handshake(io).await.map_err(handshake)?;
            tokio::spawn(async move {
                // With upgrades: a 101 hands the connection to the HTTP path's tunnel.
                if let Err(err) = conn.with_upgrades().await {
                    debug!(%host, %err, "upstream HTTP/1.1 connection ended");
                }
            });
            Ok(Sender::Http1(sender))
        }
        Proto::Http2 => {
            let (sender, conn) = http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(handshake)?;
            tokio::spawn(async move {
                if let Err(err) = conn.await {
                    debug!(%host, %err, "upstream HTTP/2 connection ended");
                }
            });
            pool.put(host, Sender::Http2(sender.clone()));
            Ok(Sender::Http2(sender))
        }
    }
}

/// TCP connect with a timeout, counted.
pub async fn connect_tcp(
    host: BackendAddr,
    timeout: Duration,
    stats: &ProxyStats,
) -> Result<TcpStream, ConnectError> {
    ProxyStats::inc(&stats.upstream_cx_total);
    within_connect_timeout(host, timeout, stats, TcpStream::connect(host.0)).await
}

/// Awaits a connect to `host` for at most `timeout`; a failure is counted
/// (`upstream_cx_connect_fail`, and `upstream_cx_connect_timeout` for a timeout).
pub(crate) async fn within_connect_timeout<T>(
    host: BackendAddr,
    timeout: Duration,
    stats: &ProxyStats,
    connecting: impl Future<Output = io::Result<T>>,
) -> Result<T, ConnectError> {
    let result = match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(connected)) => return Ok(connected),
        Ok(Err(source)) => ConnectError::Connect { host, source },
        Err(_) => {
            ProxyStats::inc(&stats.upstream_cx_connect_timeout);
            ConnectError::Timeout { host, timeout }
        }
    };
    ProxyStats::inc(&stats.upstream_cx_connect_fail);
    Err(result)
}

/// An upstream socket that adds what it reads and writes to the byte stats.
struct Metered {
    inner: TcpStream,
    stats: Arc<ProxyStats>,
    /// A cluster's connection: counted in `upstream_cx_active` as long as the socket lives.
    _open: Option<OpenConnection>,
}

impl AsyncRead for Metered {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        self.stats
            .upstream_cx_rx_bytes_total
            .fetch_add(n, Ordering::Relaxed);
        poll
    }
}

impl AsyncWrite for Metered {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = poll {
            self.stats
                .upstream_cx_tx_bytes_total
                .fetch_add(n as u64, Ordering::Relaxed);
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
