//! The proxy path's HTTP behaviour, in-process on 127.0.0.1 with real HTTP servers and routes
//! compiled from Consul config entries: route matching picks the right target, prefix rewrite,
//! retries (connect failures, status codes, `RetryOn`, the replayed body and its buffer limit,
//! another host per retry), the request timeout (before the headers: 504; during the body: the
//! downstream stream is aborted) and the idle timeout, HTTP/2 cleartext, ORIGINAL_DST pooling
//! and `x-envoy-original-dst-host`, the HTTP side of a graceful shutdown, the statuses
//! outlier detection gets (5xx answers, timed-out requests as 504), and a request the cluster's
//! circuit breakers refuse.

mod proxy_support;

use std::{collections::BTreeMap, fmt::Write as _, net::SocketAddr, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use proxy_chain::{CompileRequest, Entries, compile};
use proxy_relay::{ClusterHandle, DrainOutcome, ProxyConfig, RouteTable, Service, ServiceTable};
use proxy_support::{
    HttpServer, TestProxy, WAIT, cluster, dead_addr, get, http1_client, payload, request,
    scripted::{Scripted, echo_line, send},
};
use tokio::sync::watch;

const VIP: &str = "127.77.0.10:80";

const ENTRIES: &str = r#"[
  {"Kind": "proxy-defaults", "Name": "global", "Config": {"protocol": "http"}},
  {"Kind": "service-router", "Name": "web", "Routes": [
    {"Match": {"HTTP": {"PathPrefix": "/api/"}}, "Destination": {"Service": "api"}},
    {"Match": {"HTTP": {"Header": [{"Name": "x-canary", "Exact": "1"}]}}, "Destination": {"Service": "canary"}},
    {"Match": {"HTTP": {"QueryParam": [{"Name": "v", "Exact": "2"}]}}, "Destination": {"Service": "v2"}},
    {"Match": {"HTTP": {"PathRegex": "/item/[0-9]+", "Methods": ["POST"]}}, "Destination": {"Service": "items"}},
    {"Match": {"HTTP": {"PathPrefix": "/old/"}}, "Destination": {"Service": "api", "PrefixRewrite": "/new/"}},
    {"Match": {"HTTP": {"PathPrefix": "/retry/"}}, "Destination": {"Service": "flaky", "NumRetries": 3, "RetryOnConnectFailure": true}},
    {"Match": {"HTTP": {"PathPrefix": "/noretry/"}}, "Destination": {"Service": "dead"}},
    {"Match": {"HTTP": {"PathPrefix": "/slow"}}, "Destination": {"Service": "api", "RequestTimeout": "300ms"}},
    {"Match": {"HTTP": {"PathPrefix": "/r503/"}}, "Destination": {"Service": "scripted", "NumRetries": 2, "RetryOnStatusCodes": [503]}},
    {"Match": {"HTTP": {"PathPrefix": "/n503/"}}, "Destination": {"Service": "scripted"}},
    {"Match": {"HTTP": {"PathPrefix": "/r5xx/"}}, "Destination": {"Service": "pair", "NumRetries": 1, "RetryOn": ["5xx"]}},
    {"Match": {"HTTP": {"PathPrefix": "/body/"}}, "Destination": {"Service": "scripted", "RequestTimeout": "400ms"}},
    {"Match": {"HTTP": {"PathPrefix": "/idle/"}}, "Destination": {"Service": "scripted", "IdleTimeout": "300ms"}},
    {"Match": {"HTTP": {"PathPrefix": "/budget/"}}, "Destination": {"Service": "scripted", "RequestTimeout": "500ms", "NumRetries": 1000, "RetryOn": ["5xx"]}}
  ]}
]"#;

/// The backends, their clusters (kept so the routing channels stay open) and the proxy.
struct Setup {
    proxy: TestProxy,
    /// `scripted`'s only host: its answers depend on the path (see `scripted`).
    scripted: Scripted,
    _pair: [Scripted; 2],
    _servers: Vec<HttpServer>,
    _routing: Vec<watch::Sender<proxy_core::health::Routing>>,
}

async fn setup(config: ProxyConfig) -> Setup {
    let mut servers = Vec::new();
    let mut clusters: BTreeMap<String, ClusterHandle> = BTreeMap::new();
    let mut routing = Vec::new();
    for name in ["web", "api", "canary", "v2", "items", "flaky"] {
        let server = HttpServer::start(name).await;
        let hosts: Vec<SocketAddr> = if name == "flaky" {
            vec![dead_addr(), server.addr]
        } else {
            vec![server.addr]
        };
        let (tx, c) = cluster(name, &hosts, true);
        clusters.insert(name.to_owned(), c);
        routing.push(tx);
        servers.push(server);
    }
    let (tx, c) = cluster("dead", &[dead_addr()], true);
    clusters.insert("dead".to_owned(), c);
    routing.push(tx);
    let scripted = Scripted::start("scripted", false).await;
    let (tx, c) = cluster("scripted", &[scripted.addr], true);
    clusters.insert("scripted".to_owned(), c);
    routing.push(tx);
    // One host that always answers 503 and one that answers.
    let pair = [
        Scripted::start("failing", true).await,
        Scripted::start("good", false).await,
    ];
    let (tx, c) = cluster("pair", &[pair[0].addr, pair[1].addr], true);
    clusters.insert("pair".to_owned(), c);
    routing.push(tx);

    let entries = Entries::from_json(ENTRIES).expect("entries are valid");
    let chain =
        compile(&CompileRequest::new("web", "dc1", "consul"), &entries).expect("chain compiles");
    let table = RouteTable::from_chain(&chain, &|t| clusters.get(&t.service).cloned())
        .expect("every target has a cluster");
    let mut services = ServiceTable::new();
    services.insert(VIP.parse().unwrap(), Service::Http(Arc::new(table)));
    let proxy = TestProxy::start(config, services).await;
    Setup {
        proxy,
        scripted,
        _pair: pair,
        _servers: servers,
        _routing: routing,
    }
}

/// (method, path, headers, expected backend).
type Case = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static str,
);

fn who(body: &str) -> &str {
    body.split(' ').next().unwrap_or("")
}

#[tokio::test]
async fn routes_choose_the_right_target() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    let cases: [Case; 8] = [
        ("GET", "/api/users", &[], "api"),
        ("GET", "/anything", &[("x-canary", "1")], "canary"),
        ("GET", "/anything", &[("x-canary", "0")], "web"),
        ("GET", "/search?q=a&v=2", &[], "v2"),
        ("POST", "/item/42", &[], "items"),
        ("GET", "/item/42", &[], "web"),
        ("POST", "/item/42/x", &[], "web"),
        ("GET", "/", &[], "web"),
    ];
    for (method, path, headers, want) in cases {
        let (status, body) = request(&mut c, method, path, headers).await;
        assert_eq!(
            (status, who(&body)),
            (200, want),
            "{method} {path} {headers:?}: {body}"
        );
    }
    // Prefix rewrite: the upstream sees the new path, query kept.
    let (status, body) = get(&mut c, "/old/x?y=1", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(body, "api GET /new/x?y=1 HTTP/1.1");
    assert_eq!(s.proxy.stat("downstream_rq_total"), 9);
}

#[tokio::test]
async fn connect_failures_are_retried_on_another_host() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    for i in 0..20 {
        let (status, body) = get(&mut c, &format!("/retry/{i}"), &[]).await;
        assert_eq!((status, who(&body)), (200, "flaky"), "request {i}: {body}");
        // Let the upstream connection go back to the pool before the next request.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Half the first picks go to the dead host: P(no retry in 20) is 2^-20.
    assert!(s.proxy.stat("upstream_rq_retry") > 0);
    assert!(s.proxy.stat("upstream_cx_connect_fail") > 0);
    // Without a retry policy a connect failure is the client's 503.
    let (status, body) = get(&mut c, "/noretry/", &[]).await;
    assert_eq!(status, 503, "{body}");
}

#[tokio::test]
async fn request_timeout_gives_504() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    let started = std::time::Instant::now();
    let (status, body) = get(&mut c, "/slow", &[]).await;
    assert_eq!(status, 504, "{body}");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(s.proxy.stat("upstream_rq_timeout"), 1);
}

#[tokio::test]
async fn http2_cleartext_is_routed_and_kept_http2_upstream() {
    let s = setup(ProxyConfig::default()).await;
    let stream = s.proxy.connect(VIP.parse().unwrap()).await;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    for (path, want) in [("/api/x", "api"), ("/", "web")] {
        let req = hyper::Request::builder()
            .uri(format!("http://svc{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = tokio::time::timeout(WAIT, sender.send_request(req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body).into_owned();
        assert_eq!(who(&body), want);
        assert!(body.ends_with("HTTP/2.0"), "{body}");
    }
}

#[tokio::test]
async fn original_dst_http_pools_and_honours_the_header() {
    let (one, two) = (
        HttpServer::start("one").await,
        HttpServer::start("two").await,
    );
    let mut services = ServiceTable::new();
    services.set_fallback(Service::OriginalDst { http: true });
    let config = ProxyConfig {
        use_http_header: true,
        cleanup_interval: Duration::from_millis(300),
        ..ProxyConfig::default()
    };
    let proxy = TestProxy::start(config, services).await;
    let mut c = http1_client(&proxy, one.addr).await;
    for _ in 0..3 {
        let (status, body) = get(&mut c, "/", &[]).await;
        assert_eq!((status, who(&body)), (200, "one"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // One upstream connection served all three.
    assert_eq!(one.connections.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(proxy.stat("upstream_cx_pool_reuse"), 2);
    let (status, body) = get(
        &mut c,
        "/",
        &[("x-envoy-original-dst-host", &two.addr.to_string())],
    )
    .await;
    assert_eq!((status, who(&body)), (200, "two"));
    let (status, _) = get(
        &mut c,
        "/",
        &[("x-envoy-original-dst-host", "not-an-address")],
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(proxy.stat("original_dst_hosts"), 2);
    // Unused for the cleanup interval: both hosts flushed (with their pooled connections).
    proxy.wait_stat("original_dst_hosts", 0).await;
}

#[tokio::test]
async fn shutdown_lets_the_request_in_flight_finish() {
    let config = ProxyConfig {
        shutdown_timeout: Duration::from_secs(5),
        ..ProxyConfig::default()
    };
    let server = HttpServer::start("one").await;
    let mut services = ServiceTable::new();
    services.set_fallback(Service::OriginalDst { http: true });
    let proxy = TestProxy::start(config, services).await;
    let mut c = http1_client(&proxy, server.addr).await;
    let in_flight = tokio::spawn(async move { get(&mut c, "/slow", &[]).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let outcome = tokio::time::timeout(WAIT, proxy.handle.shutdown())
        .await
        .expect("shutdown in time");
    let (status, body) = in_flight.await.unwrap();
    assert_eq!((status, who(&body)), (200, "one"));
    assert_eq!(outcome, DrainOutcome::Graceful);
}

/// A connection the proxy accepted before a graceful shutdown (a reload's old proxy, say) whose
/// first request comes after the drain began is served, then closed; it is not reset as an
/// idle connection would be.
#[tokio::test]
async fn shutdown_serves_the_first_request_of_a_connection_accepted_before_it() {
    let config = ProxyConfig {
        shutdown_timeout: Duration::from_secs(5),
        ..ProxyConfig::default()
    };
    let server = HttpServer::start("one").await;
    let mut services = ServiceTable::new();
    services.set_fallback(Service::OriginalDst { http: true });
    let proxy = TestProxy::start(config, services).await;
    let mut c = http1_client(&proxy, server.addr).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while proxy.handle.active_connections() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never accepted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let shutdown = proxy.handle.shutdown();
    tokio::pin!(shutdown);
    // One poll starts the drain; the request is sent after it.
    tokio::select! {
        biased;
        _ = &mut shutdown => panic!("the drain waits for the accepted connection"),
        () = std::future::ready(()) => {}
    }
    let answer = tokio::spawn(async move { get(&mut c, "/", &[]).await });
    let outcome = tokio::time::timeout(WAIT, shutdown)
        .await
        .expect("shutdown in time");
    let (status, body) = answer.await.unwrap();
    assert_eq!((status, who(&body)), (200, "one"));
    assert_eq!(outcome, DrainOutcome::Graceful);
}

#[tokio::test]
async fn a_503_is_retried_and_the_body_replayed() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    let body = payload(4096, 7);
    let (status, text) = send(&mut c, "POST", "/r503/fail-once", &body).await;
    assert_eq!(status, 200);
    assert_eq!(
        text.expect("complete body"),
        echo_line("scripted", "POST", "/r503/fail-once", &body),
        "the retry carried the same body"
    );
    assert_eq!(s.scripted.requests("/r503/fail-once"), 2);
    assert_eq!(s.proxy.stat("upstream_rq_retry"), 1);
    assert_eq!(s.proxy.stat("upstream_rq_retry_success"), 1);
    assert_eq!(s.proxy.stat("upstream_rq_retry_limit_exceeded"), 0);
    assert_eq!(s.proxy.stat("upstream_rq_total"), 2);
    // Every attempt fails: the last upstream answer is the client's, the limit is counted.
    let (status, _) = send(&mut c, "GET", "/r503/fail", &[]).await;
    assert_eq!(status, 503);
    assert_eq!(
        s.scripted.requests("/r503/fail"),
        3,
        "one attempt and NumRetries 2"
    );
    assert_eq!(s.proxy.stat("upstream_rq_retry_limit_exceeded"), 1);
}

#[tokio::test]
async fn without_a_retry_policy_the_503_is_the_answer() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    let (status, _) = send(&mut c, "GET", "/n503/fail-once", &[]).await;
    assert_eq!(status, 503);
    assert_eq!(s.scripted.requests("/n503/fail-once"), 1);
    assert_eq!(s.proxy.stat("upstream_rq_retry"), 0);
}

#[tokio::test]
async fn a_body_over_the_retry_buffer_is_not_retried() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    // 100 KiB: over the 64 KiB retry buffer.
    let body = payload(100 * 1024, 3);
    let (status, _) = send(&mut c, "POST", "/r503/fail-once", &body).await;
    assert_eq!(status, 503, "not retried");
    assert_eq!(s.scripted.requests("/r503/fail-once"), 1);
    assert_eq!(
        s.scripted.last_body("/r503/fail-once"),
        Some(echo_line("scripted", "POST", "/r503/fail-once", &body)),
        "the streamed body arrived whole"
    );
    assert_eq!(s.proxy.stat("retry_or_shadow_abandoned"), 1);
    assert_eq!(s.proxy.stat("upstream_rq_retry"), 0);
}

#[tokio::test]
async fn each_retry_goes_to_another_host() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    // Half the first attempts go to the failing host; with one retry on the other host every
    // request succeeds. P(no retry in 20 requests) is 2^-20.
    for i in 0..20 {
        let (status, text) = send(&mut c, "GET", &format!("/r5xx/{i}"), &[]).await;
        assert_eq!(status, 200, "request {i}: {text:?}");
    }
    let retries = s.proxy.stat("upstream_rq_retry");
    assert!(retries > 0);
    assert_eq!(s.proxy.stat("upstream_rq_retry_success"), retries);
}

#[tokio::test]
async fn the_request_timeout_aborts_a_slow_body() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    // Headers at once, then a chunk every 50 ms for a second: the 400 ms timeout cuts it.
    let (status, text) = send(&mut c, "GET", "/body/trickle", &[]).await;
    assert_eq!(status, 200, "the headers had gone out");
    assert!(text.is_err(), "the body was aborted: {text:?}");
    assert_eq!(s.proxy.stat("upstream_rq_timeout"), 1);
    // Over HTTP/2 the stream is reset; the connection stays usable.
    let stream = s.proxy.connect(VIP.parse().unwrap()).await;
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let stalled = h2_get(&mut h2, "/body/stall").await;
    assert!(stalled.is_err(), "{stalled:?}");
    assert_eq!(s.proxy.stat("upstream_rq_timeout"), 2);
    let fine = h2_get(&mut h2, "/body/ok").await;
    assert_eq!(fine.unwrap(), echo_line("scripted", "GET", "/body/ok", &[]));
}

#[tokio::test]
async fn the_request_timeout_is_shared_by_the_retries() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    let (status, _) = send(&mut c, "GET", "/budget/fail", &[]).await;
    assert_eq!(status, 504, "NumRetries 1000 ended by the 500 ms timeout");
    assert_eq!(s.proxy.stat("upstream_rq_timeout"), 1);
    let retries = s.proxy.stat("upstream_rq_retry");
    assert!((1..1000).contains(&retries), "{retries}");
}

#[tokio::test]
async fn the_idle_timeout_aborts_a_stalled_body_only() {
    let s = setup(ProxyConfig::default()).await;
    let mut c = http1_client(&s.proxy, VIP.parse().unwrap()).await;
    // Chunks every 50 ms keep the stream active past its 300 ms idle timeout.
    let (status, text) = send(&mut c, "GET", "/idle/trickle", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(text.expect("complete body").len(), 20);
    // A 2 s pause is not.
    let (status, text) = send(&mut c, "GET", "/idle/stall", &[]).await;
    assert_eq!(status, 200);
    assert!(text.is_err(), "{text:?}");
    assert_eq!(s.proxy.stat("downstream_rq_idle_timeout"), 1);
}

/// A GET over HTTP/2 (bounded): the body, or the error that ended it.
async fn h2_get(
    sender: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    path: &str,
) -> Result<String, hyper::Error> {
    let req = hyper::Request::builder()
        .uri(format!("http://svc{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("response in time")?;
    assert_eq!(resp.status(), 200);
    let body = tokio::time::timeout(WAIT, resp.into_body().collect())
        .await
        .expect("body in time")?;
    Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
}

/// A proxy whose every route goes to one real cluster (`pair`) of `hosts` with this
/// `outlier_detection`.
async fn outlier_proxy(
    hosts: &[SocketAddr],
    outlier: &str,
) -> (proxy_core::upstream::Upstream, TestProxy) {
    let mut yaml = format!(
        "clusters:\n  - name: pair\n    outlier_detection: {outlier}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n"
    );
    for a in hosts {
        let _ = writeln!(
            yaml,
            "            - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
            a.ip(),
            a.port()
        );
    }
    let config = proxy_core::config::Config::parse(&yaml, std::path::Path::new("t.yaml"))
        .expect("valid config");
    let up = proxy_core::upstream::Upstream::spawn(
        &config.clusters[0],
        &proxy_core::health::HealthCheckManager::default(),
    )
    .expect("spawns");
    up.initialized().wait_for(|i| *i).await.unwrap();
    let handle = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
    let entries = Entries::from_json(ENTRIES).expect("entries are valid");
    let chain =
        compile(&CompileRequest::new("web", "dc1", "consul"), &entries).expect("chain compiles");
    let table = RouteTable::from_chain(&chain, &|_| Some(handle.clone())).expect("routes");
    let mut services = ServiceTable::new();
    services.insert(VIP.parse().unwrap(), Service::Http(Arc::new(table)));
    let proxy = TestProxy::start(ProxyConfig::default(), services).await;
    (up, proxy)
}

fn outlier_stat(up: &proxy_core::upstream::Upstream, name: &str) -> u64 {
    let name = format!("cluster.pair.outlier_detection.{name}");
    up.stats()
        .into_iter()
        .find_map(|(n, v)| (n == name).then_some(v))
        .unwrap_or(0)
}

/// The proxy path's HTTP answers reach outlier detection as their statuses: of two hosts, the
/// one answering 503 is ejected after `consecutive_5xx` of them in a row (its successful
/// connects do not break the run), and then every request goes to the other.
#[tokio::test]
async fn http_503_answers_eject_their_host() {
    let failing = Scripted::start("failing", true).await;
    let good = Scripted::start("good", false).await;
    let (up, proxy) = outlier_proxy(
        &[failing.addr, good.addr],
        "{ consecutive_5xx: 3, interval: 1s, max_ejection_percent: 50 }",
    )
    .await;
    let mut c = http1_client(&proxy, VIP.parse().unwrap()).await;
    let mut routing = up.routing();
    let ejected =
        |r: &proxy_core::health::Routing| r.routable().iter().all(|h| h.addr != failing.addr);
    let mut sent = 0;
    while !ejected(&routing.borrow()) {
        assert!(sent < 200, "the host answering 503 was never ejected");
        // `/api/` has no retry policy: each answer is the host's.
        let (status, _) = get(&mut c, "/api/x", &[]).await;
        assert!(status == 200 || status == 503, "{status}");
        sent += 1;
    }
    tokio::time::timeout(WAIT, routing.wait_for(ejected))
        .await
        .expect("ejected in time")
        .unwrap();
    assert_eq!(outlier_stat(&up, "ejections_enforced_consecutive_5xx"), 1);
    for _ in 0..20 {
        let (status, body) = get(&mut c, "/api/x", &[]).await;
        assert_eq!((status, who(&body)), (200, "good"), "after {sent} requests");
    }
}

/// A request that runs out of its route's timeout is a 504 of the host it waited for, as in
/// Envoy: two in a row are two gateway failures.
#[tokio::test]
async fn timed_out_requests_count_as_gateway_failures() {
    let server = HttpServer::start("slow").await;
    let (up, proxy) = outlier_proxy(
        &[server.addr],
        "{ consecutive_5xx: 1000, consecutive_gateway_failure: 2, enforcing_consecutive_gateway_failure: 100, max_ejection_percent: 100 }",
    )
    .await;
    let mut c = http1_client(&proxy, VIP.parse().unwrap()).await;
    // `/slow` answers after 2 s; its route's timeout is 300 ms.
    for _ in 0..2 {
        let (status, body) = get(&mut c, "/slow", &[]).await;
        assert_eq!(status, 504, "{body}");
    }
    // One host ejected is the whole cluster: panic mode keeps routing to it, so the ejection
    // shows in the counters and the host's flags.
    let deadline = std::time::Instant::now() + WAIT;
    while outlier_stat(&up, "ejections_enforced_consecutive_gateway_failure") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "not ejected: {:?}",
            up.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(outlier_stat(&up, "ejections_active"), 1);
    assert!(up.host_statuses()[0].flags.failed_outlier_check);
}

/// A routed request its cluster's circuit breakers refuse (`max_requests: 0`, from the
/// cluster's configuration) is Envoy's 503 with the overflow reset reason, counted in the
/// cluster's `upstream_rq_active_overflow` (as Envoy 1.38 and later count it); nothing reaches
/// the host but the connection.
#[tokio::test]
async fn a_request_over_max_requests_is_envoys_overflow_503() {
    let server = HttpServer::start("lim").await;
    let yaml = format!(
        "clusters:\n  - name: lim\n    circuit_breakers: {{ thresholds: [ {{ max_requests: 0 }} ] }}\n    load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }} }} ] }} ] }}\n",
        server.addr.port()
    );
    let config = proxy_core::config::Config::parse(&yaml, std::path::Path::new("t.yaml"))
        .expect("a valid cluster");
    let manager = proxy_core::health::HealthCheckManager::default();
    let up = proxy_core::upstream::Upstream::spawn(&config.clusters[0], &manager).expect("spawn");
    up.initialized()
        .wait_for(|i| *i)
        .await
        .expect("initialized");
    let handle = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
    let entries = Entries::from_json(
        r#"[{"Kind": "proxy-defaults", "Name": "global", "Config": {"protocol": "http"}}]"#,
    )
    .expect("entries are valid");
    let chain =
        compile(&CompileRequest::new("lim", "dc1", "consul"), &entries).expect("chain compiles");
    let table =
        RouteTable::from_chain(&chain, &|_| Some(handle.clone())).expect("the target's cluster");
    let mut services = ServiceTable::new();
    services.insert(VIP.parse().unwrap(), Service::Http(Arc::new(table)));
    let proxy = TestProxy::start(ProxyConfig::default(), services).await;
    let mut c = http1_client(&proxy, VIP.parse().unwrap()).await;
    let (status, body) = get(&mut c, "/", &[]).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.ends_with("reset reason: overflow\n"), "{body}");
    let stats: BTreeMap<String, u64> = up.stats().into_iter().collect();
    assert_eq!(stats["cluster.lim.upstream_rq_active_overflow"], 1);
    assert_eq!(stats["cluster.lim.upstream_rq_pending_overflow"], 0);
    assert_eq!(stats["cluster.lim.circuit_breakers.default.rq_open"], 1);
}
