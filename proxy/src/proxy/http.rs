//! The HTTP path: HTTP/1.1 and HTTP/2 cleartext (prior knowledge) from the client, each request
//! routed on its own: a service-router route and leg, or ORIGINAL_DST (with
//! `x-envoy-original-dst-host` when enabled); a host per request, pooled upstream connections in
//! the request's protocol, retries on connect failure, the route's request timeout.

use std::{convert::Infallible, sync::Arc, time::Duration};

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
use tokio::{net::TcpStream, time::Instant};
use tracing::debug;

use super::{
    Service, Shared,
    cluster::ClusterHandle,
    drain::DrainWatcher,
    orig_dst::{BackendAddr, HostLease, OrigDstAddr},
    pool::{self, Body, Pool, Proto, Sender},
    route::{Route, apply_headers},
    stats::ProxyStats,
};

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
    service: Service,
}

/// Serves one client connection until it ends; on drain, asks it to close after the current
/// request (HTTP/1.1 `Connection: close`, HTTP/2 GOAWAY); at the shutdown deadline, drops it.
pub(super) async fn serve(
    stream: TcpStream,
    orig: OrigDstAddr,
    service: Service,
    shared: Arc<Shared>,
    drain: &DrainWatcher,
) {
    let ctx = Arc::new(Ctx {
        shared,
        orig,
        service,
    });
    let svc = service_fn(move |req| {
        let ctx = ctx.clone();
        async move { Ok::<_, Infallible>(handle(req, &ctx).await) }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(err) = result {
                debug!(%err, "client HTTP connection ended with an error");
            }
            return;
        }
        () = drain.draining() => conn.as_mut().graceful_shutdown(),
    }
    tokio::select! {
        _ = conn.as_mut() => {}
        () = drain.closing() => debug!("shutdown deadline passed: HTTP connection dropped"),
    }
}

/// One request, answered by the upstream or by the proxy itself (404, 503, 504).
async fn handle(req: Request<Incoming>, ctx: &Ctx) -> Response<Body> {
    let stats = &ctx.shared.stats;
    ProxyStats::inc(&stats.downstream_rq_total);
    let proto = if req.version() == Version::HTTP_2 {
        Proto::Http2
    } else {
        Proto::Http1
    };
    match &ctx.service {
        Service::Http(table) => {
            let Some(route) = table.route(&req) else {
                ProxyStats::inc(&stats.downstream_rq_no_route);
                return local_reply(StatusCode::NOT_FOUND, "no route matched\n");
            };
            routed(req, route, proto, ctx).await
        }
        Service::OriginalDst { .. } => original_dst(req, proto, ctx).await,
        Service::Tcp(_) => local_reply(StatusCode::INTERNAL_SERVER_ERROR, "not an HTTP service\n"),
    }
}

/// A request on a service-router route.
async fn routed(req: Request<Incoming>, route: &Route, proto: Proto, ctx: &Ctx) -> Response<Body> {
    let stats = &ctx.shared.stats;
    let Some(leg) = route.pick_leg() else {
        ProxyStats::inc(&stats.upstream_cx_none_healthy);
        return local_reply(StatusCode::SERVICE_UNAVAILABLE, "no healthy upstream\n");
    };
    // The target's cluster, or the first failover cluster with a routable host.
    let Some(cluster) = leg.clusters.iter().find(|c| c.pick(&[]).is_some()) else {
        ProxyStats::inc(&stats.upstream_cx_none_healthy);
        return local_reply(StatusCode::SERVICE_UNAVAILABLE, "no healthy upstream\n");
    };
    let deadline = route.request_timeout.map(|t| Instant::now() + t);
    let connect_timeout = leg
        .connect_timeout
        .unwrap_or(ctx.shared.config.connect_timeout);
    let (mut parts, body) = req.into_parts();
    if let Some(path) = route.rewrite(&parts.uri) {
        parts.uri = set_path(&parts.uri, &path);
    }
    apply_headers(&mut parts.headers, route.request_headers.as_ref());
    let (sender, host) = match with_deadline(
        deadline,
        connect_with_retries(cluster, proto, connect_timeout, route.connect_retries, ctx),
    )
    .await
    {
        Some(Ok(found)) => found,
        Some(Err(reply)) => return reply,
        None => return timed_out(stats),
    };
    debug!(route_target = %leg.target, %host, "request routed");
    let req = Request::from_parts(parts, body.boxed());
    let mut resp = send(sender, host, req, proto, cluster.pool(), deadline, ctx).await;
    apply_headers(resp.headers_mut(), route.response_headers.as_ref());
    resp
}

/// Picks hosts and connects (pooled connection first), retrying other hosts on connect failure.
async fn connect_with_retries(
    cluster: &ClusterHandle,
    proto: Proto,
    timeout: Duration,
    retries: u32,
    ctx: &Ctx,
) -> Result<(Sender, BackendAddr), Response<Body>> {
    let stats = &ctx.shared.stats;
    let mut tried = Vec::new();
    for attempt in 0..=retries {
        let Some(host) = cluster.pick(&tried) else {
            ProxyStats::inc(&stats.upstream_cx_none_healthy);
            return Err(local_reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "no healthy upstream\n",
            ));
        };
        if attempt > 0 {
            ProxyStats::inc(&stats.upstream_rq_retry);
        }
        if let Some(sender) = cluster.pool().take(host, proto) {
            ProxyStats::inc(&stats.upstream_cx_pool_reuse);
            return Ok((sender, host));
        }
        match pool::connect(host, proto, timeout, stats, cluster.pool()).await {
            Ok(sender) => {
                cluster.report_connect(host, true);
                return Ok((sender, host));
            }
            Err(err) => {
                cluster.report_connect(host, false);
                debug!(%err, attempt, "upstream connect failed");
                if !err.is_connect_failure() || attempt == retries {
                    return Err(connect_failed());
                }
                tried.push(host);
            }
        }
    }
    Err(connect_failed())
}

/// ORIGINAL_DST over HTTP: the request goes to the connection's original destination, or to
/// `x-envoy-original-dst-host` when enabled and present.
async fn original_dst(req: Request<Incoming>, proto: Proto, ctx: &Ctx) -> Response<Body> {
    let shared = &ctx.shared;
    let mut host = BackendAddr(ctx.orig.0);
    if shared.config.use_http_header
        && let Some(value) = req.headers().get(ORIGINAL_DST_HOST)
    {
        match value.to_str().ok().and_then(|v| v.parse().ok()) {
            Some(addr) if !shared.is_self(addr) => host = BackendAddr(addr),
            _ => return local_reply(StatusCode::BAD_REQUEST, "bad x-envoy-original-dst-host\n"),
        }
    }
    let lease: HostLease = shared.orig_dst_cluster.lease(host);
    let pool = shared.orig_dst_cluster.pool();
    let sender = match pool.take(host, proto) {
        Some(s) => {
            ProxyStats::inc(&shared.stats.upstream_cx_pool_reuse);
            s
        }
        None => match pool::connect(
            host,
            proto,
            shared.config.connect_timeout,
            &shared.stats,
            pool,
        )
        .await
        {
            Ok(s) => s,
            Err(err) => {
                debug!(%err, "ORIGINAL_DST connect failed");
                return connect_failed();
            }
        },
    };
    let (parts, body) = req.into_parts();
    let resp = send(
        sender,
        host,
        Request::from_parts(parts, body.boxed()),
        proto,
        pool,
        None,
        ctx,
    )
    .await;
    drop(lease);
    resp
}

/// Sends the request (a stale pooled connection is replaced once), returns the connection to
/// the pool when its response is done, and turns failures into 503 / 504.
async fn send(
    mut sender: Sender,
    host: BackendAddr,
    req: Request<Body>,
    proto: Proto,
    pool: &Arc<Pool>,
    deadline: Option<Instant>,
    ctx: &Ctx,
) -> Response<Body> {
    let stats = &ctx.shared.stats;
    let req = upstream_request(req, proto, host);
    ProxyStats::inc(&stats.upstream_rq_total);
    let first = match with_deadline(deadline, sender.try_send(req)).await {
        None => return timed_out(stats),
        Some(r) => r,
    };
    let result = match first {
        Err((err, Some(req))) => {
            // The pooled connection was closed before the request went out: a fresh one.
            debug!(%err, "pooled connection unusable; reconnecting");
            let timeout = ctx.shared.config.connect_timeout;
            sender = match pool::connect(host, proto, timeout, stats, pool).await {
                Ok(s) => s,
                Err(_) => return connect_failed(),
            };
            match with_deadline(deadline, sender.try_send(req)).await {
                None => return timed_out(stats),
                Some(r) => r,
            }
        }
        other => other,
    };
    match result {
        Ok(resp) => {
            if let Sender::Http1(mut s) = sender {
                let pool = pool.clone();
                // Back to the pool once the response body has been read to the end.
                tokio::spawn(async move {
                    if s.ready().await.is_ok() {
                        pool.put(host, Sender::Http1(s));
                    }
                });
            }
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, body.boxed())
        }
        Err((err, _)) => {
            debug!(%err, %host, "upstream request failed");
            local_reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "upstream connect error or disconnect/reset before headers\n",
            )
        }
    }
}

impl Sender {
    /// Sends, giving the request back when it was not sent at all.
    async fn try_send(
        &mut self,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, (hyper::Error, Option<Request<Body>>)> {
        let result = match self {
            Sender::Http1(s) => s.try_send_request(req).await,
            Sender::Http2(s) => s.try_send_request(req).await,
        };
        result.map_err(|mut e| {
            let req = e.take_message();
            (e.into_error(), req)
        })
    }
}

/// The request as the upstream gets it: hop-by-hop headers removed, version and URI form of
/// the upstream protocol, `Host` kept (HTTP/2's authority becomes `Host` for HTTP/1.1).
fn upstream_request(req: Request<Body>, proto: Proto, host: BackendAddr) -> Request<Body> {
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let authority = parts
        .headers
        .get(HOST)
        .and_then(|h| h.to_str().ok().map(str::to_owned))
        .or_else(|| parts.uri.authority().map(|a| a.to_string()))
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

async fn with_deadline<F: Future>(deadline: Option<Instant>, f: F) -> Option<F::Output> {
    match deadline {
        Some(d) => tokio::time::timeout_at(d, f).await.ok(),
        None => Some(f.await),
    }
}

fn timed_out(stats: &ProxyStats) -> Response<Body> {
    ProxyStats::inc(&stats.upstream_rq_timeout);
    local_reply(StatusCode::GATEWAY_TIMEOUT, "upstream request timeout\n")
}

fn connect_failed() -> Response<Body> {
    local_reply(
        StatusCode::SERVICE_UNAVAILABLE,
        "upstream connect error or disconnect/reset before headers\n",
    )
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
