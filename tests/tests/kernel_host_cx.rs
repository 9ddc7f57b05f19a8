//! Per-host connect counts of the kernel path (root), through the real daemon: connect4/6 count
//! each kernel-path connect for the host it chose (`HOST_CX_V1`), and `/clusters` adds them to
//! that host's `cx_total`, in Envoy's JSON and in the text. Each host's count is exactly what its
//! server accepted; connected UDP counts, unconnected datagrams do not; a proxy-mode connect is
//! counted once, by the proxy path; `cx_connect_fail` and `cx_active` stay the proxy path's.

use std::{
    collections::BTreeMap, fmt::Write as _, net::SocketAddr, path::PathBuf, process::Command,
    time::Duration,
};

use integration_tests::kernel::{
    BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, Probe, TestCgroup, proxy_bin,
    require_root, udp_sendto_loop, unique,
};
use proxy_common::abi::maps;
use rstest::rstest;

/// Connects of the kernel-path probe.
const CONNECTS: u32 = 300;

fn endpoints(hosts: &[SocketAddr]) -> String {
    let mut out = String::new();
    for a in hosts {
        writeln!(
            out,
            "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}",
            a.ip(),
            a.port()
        )
        .expect("writing to a String");
    }
    out
}

/// A daemon in `netns` with cluster `web` of `hosts` and `services` (YAML flow lines).
fn start(netns: &Netns, cgroup: &TestCgroup, hosts: &[SocketAddr], services: &str) -> Daemon {
    Daemon::start_in(netns, &config(&unique("hcx"), cgroup, hosts, services))
}

/// The configuration of instance `instance` that [`start`] runs.
fn config(instance: &str, cgroup: &TestCgroup, hosts: &[SocketAddr], services: &str) -> String {
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{}services:\n{services}",
        cgroup.path().display(),
        endpoints(hosts),
    )
}

/// One host's stats as `/clusters` shows them, under their names there.
#[derive(Debug, Default, PartialEq, Eq)]
#[expect(
    clippy::struct_field_names,
    reason = "the fields are named as /clusters names the stats"
)]
struct HostStats {
    cx_total: u64,
    cx_connect_fail: u64,
    cx_active: u64,
}

/// Cluster `web`'s hosts in `/clusters?format=json`, checked against the text form.
fn host_stats(daemon: &Daemon) -> BTreeMap<SocketAddr, HostStats> {
    let (status, body) = daemon.get("/clusters?format=json").expect("/clusters");
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let cluster = json["cluster_statuses"]
        .as_array()
        .expect("cluster_statuses")
        .iter()
        .find(|c| c["name"] == "web")
        .expect("cluster web");
    let mut hosts = BTreeMap::new();
    for host in cluster["host_statuses"].as_array().expect("host_statuses") {
        let socket = &host["address"]["socket_address"];
        let ip = socket["address"].as_str().expect("address").parse();
        let port = socket["port_value"].as_u64().expect("port");
        let addr = SocketAddr::new(ip.expect("an IP"), u16::try_from(port).expect("a port"));
        let mut stats = HostStats::default();
        for stat in host["stats"].as_array().expect("stats") {
            // A zero value is left out, as Envoy leaves it.
            let value = stat["value"]
                .as_str()
                .map_or(0, |v| v.parse().expect("u64"));
            match stat["name"].as_str().expect("name") {
                "cx_total" => stats.cx_total = value,
                "cx_connect_fail" => stats.cx_connect_fail = value,
                "cx_active" => stats.cx_active = value,
                other => panic!("unexpected host stat {other}"),
            }
        }
        hosts.insert(addr, stats);
    }
    let (_, text) = daemon.get("/clusters").expect("/clusters");
    for (addr, stats) in &hosts {
        let line = format!("web::{addr}::cx_total::{}\n", stats.cx_total);
        assert!(text.contains(&line), "{line:?} not in the text:\n{text}");
    }
    hosts
}

#[rstest]
#[case::ipv4("127.77.0.1:80", ["127.0.0.41:8081", "127.0.0.42:8082", "127.0.0.43:8083"])]
#[case::ipv6("[fd77::1]:80", ["[::1]:8081", "[::1]:8082", "[::1]:8083"])]
fn kernel_path_connects_count_in_each_hosts_cx_total(#[case] vip: &str, #[case] hosts: [&str; 3]) {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let vip: SocketAddr = vip.parse().unwrap();
    let hosts: Vec<SocketAddr> = hosts.iter().map(|h| h.parse().unwrap()).collect();
    let servers: Vec<(SocketAddr, String, bool)> =
        hosts.iter().map(|h| (*h, h.to_string(), false)).collect();
    let servers: Vec<(SocketAddr, &str, bool)> = servers
        .iter()
        .map(|(a, b, u)| (*a, b.as_str(), *u))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let service = format!(
        "  - {{ name: web, address: \"{}\", port: {}, cluster: web }}\n",
        vip.ip(),
        vip.port()
    );
    let daemon = start(&netns, &cgroup, &hosts, &service);
    let before = host_stats(&daemon);
    assert!(
        before.values().all(|s| *s == HostStats::default()),
        "{before:?}"
    );

    let probe = Probe::run(&netns, Some(cgroup.path()), vip, CONNECTS, false);
    assert!(probe.errors.is_empty(), "{probe:?}");
    let stats = host_stats(&daemon);
    println!("{probe:?}\n{stats:?}");
    for host in &hosts {
        // Exactly what the host's server accepted; the kernel sees no outcome and no close.
        let expected = HostStats {
            cx_total: u64::from(probe.count(&host.to_string())),
            ..HostStats::default()
        };
        assert_eq!(stats[host], expected, "{host}");
    }
    let total: u64 = stats.values().map(|s| s.cx_total).sum();
    assert_eq!(total, u64::from(CONNECTS));
    assert_eq!(daemon.stat("cluster.web.upstream_cx_total"), total);
    assert_eq!(daemon.counter("host_cx_record_failed"), 0);
}

/// One cluster behind a kernel-path TCP service, a UDP service and a proxy-mode service: each
/// host's `cx_total` is its TCP and connected UDP connects of the kernel path plus the proxy
/// path's upstream connects, each counted once; unconnected datagrams add nothing.
#[test]
fn connected_udp_and_proxied_connects_count_once_and_datagrams_not() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let hosts: Vec<SocketAddr> = ["127.0.0.44:8080", "127.0.0.45:8080"]
        .iter()
        .map(|h| h.parse().unwrap())
        .collect();
    let names: Vec<String> = hosts.iter().map(ToString::to_string).collect();
    let mut servers = Vec::new();
    for (host, name) in hosts.iter().zip(&names) {
        servers.push((*host, name.as_str(), false));
        servers.push((*host, name.as_str(), true));
    }
    let _servers = BannerServers::start(&netns, &servers);
    let (tcp, udp, proxied): (SocketAddr, SocketAddr, SocketAddr) = (
        "127.77.0.1:80".parse().unwrap(),
        "127.77.0.2:53".parse().unwrap(),
        "127.77.0.3:80".parse().unwrap(),
    );
    let services = "  - { name: tcp, address: 127.77.0.1, port: 80, cluster: web }\n  - { name: udp, address: 127.77.0.2, port: 53, cluster: web, protocol: UDP }\n  - { name: prx, address: 127.77.0.3, port: 80, cluster: web, mode: proxy }\n";
    let daemon = start(&netns, &cgroup, &hosts, services);

    let direct = Probe::run(&netns, Some(cgroup.path()), tcp, 100, false);
    let connected = Probe::run(&netns, Some(cgroup.path()), udp, 40, true);
    let through_proxy = Probe::run(&netns, Some(cgroup.path()), proxied, 50, false);
    for probe in [&direct, &connected, &through_proxy] {
        assert!(probe.errors.is_empty(), "{probe:?}");
    }
    let datagrams = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&udp_sendto_loop(udp, 30)).unwrap()
        })
        .wait(Duration::from_secs(30)),
    );
    assert_eq!(
        (datagrams.ok(), datagrams.failed()),
        (30, 0),
        "{datagrams:?}"
    );

    let stats = host_stats(&daemon);
    println!("{direct:?}\n{connected:?}\n{through_proxy:?}\n{stats:?}");
    for (host, name) in hosts.iter().zip(&names) {
        let expected = [&direct, &connected, &through_proxy]
            .iter()
            .map(|p| u64::from(p.count(name)))
            .sum::<u64>();
        assert_eq!(stats[host].cx_total, expected, "{host}");
        assert_eq!(stats[host].cx_connect_fail, 0, "{host}");
    }
    let total: u64 = stats.values().map(|s| s.cx_total).sum();
    assert_eq!(total, 100 + 40 + 50);
    // The datagrams went to the hosts, and only the service counts them.
    assert_eq!(daemon.stat("service.udp.cx_to_host"), 40 + 30);
    assert_eq!(daemon.stat("proxy.upstream_cx_total"), 50);
}

/// The kernel's counts are pinned with the data path: a restart (SIGTERM, then a new daemon)
/// keeps them. An instance an earlier version ran has no `HOST_CX_V1`: `proxy dataplane show`
/// reads it all the same, and the next daemon creates the map and counts from there.
#[test]
fn counts_outlive_a_restart_and_pins_without_the_map_are_upgraded() {
    require_root();
    let (netns, cgroup, instance) = (Netns::new(), TestCgroup::new(), unique("hcx"));
    let pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let hosts: Vec<SocketAddr> = ["127.0.0.46:8080", "127.0.0.47:8080"]
        .iter()
        .map(|h| h.parse().unwrap())
        .collect();
    let names: Vec<String> = hosts.iter().map(ToString::to_string).collect();
    let servers: Vec<(SocketAddr, &str, bool)> = hosts
        .iter()
        .zip(&names)
        .map(|(h, n)| (*h, n.as_str(), false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let services = "  - { name: web, address: 127.77.0.1, port: 80, cluster: web }\n";
    let config = config(&instance, &cgroup, &hosts, services);
    let total = |d: &Daemon| host_stats(d).values().map(|s| s.cx_total).sum::<u64>();
    let connect = |n: u32| {
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, n, false);
        assert_eq!(probe.backends.values().sum::<u32>(), n, "{probe:?}");
    };

    let mut first = Daemon::start_in(&netns, &config);
    connect(40);
    assert_eq!(total(&first), 40);
    assert!(first.terminate(), "the first daemon's stop");
    let mut second = Daemon::start_in(&netns, &config);
    assert_eq!(total(&second), 40, "the counts went with the restart");
    connect(20);
    assert_eq!(total(&second), 60);
    assert!(second.terminate(), "the second daemon's stop");

    // As an earlier version leaves its instance: every map but this one.
    std::fs::remove_file(pins.0.join(maps::HOST_CX)).expect("removing the HOST_CX_V1 pin");
    let out = Command::new(proxy_bin())
        .args(["dataplane", "show", "--json", "--instance", &instance])
        .output()
        .expect("running proxy dataplane show");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "dataplane show of pins without HOST_CX_V1: {shown}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let snap: serde_json::Value = serde_json::from_str(&shown).expect("JSON");
    assert_eq!(snap["services"][0]["counters"]["to_host"], 60, "{shown}");
    let third = Daemon::start_in(&netns, &config);
    assert!(pins.0.join(maps::HOST_CX).exists(), "the new map is pinned");
    assert_eq!(total(&third), 0);
    connect(10);
    assert_eq!(total(&third), 10);
}
