//! Outlier detection side by side with a real Envoy 1.40: a cluster of three loopback hosts, one
//! of which refuses connections, takes the same connections through Envoy's TCP proxy and
//! through our detector (fed the connect results Envoy saw, per host); both must then report
//! the same ejection counters. The cases are the ones where Envoy 1.40 departs from the older
//! rule "one host may always be ejected": with the default `max_ejection_percent` (10) one of
//! three hosts is 33 % and nothing is ejected; with `always_eject_one_host` it is.
//!
//! No root needed: Envoy, the backends and the detector all stay on 127.0.0.1.

use std::{
    fmt::Write as _,
    io::Read as _,
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use integration_tests::xds_server::Envoy;
use proxy_core::{config::Config, health::HealthCheckManager, upstream::Upstream};
use proxy_relay::{BackendAddr, ClusterHandle};
use serde_json::{Value, json};

/// Connections sent through Envoy: five of them reach each host in a round-robin rotation.
const CONNECTIONS: usize = 15;
/// Bound of every wait.
const WAIT: Duration = Duration::from_secs(15);
/// The ejection counters compared.
const COUNTERS: [&str; 6] = [
    "ejections_active",
    "ejections_overflow",
    "ejections_enforced_total",
    "ejections_detected_consecutive_5xx",
    "ejections_enforced_consecutive_5xx",
    "ejections_detected_consecutive_gateway_failure",
];

/// A loopback listener that accepts and closes every connection until dropped.
struct Backend {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Backend {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("backend binds");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => drop(conn),
                    Err(_) => thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Self {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A loopback port nothing listens on, held for the test's life: a socket bound there without
/// `SO_REUSEADDR` and never listening. Connects to it are reset, and no other socket of the
/// machine can bind it meanwhile. (A port bound and released at once could be taken by any
/// listener that the suite's other lanes start, which turns the dead host live: Envoy then
/// counts no failure and detects nothing.)
struct RefusingPort {
    addr: SocketAddr,
    _socket: tokio::net::TcpSocket,
}

impl RefusingPort {
    fn hold() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.1:0".parse().unwrap())
            .expect("binding the refusing port");
        Self {
            addr: socket.local_addr().expect("its address"),
            _socket: socket,
        }
    }
}

fn endpoint(addr: SocketAddr) -> Value {
    json!({"endpoint": {"address": {"socket_address": {"address": addr.ip().to_string(), "port_value": addr.port()}}}})
}

/// Envoy with a TCP proxy listener on an ephemeral port in front of cluster `web`.
fn envoy_bootstrap(hosts: &[SocketAddr], outlier: &Value) -> String {
    let address =
        |port: u16| json!({"socket_address": {"address": "127.0.0.1", "port_value": port}});
    json!({
        "node": {"id": "outlier", "cluster": "test"},
        "admin": {"address": address(0)},
        "static_resources": {
            "listeners": [{
                "name": "in",
                "address": address(0),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.tcp_proxy",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                        "stat_prefix": "in",
                        "cluster": "web",
                    },
                }]}],
            }],
            "clusters": [{
                "name": "web",
                "type": "STATIC",
                "connect_timeout": "1s",
                "lb_policy": "ROUND_ROBIN",
                "outlier_detection": outlier,
                "load_assignment": {"cluster_name": "web", "endpoints": [{
                    "lb_endpoints": hosts.iter().map(|a| endpoint(*a)).collect::<Vec<_>>(),
                }]},
            }],
        },
    })
    .to_string()
}

/// The port of Envoy's listener `in`.
fn listener_port(envoy: &Envoy) -> u16 {
    let (_, body) = envoy.admin_get("/listeners?format=json");
    let listeners: Value = serde_json::from_str(&body).expect("listeners JSON");
    listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or_else(|| panic!("no listener port in {body}"))
}

/// Envoy's value of `cluster.web.<name>` (0 when absent).
fn envoy_stat(envoy: &Envoy, name: &str) -> u64 {
    let (_, body) = envoy.admin_get(&format!("/stats?filter=^cluster\\.web\\.{name}$"));
    body.lines()
        .find_map(|l| l.split_once(": ").and_then(|(_, v)| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// Per host of `web`: (address, connect attempts, connect failures), from Envoy's /clusters.
fn envoy_host_results(envoy: &Envoy) -> Vec<(SocketAddr, u64, u64)> {
    let clusters = envoy.clusters();
    let web = clusters["cluster_statuses"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "web"))
        .expect("cluster web in /clusters");
    let stat = |host: &Value, name: &str| {
        host["stats"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["name"] == name))
            .and_then(|s| {
                s["value"]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .or(s["value"].as_u64())
            })
            .unwrap_or(0)
    };
    web["host_statuses"]
        .as_array()
        .expect("host_statuses")
        .iter()
        .map(|h| {
            let sa = &h["address"]["socket_address"];
            let addr = SocketAddr::new(
                sa["address"].as_str().unwrap().parse().unwrap(),
                u16::try_from(sa["port_value"].as_u64().unwrap()).unwrap(),
            );
            (addr, stat(h, "cx_total"), stat(h, "cx_connect_fail"))
        })
        .collect()
}

/// Sends `CONNECTIONS` connections through Envoy one after another, each until Envoy closes it.
fn drive_envoy(envoy: &Envoy) {
    let port = listener_port(envoy);
    for _ in 0..CONNECTIONS {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("envoy accepts");
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    // Envoy detects on its main thread after the worker's report: wait until every connection
    // is counted and the detections settled.
    let deadline = Instant::now() + WAIT;
    loop {
        let total: u64 = envoy_host_results(envoy).iter().map(|h| h.1).sum();
        if total >= CONNECTIONS as u64
            && envoy_stat(
                envoy,
                "outlier_detection.ejections_detected_consecutive_5xx",
            ) > 0
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Envoy did not count the connections and detect: per host (address, attempts, \
             failures) {:?}, counters {:?}",
            envoy_host_results(envoy),
            COUNTERS
                .iter()
                .map(|c| (c, envoy_stat(envoy, &format!("outlier_detection.{c}"))))
                .collect::<Vec<_>>()
        );
        thread::sleep(Duration::from_millis(50));
    }
    thread::sleep(Duration::from_millis(300));
}

/// Our cluster with the same hosts and outlier settings, fed each host's connect results as
/// Envoy saw them; returns our counters.
async fn ours(hosts: &[SocketAddr], outlier: &str, results: &[(SocketAddr, u64, u64)]) -> Vec<u64> {
    let mut endpoints = String::new();
    for a in hosts {
        let _ = writeln!(
            endpoints,
            "            - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
            a.ip(),
            a.port()
        );
    }
    let yaml = format!(
        "clusters:\n  - name: web\n    lb_policy: ROUND_ROBIN\n    outlier_detection: {outlier}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}"
    );
    let config = Config::parse(&yaml, std::path::Path::new("outlier.yaml")).expect("valid");
    let up = Upstream::spawn(&config.clusters[0], &HealthCheckManager::default()).expect("spawns");
    up.initialized().wait_for(|i| *i).await.unwrap();
    let handle = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
    for &(addr, total, failed) in results {
        for n in 0..total {
            handle.report_connect(BackendAddr(addr), n >= failed);
        }
    }
    // The cluster's task applies the signals in order; wait until it counted them all.
    let deadline = Instant::now() + WAIT;
    let detected = "cluster.web.outlier_detection.ejections_detected_consecutive_5xx";
    loop {
        let stats = up.stats();
        if stats.iter().any(|(n, v)| n == detected && *v > 0) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let stats = up.stats();
            return COUNTERS
                .iter()
                .map(|c| {
                    let name = format!("cluster.web.outlier_detection.{c}");
                    stats
                        .iter()
                        .find(|(n, _)| *n == name)
                        .map_or(0, |(_, v)| *v)
                })
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "our detector counted nothing: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn compare(outlier_json: Value, outlier_yaml: &str) -> Vec<u64> {
    let (a, b) = (Backend::start(), Backend::start());
    let dead = RefusingPort::hold();
    let hosts = [a.addr, b.addr, dead.addr];
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(&hosts, &outlier_json), None);
    drive_envoy(&envoy);
    let results = envoy_host_results(&envoy);
    let envoy_counters: Vec<u64> = COUNTERS
        .iter()
        .map(|c| envoy_stat(&envoy, &format!("outlier_detection.{c}")))
        .collect();
    let our_counters = ours(&hosts, outlier_yaml, &results).await;
    eprintln!("connect results per host (address, attempts, failures): {results:?}");
    for (i, c) in COUNTERS.iter().enumerate() {
        eprintln!("{c}: Envoy {} ours {}", envoy_counters[i], our_counters[i]);
    }
    assert_eq!(our_counters, envoy_counters, "{COUNTERS:?}");
    envoy_counters
}

/// Defaults (max_ejection_percent 10): one of three hosts is over the cap, so both detections
/// of the refusing host (gateway failure and 5xx) overflow and nothing is ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_with_the_default_cap_eject_nothing_as_envoy() {
    let counters = compare(
        json!({"consecutive_5xx": 5, "interval": "1s"}),
        "{ consecutive_5xx: 5, interval: 1s }",
    )
    .await;
    assert_eq!(counters[0], 0, "nothing ejected");
    assert!(counters[1] > 0, "the cap was counted");
}

/// `always_eject_one_host`: the refusing host is ejected by the 5xx detector (the gateway
/// detector found it first but is not enforced by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_eject_one_host_ejects_it_as_envoy() {
    let counters = compare(
        json!({"consecutive_5xx": 5, "interval": "1s", "always_eject_one_host": true}),
        "{ consecutive_5xx: 5, interval: 1s, always_eject_one_host: true }",
    )
    .await;
    assert_eq!(counters[0], 1, "one host ejected");
}
