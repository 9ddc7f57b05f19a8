//! Consul discovery chains executed by the kernel path (root): the real daemon compiles the
//! chain from config entries, and connects from a fresh cgroup in a fresh network namespace
//! follow it: a 90/10 split by subset, a redirect, and failover when the primary's hosts fail
//! their active health checks (and back when they recover).

use std::{
    net::{SocketAddr, TcpListener},
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    BannerServers, Daemon, Netns, Probe, TestCgroup, assert_share, free_port, http_get,
    require_root, unique,
};

const VIP: &str = "127.77.0.1:80";

fn header(cgroup: &TestCgroup) -> String {
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\n",
        unique("t"),
        cgroup.path().display()
    )
}

fn endpoint(addr: SocketAddr, version: &str) -> String {
    format!(
        "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n              metadata: {{ filter_metadata: {{ envoy.lb: {{ version: {version} }} }} }}\n",
        addr.ip(),
        addr.port()
    )
}

fn cluster(name: &str, endpoints: &str, extra: &str) -> String {
    format!(
        "  - name: {name}\n{extra}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}"
    )
}

#[test]
fn split_by_subset_follows_the_weights() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (v1, v2): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.12:8082".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(v1, "v1", false), (v2, "v2", false)]);
    let config = format!(
        "{}clusters:\n{}config_entries:\n  - {{ Kind: service-defaults, Name: web, Protocol: http }}\n  - Kind: service-splitter\n    Name: web\n    Splits: [{{ Weight: 90, ServiceSubset: v1 }}, {{ Weight: 10, ServiceSubset: v2 }}]\n  - Kind: service-resolver\n    Name: web\n    Subsets:\n      v1: {{ Filter: \"Service.Meta.version == v1\" }}\n      v2: {{ Filter: \"Service.Meta.version == v2\" }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n",
        header(&cgroup),
        cluster("web", &(endpoint(v1, "v1") + &endpoint(v2, "v2")), ""),
    );
    let daemon = Daemon::start(&config);
    let n = 2000;
    let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
    assert!(probe.errors.is_empty(), "{probe:?}");
    assert_share("v1", probe.count("v1"), n, 0.9);
    assert_share("v2", probe.count("v2"), n, 0.1);

    let (code, body) = http_get(daemon.admin, "/chain/web").expect("admin");
    assert_eq!(code, 200);
    let chain: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(chain["StartNode"], "splitter:web.default.default");
    assert_eq!(
        chain["Targets"]["v2.web.default.default.dc1"]["ServiceSubset"],
        "v2"
    );
}

#[test]
fn redirect_sends_connects_to_the_redirected_service() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (web, other): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.13:8083".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(web, "web", false), (other, "other", false)]);
    let config = format!(
        "{}clusters:\n{}{}config_entries:\n  - {{ Kind: service-resolver, Name: web, Redirect: {{ Service: other }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n",
        header(&cgroup),
        cluster("web", &endpoint(web, "a"), ""),
        cluster("other", &endpoint(other, "b"), ""),
    );
    let _daemon = Daemon::start(&config);
    let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), 50, false);
    assert_eq!(probe.count("other"), 50, "{probe:?}");
}

/// Fast TCP health checking (connect only) so the test sees transitions within a second.
const FAST_TCP_CHECK: &str = "    health_checks:\n      - { timeout: 0.2s, interval: 0.2s, no_traffic_interval: 0.2s, unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {} }\n";

#[test]
fn failover_when_the_primary_fails_health_checks_and_back() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    // The daemon health-checks from the host's loopback; clients connect inside the namespace.
    // The primary's address is a free host port with nothing listening: its check fails.
    let primary = free_port();
    let backup: SocketAddr = "127.0.0.22:8082".parse().unwrap();
    let health_target = TcpListener::bind(backup).expect("backup health endpoint on the host");
    let _servers = BannerServers::start(
        &netns,
        &[(primary, "primary", false), (backup, "backup", false)],
    );
    let config = format!(
        "{}clusters:\n{}{}config_entries:\n  - Kind: service-resolver\n    Name: web\n    Failover:\n      '*': {{ Service: backup }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web }}\n",
        header(&cgroup),
        cluster("web", &endpoint(primary, "a"), FAST_TCP_CHECK),
        cluster("backup", &endpoint(backup, "b"), FAST_TCP_CHECK),
    );
    let _daemon = Daemon::start(&config);
    let vip: SocketAddr = VIP.parse().unwrap();
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 30, false);
    assert_eq!(probe.count("backup"), 30, "primary is down: {probe:?}");

    // The primary comes up on the host: its check passes and traffic returns to it.
    let _primary_up = TcpListener::bind(primary).expect("primary health endpoint");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, 10, false);
        if probe.count("primary") == 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "traffic did not return to the primary: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(health_target);
}

#[test]
fn a_split_leg_without_hosts_fails_its_share_unless_health_aware() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (web, canary): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.14:8084".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(web, "web", false), (canary, "canary", false)]);
    let entries = "config_entries:\n  - { Kind: service-defaults, Name: web, Protocol: http }\n  - { Kind: service-defaults, Name: canary, Protocol: http }\n  - Kind: service-splitter\n    Name: web\n    Splits: [{ Weight: 80, Service: web }, { Weight: 20, Service: canary }]\n";
    // The canary's only host is marked UNHEALTHY: that leg has nowhere to go.
    let canary_endpoint = endpoint(canary, "c").replace(
        "              metadata:",
        "              health_status: UNHEALTHY\n              metadata:",
    );
    let config = |options: &str| {
        format!(
            "{}clusters:\n{}{}{entries}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web{options} }}\n",
            header(&cgroup),
            cluster("web", &endpoint(web, "a"), ""),
            cluster("canary", &canary_endpoint, ""),
        )
    };
    let n = 1000;
    let vip: SocketAddr = VIP.parse().unwrap();
    {
        let _daemon = Daemon::start(&config(""));
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, n, false);
        assert_share("web", probe.count("web"), n, 0.8);
        let refused = probe.errors.get("ECONNREFUSED").copied().unwrap_or(0);
        assert_share("refused", refused, n, 0.2);
    }
    let _daemon = Daemon::start(&config(", chain_options: { health_aware_splits: true }"));
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 200, false);
    assert_eq!(
        probe.count("web"),
        200,
        "health-aware: the canary's share goes to web: {probe:?}"
    );
}
