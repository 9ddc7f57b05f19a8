//! Zone-aware routing side by side with Envoy 1.40. The node is in zone `a`; its local cluster
//! has one host in zone `a` and one in `b` (each zone holds half of it). Two upstream clusters
//! of eight banner backends with `zone_aware_lb_config: {}` (Envoy's defaults: every pick
//! routed by zone, `min_cluster_size` 6):
//!
//! * `direct`: `b1`-`b4` in `a`, `b5`-`b8` in `b`. Zone `a` holds half of the upstream too, at
//!   least its local half, so every connect stays in `a`: exact on both.
//! * `residual`: `b1`, `b2` in `a`, `b3`-`b8` in `b`. Zone `a` holds a quarter of the upstream
//!   against half of the local cluster: half of the connects stay in `a` (25 / 50), the other
//!   half spill to `b` (its residual capacity, 75 - 50). Envoy samples per connect; the daemon's
//!   RANDOM table holds the same expected shares. Of [`CONNECTS`] connects, zone `a`'s count is
//!   binomial with p = 1/2 on both sides: mean 200, standard deviation 10; each side must be
//!   within 50 (five deviations) of 200, a bound fixed before the run. Without zone routing
//!   zone `a` would take 100 (2 of 8 hosts), outside it.

use std::{net::SocketAddr, time::Duration};

use integration_tests::{
    kernel::{
        BannerServers, Daemon, Netns, Probe, TestCgroup, in_netns, require_root,
        skip_without_dataplane, unique, wait_for_backends,
    },
    xds_server::{Envoy, http},
};
use serde_json::{Value, json};

const BACKENDS: [(&str, &str); 8] = [
    ("127.0.0.91:8091", "b1"),
    ("127.0.0.92:8092", "b2"),
    ("127.0.0.93:8093", "b3"),
    ("127.0.0.94:8094", "b4"),
    ("127.0.0.95:8095", "b5"),
    ("127.0.0.96:8096", "b6"),
    ("127.0.0.97:8097", "b7"),
    ("127.0.0.98:8098", "b8"),
];
/// Connects per side and cluster.
const CONNECTS: u32 = 400;

fn endpoint(addr: &str) -> Value {
    let addr: SocketAddr = addr.parse().unwrap();
    json!({"endpoint": {"address": {"socket_address": {
        "address": addr.ip().to_string(), "port_value": addr.port()}}}})
}

fn group(zone: &str, addrs: &[&str]) -> Value {
    let endpoints: Vec<Value> = addrs.iter().map(|a| endpoint(a)).collect();
    json!({"locality": {"region": "r", "zone": zone}, "lb_endpoints": endpoints})
}

/// An upstream cluster whose first `in_a` backends are in zone `a`, the rest in `b`.
fn upstream(name: &str, in_a: usize) -> Value {
    let addrs: Vec<&str> = BACKENDS.iter().map(|(a, _)| *a).collect();
    json!({
        "name": name, "type": "STATIC", "lb_policy": "RANDOM", "connect_timeout": "1s",
        "common_lb_config": {"zone_aware_lb_config": {}},
        "load_assignment": {"cluster_name": name,
            "endpoints": [group("a", &addrs[..in_a]), group("b", &addrs[in_a..])]}
    })
}

/// The node's own cluster: one host per zone (never connected to).
fn local() -> Value {
    json!({
        "name": "local", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "local", "endpoints": [
            group("a", &["127.0.1.1:9"]), group("b", &["127.0.1.2:9"])]}
    })
}

fn listener(port: u16, cluster: &str) -> Value {
    json!({
        "name": cluster,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.tcp_proxy",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": cluster, "cluster": cluster
            }
        }]}]
    })
}

fn daemon_config(cgroup: &TestCgroup) -> String {
    let strip = |mut c: Value| {
        c["load_assignment"]
            .as_object_mut()
            .unwrap()
            .remove("cluster_name");
        c
    };
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\ncluster_manager: {{local_cluster_name: local}}\nnode: {{locality: {{region: r, zone: a}}}}\nclusters:\n  - {}\n  - {}\n  - {}\nservices:\n  - {{ name: direct, address: 127.77.9.21, port: 80, cluster: direct }}\n  - {{ name: residual, address: 127.77.9.22, port: 80, cluster: residual }}\n  - {{ name: residual-proxied, address: 127.77.9.23, port: 80, cluster: residual, mode: proxy }}\n",
        unique("zone"),
        cgroup.path().display(),
        strip(local()),
        strip(upstream("direct", 4)),
        strip(upstream("residual", 2)),
    )
}

/// Waits until Envoy's two listeners are active.
fn until_envoy_listens(netns: &Netns, envoy: &Envoy) {
    let admin = envoy.admin();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = in_netns(netns, move || http(admin, "GET", "/stats?format=json", ""))
            .join()
            .expect("envoy admin answers");
        let stats: Value = serde_json::from_str(&body).unwrap_or_default();
        let active = stats["stats"].as_array().and_then(|all| {
            all.iter()
                .find(|s| s["name"] == "listener_manager.total_listeners_active")
                .and_then(|s| s["value"].as_u64())
        });
        if active == Some(2) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "envoy's listeners never came up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connects to `to` that reached zone `a` (of `in_a` backends) and zone `b`.
fn zones(netns: &Netns, cgroup: Option<&TestCgroup>, to: &str, in_a: usize) -> (u32, u32) {
    let probe = Probe::run(
        netns,
        cgroup.map(TestCgroup::path),
        to.parse().unwrap(),
        CONNECTS,
        false,
    );
    assert!(probe.errors.is_empty(), "{to}: {probe:?}");
    let count = |range: &[(&str, &str)]| range.iter().map(|(_, b)| probe.count(b)).sum();
    (count(&BACKENDS[..in_a]), count(&BACKENDS[in_a..]))
}

#[test]
fn zone_aware_routing_keeps_and_spills_as_envoy() {
    require_root();
    if skip_without_dataplane("zone_aware_routing_keeps_and_spills_as_envoy") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let servers: Vec<(SocketAddr, &str, bool)> = BACKENDS
        .iter()
        .map(|(a, b)| (a.parse().unwrap(), *b, false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let _daemon = Daemon::start_in(&netns, &daemon_config(&cgroup));
    let bootstrap = json!({
        "node": {"id": "zone-test", "cluster": "local", "locality": {"region": "r", "zone": "a"}},
        "cluster_manager": {"local_cluster_name": "local"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [listener(15022, "direct"), listener(15023, "residual")],
            "clusters": [local(), upstream("direct", 4), upstream("residual", 2)]
        }
    });
    let envoy = Envoy::with_bootstrap(&bootstrap.to_string(), Some(&netns.path()));
    until_envoy_listens(&netns, &envoy);
    let first_four: Vec<&str> = BACKENDS[..4].iter().map(|(_, b)| *b).collect();
    wait_for_backends(
        &netns,
        &cgroup,
        "127.77.9.21:80".parse().unwrap(),
        &first_four,
        Duration::from_secs(10),
    );
    // Direct: every connect in zone a, on both.
    let kernel = zones(&netns, Some(&cgroup), "127.77.9.21:80", 4);
    let envoys = zones(&netns, None, "127.0.0.1:15022", 4);
    println!("direct: daemon {kernel:?}, envoy {envoys:?}");
    assert_eq!(
        kernel,
        (CONNECTS, 0),
        "the daemon keeps every connect in zone a"
    );
    assert_eq!(envoys, (CONNECTS, 0), "envoy keeps every connect in zone a");
    // Residual: half stays, on both paths and on Envoy (bounds in the module's doc).
    let all: Vec<&str> = BACKENDS.iter().map(|(_, b)| *b).collect();
    wait_for_backends(
        &netns,
        &cgroup,
        "127.77.9.22:80".parse().unwrap(),
        &all,
        Duration::from_secs(10),
    );
    for (side, cgroup, to) in [
        ("kernel path", Some(&cgroup), "127.77.9.22:80"),
        ("proxy path", Some(&cgroup), "127.77.9.23:80"),
        ("envoy", None, "127.0.0.1:15023"),
    ] {
        let (a, b) = zones(&netns, cgroup, to, 2);
        println!("residual, {side}: zone a {a}, zone b {b}");
        assert_eq!(a + b, CONNECTS, "{side}");
        assert!(
            a.abs_diff(CONNECTS / 2) <= 50,
            "{side}: zone a took {a} of {CONNECTS}"
        );
    }
}
