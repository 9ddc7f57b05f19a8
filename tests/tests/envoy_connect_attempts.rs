//! `max_connect_attempts` side by side with a real Envoy 1.40 (root): the same STATIC cluster of
//! one dead host (nothing listens on it) and one live, ROUND_ROBIN, no health checks, in one
//! fresh network namespace. Envoy's tcp_proxy and the daemon's proxy path (a `mode: proxy`
//! service, reached through the kernel's redirect) each get the same loop of connects, one after
//! another, once with the field unset (one attempt) and once with two attempts. Both must count
//! alike: the connects that failed, `upstream_cx_connect_attempts_exceeded`,
//! `upstream_cx_connect_fail` and `upstream_cx_total` of the cluster.
//!
//! The cluster's `circuit_breakers` on the same tcp_proxy path: with `max_connections: 2`
//! pasted as Envoy takes it, two held connections and a third; both must refuse the third
//! alike and count one `upstream_cx_overflow`.
//!
//! An endpoint marked `protocol: UDP` in that TCP cluster: both connect to it over TCP.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{
        BannerServers, Daemon, InCgroup, Netns, Probe, TestCgroup, in_netns, require_root, unique,
    },
    xds_server::{Envoy, http},
};
use serde_json::{Value, json};

const DEAD: &str = "127.0.0.81:8081";
const LIVE: &str = "127.0.0.82:8082";
const VIP: &str = "127.77.8.1:80";
/// Envoy's tcp_proxy listener (the daemon's proxy listener is 127.0.0.1:15001).
const ENVOY_LISTENER: &str = "127.0.0.1:15002";
/// Connects per run: even, so that ROUND_ROBIN sends exactly half of the first connects to the
/// dead host whichever host it starts with.
const CONNECTS: u32 = 100;

/// The cluster both run, as Envoy's JSON (the daemon reads the same fields from its YAML).
fn cluster() -> Value {
    let endpoints: Vec<Value> = [DEAD, LIVE]
        .iter()
        .map(|b| {
            let b: SocketAddr = b.parse().unwrap();
            json!({"endpoint": {"address": {"socket_address": {"address": b.ip().to_string(), "port_value": b.port()}}}})
        })
        .collect();
    json!({
        "name": "c",
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "c", "endpoints": [{"lb_endpoints": endpoints}]}
    })
}

/// The cluster of the circuit-breaker test: the live host only, at most two connections.
fn limited_cluster() -> Value {
    let mut c = cluster();
    let live: SocketAddr = LIVE.parse().unwrap();
    c["load_assignment"]["endpoints"][0]["lb_endpoints"] = json!([{"endpoint": {"address": {"socket_address": {"address": live.ip().to_string(), "port_value": live.port()}}}}]);
    c["circuit_breakers"] = json!({"thresholds": [{"max_connections": 2}]});
    c
}

fn envoy_bootstrap(attempts: Option<u32>) -> String {
    envoy_bootstrap_with(attempts, &cluster())
}

fn envoy_bootstrap_with(attempts: Option<u32>, cluster: &Value) -> String {
    let listener: SocketAddr = ENVOY_LISTENER.parse().unwrap();
    let mut tcp_proxy = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": "tp",
        "cluster": "c"
    });
    if let Some(n) = attempts {
        tcp_proxy["max_connect_attempts"] = json!(n);
    }
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "l",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener.port()}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.tcp_proxy",
                    "typed_config": tcp_proxy
                }]}]
            }],
            "clusters": [cluster]
        }
    })
    .to_string()
}

fn daemon_config(cgroup: &TestCgroup, attempts: Option<u32>) -> String {
    daemon_config_with(cgroup, attempts, cluster())
}

fn daemon_config_with(cgroup: &TestCgroup, attempts: Option<u32>, mut cluster: Value) -> String {
    let vip: SocketAddr = VIP.parse().unwrap();
    // JSON is YAML: the daemon gets the very cluster Envoy gets, less the field it derives.
    cluster["load_assignment"]
        .as_object_mut()
        .unwrap()
        .remove("cluster_name");
    let field = attempts.map_or(String::new(), |n| format!(", max_connect_attempts: {n}"));
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n  - {cluster}\nservices:\n  - {{ name: web, address: \"{}\", port: {}, cluster: c, mode: proxy{field} }}\n",
        unique("att"),
        cgroup.path().display(),
        vip.ip(),
        vip.port()
    )
}

/// A stat from `{"stats": [{"name", "value"}, ...]}`.
fn stat(stats: &Value, name: &str) -> u64 {
    stats["stats"]
        .as_array()
        .expect("a stats list")
        .iter()
        .find(|s| s["name"] == name)
        .and_then(|s| s["value"].as_u64())
        .unwrap_or_else(|| panic!("no stat {name}"))
}

/// Envoy's `/stats?format=json`, read from inside `netns`.
fn envoy_stats(netns: &Netns, admin: SocketAddr) -> Value {
    let (_, body) = in_netns(netns, move || http(admin, "GET", "/stats?format=json", ""))
        .join()
        .expect("envoy admin answers");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("envoy stats JSON ({e}): {body}"))
}

/// Waits until Envoy is live with its listener bound (its admin answers before that): a
/// connect earlier would be refused by the namespace, not by Envoy.
fn until_envoy_serves(netns: &Netns, admin: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = envoy_stats(netns, admin);
        // `server.state` 0 is LIVE.
        let live = stat(&stats, "server.state") == 0;
        if live && stat(&stats, "listener_manager.total_listeners_active") == 1 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "envoy not live with its listener"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What one side showed: (failed connects, exceeded, connect_fail, total).
fn counts(probe: &Probe, stats: &Value) -> (u64, u64, u64, u64) {
    let cluster = |name: &str| stat(stats, &format!("cluster.c.{name}"));
    (
        u64::from(CONNECTS - probe.count("live")),
        cluster("upstream_cx_connect_attempts_exceeded"),
        cluster("upstream_cx_connect_fail"),
        cluster("upstream_cx_total"),
    )
}

#[test]
fn connect_attempts_count_as_envoy_with_a_dead_host() {
    require_root();
    let n = u64::from(CONNECTS);
    for attempts in [None, Some(2)] {
        let (netns, cgroup) = (Netns::new(), TestCgroup::new());
        let _live = BannerServers::start(&netns, &[(LIVE.parse().unwrap(), "live", false)]);
        let daemon = Daemon::start_in(&netns, &daemon_config(&cgroup, attempts));
        let envoy = Envoy::with_bootstrap(&envoy_bootstrap(attempts), Some(&netns.path()));
        until_envoy_serves(&netns, envoy.admin());
        let listener = ENVOY_LISTENER.parse().unwrap();
        let through_envoy = Probe::run(&netns, None, listener, CONNECTS, false);
        let vip = VIP.parse().unwrap();
        let through_daemon = Probe::run(&netns, Some(cgroup.path()), vip, CONNECTS, false);
        let envoy_stats = envoy_stats(&netns, envoy.admin());
        let (code, body) = daemon
            .get("/stats?format=json")
            .expect("daemon admin answers");
        assert_eq!(code, 200, "{body}");
        let daemon_stats: Value = serde_json::from_str(&body).expect("daemon stats JSON");
        let envoy = counts(&through_envoy, &envoy_stats);
        let ours = counts(&through_daemon, &daemon_stats);
        println!(
            "max_connect_attempts {attempts:?}: (failed, exceeded, connect_fail, total) envoy \
             {envoy:?}, daemon {ours:?}"
        );
        if attempts.is_none() {
            // Every other connect goes to the dead host, fails and is counted once.
            let half = n / 2;
            assert_eq!(envoy, (half, half, half, n), "envoy");
            assert_eq!(ours, envoy, "daemon");
        } else {
            // No connect fails; each that went to the dead host first was tried once more, on
            // the live one (ROUND_ROBIN's next): all of them or all but the first, by where
            // the rotation starts.
            for (side, (failed, exceeded, connect_fail, total)) in
                [("envoy", envoy), ("daemon", ours)]
            {
                assert_eq!((failed, exceeded), (0, 0), "{side}");
                assert!(
                    connect_fail == n || connect_fail == n - 1,
                    "{side}: {connect_fail}"
                );
                assert_eq!(total, n + connect_fail, "{side}");
            }
        }
    }
}

/// From `cgroup` (or none) in `netns`: two connections to `target` that each read their banner
/// and stay open, then a third; what each got: its banner, `eof` (closed before any byte) or
/// `reset` (at the connect or the read).
fn two_held_then_a_third(
    netns: &Netns,
    cgroup: Option<&std::path::Path>,
    target: SocketAddr,
) -> String {
    let child = InCgroup::spawn(cgroup, netns, move || {
        use std::io::{BufRead, BufReader};
        let outcome = |s: std::io::Result<std::net::TcpStream>| {
            let s = match s {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    return ("reset".to_owned(), None);
                }
                Err(e) => panic!("connecting to {target}: {e}"),
            };
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let mut line = String::new();
            let got = match BufReader::new(&s).read_line(&mut line) {
                Ok(0) => "eof".to_owned(),
                Ok(_) => line.trim().to_owned(),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => "reset".to_owned(),
                Err(e) => panic!("reading from {target}: {e}"),
            };
            (got, Some(s))
        };
        let open = || std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2));
        let held: Vec<_> = (0..2).map(|_| outcome(open())).collect();
        let (third, _) = outcome(open());
        format!("{} {} {third}", held[0].0, held[1].0)
    });
    child.wait(Duration::from_secs(20))
}

#[test]
fn max_connections_refuses_the_third_connection_as_envoy() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let _live = BannerServers::start_holding(&netns, &[(LIVE.parse().unwrap(), "live", false)]);
    let daemon = Daemon::start_in(
        &netns,
        &daemon_config_with(&cgroup, None, limited_cluster()),
    );
    let envoy = Envoy::with_bootstrap(
        &envoy_bootstrap_with(None, &limited_cluster()),
        Some(&netns.path()),
    );
    until_envoy_serves(&netns, envoy.admin());
    let through_envoy = two_held_then_a_third(&netns, None, ENVOY_LISTENER.parse().unwrap());
    let through_daemon = two_held_then_a_third(&netns, Some(cgroup.path()), VIP.parse().unwrap());
    let envoy_stats = envoy_stats(&netns, envoy.admin());
    let (code, body) = daemon
        .get("/stats?format=json")
        .expect("daemon admin answers");
    assert_eq!(code, 200, "{body}");
    let daemon_stats: Value = serde_json::from_str(&body).expect("daemon stats JSON");
    let overflow = |stats: &Value| stat(stats, "cluster.c.upstream_cx_overflow");
    println!(
        "max_connections 2: envoy {through_envoy:?}, overflow {}; daemon {through_daemon:?}, overflow {}",
        overflow(&envoy_stats),
        overflow(&daemon_stats)
    );
    assert!(
        through_envoy.starts_with("live live "),
        "envoy: {through_envoy}"
    );
    assert_eq!(through_daemon, through_envoy, "daemon");
    assert_eq!(overflow(&envoy_stats), 1, "envoy");
    assert_eq!(overflow(&daemon_stats), 1, "daemon");
}

/// An endpoint whose `socket_address.protocol` is `UDP`, in a TCP service's cluster: Envoy
/// 1.40 takes it and connects TCP to it, and so does the daemon (a host serves its service's
/// protocol).
#[test]
fn a_udp_endpoint_is_connected_over_tcp_as_by_envoy() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let _live = BannerServers::start(&netns, &[(LIVE.parse().unwrap(), "live", false)]);
    let mut udp = limited_cluster();
    udp.as_object_mut().unwrap().remove("circuit_breakers");
    udp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        ["protocol"] = json!("UDP");
    let _daemon = Daemon::start_in(&netns, &daemon_config_with(&cgroup, None, udp.clone()));
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap_with(None, &udp), Some(&netns.path()));
    until_envoy_serves(&netns, envoy.admin());
    let through_envoy = Probe::run(&netns, None, ENVOY_LISTENER.parse().unwrap(), 10, false);
    let through_daemon = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), 10, false);
    assert_eq!(through_envoy.count("live"), 10, "envoy");
    assert_eq!(through_daemon.count("live"), 10, "daemon");
}
