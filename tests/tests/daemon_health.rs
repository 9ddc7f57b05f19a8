//! Health checks and traffic (root), with `no_traffic_interval` at its default (60 s): a cluster
//! that carried a connection is checked at `interval` from its next check on, as Envoy does, so
//! a dead host of a busy service is found about a minute after start at worst (not two); a
//! cluster that carried nothing stays at the slow rate. The kernel's per-service counters,
//! which feed this, are exported as `service.<name>.*`. A `protocol: UDP` service's datagrams
//! count as traffic the same way, and its UDP health checks move the kernel path's datagrams
//! off a dead host and back.

use std::{
    collections::BTreeMap,
    net::{SocketAddr, UdpSocket},
    path::PathBuf,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{
        BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, TestCgroup, require_root,
        skip_without_dataplane, tcp_loop, unique,
    },
    unbound::Unbound,
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

/// The DNS service's address; each unbound answers `who.svc.test.` with its own 10.0.0.x.
const DNS_VIP: &str = "127.77.9.53:53";

/// A DNS query for `who.svc.test. A` with `id`.
fn who_query(id: u16) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[1, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
    q.extend_from_slice(b"\x03who\x03svc\x04test\x00\x00\x01\x00\x01");
    q
}

/// Sends `count` queries to the VIP from one unconnected socket (the kernel picks a host per
/// datagram) and counts the answers by the address they carry; `failed` for no or a bad answer.
fn ask(vip: SocketAddr, count: u16) -> BTreeMap<String, u32> {
    let socket = UdpSocket::bind("0.0.0.0:0").expect("binding a DNS client");
    socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    let mut answers = BTreeMap::new();
    let mut buf = [0u8; 512];
    for id in 1..=count {
        let answer = socket
            .send_to(&who_query(id), vip)
            .and_then(|_| socket.recv_from(&mut buf))
            .ok()
            .and_then(|(n, _)| {
                let r = &buf[..n];
                let noerror = r.get(3).map(|flags| flags & 0x0f) == Some(0);
                // Our ID, NOERROR, one answer and nothing else: the A record's data ends it.
                (n > 16 && r[..2] == id.to_be_bytes() && noerror && r[6..12] == [0, 1, 0, 0, 0, 0])
                    .then(|| format!("{}.{}.{}.{}", r[n - 4], r[n - 3], r[n - 2], r[n - 1]))
            });
        *answers
            .entry(answer.unwrap_or_else(|| "failed".into()))
            .or_insert(0) += 1;
    }
    answers
}

fn ask_in_cgroup(cgroup: &TestCgroup, netns: &Netns) -> BTreeMap<String, u32> {
    let vip: SocketAddr = DNS_VIP.parse().unwrap();
    let out = InCgroup::spawn(Some(cgroup.path()), netns, move || {
        serde_json::to_string(&ask(vip, 40)).unwrap()
    })
    .wait(Duration::from_secs(60));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("client output {out:?}: {e}"))
}

/// Polls `/clusters` until `host`'s flags satisfy `want`, up to `deadline`.
fn wait_flags(
    daemon: &Daemon,
    host: &str,
    deadline: Instant,
    what: &str,
    want: impl Fn(&str) -> bool,
) {
    loop {
        let now = flags(daemon, "dns", host);
        if want(&now) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{host}: {what}; flags still {now:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn udp_health_checks_move_a_udp_services_datagrams_off_a_dead_host_and_back() {
    require_root();
    if skip_without_dataplane(
        "udp_health_checks_move_a_udp_services_datagrams_off_a_dead_host_and_back",
    ) {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let check = "health.svc.test. 5 IN A 127.0.0.9";
    let a = Unbound::start_in(&netns.path(), &["who.svc.test. 5 IN A 10.0.0.1", check]);
    let mut b = Unbound::start_in(&netns.path(), &["who.svc.test. 5 IN A 10.0.0.2", check]);
    let (host_a, host_b) = (a.addr().to_string(), b.addr().to_string());
    let endpoint = |addr: SocketAddr| {
        format!(
            "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
            addr.ip(),
            addr.port()
        )
    };
    let instance = unique("udphc");
    let _pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let vip: SocketAddr = DNS_VIP.parse().unwrap();
    // `no_traffic_interval` is left at its default: the datagrams below are the traffic that
    // brings the checks to `interval`.
    let config = format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: dns\n    \
         health_checks:\n      - {{ timeout: 0.5s, interval: 0.5s, unhealthy_threshold: 2, healthy_threshold: 1, \
         udp_health_check: {{ dns: {{ name: health.svc.test. }} }} }}\n    \
         load_assignment:\n      endpoints:\n        - lb_endpoints:\n{}{}services:\n  - \
         {{ name: dns, address: \"{}\", port: {}, protocol: UDP, cluster: dns }}\n",
        cgroup.path().display(),
        endpoint(a.addr()),
        endpoint(b.addr()),
        vip.ip(),
        vip.port(),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let start = Instant::now();
    assert_eq!(flags(&daemon, "dns", &host_a), "healthy");
    assert_eq!(flags(&daemon, "dns", &host_b), "healthy");

    let both = ask_in_cgroup(&cgroup, &netns);
    assert!(
        both.get("10.0.0.1").is_some_and(|n| *n > 0)
            && both.get("10.0.0.2").is_some_and(|n| *n > 0),
        "both hosts answer: {both:?}"
    );
    assert_eq!(both.get("failed"), None, "{both:?}");

    // B dies. Its next check (at most no_traffic_interval after start) draws an ICMP port
    // unreachable; the one after it follows at `interval`; then it is out.
    b.stop();
    wait_flags(
        &daemon,
        &host_b,
        start + Duration::from_secs(90),
        "the dead host never failed",
        |f| f.contains("failed_active_hc"),
    );
    println!(
        "UDP DNS host out {:?} after start (no_traffic_interval 60 s)",
        start.elapsed()
    );
    let only_a = ask_in_cgroup(&cgroup, &netns);
    assert_eq!(
        only_a,
        BTreeMap::from([("10.0.0.1".to_owned(), 40)]),
        "after B failed"
    );
    assert!(daemon.stat("cluster.dns.health_check.network_failure") >= 2);

    b.restart();
    wait_flags(
        &daemon,
        &host_b,
        Instant::now() + Duration::from_secs(10),
        "the restarted host never came back",
        |f| f == "healthy",
    );
    let back = ask_in_cgroup(&cgroup, &netns);
    assert!(
        back.get("10.0.0.2").is_some_and(|n| *n > 0),
        "the restarted host answers again: {back:?}"
    );
    assert_eq!(back.get("failed"), None, "{back:?}");
    assert_eq!(flags(&daemon, "dns", &host_a), "healthy");
}
