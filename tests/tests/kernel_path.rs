//! The kernel path end to end (root): the real daemon binary attaches the real eBPF object to a
//! fresh cgroup; clients in a fresh network namespace connect to a VIP.
//!
//! Asserts the rewrite, the weight distribution over a fixed number of connects, that
//! getpeername shows the VIP, that processes outside the cgroup and destinations that are not
//! services are untouched, that a service without hosts refuses connects, and that a bad config
//! changes nothing.

use std::{net::SocketAddr, path::Path, process::Command};

use integration_tests::kernel::{
    BannerServers, Daemon, Netns, Probe, TestCgroup, assert_share, proxy_bin, require_root,
    unique,
};
use rstest::rstest;

/// Connects per distribution test: enough that a 4.5-sigma bound is a few percent.
const CONNECTS: u32 = 2000;

struct Family {
    vip: &'static str,
    hosts: [&'static str; 3],
    not_a_service: &'static str,
}

const V4: Family = Family {
    vip: "127.77.0.1:80",
    hosts: ["127.0.0.11:8081", "127.0.0.12:8082", "127.0.0.13:8083"],
    not_a_service: "127.0.0.50:9000",
};

// IPv6 VIPs other than loopback exist only inside the test's own namespace.
const V6: Family = Family {
    vip: "[fd77::1]:80",
    hosts: ["[::1]:8081", "[::1]:8082", "[::1]:8083"],
    not_a_service: "[::1]:9000",
};

fn config(instance: &str, cgroup: &Path, vip: SocketAddr, hosts: &[(&str, u32)]) -> String {
    let endpoints: String = hosts
        .iter()
        .map(|(addr, w)| {
            let a: SocketAddr = addr.parse().expect("host address");
            format!(
                "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n              load_balancing_weight: {w}\n",
                a.ip(),
                a.port()
            )
        })
        .collect();
    format!(
        "instance: {instance}\ncgroup: {cgroup}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}services:\n  - name: web\n    address: \"{ip}\"\n    port: {port}\n    cluster: web\n",
        cgroup = cgroup.display(),
        ip = vip.ip(),
        port = vip.port(),
    )
}

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn connect_rewrites_by_weight_and_getpeername_shows_the_vip(#[case] fam: Family) {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let weights = [5, 3, 2];
    let mut servers: Vec<(SocketAddr, &str, bool)> =
        fam.hosts.iter().map(|h| (h.parse().unwrap(), *h, false)).collect();
    // Something on the VIP itself and on a plain address, so an untouched connect succeeds and
    // says where it went.
    if vip.is_ipv6() {
        netns.add_lo_addr("fd77::1/128");
    }
    servers.push((vip, "vip-itself", false));
    servers.push((fam.not_a_service.parse().unwrap(), "not-a-service", false));
    let _servers = BannerServers::start(&netns, &servers);
    let hosts: Vec<(&str, u32)> = fam.hosts.iter().copied().zip(weights).collect();
    let daemon = Daemon::start(&config(&unique("t"), cgroup.path(), vip, &hosts));

    let inside = Probe::run(&netns, Some(cgroup.path()), vip, CONNECTS, false);
    assert!(inside.errors.is_empty(), "connect errors: {:?}", inside.errors);
    assert_eq!(inside.count("vip-itself"), 0, "a connect in the cgroup was not rewritten");
    for (host, weight) in &hosts {
        assert_share(host, inside.count(host), CONNECTS, f64::from(*weight) / 10.0);
    }
    assert_eq!(inside.peers, [vip.to_string()], "getpeername must show the VIP");
    assert_eq!(daemon.counter("connect_rewritten"), u64::from(CONNECTS));

    let outside = Probe::run(&netns, None, vip, 20, false);
    assert_eq!(outside.count("vip-itself"), 20, "outside the cgroup: {outside:?}");

    let plain = Probe::run(&netns, Some(cgroup.path()), fam.not_a_service.parse().unwrap(), 20, false);
    assert_eq!(plain.count("not-a-service"), 20, "a non-service destination: {plain:?}");
    assert!(daemon.counter("connect_not_service") >= 20);
}

#[test]
fn service_without_hosts_refuses_connects() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = V4.vip.parse().unwrap();
    let _servers = BannerServers::start(&netns, &[(vip, "vip-itself", false)]);
    let daemon = Daemon::start(&config(&unique("t"), cgroup.path(), vip, &[]));
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 10, false);
    assert_eq!(probe.errors.get("EPERM"), Some(&10), "{probe:?}");
    assert_eq!(daemon.counter("connect_no_host"), 10);
}

#[test]
fn udp_connect_is_rewritten_for_udp_services() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.0.53:53".parse().unwrap();
    let host = "127.0.0.31:5353";
    let _servers = BannerServers::start(&netns, &[(host.parse().unwrap(), host, true)]);
    let cfg = config(&unique("t"), cgroup.path(), vip, &[(host, 1)])
        .replace("    cluster: web\n", "    cluster: web\n    protocol: UDP\n");
    let _daemon = Daemon::start(&cfg);
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 20, true);
    assert_eq!(probe.count(host), 20, "{probe:?}");
    assert_eq!(probe.peers, [vip.to_string()]);
}

#[test]
fn stop_removes_pins_and_the_created_cgroup() {
    require_root();
    let parent = TestCgroup::new();
    let cgroup = parent.path().join("child-created-by-daemon");
    let instance = unique("t");
    let vip: SocketAddr = V4.vip.parse().unwrap();
    let mut daemon = Daemon::start(&config(&instance, &cgroup, vip, &[(V4.hosts[0], 1)]));
    let pins = Path::new("/sys/fs/bpf").join(&instance);
    assert!(pins.join("SERVICES_V2").exists() && pins.join("link_connect4").exists());
    assert!(cgroup.exists(), "the daemon creates a missing cgroup");
    assert!(daemon.stop(), "clean exit on SIGTERM:\n{}", daemon.log_text());
    assert!(!pins.exists(), "pins left behind");
    assert!(!cgroup.exists(), "the cgroup the daemon created is left behind");
}

#[test]
fn bad_config_exits_64_and_attaches_nothing() {
    require_root();
    let dir = integration_tests::kernel::TempDir::new();
    let instance = unique("t");
    let path = dir.0.join("bad.yaml");
    std::fs::write(
        &path,
        format!("instance: {instance}\nclusters:\n  - name: web\n    lb_policy: ROUND_ROBIN\n"),
    )
    .unwrap();
    for sub in ["check", "run"] {
        let out = Command::new(proxy_bin()).args([sub, "--config"]).arg(&path).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{sub}: {stderr}");
        let want = format!("{}:4:5: clusters[0].lb_policy:", path.display());
        assert!(stderr.contains(&want), "{sub}: {stderr}");
    }
    assert!(!Path::new("/sys/fs/bpf").join(&instance).exists(), "nothing may be pinned");
}
