//! Locality-weighted load balancing side by side with Envoy 1.40: one ROUND_ROBIN cluster of
//! four banner backends in two localities, zone `a` (weight 1: `b1`, and `b2` UNHEALTHY by its
//! `health_status`) and zone `b` (weight 2: `b3`, `b4`), with
//! `locality_weighted_lb_config`; once with the default overprovisioning factor (zone `a`'s
//! effective weight 1.4 x 1/2 = 0.7 against 2: `b1` 7/27 of the connects, `b3` and `b4` 10/27
//! each) and once with `policy.overprovisioning_factor: 100` (0.5 against 2: 1/5, 2/5, 2/5).
//!
//! Each side takes 270 connects, ten full rotations of the daemon's table (27 and 5 slots), so
//! its counts are exact on the kernel path (connects from the cgroup) and on the proxy path
//! (the same cluster through a `mode: proxy` service). Envoy picks a locality with its
//! deterministic earliest-deadline scheduler and then a host round robin inside it (one
//! worker): over any run of picks a locality's count is within 2 of its share, and a host's
//! within 1 more of half its locality's. So Envoy's count per backend must be within 3 of the
//! daemon's exact one, fixed before the run; host-by-host round robin (90 each) is outside.

use std::{net::SocketAddr, time::Duration};

use integration_tests::{
    features::{Feature, missing},
    kernel::{
        BannerServers, Daemon, Netns, Probe, TestCgroup, in_netns, require_root,
        skip_without_dataplane, unique, wait_for_backends,
    },
    xds_server::{Envoy, http},
};
use serde_json::{Value, json};

/// (address, banner, zone, `health_status`).
const HOSTS: [(&str, &str, &str, &str); 4] = [
    ("127.0.0.91:8091", "b1", "a", "HEALTHY"),
    ("127.0.0.92:8092", "b2", "a", "UNHEALTHY"),
    ("127.0.0.93:8093", "b3", "b", "HEALTHY"),
    ("127.0.0.94:8094", "b4", "b", "HEALTHY"),
];
/// Connects per side and case: ten rotations of either table.
const CONNECTS: u32 = 270;

/// The cluster as Envoy's JSON; `factor` is the policy's overprovisioning factor, if set.
fn cluster(name: &str, factor: Option<u32>) -> Value {
    let group = |zone: &str, weight: u32| {
        let endpoints: Vec<Value> = HOSTS
            .iter()
            .filter(|h| h.2 == zone)
            .map(|(addr, _, _, health)| {
                let addr: SocketAddr = addr.parse().unwrap();
                json!({"endpoint": {"address": {"socket_address": {
                    "address": addr.ip().to_string(), "port_value": addr.port()}}},
                    "health_status": health})
            })
            .collect();
        json!({"locality": {"region": "r", "zone": zone}, "load_balancing_weight": weight,
               "lb_endpoints": endpoints})
    };
    let mut assignment = json!({"cluster_name": name, "endpoints": [group("a", 1), group("b", 2)]});
    if let Some(f) = factor {
        assignment["policy"] = json!({"overprovisioning_factor": f});
    }
    json!({
        "name": name, "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "1s",
        "common_lb_config": {"locality_weighted_lb_config": {}},
        "load_assignment": assignment
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
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n  - {}\n  - {}\nservices:\n  - {{ name: zones, address: 127.77.9.11, port: 80, cluster: zones }}\n  - {{ name: zones-proxied, address: 127.77.9.12, port: 80, cluster: zones, mode: proxy }}\n  - {{ name: exact, address: 127.77.9.13, port: 80, cluster: exact }}\n",
        unique("loc"),
        cgroup.path().display(),
        strip(cluster("zones", None)),
        strip(cluster("exact", Some(100))),
    )
}

/// Waits until Envoy's two listeners are active.
fn until_envoy_listens(netns: &Netns, envoy: &Envoy) {
    until_envoy_listens_n(netns, envoy, 2);
}

/// Waits until `n` listeners of Envoy are active.
pub(super) fn until_envoy_listens_n(netns: &Netns, envoy: &Envoy, n: u64) {
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
        if active == Some(n) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "envoy's listeners never came up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connects per backend (`b1`, `b2`, `b3`, `b4`) of [`CONNECTS`] to `to`.
fn counts(netns: &Netns, cgroup: Option<&TestCgroup>, to: &str) -> [u32; 4] {
    let probe = Probe::run(
        netns,
        cgroup.map(TestCgroup::path),
        to.parse().unwrap(),
        CONNECTS,
        false,
    );
    assert!(probe.errors.is_empty(), "{to}: {probe:?}");
    ["b1", "b2", "b3", "b4"].map(|b| probe.count(b))
}

#[test]
fn locality_weighted_round_robin_shares_match_envoy() {
    require_root();
    if skip_without_dataplane("locality_weighted_round_robin_shares_match_envoy") {
        return;
    }
    if let Some(why) = missing(&[Feature::AtomicFetch]) {
        println!("skipped: kernel ROUND_ROBIN needs {why}");
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let servers: Vec<(SocketAddr, &str, bool)> = HOSTS
        .iter()
        .map(|(a, b, _, _)| (a.parse().unwrap(), *b, false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let _daemon = Daemon::start_in(&netns, &daemon_config(&cgroup));
    let bootstrap = json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [listener(15012, "zones"), listener(15013, "exact")],
            "clusters": [cluster("zones", None), cluster("exact", Some(100))]
        }
    });
    let envoy = Envoy::with_bootstrap(&bootstrap.to_string(), Some(&netns.path()));
    until_envoy_listens(&netns, &envoy);
    let routed = ["b1", "b3", "b4"];
    for vip in ["127.77.9.11:80", "127.77.9.12:80", "127.77.9.13:80"] {
        wait_for_backends(
            &netns,
            &cgroup,
            vip.parse().unwrap(),
            &routed,
            Duration::from_secs(10),
        );
    }
    for (envoy_at, kernel_vip, proxy_vip, want) in [
        (
            "127.0.0.1:15012",
            "127.77.9.11:80",
            Some("127.77.9.12:80"),
            [70, 0, 100, 100],
        ),
        ("127.0.0.1:15013", "127.77.9.13:80", None, [54, 0, 108, 108]),
    ] {
        let kernel = counts(&netns, Some(&cgroup), kernel_vip);
        assert_eq!(
            kernel, want,
            "{kernel_vip}: the kernel path's counts are the exact shares"
        );
        if let Some(vip) = proxy_vip {
            let proxied = counts(&netns, Some(&cgroup), vip);
            assert_eq!(
                proxied, want,
                "{vip}: the proxy path's counts are the exact shares"
            );
        }
        let envoys = counts(&netns, None, envoy_at);
        println!("{envoy_at}: envoy {envoys:?}, daemon {want:?}");
        for (i, (e, d)) in envoys.iter().zip(want).enumerate() {
            assert!(
                e.abs_diff(d) <= 3,
                "backend b{}: envoy {e}, daemon {d} ({envoys:?} vs {want:?})",
                i + 1
            );
        }
    }
}

/// `policy.weighted_priority_health` side by side: priority 0 holds `b1` (weight 1, healthy) and
/// `b2` (weight 3, UNHEALTHY), priority 1 `b3` and `b4`. Counted by weight, priority 0 is
/// 1/4 available: its health is 1.4 x 1/4 = 35 %, so `b1` takes 35 % of the connects and the
/// rest go to priority 1 (counted by hosts it would be 70 %). Envoy chooses the priority per
/// connect at random and the daemon's RANDOM table holds the same shares, so of 400 connects
/// `b1`'s count is binomial (mean 140, deviation 9.5) on both sides; each must be within 48
/// (five deviations) of 140, a bound fixed before the run; 280 is far outside.
#[test]
fn weighted_priority_health_shares_match_envoy() {
    require_root();
    if skip_without_dataplane("weighted_priority_health_shares_match_envoy") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let servers: Vec<(SocketAddr, &str, bool)> = HOSTS
        .iter()
        .map(|(a, b, _, _)| (a.parse().unwrap(), *b, false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let endpoint = |i: usize, weight: u32, health: &str| {
        let addr: SocketAddr = HOSTS[i].0.parse().unwrap();
        json!({"endpoint": {"address": {"socket_address": {
            "address": addr.ip().to_string(), "port_value": addr.port()}}},
            "load_balancing_weight": weight, "health_status": health})
    };
    let cluster = json!({
        "name": "wph", "type": "STATIC", "lb_policy": "RANDOM", "connect_timeout": "1s",
        "load_assignment": {
            "policy": {"weighted_priority_health": true},
            "endpoints": [
                {"priority": 0, "lb_endpoints": [endpoint(0, 1, "HEALTHY"), endpoint(1, 3, "UNHEALTHY")]},
                {"priority": 1, "lb_endpoints": [endpoint(2, 1, "HEALTHY"), endpoint(3, 1, "HEALTHY")]}
            ]
        }
    });
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - {cluster}\nservices:\n  - {{ name: wph, address: 127.77.9.14, port: 80, cluster: wph }}\n",
        unique("wph"),
        cgroup.path().display(),
    );
    let _daemon = Daemon::start_in(&netns, &config);
    let mut envoy_cluster = cluster.clone();
    envoy_cluster["load_assignment"]["cluster_name"] = json!("wph");
    let bootstrap = json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [listener(15014, "wph")],
            "clusters": [envoy_cluster]
        }
    });
    let envoy = Envoy::with_bootstrap(&bootstrap.to_string(), Some(&netns.path()));
    until_envoy_listens_n(&netns, &envoy, 1);
    wait_for_backends(
        &netns,
        &cgroup,
        "127.77.9.14:80".parse().unwrap(),
        &["b1", "b3", "b4"],
        Duration::from_secs(10),
    );
    for (side, cgroup, to) in [
        ("daemon", Some(&cgroup), "127.77.9.14:80"),
        ("envoy", None, "127.0.0.1:15014"),
    ] {
        let probe = Probe::run(
            &netns,
            cgroup.map(TestCgroup::path),
            to.parse().unwrap(),
            400,
            false,
        );
        assert!(probe.errors.is_empty(), "{side}: {probe:?}");
        let b1 = probe.count("b1");
        println!("weighted priority health, {side}: b1 {b1} of 400");
        assert_eq!(probe.count("b2"), 0, "{side}: the unhealthy host");
        assert!(b1.abs_diff(140) <= 48, "{side}: b1 took {b1} of 400");
    }
}
