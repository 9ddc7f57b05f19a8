//! Dashboards carry over (root): the daemon and a real Envoy 1.40 side by side, one HTTP
//! cluster `web` of one backend each, in one fresh network namespace, the same requests through
//! Envoy's HTTP listener and through the daemon's proxy path (a `mode: proxy` service reached
//! by the kernel's redirect): three answered 200, one 404, one 503. Then:
//! - the selectors an Envoy cluster dashboard runs (metric names and labels of
//!   `/stats/prometheus`: connections, connect-time and request-time histograms, requests,
//!   response classes and codes, membership) find samples on both sides, with the same response-class
//!   and request counts;
//! - `/stats?filter=<regex>&usedonly` shows the same lines on both, before and after
//!   `POST /reset_counters` (counters back to zero, still "used");
//! - the daemon's `/config_dump` parses with protobuf's strict JSON parser as
//!   `envoy.admin.v3.ConfigDump` (its clusters, endpoints and listeners, a `tcp_proxy` listener
//!   among them), and `/listeners?format=json` as `envoy.admin.v3.Listeners`.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

use integration_tests::{
    http_servers::{Servers, get_in_cgroup},
    kernel::{Daemon, Netns, TestCgroup, in_netns_at, require_root, unique},
    xds_server::{Envoy, http, python},
};
use serde_json::json;

const ENVOY_BACKEND: &str = "127.0.0.61:8061";
const DAEMON_BACKEND: &str = "127.0.0.62:8062";
const ENVOY_LISTENER: &str = "127.0.0.1:15003";
const VIP: &str = "127.77.8.1:80";
/// The paths each side is asked, in order: the backend answers the status the path names.
const PATHS: [&str; 5] = [
    "/status/200",
    "/status/200",
    "/status/404",
    "/status/200",
    "/status/503",
];
/// How long anything here may take.
const BOUND: Duration = Duration::from_secs(20);

/// Answers one HTTP/1.1 request with the status its path names (`/status/404`), else 200.
fn status_server(mut conn: TcpStream, name: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&head);
    let path = head.split_whitespace().nth(1).unwrap_or_default();
    let status: u16 = path
        .strip_prefix("/status/")
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let body = format!("{name} {status}");
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The cluster on one side, as Envoy's JSON (the daemon reads the same fields).
fn cluster(backend: &str) -> serde_json::Value {
    let b: SocketAddr = backend.parse().unwrap();
    json!({
        "name": "web", "type": "STATIC", "connect_timeout": "5s",
        "load_assignment": {"cluster_name": "web", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": b.ip().to_string(), "port_value": b.port()}}}}]}]}
    })
}

/// Envoy: an HTTP listener routing everything to `web`; histograms flushed every second.
fn envoy_bootstrap() -> String {
    let listener: SocketAddr = ENVOY_LISTENER.parse().unwrap();
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "stats_flush_interval": "1s",
        "static_resources": {
            "listeners": [{
                "name": "web",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener.port()}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "web",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                            "match": {"prefix": "/"}, "route": {"cluster": "web"}
                        }]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                        }}]
                    }
                }]}]
            }],
            "clusters": [cluster(ENVOY_BACKEND)]
        }
    })
    .to_string()
}

/// The daemon: `web` as an HTTP service on the proxy path, and `tcp`, a kernel-path service of
/// the same cluster (a `tcp_proxy` listener in the config dump).
fn daemon_config(cgroup: &TestCgroup) -> String {
    let vip: SocketAddr = VIP.parse().unwrap();
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n  - {}\nconfig_entries:\n  - {{ Kind: proxy-defaults, Name: global, Config: {{ protocol: http }} }}\nservices:\n  - {{ name: web, address: {}, port: {}, chain: web, mode: proxy }}\n  - {{ name: tcp, address: 127.77.8.2, port: 80, cluster: web }}\n",
        unique("dash"),
        cgroup.path().display(),
        cluster(DAEMON_BACKEND),
        vip.ip(),
        vip.port()
    )
}

/// One sample of a text exposition: series name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

/// The samples of a Prometheus text exposition (label values here hold no `,` or `"`).
fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let value = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                None => (series, Vec::new()),
                Some((name, rest)) => {
                    let labels = rest
                        .trim_end_matches('}')
                        .split(',')
                        .filter_map(|kv| {
                            let (k, v) = kv.split_once('=')?;
                            Some((k.to_owned(), v.trim_matches('"').to_owned()))
                        })
                        .collect();
                    (name, labels)
                }
            };
            Some((name.to_owned(), labels, value))
        })
        .collect()
}

/// The value of the first sample named `name` with every label of `want`.
fn value(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|(n, labels, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|s| s.2)
}

const WEB: (&str, &str) = ("envoy_cluster_name", "web");

/// The selectors of an Envoy cluster dashboard: each must find a sample on both sides.
const DASHBOARD: &[(&str, &[(&str, &str)])] = &[
    ("envoy_cluster_upstream_cx_total", &[WEB]),
    ("envoy_cluster_upstream_cx_active", &[WEB]),
    ("envoy_cluster_upstream_cx_connect_fail", &[WEB]),
    ("envoy_cluster_upstream_cx_none_healthy", &[WEB]),
    ("envoy_cluster_upstream_cx_overflow", &[WEB]),
    (
        "envoy_cluster_upstream_cx_connect_ms_bucket",
        &[WEB, ("le", "5")],
    ),
    (
        "envoy_cluster_upstream_cx_connect_ms_bucket",
        &[WEB, ("le", "+Inf")],
    ),
    ("envoy_cluster_upstream_cx_connect_ms_sum", &[WEB]),
    ("envoy_cluster_upstream_cx_connect_ms_count", &[WEB]),
    (
        "envoy_cluster_upstream_rq",
        &[WEB, ("envoy_response_code", "200")],
    ),
    (
        "envoy_cluster_upstream_rq",
        &[WEB, ("envoy_response_code", "404")],
    ),
    (
        "envoy_cluster_upstream_rq",
        &[WEB, ("envoy_response_code", "503")],
    ),
    ("envoy_cluster_upstream_rq_total", &[WEB]),
    ("envoy_cluster_upstream_rq_completed", &[WEB]),
    (
        "envoy_cluster_upstream_rq_xx",
        &[WEB, ("envoy_response_code_class", "2")],
    ),
    (
        "envoy_cluster_upstream_rq_xx",
        &[WEB, ("envoy_response_code_class", "4")],
    ),
    (
        "envoy_cluster_upstream_rq_xx",
        &[WEB, ("envoy_response_code_class", "5")],
    ),
    (
        "envoy_cluster_upstream_rq_time_bucket",
        &[WEB, ("le", "1000")],
    ),
    ("envoy_cluster_upstream_rq_time_sum", &[WEB]),
    ("envoy_cluster_upstream_rq_time_count", &[WEB]),
    ("envoy_cluster_upstream_rq_pending_overflow", &[WEB]),
    ("envoy_cluster_lb_healthy_panic", &[WEB]),
    ("envoy_cluster_membership_healthy", &[WEB]),
    ("envoy_cluster_membership_total", &[WEB]),
];

/// The counts both sides must agree on once the requests are in.
const AGREED: &[(&str, &[(&str, &str)])] = &[
    (
        "envoy_cluster_upstream_rq_xx",
        &[WEB, ("envoy_response_code_class", "2")],
    ),
    (
        "envoy_cluster_upstream_rq_xx",
        &[WEB, ("envoy_response_code_class", "4")],
    ),
    (
        "envoy_cluster_upstream_rq_xx",
        &[WEB, ("envoy_response_code_class", "5")],
    ),
    (
        "envoy_cluster_upstream_rq",
        &[WEB, ("envoy_response_code", "200")],
    ),
    (
        "envoy_cluster_upstream_rq",
        &[WEB, ("envoy_response_code", "404")],
    ),
    (
        "envoy_cluster_upstream_rq",
        &[WEB, ("envoy_response_code", "503")],
    ),
    ("envoy_cluster_upstream_rq_total", &[WEB]),
    ("envoy_cluster_upstream_rq_completed", &[WEB]),
    ("envoy_cluster_upstream_rq_time_count", &[WEB]),
    (
        "envoy_cluster_upstream_rq_time_bucket",
        &[WEB, ("le", "+Inf")],
    ),
    ("envoy_cluster_membership_total", &[WEB]),
];

/// `POST target` on the daemon's control socket; the status.
fn post_control(control: &Path, target: &str) -> u16 {
    let mut s = UnixStream::connect(control).expect("control socket");
    s.set_read_timeout(Some(BOUND)).unwrap();
    write!(
        s,
        "POST {target} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("answer");
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// `body` parses with protobuf's strict JSON parser (unknown fields refused) as `message` of
/// `module`, the `@type`s it names resolved by importing their modules.
fn assert_parses_strictly(body: &str, module: &str, message: &str) {
    let script = format!(
        "import sys\nfrom google.protobuf import json_format\nfrom envoy.config.cluster.v3 import cluster_pb2\nfrom envoy.config.endpoint.v3 import endpoint_pb2\nfrom envoy.config.listener.v3 import listener_pb2\nfrom envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2\nfrom envoy.admin.v3 import {module}\njson_format.Parse(sys.stdin.read(), {module}.{message}())\n"
    );
    let mut child = std::process::Command::new(python())
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{message} does not parse strictly: {}\n{body}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn an_envoy_cluster_dashboard_reads_the_daemon_as_it_reads_envoy() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let _servers = Servers::start(
        &netns,
        &[
            (ENVOY_BACKEND.parse().unwrap(), "envoy-side"),
            (DAEMON_BACKEND.parse().unwrap(), "daemon-side"),
        ],
        status_server,
    );
    let daemon = Daemon::start_in(&netns, &daemon_config(&cgroup));
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(), Some(&netns.path()));
    let (admin, ns) = (envoy.admin(), netns.path());
    let envoy_get = move |path: &'static str| -> String {
        let (code, body) = in_netns_at(ns.clone(), move || http(admin, "GET", path, ""))
            .join()
            .expect("envoy admin answers");
        assert_eq!(code, 200, "envoy {path}: {body}");
        body
    };
    let daemon_get = |path: &str| -> String {
        let (code, body) = daemon.get(path).expect("daemon admin answers");
        assert_eq!(code, 200, "daemon {path}: {body}");
        body
    };
    for (target, side) in [(ENVOY_LISTENER, "envoy-side"), (VIP, "daemon-side")] {
        let bodies = get_in_cgroup(target.parse().unwrap(), &netns, &cgroup, &PATHS);
        let want: Vec<String> = PATHS
            .iter()
            .map(|p| format!("{side} {}", &p["/status/".len()..]))
            .collect();
        assert_eq!(bodies, want, "through {target}");
    }
    // Envoy shows histograms from its next flush on.
    let deadline = Instant::now() + BOUND;
    let (envoy_text, daemon_text) = loop {
        let (e, d) = (
            envoy_get("/stats/prometheus"),
            daemon_get("/stats/prometheus"),
        );
        let count = |text: &str| {
            value(
                &samples(text),
                "envoy_cluster_upstream_rq_time_count",
                &[WEB],
            )
        };
        if count(&e) == Some(5.0) {
            break (e, d);
        }
        assert!(
            Instant::now() < deadline,
            "envoy never flushed 5 requests:\n{e}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    compare_dashboards(&envoy_text, &daemon_text);

    // The same lines for the same filter, before and after resetting the counters.
    let filter = "/stats?usedonly&filter=%5Ecluster%5C.web%5C.upstream_rq_(%5B0-9%5D(xx%7C%5B0-9%5D%5B0-9%5D)%7Ctotal%7Ccompleted)%24";
    let lines = envoy_get(filter);
    assert_eq!(
        lines,
        "cluster.web.upstream_rq_200: 3\ncluster.web.upstream_rq_2xx: 3\ncluster.web.upstream_rq_404: 1\ncluster.web.upstream_rq_4xx: 1\ncluster.web.upstream_rq_503: 1\ncluster.web.upstream_rq_5xx: 1\ncluster.web.upstream_rq_completed: 5\ncluster.web.upstream_rq_total: 5\n"
    );
    assert_eq!(daemon_get(filter), lines);
    let (code, _) = in_netns_at(netns.path(), move || {
        http(admin, "POST", "/reset_counters", "")
    })
    .join()
    .unwrap();
    assert_eq!(code, 200);
    assert_eq!(post_control(&daemon.control, "/reset_counters"), 200);
    let zeroed = envoy_get(filter);
    assert!(
        zeroed.contains("cluster.web.upstream_rq_2xx: 0\n"),
        "{zeroed}"
    );
    assert_eq!(daemon_get(filter), zeroed);

    check_config_dump(&daemon_get);
}

/// Every dashboard selector finds a sample on both sides; the agreed counts are equal.
fn compare_dashboards(envoy_text: &str, daemon_text: &str) {
    let (envoy_samples, daemon_samples) = (samples(envoy_text), samples(daemon_text));
    for (name, want) in DASHBOARD {
        assert!(
            value(&envoy_samples, name, want).is_some(),
            "envoy: {name}{want:?}\n{envoy_text}"
        );
        assert!(
            value(&daemon_samples, name, want).is_some(),
            "daemon: {name}{want:?}\n{daemon_text}"
        );
    }
    for (name, want) in AGREED {
        assert_eq!(
            value(&daemon_samples, name, want),
            value(&envoy_samples, name, want),
            "{name}{want:?}\nenvoy:\n{envoy_text}\ndaemon:\n{daemon_text}"
        );
    }
    assert!(
        daemon_text.contains("# HELP envoy_cluster_upstream_rq_xx "),
        "{daemon_text}"
    );
}

/// The daemon's `/config_dump` and `/listeners?format=json` in Envoy's schemas: strictly
/// parsed, with the `tcp` service's `tcp_proxy` to `web` and `web`'s endpoint.
fn check_config_dump(daemon_get: &dyn Fn(&str) -> String) {
    assert_parses_strictly(&daemon_get("/config_dump"), "config_dump_pb2", "ConfigDump");
    assert_parses_strictly(
        &daemon_get("/listeners?format=json"),
        "listeners_pb2",
        "Listeners",
    );
    let dump: serde_json::Value = serde_json::from_str(&daemon_get("/config_dump")).unwrap();
    let listeners = &dump["configs"][2]["static_listeners"];
    let tcp = listeners
        .as_array()
        .and_then(|l| l.iter().find(|l| l["listener"]["name"] == "tcp"))
        .unwrap_or_else(|| panic!("no listener tcp: {dump}"));
    assert_eq!(
        tcp["listener"]["filter_chains"][0]["filters"][0]["typed_config"]["cluster"],
        "web"
    );
    let endpoints = &dump["configs"][1]["static_endpoint_configs"][0]["endpoint_config"];
    assert_eq!(
        endpoints["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"],
        8062,
        "{dump}"
    );
}
