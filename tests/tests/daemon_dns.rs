//! STRICT_DNS, LOGICAL_DNS and DNS SRV clusters through the daemon and the kernel (root): a real
//! unbound answers;
//! records changed live through unbound-control move connects from a fresh cgroup and
//! namespace to the new addresses.

use std::{fmt::Write as _, net::SocketAddr, time::Duration};

use integration_tests::{
    kernel::{BannerServers, Daemon, Netns, Probe, TestCgroup, require_root, unique},
    unbound::Unbound,
};

/// Bound of every wait for connects to follow a change.
const WITHIN: Duration = Duration::from_secs(15);

fn wait(netns: &Netns, cgroup: &TestCgroup, want: &[&str]) {
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    integration_tests::kernel::wait_for_backends(netns, cgroup, vip, want, WITHIN);
}

fn config(cgroup: &TestCgroup, dns: &Unbound, kind: &str) -> String {
    config_names(cgroup, dns, kind, &["web.svc.test"])
}

/// A cluster `web` of `kind` with one endpoint per name (port 8080), behind 127.77.0.1:80.
fn config_names(cgroup: &TestCgroup, dns: &Unbound, kind: &str, names: &[&str]) -> String {
    let mut endpoints = String::new();
    for name in names {
        let _ = writeln!(
            endpoints,
            "            - endpoint: {{ address: {{ socket_address: {{ address: {name}, port_value: 8080 }} }} }}"
        );
    }
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    type: {kind}\n    dns_refresh_rate: 0.2s\n    dns_lookup_family: V4_ONLY\n    dns_resolvers: [\"{}\"]\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("t"),
        cgroup.path().display(),
        dns.addr(),
    )
}

#[test]
fn strict_dns_follows_live_record_changes() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b, c) = ("127.0.0.41:8080", "127.0.0.42:8080", "127.0.0.43:8080");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
            (c.parse().unwrap(), c, false),
        ],
    );
    let dns = Unbound::start(&[
        "web.svc.test. 5 IN A 127.0.0.41",
        "web.svc.test. 5 IN A 127.0.0.42",
    ]);
    let daemon = Daemon::start(&config(&cgroup, &dns, "STRICT_DNS"));
    wait(&netns, &cgroup, &[a, b]);

    dns.replace("web.svc.test", &["web.svc.test. 5 IN A 127.0.0.43"]);
    wait(&netns, &cgroup, &[c]);
    let (_, stats) = integration_tests::kernel::http_get(daemon.admin, "/stats").unwrap();
    assert!(stats.contains("cluster.web.update_success"), "{stats}");
}

#[test]
fn logical_dns_uses_the_first_address_only() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.44:8080", "127.0.0.45:8080");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
        ],
    );
    let dns = Unbound::start(&[
        "web.svc.test. 5 IN A 127.0.0.44",
        "web.svc.test. 5 IN A 127.0.0.45",
    ]);
    let _daemon = Daemon::start(&config(&cgroup, &dns, "LOGICAL_DNS"));
    // Only one of the two answers is ever used for new connections.
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 40, false);
    assert_eq!(probe.backends.len(), 1, "{probe:?}");
    assert!(probe.errors.is_empty(), "{probe:?}");
}

/// One address returned by two names is two hosts, as in Envoy: `/clusters` lists it twice and
/// it takes twice the share of connects of the address only one name returns.
#[test]
fn strict_dns_address_from_two_names_is_two_hosts() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (shared, single) = ("127.0.0.46:8080", "127.0.0.47:8080");
    let _servers = BannerServers::start(
        &netns,
        &[
            (shared.parse().unwrap(), shared, false),
            (single.parse().unwrap(), single, false),
        ],
    );
    let dns = Unbound::start(&[
        "a.svc.test. 5 IN A 127.0.0.46",
        "b.svc.test. 5 IN A 127.0.0.46",
        "b.svc.test. 5 IN A 127.0.0.47",
    ]);
    let names = ["a.svc.test", "b.svc.test"];
    let daemon = Daemon::start(&config_names(&cgroup, &dns, "STRICT_DNS", &names));
    wait(&netns, &cgroup, &[shared, single]);

    let (_, clusters) = daemon.get("/clusters").expect("admin /clusters");
    let entries = |host: &str| {
        let prefix = format!("web::{host}::weight::");
        clusters.lines().filter(|l| l.starts_with(&prefix)).count()
    };
    assert_eq!((entries(shared), entries(single)), (2, 1), "{clusters}");
    let (_, stats) = daemon.get("/stats").expect("admin /stats");
    assert!(
        stats
            .lines()
            .any(|l| l == "cluster.web.membership_total: 3"),
        "{stats}"
    );

    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let n = 300;
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, n, false);
    assert!(probe.errors.is_empty(), "{probe:?}");
    integration_tests::kernel::assert_share(
        "the shared address",
        probe.count(shared),
        n,
        2.0 / 3.0,
    );
}

/// A `proxy.clusters.dns_srv` cluster through the daemon and the kernel: the SRV targets' ports
/// are the hosts' ports, the lowest SRV priority serves alone while it has a host, and records
/// changed live move connects (the higher priority takes over, then the first comes back).
#[test]
fn dns_srv_priorities_and_ports_reach_the_kernel() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.48:8081", "127.0.0.49:8082");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
        ],
    );
    let first = "_web._tcp.svc.test. 5 IN SRV 10 5 8081 a.svc.test.";
    let second = "_web._tcp.svc.test. 5 IN SRV 20 5 8082 b.svc.test.";
    let dns = Unbound::start(&[
        first,
        second,
        "a.svc.test. 5 IN A 127.0.0.48",
        "b.svc.test. 5 IN A 127.0.0.49",
    ]);
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    cluster_type: {{ name: proxy.clusters.dns_srv, typed_config: {{ service_names: [_web._tcp.svc.test] }} }}\n    dns_refresh_rate: 0.2s\n    dns_lookup_family: V4_ONLY\n    dns_resolvers: [\"{}\"]\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("srv"),
        cgroup.path().display(),
        dns.addr(),
    );
    let daemon = Daemon::start(&config);
    wait(&netns, &cgroup, &[a]);
    let (_, clusters) = daemon.get("/clusters").expect("admin /clusters");
    for (host, priority) in [(a, 0), (b, 1)] {
        let line = format!("web::{host}::priority::{priority}");
        assert!(clusters.lines().any(|l| l == line), "{line} in {clusters}");
    }

    dns.replace("_web._tcp.svc.test", &[second]);
    wait(&netns, &cgroup, &[b]);
    dns.replace("_web._tcp.svc.test", &[first, second]);
    wait(&netns, &cgroup, &[a]);
}
