//! Health checks and traffic (root), with `no_traffic_interval` at its default (60 s): a cluster
//! that carried a connection is checked at `interval` from its next check on, as Envoy does, so
//! a dead host of a busy service is found about a minute after start at worst (not two); a
//! cluster that carried nothing stays at the slow rate. The kernel's per-service counters,
//! which feed this, are exported as `service.<name>.*`.

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, TestCgroup, require_root,
    skip_without_dataplane, tcp_loop, unique,
};

const BUSY: (&str, &str) = ("127.77.8.1:80", "127.0.0.81:8081");
const IDLE: (&str, &str) = ("127.77.8.2:80", "127.0.0.82:8082");

/// Checks every 0.5 s once there is traffic; `no_traffic_interval` is left at its default.
const CHECK: &str = "    health_checks:\n      - { timeout: 0.5s, interval: 0.5s, unhealthy_threshold: 2, healthy_threshold: 1, tcp_health_check: {} }\n";

fn cluster(name: &str, host: &str) -> String {
    let host: SocketAddr = host.parse().unwrap();
    format!(
        "  - name: {name}\n{CHECK}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
        host.ip(),
        host.port()
    )
}

fn service(name: &str, vip: &str) -> String {
    let vip: SocketAddr = vip.parse().unwrap();
    format!(
        "  - {{ name: {name}, address: \"{}\", port: {}, cluster: {name} }}\n",
        vip.ip(),
        vip.port()
    )
}

/// The host's health flags in `/clusters` (Envoy's text: `healthy`, or `/failed_active_hc`...).
fn flags(daemon: &Daemon, cluster: &str, host: &str) -> String {
    let (_, body) = daemon.get("/clusters").expect("admin /clusters");
    let prefix = format!("{cluster}::{host}::health_flags::");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in /clusters:\n{body}"))
        .to_owned()
}

#[test]
fn traffic_moves_a_cluster_off_no_traffic_interval() {
    require_root();
    if skip_without_dataplane("traffic_moves_a_cluster_off_no_traffic_interval") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let busy_server = BannerServers::start(&netns, &[(BUSY.1.parse().unwrap(), "busy", false)]);
    let idle_server = BannerServers::start(&netns, &[(IDLE.1.parse().unwrap(), "idle", false)]);
    let instance = unique("hc");
    let _pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let config = format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n{}{}services:\n{}{}",
        cgroup.path().display(),
        cluster("busy", BUSY.1),
        cluster("idle", IDLE.1),
        service("busy", BUSY.0),
        service("idle", IDLE.0),
    );
    let daemon = Daemon::start_in(&netns, &config);
    // Ready means every host had its first check; the next ones are a minute away.
    let start = Instant::now();
    assert_eq!(flags(&daemon, "busy", BUSY.1), "healthy");
    assert_eq!(flags(&daemon, "idle", IDLE.1), "healthy");

    let vip: SocketAddr = BUSY.0.parse().unwrap();
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(vip, 20, Duration::from_secs(5))).unwrap()
    });
    let report = LoopReport::parse(&client.wait(Duration::from_secs(30)));
    assert_eq!(report.banners.get("busy").copied(), Some(20), "{report:?}");
    assert_eq!(daemon.stat("service.busy.cx_to_host"), 20);
    assert_eq!(daemon.stat("service.busy.cx_no_host"), 0);
    assert_eq!(daemon.stat("service.idle.cx_to_host"), 0);
    let (_, prometheus) = daemon.get("/stats/prometheus").expect("admin");
    assert!(
        prometheus.contains("proxy_service_cx_to_host{service=\"busy\"} 20"),
        "{prometheus}"
    );

    // Both hosts die. The busy cluster's next check (at most 60 s after start) fails and the one
    // after it follows at `interval`: two failures, the host is out. The idle cluster's host
    // fails the same check but waits `no_traffic_interval` for the second.
    drop(busy_server);
    drop(idle_server);
    let deadline = start + Duration::from_secs(90);
    loop {
        if flags(&daemon, "busy", BUSY.1).contains("failed_active_hc") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the busy cluster's dead host is still healthy {:?} after start: its checks never left no_traffic_interval",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let found = start.elapsed();
    println!(
        "busy cluster: dead host out {found:?} after start (no_traffic_interval 60 s, interval 0.5 s, threshold 2)"
    );
    assert!(
        found < Duration::from_secs(75),
        "two failed checks took {found:?}: the second waited no_traffic_interval"
    );
    assert_eq!(
        flags(&daemon, "idle", IDLE.1),
        "healthy",
        "a cluster without traffic is checked at no_traffic_interval"
    );
}
