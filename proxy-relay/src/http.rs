//! The HTTP path: HTTP/1.1 and HTTP/2 cleartext (prior knowledge) from the client, each request
//! routed on its own: a service-router route and leg, or ORIGINAL_DST (with
//! `x-envoy-original-dst-host` when enabled); a host per request, pooled upstream connections in
//! the request's protocol; on routes, Envoy's retry policy (request bodies up to
//! [`body::RETRY_BUFFER_LIMIT`] are replayed, each retry on another host when there is one) and the
//! route's request and idle timeouts, which cover the response body too.

use std::{convert::Infallible, sync::Arc};

use bytes::Bytes;
use http::{
    HeaderMap, HeaderValue, Request, Response, StatusCode, Uri, Version,
    header::{CONNECTION, HOST},
};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use proxy_core::upstream::breakers::Held;
use tokio::{net::TcpStream, task::JoinHandle};
use tracing::debug;

use self::{
    attempts::{Attempts, attempt_failure},
    body::{BoxError, Clock, Expired, Payload, TimedBody},
    exchange::{Reconnect, exchange},
    upgrade::{KeepUpgrade, UpgradePolicy},
};
use crate::{
    addr::{BackendAddr, OrigDstAddr},
    cluster::ClusterHandle,
    drain::DrainWatcher,
    orig_dst::HostLease,
    pool::{self, Body, Pool, Proto, Sender},
    route::{AttemptFailure, Hashed, Peers, Route, RouteLeg, apply_headers},
    service::Service,
    shared::Shared,
    stats::ProxyStats,
};

mod attempts;
mod body;
mod drop_overload;
mod exchange;
mod pending;
pub(crate) mod upgrade;

/// The header ORIGINAL_DST takes the destination from when `use_http_header` is on.
pub const ORIGINAL_DST_HOST: &str = "x-envoy-original-dst-host";

/// Headers that belong to one hop and are never forwarded (RFC 9110 section 7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

struct Ctx {
    shared: Arc<Shared>,
    orig: OrigDstAddr,
    /// The client and the service address (what hash policies may hash).
    peers: Peers,
    service: Service,
    /// The bytes of an upgraded connection (at most one per HTTP/1.1 connection).
    tunnel: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Set once the connection's first request has been read.
    started: tokio::sync::watch::Sender<bool>,
}

/// Serves one client connection until it ends (an upgraded one: until its tunnel ends); on
/// drain, asks it to close after the current request (HTTP/1.1 `Connection: close`, HTTP/2
/// GOAWAY), but only once its first request has been read; at the shutdown deadline, drops
/// it.
pub(crate) async fn serve(
    stream: TcpStream,
    orig: OrigDstAddr,
    service: Service,
    shared: Arc<Shared>,
    drain: &DrainWatcher,
) {
    let client = stream
        .peer_addr()
        .unwrap_or_else(|_| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
    let ctx = Arc::new(Ctx {
        shared,
        orig,
        peers: Peers {
            client,
            service: orig.0,
        },
        service,
        tunnel: std::sync::Mutex::new(None),
        started: tokio::sync::watch::Sender::new(false),
    });
    let handler = ctx.clone();
    let svc = service_fn(move |req| {
        let ctx = handler.clone();
        async move { Ok::<_, Infallible>(handle(req, &ctx).await) }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let ended = tokio::select! {
        result = conn.as_mut() => Some(result),
        () = drain.draining() => None,
    };
    match ended {
        Some(Err(err)) => debug!(%err, "client HTTP connection ended with an error"),
        Some(Ok(())) => {}
        None => {
            // A graceful shutdown closes a connection whose first request is not read yet at
            // once (it counts as idle), which resets a client that has sent one, or is about
            // to: a connection accepted just before a reload handed the listeners over. Such a
            // connection gets its first request served (the shutdown deadline bounds the wait).
            let mut started = ctx.started.subscribe();
            let first = tokio::select! {
                _ = conn.as_mut() => false,
                _ = started.wait_for(|started| *started) => true,
                () = drain.closing() => {
                    debug!("shutdown deadline passed before a first request: HTTP connection dropped");
                    false
                }
            };
            if first {
                conn.as_mut().graceful_shutdown();
                tokio::select! {
                    _ = conn.as_mut() => {}
                    () = drain.closing() => debug!("shutdown deadline passed: HTTP connection dropped"),
                }
            }
        }
    }
    upgrade::finish(&ctx, drain).await;
}

/// One request, answered by the upstream or by the proxy itself (404, 503, 504).
async fn handle(req: Request<Incoming>, ctx: &Ctx) -> Response<Body> {
    ctx.started
        .send_if_modified(|started| !std::mem::replace(started, true));
    let stats = &ctx.shared.stats;
    ProxyStats::inc(&stats.downstream_rq_total);
    let proto = if req.version() == Version::HTTP_2 {
        Proto::Http2
    } else {
        Proto::Http1
    };
    let upgrade = upgrade::requested(&req);
    match &ctx.service {
        Service::Http(table) => {
            let Some(route) = table.route(&req) else {
                ProxyStats::inc(&stats.downstream_rq_no_route);
                return local_reply(StatusCode::NOT_FOUND, "no route matched\n");
            };
            if upgrade
                .as_ref()
                .is_some_and(|u| !table.upgrades().allows(u))
            {
                return upgrade::refused(ctx);
            }
            routed(req, route, proto, upgrade, ctx).await
        }
        Service::OriginalDst { .. } => {
            if upgrade
                .as_ref()
                .is_some_and(|u| !UpgradePolicy::default().allows(u))
            {
                return upgrade::refused(ctx);
            }
            original_dst(req, proto, upgrade, ctx).await
        }
        Service::Tcp(_) => local_reply(StatusCode::INTERNAL_SERVER_ERROR, "not an HTTP service\n"),
    }
}

/// A request on a service-router route: the route's request and idle timeouts around every
/// attempt (and the response body), retries per the route's policy on other hosts. An allowed
/// `upgrade` goes upstream with its headers; its 101 starts a tunnel, beyond the timeouts.
async fn routed(
    mut req: Request<Incoming>,
    route: &Route,
    proto: Proto,
    upgrade: Option<HeaderValue>,
    ctx: &Ctx,
) -> Response<Body> {
    let stats = &ctx.shared.stats;
    let Some((leg, cluster)) = pick_cluster(route, stats) else {
        return no_healthy_upstream();
    };
    if let Some(reply) = drop_overload::reply(cluster) {
        return reply;
    }
    // Only a hashing policy asks for the hash (and so generates a cookie), as in Envoy.
    let hashed = if cluster.balancer().is_hash_based() {
        leg.hash.compute(req.headers(), req.uri(), ctx.peers)
    } else {
        Hashed::default()
    };
    let client = upgrade.map(|kind| upgrade::prepare(&mut req, kind));
    let (mut parts, body) = req.into_parts();
    if let Some(path) = route.rewrite(&parts.uri) {
        parts.uri = set_path(&parts.uri, &path);
    }
    apply_headers(&mut parts.headers, route.request_headers.as_ref());
    let clock = Clock::new(route.request_timeout, route.idle_timeout);
    let payload = match Payload::read(body, route.retry.enabled(), &clock).await {
        Ok(p) => p,
        Err(err) => {
            debug!(%err, "client request body failed");
            return local_reply(StatusCode::BAD_REQUEST, "bad request body\n");
        }
    };
    if route.retry.enabled() && !payload.replayable() {
        ProxyStats::inc(&stats.retry_or_shadow_abandoned);
    }
    // The host of the attempt in flight: a request timeout that fires meanwhile is its 504.
    let in_flight = std::sync::Mutex::new(None);
    let attempts = Attempts {
        cluster,
        in_flight: &in_flight,
        proto,
        // The chain's resolver ConnectTimeout, else the cluster's own, else the proxy's.
        connect_timeout: leg
            .connect_timeout
            .unwrap_or_else(|| ctx.shared.connect_timeout(Some(cluster))),
        policy: &route.retry,
        hash: hashed.hash,
        parts,
        payload,
        stats,
    };
    let result = tokio::select! {
        result = attempts.run() => result,
        which = clock.clone().expired() => {
            let host = *in_flight.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let (Expired::Request, Some(host)) = (which, host) {
                // Envoy records a request that timed out as a 504 of its host.
                cluster.report_response(host, 504);
            }
            Err(expired_reply(which, stats))
        }
    };
    let mut resp = match result {
        Ok(mut answer) => {
            debug!(route_target = %leg.target, host = %answer.host, "request routed");
            if let Some(cookie) = hashed.set_cookie {
                answer
                    .resp
                    .headers_mut()
                    .append(http::header::SET_COOKIE, cookie);
            }
            match client {
                Some(client) => upgrade::answer(answer, client, ctx),
                None => respond(answer, cluster.pool(), Some(clock), stats),
            }
        }
        Err(reply) => reply,
    };
    apply_headers(resp.headers_mut(), route.response_headers.as_ref());
    resp
}

/// The leg the route picks and its cluster, or the first failover cluster with a routable host;
/// `None` (counted) when none has one.
fn pick_cluster<'r>(
    route: &'r Route,
    stats: &ProxyStats,
) -> Option<(&'r RouteLeg, &'r ClusterHandle)> {
    let picked = route.pick_leg();
    let cluster =
        picked.and_then(|leg| Some((leg, leg.clusters.iter().find(|c| c.has_routable())?)));
    if cluster.is_none() {
        ProxyStats::inc(&stats.upstream_cx_none_healthy);
        if let Some(first) = picked.and_then(|leg| leg.clusters.first()) {
            first.count_none_healthy();
        }
    }
    cluster
}

/// An upstream response, with the connection it came on and the host.
struct Answer {
    resp: Response<Incoming>,
    sender: Sender,
    host: BackendAddr,
    /// A routed request's place in its cluster's `max_requests`, held until the response body
    /// has ended (or been dropped).
    request: Option<Held>,
}

/// ORIGINAL_DST over HTTP: the request goes to the connection's original destination, or to
/// `x-envoy-original-dst-host` when enabled and present; an allowed `upgrade` as on a route.
async fn original_dst(
    mut req: Request<Incoming>,
    proto: Proto,
    upgrade: Option<HeaderValue>,
    ctx: &Ctx,
) -> Response<Body> {
    let shared = &ctx.shared;
    let Some(host) = orig_dst_host(&req, ctx) else {
        return local_reply(StatusCode::BAD_REQUEST, "bad x-envoy-original-dst-host\n");
    };
    let lease: HostLease = shared.orig_dst_cluster.lease(host);
    let pool = shared.orig_dst_cluster.pool();
    let timeout = shared.connect_timeout(None);
    let sender = match pool.take(host, proto) {
        Some(s) => {
            ProxyStats::inc(&shared.stats.upstream_cx_pool_reuse);
            s
        }
        None => match pool::connect(host, proto, timeout, &shared.stats, pool, None).await {
            Ok(s) => s,
            Err(err) => {
                debug!(%err, "ORIGINAL_DST connect failed");
                return failure_reply(attempt_failure(&err));
            }
        },
    };
    let client = upgrade.map(|kind| upgrade::prepare(&mut req, kind));
    let (parts, body) = req.into_parts();
    let req = Request::from_parts(parts, body.map_err(BoxError::from).boxed());
    let reconnect = Reconnect {
        pool,
        timeout,
        cluster: None,
    };
    let resp = match exchange(sender, host, req, proto, &reconnect, &shared.stats).await {
        Ok((resp, sender)) => {
            let answer = Answer {
                resp,
                sender,
                host,
                request: None,
            };
            match client {
                Some(client) => upgrade::answer(answer, client, ctx),
                None => respond(answer, pool, None, &shared.stats),
            }
        }
        Err(failure) => failure_reply(failure),
    };
    drop(lease);
    resp
}

/// The connection's original destination, or `x-envoy-original-dst-host` when enabled and
/// present; `None` when that header is not an address or names the proxy itself.
fn orig_dst_host<B>(req: &Request<B>, ctx: &Ctx) -> Option<BackendAddr> {
    let shared = &ctx.shared;
    match req.headers().get(ORIGINAL_DST_HOST) {
        Some(value) if shared.config.use_http_header => {
            match value.to_str().ok().and_then(|v| v.parse().ok()) {
                Some(addr) if !shared.is_self(addr) => Some(BackendAddr(addr)),
                _ => None,
            }
        }
        _ => Some(BackendAddr(ctx.orig.0)),
    }
}

/// The response for the client: hop-by-hop headers removed, the body under the route's
/// timeouts (when routed); an HTTP/1.1 connection goes back to the pool once the response body
/// has been read to the end.
fn respond(
    answer: Answer,
    pool: &Arc<Pool>,
    clock: Option<Arc<Clock>>,
    stats: &Arc<ProxyStats>,
) -> Response<Body> {
    let Answer {
        resp,
        sender,
        host,
        request,
    } = answer;
    if let Sender::Http1(mut s) = sender {
        let pool = pool.clone();
        tokio::spawn(async move {
            if s.ready().await.is_ok() {
                pool.put(host, Sender::Http1(s));
            }
        });
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let body = match clock {
        Some(clock) => TimedBody::new(body, clock, stats.clone()).boxed(),
        None => body.map_err(BoxError::from).boxed(),
    };
    // The request stays in flight (`max_requests`) as long as its response body lives.
    let body = body
        .map_err(move |err| {
            let _in_flight = &request;
            err
        })
        .boxed();
    Response::from_parts(parts, body)
}

/// The request as the upstream gets it: hop-by-hop headers removed (an allowed upgrade's kept),
/// version and URI form of the upstream protocol, `Host` kept (HTTP/2's authority becomes
/// `Host` for HTTP/1.1).
fn upstream_request(req: Request<Body>, proto: Proto, host: BackendAddr) -> Request<Body> {
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let Some(KeepUpgrade(kind)) = parts.extensions.get() {
        let kind = kind.clone();
        parts
            .headers
            .insert(CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(http::header::UPGRADE, kind);
    }
    let authority = parts
        .headers
        .get(HOST)
        .and_then(|h| h.to_str().ok().map(str::to_owned))
        .or_else(|| parts.uri.authority().map(std::string::ToString::to_string))
        .unwrap_or_else(|| host.to_string());
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    match proto {
        Proto::Http1 => {
            parts.version = Version::HTTP_11;
            parts.uri = path.parse().unwrap_or_else(|_| Uri::from_static("/"));
            if let Ok(v) = HeaderValue::from_str(&authority) {
                parts.headers.insert(HOST, v);
            }
        }
        Proto::Http2 => {
            parts.version = Version::HTTP_2;
            parts.headers.remove(HOST);
            let uri = format!("http://{authority}{path}");
            parts.uri = uri.parse().unwrap_or_else(|_| parts.uri.clone());
        }
    }
    Request::from_parts(parts, body)
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<String> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    for name in HOP_BY_HOP
        .iter()
        .copied()
        .chain(named.iter().map(String::as_str))
    {
        headers.remove(name);
    }
    headers.remove("upgrade");
}

fn set_path(uri: &Uri, path_and_query: &str) -> Uri {
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = path_and_query.parse().ok();
    Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

/// The reply when a timeout fired before the response headers: 504 for the request timeout,
/// 408 for the idle timeout (Envoy's codes and bodies).
fn expired_reply(which: Expired, stats: &ProxyStats) -> Response<Body> {
    match which {
        Expired::Request => {
            ProxyStats::inc(&stats.upstream_rq_timeout);
            local_reply(StatusCode::GATEWAY_TIMEOUT, "upstream request timeout\n")
        }
        Expired::Idle => {
            ProxyStats::inc(&stats.downstream_rq_idle_timeout);
            local_reply(StatusCode::REQUEST_TIMEOUT, "stream timeout\n")
        }
    }
}

fn no_healthy_upstream() -> Response<Body> {
    local_reply(StatusCode::SERVICE_UNAVAILABLE, "no healthy upstream\n")
}

/// Envoy's 503 when no response headers came, with its reset reason.
fn failure_reply(failure: AttemptFailure) -> Response<Body> {
    let text = match failure {
        AttemptFailure::ConnectFailure => {
            "upstream connect error or disconnect/reset before headers. reset reason: connection failure\n"
        }
        AttemptFailure::Reset {
            refused_stream: true,
        } => {
            "upstream connect error or disconnect/reset before headers. reset reason: remote refused stream reset\n"
        }
        AttemptFailure::Reset {
            refused_stream: false,
        } => {
            "upstream connect error or disconnect/reset before headers. reset reason: connection termination\n"
        }
    };
    local_reply(StatusCode::SERVICE_UNAVAILABLE, text)
}

/// A response the proxy makes itself.
fn local_reply(status: StatusCode, text: &'static str) -> Response<Body> {
    let body = Full::new(Bytes::from_static(text.as_bytes()))
        .map_err(|never| match never {})
        .boxed();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> Body {
        Full::new(Bytes::new())
            .map_err(|never| match never {})
            .boxed()
    }

    #[test]
    fn upstream_request_forms() {
        let host = BackendAddr("127.0.0.1:8080".parse().unwrap());
        let req = Request::builder()
            .version(Version::HTTP_2)
            .uri("http://svc.example:80/a?b=1")
            .header("te", "trailers")
            .header("connection", "x-private")
            .header("x-private", "1")
            .header("x-keep", "1")
            .body(empty())
            .unwrap();
        let h1 = upstream_request(req, Proto::Http1, host);
        assert_eq!(h1.uri(), "/a?b=1");
        assert_eq!(h1.headers()[HOST], "svc.example:80");
        assert!(h1.headers().get("te").is_none() && h1.headers().get("x-private").is_none());
        assert_eq!(h1.headers()["x-keep"], "1");
        let req = Request::builder()
            .uri("/p")
            .header(HOST, "svc")
            .body(empty())
            .unwrap();
        let h2 = upstream_request(req, Proto::Http2, host);
        assert_eq!(h2.uri(), "http://svc/p");
        assert!(h2.headers().get(HOST).is_none());
    }
}
