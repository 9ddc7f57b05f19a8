//! A routed request's upstream connection under its cluster's circuit breakers, as Envoy's
//! connection pool takes one: a pooled connection when one is free; else the request waits
//! (`max_pending_requests`) for a new connection (`max_connections`) or a pooled one handed
//! back; once it has a connection it is in flight (`max_requests`). A refusal is Envoy's 503
//! with `x-envoy-overloaded: true`, counted in `upstream_rq_pending_overflow` (no place to wait)
//! or `upstream_rq_active_overflow` (no place in flight, as Envoy 1.38 and later count it); a
//! connection a limit kept from opening is counted in `upstream_cx_overflow`.

use std::{sync::Arc, time::Duration};

use http::{HeaderValue, Response, StatusCode};
use proxy_core::upstream::{
    OpenConnection,
    breakers::{Breakers, Held, Resource},
};
use tracing::debug;

use super::local_reply;
use crate::{
    addr::BackendAddr,
    cluster::ClusterHandle,
    pool::{self, Body, ConnectError, Proto, Sender},
    stats::ProxyStats,
};

/// Why a request got no upstream connection.
#[derive(Debug)]
pub(super) enum Refused {
    /// A circuit breaker refused it (or no connection was free within the connect timeout
    /// while the cluster was at `max_connections`).
    Overflow,
    /// The connect failed.
    Connect(ConnectError),
}

/// A connection to `host` for one request, with the request's place in `max_requests` (held
/// until the response has ended).
pub(super) async fn connection(
    cluster: &ClusterHandle,
    host: BackendAddr,
    proto: Proto,
    timeout: Duration,
    stats: &Arc<ProxyStats>,
) -> Result<(Sender, Held), Refused> {
    let breakers = cluster.traffic().breakers().clone();
    if let Some(sender) = cluster.pool().take(host, proto) {
        ProxyStats::inc(&stats.upstream_cx_pool_reuse);
        return attach(cluster, host, sender, &breakers);
    }
    let Some(pending) = breakers.try_hold(Resource::Pending) else {
        debug!(
            cluster = cluster.name(),
            "max_pending_requests reached: 503"
        );
        Breakers::overflowed(&breakers.rq_pending_overflow);
        return Err(Refused::Overflow);
    };
    let sender = wait_or_connect(cluster, host, proto, timeout, stats).await?;
    drop(pending);
    attach(cluster, host, sender, &breakers)
}

/// The request goes in flight on `sender`, unless `max_requests` are (the connection stays
/// pooled for the next request).
fn attach(
    cluster: &ClusterHandle,
    host: BackendAddr,
    sender: Sender,
    breakers: &Arc<Breakers>,
) -> Result<(Sender, Held), Refused> {
    if let Some(request) = breakers.try_hold(Resource::Request) {
        return Ok((sender, request));
    }
    debug!(cluster = cluster.name(), "max_requests reached: 503");
    Breakers::overflowed(&breakers.rq_active_overflow);
    // An HTTP/2 connection stays registered in the pool; an HTTP/1.1 one goes back.
    if let Sender::Http1(_) = sender {
        cluster.pool().put(host, sender);
    }
    Err(Refused::Overflow)
}

/// A new connection while `max_connections` allows one (or while the host has none at all,
/// as Envoy's pool does so that a request never waits on nothing); else the first pooled
/// connection handed back or place freed, for at most `timeout`.
async fn wait_or_connect(
    cluster: &ClusterHandle,
    host: BackendAddr,
    proto: Proto,
    timeout: Duration,
    stats: &Arc<ProxyStats>,
) -> Result<Sender, Refused> {
    let traffic = cluster.traffic();
    let deadline = tokio::time::Instant::now() + timeout;
    let mut overflowed = false;
    // Bounded by the deadline; each turn waits for an event.
    loop {
        let freed = traffic.breakers().freed();
        let returned = cluster.pool().returned();
        tokio::pin!(freed, returned);
        freed.as_mut().enable();
        returned.as_mut().enable();
        if let Some(sender) = cluster.pool().take(host, proto) {
            ProxyStats::inc(&stats.upstream_cx_pool_reuse);
            return Ok(sender);
        }
        let open = cluster.try_open_connection(host).or_else(|| {
            if !overflowed {
                Breakers::overflowed(&traffic.breakers().cx_overflow);
                overflowed = true;
            }
            (traffic.host(host.0).cx_active == 0).then(|| cluster.open_connection(host))
        });
        if let Some(open) = open {
            return connect(cluster, host, proto, timeout, stats, open).await;
        }
        tokio::select! {
            () = freed => {}
            () = returned => {}
            () = tokio::time::sleep_until(deadline) => {
                debug!(cluster = cluster.name(), %host, "no connection free within the connect timeout at max_connections: 503");
                return Err(Refused::Overflow);
            }
        }
    }
}

/// A new connection to `host`, counted in the cluster's open connections by `open` (its
/// result goes to outlier detection).
async fn connect(
    cluster: &ClusterHandle,
    host: BackendAddr,
    proto: Proto,
    timeout: Duration,
    stats: &Arc<ProxyStats>,
    open: OpenConnection,
) -> Result<Sender, Refused> {
    let started = std::time::Instant::now();
    let result = pool::connect(host, proto, timeout, stats, cluster.pool(), Some(open)).await;
    match &result {
        Ok(_) => cluster.traffic().cx_connect_ms.record(started.elapsed()),
        Err(err) => debug!(%err, "upstream connect failed"),
    }
    cluster.report_http_connect(host, result.is_ok());
    result.map_err(Refused::Connect)
}

/// Envoy's answer to a request the circuit breakers refuse.
pub(super) fn overflow_reply() -> Response<Body> {
    let mut resp = local_reply(
        StatusCode::SERVICE_UNAVAILABLE,
        "upstream connect error or disconnect/reset before headers. reset reason: overflow\n",
    );
    resp.headers_mut()
        .insert("x-envoy-overloaded", HeaderValue::from_static("true"));
    resp
}

/// The retry about to be made, in flight until its attempt is answered, unless
/// `max_retries` are (then counted in `upstream_rq_retry_overflow`, and the last answer
/// stands, as Envoy's router does).
pub(super) fn hold_retry(cluster: &ClusterHandle) -> Option<Held> {
    let breakers = cluster.traffic().breakers();
    let held = breakers.try_hold(Resource::Retry);
    if held.is_none() {
        debug!(
            cluster = cluster.name(),
            "max_retries in flight: not retried"
        );
        Breakers::overflowed(&breakers.rq_retry_overflow);
    }
    held
}

#[cfg(test)]
mod tests {
    use std::{
        net::SocketAddr,
        sync::atomic::{AtomicU64, Ordering},
    };

    use proxy_core::{
        config::circuit_breakers::Limits,
        health::{HostClass, Routing},
        host::Host,
    };
    use tokio::{net::TcpListener, sync::watch};

    use super::*;

    /// An HTTP/1.1 server on loopback that counts the connections it accepts.
    async fn server() -> (SocketAddr, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve(socket));
            }
        });
        (addr, accepted)
    }

    /// Answers the HTTP/1.1 requests of `socket` with empty 200s.
    async fn serve(socket: tokio::net::TcpStream) {
        let service = hyper::service::service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(Response::new(String::new()))
        });
        let io = hyper_util::rt::TokioIo::new(socket);
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await;
    }

    fn cluster(host: SocketAddr, limits: Limits) -> (ClusterHandle, watch::Sender<Routing>) {
        let hosts = [(Host::new(host), HostClass::Healthy)];
        let (tx, rx) = watch::channel(Routing::compute(&hosts, 50.0));
        let handle = ClusterHandle::new("c", rx, true, Duration::from_secs(60)).with_limits(limits);
        (handle, tx)
    }

    fn load(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Runs other tasks until `done` holds (bounded: a current-thread runtime runs a spawned
    /// task at a yield, and the task under test needs no I/O to reach its wait).
    async fn until(done: impl Fn() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the awaited state was never reached");
    }

    const TIMEOUT: Duration = Duration::from_secs(5);

    /// At `max_connections` a request waits (pending) for a connection handed back; a request
    /// over `max_pending_requests` is refused at once; each counted as Envoy counts them.
    #[tokio::test]
    async fn a_request_waits_at_max_connections_and_overflows_past_max_pending() {
        let (host, accepted) = server().await;
        let limits = Limits {
            max_connections: 1,
            max_pending_requests: 1,
            ..Limits::default()
        };
        let (c, _tx) = cluster(host, limits);
        let host = BackendAddr(host);
        let stats = Arc::new(ProxyStats::default());
        let (first, request) = connection(&c, host, Proto::Http1, TIMEOUT, &stats)
            .await
            .expect("the first request connects");
        let waiting = {
            let (c, stats) = (c.clone(), stats.clone());
            tokio::spawn(async move {
                connection(&c, host, Proto::Http1, TIMEOUT, &stats)
                    .await
                    .map_err(|_| "refused")
            })
        };
        let breakers = c.traffic().breakers().clone();
        until(|| breakers.held(Resource::Pending) == 1).await;
        let refused = connection(&c, host, Proto::Http1, TIMEOUT, &stats).await;
        assert!(matches!(refused, Err(Refused::Overflow)), "refused");
        // The first response ends: its connection goes back to the pool for the waiting one.
        drop(request);
        c.pool().put(host, first);
        let _second = waiting
            .await
            .unwrap()
            .expect("the waiting request gets the pooled connection");
        assert_eq!(
            (
                load(&breakers.cx_overflow),
                load(&breakers.rq_pending_overflow),
                load(&stats.upstream_cx_pool_reuse),
                load(&accepted),
                c.traffic().cx_active(),
                breakers.held(Resource::Pending),
            ),
            (1, 1, 1, 1, 1, 0)
        );
    }

    /// Over `max_requests` a request with a connection is refused and the connection stays
    /// pooled; the next request, once a place is free, takes it.
    #[tokio::test]
    async fn a_request_over_max_requests_is_refused_and_its_connection_pooled() {
        let (host, accepted) = server().await;
        let limits = Limits {
            max_requests: 1,
            ..Limits::default()
        };
        let (c, _tx) = cluster(host, limits);
        let host = BackendAddr(host);
        let stats = Arc::new(ProxyStats::default());
        let (_first, request) = connection(&c, host, Proto::Http1, TIMEOUT, &stats)
            .await
            .expect("the first request connects");
        let refused = connection(&c, host, Proto::Http1, TIMEOUT, &stats).await;
        assert!(matches!(refused, Err(Refused::Overflow)), "refused");
        let breakers = c.traffic().breakers();
        // Envoy 1.38 and later count it as an active, not a pending, overflow.
        assert_eq!(
            (
                load(&breakers.rq_active_overflow),
                load(&breakers.rq_pending_overflow)
            ),
            (1, 0)
        );
        assert_eq!((c.pool().len(), load(&accepted)), (1, 2));
        drop(request);
        connection(&c, host, Proto::Http1, TIMEOUT, &stats)
            .await
            .expect("a free place and the pooled connection");
        assert_eq!(
            (load(&stats.upstream_cx_pool_reuse), load(&accepted)),
            (1, 2)
        );
    }

    /// A pooled connection found closed before the request went out is replaced, and the
    /// replacement counts in the cluster's open connections (`max_connections`) while it lives.
    #[tokio::test]
    async fn a_replaced_pooled_connection_counts_against_max_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = BackendAddr(listener.local_addr().unwrap());
        tokio::spawn(async move {
            // The first connection is closed at once, the second served.
            drop(listener.accept().await);
            if let Ok((socket, _)) = listener.accept().await {
                serve(socket).await;
            }
        });
        let (c, _tx) = cluster(host.0, Limits::default());
        let stats = Arc::new(ProxyStats::default());
        let mut stale = pool::connect(host, Proto::Http1, TIMEOUT, &stats, c.pool(), None)
            .await
            .expect("connects");
        let Sender::Http1(s) = &mut stale else {
            unreachable!("an HTTP/1.1 connection")
        };
        // Its connection task sees the close (a read of EOF; the runtime polls I/O between
        // the yields) and ends, closing the sender.
        let closed = async {
            while !s.is_closed() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(TIMEOUT, closed)
            .await
            .expect("the server's close reaches the pooled connection");
        let reconnect = super::super::Reconnect {
            pool: c.pool(),
            timeout: TIMEOUT,
            cluster: Some(&c),
        };
        let req = http::Request::get("/")
            .body(http_body_util::BodyExt::boxed(
                http_body_util::BodyExt::map_err(
                    http_body_util::Empty::<bytes::Bytes>::new(),
                    |never| match never {},
                ),
            ))
            .unwrap();
        let (resp, _replacement) =
            super::super::exchange(stale, host, req, Proto::Http1, &reconnect, &stats)
                .await
                .expect("answered on the replacement");
        assert_eq!(resp.status(), 200);
        assert_eq!(c.traffic().cx_active(), 1, "the replacement is counted");
    }

    /// A retry is held until dropped; past `max_retries` none is, counted.
    #[test]
    fn retries_in_flight_are_bounded_by_max_retries() {
        let (c, _tx) = cluster(
            "127.0.0.1:1".parse().unwrap(),
            Limits {
                max_retries: 1,
                ..Limits::default()
            },
        );
        let first = hold_retry(&c).expect("one retry");
        assert!(hold_retry(&c).is_none());
        drop(first);
        assert!(hold_retry(&c).is_some());
        assert_eq!(load(&c.traffic().breakers().rq_retry_overflow), 1);
    }

    /// The refusal is Envoy's: 503, `x-envoy-overloaded: true`, reset reason overflow.
    #[tokio::test]
    async fn the_overflow_reply_is_envoys() {
        use http_body_util::BodyExt;
        let (parts, body) = overflow_reply().into_parts();
        assert_eq!(parts.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(parts.headers["x-envoy-overloaded"], "true");
        let text = body.collect().await.unwrap().to_bytes();
        assert!(text.ends_with(b"reset reason: overflow\n"));
    }
}
