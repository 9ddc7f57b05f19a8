//! Outlier detection fed by the kernel's passive signal (root): connects from a fresh cgroup to
//! a host with nothing listening fail; sockops counts them; the daemon ejects the host and new
//! connects go to the healthy one. And the HTTP detectors (success rate, failure percentage) fed
//! by the proxy path's answers from a host that returns 500, and LEAST_REQUEST from the file,
//! which sockops follows by counting each host's open connections.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    http_servers::{Servers, get_in_cgroup},
    kernel::{BannerServers, Daemon, Netns, Probe, TestCgroup, require_root, unique},
};

#[test]
fn connect_failures_eject_the_host() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (good, bad) = ("127.0.0.61:8080", "127.0.0.62:8080");
    // Only the good host listens; connects rewritten to the bad one are refused.
    let _servers = BannerServers::start(&netns, &[(good.parse().unwrap(), good, false)]);
    let endpoint = |a: &str| {
        let a: SocketAddr = a.parse().unwrap();
        format!(
            "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
            a.ip(),
            a.port()
        )
    };
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    outlier_detection: {{ consecutive_5xx: 2, interval: 0.2s, max_ejection_percent: 50 }}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{}{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("t"),
        cgroup.path().display(),
        endpoint(good),
        endpoint(bad),
    );
    let daemon = Daemon::start(&config);
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, 20, false);
        if probe.errors.is_empty() && probe.count(good) == 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the refusing host was never ejected: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The refused connects before the ejection, in the service's kernel counter.
    let failed = daemon.stat("service.web.cx_passive_failure");
    println!("service.web.cx_passive_failure: {failed}");
    assert!(failed >= 2, "at least consecutive_5xx failures: {failed}");
}

/// Answers one HTTP/1.1 request: 500 from the hosts named `bad`, 200 from the others; the body
/// names the host.
fn status_server(mut conn: std::net::TcpStream, name: &str) {
    use std::io::{Read as _, Write as _};
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let status = if name == "bad" {
        "500 Internal Server Error"
    } else {
        "200 OK"
    };
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{name}",
        name.len()
    );
}

/// The success-rate and failure-percentage detectors fed by the proxy path's HTTP statuses,
/// through the daemon and the kernel redirect: five hosts, one answering 500 to everything. Each
/// of two chains' clusters runs one detector alone (the others not enforcing); both eject the
/// 500 host within a few intervals, count it under their own detector, and then no request
/// reaches it.
#[test]
fn http_5xx_feed_the_success_rate_and_failure_percentage_detectors() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let hosts: Vec<(SocketAddr, &str)> = ["ok1", "ok2", "ok3", "ok4", "bad"]
        .iter()
        .enumerate()
        .map(|(i, name)| (SocketAddr::from(([127, 0, 0, 71 + i as u8], 8080)), *name))
        .collect();
    let _servers = Servers::start(&netns, &hosts, status_server);
    let mut endpoints = String::new();
    for (a, _) in &hosts {
        writeln!(
            endpoints,
            "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}",
            a.ip(),
            a.port()
        )
        .expect("writing to a String");
    }
    // Only the detector under test enforces; consecutive 5xx (enforcing by default) is off.
    let common = "interval: 1s, max_ejection_percent: 50, enforcing_consecutive_5xx: 0";
    let detectors = [
        (
            "sr",
            format!(
                "{{ {common}, success_rate_minimum_hosts: 5, success_rate_request_volume: 10 }}"
            ),
            "outlier_detection.ejections_enforced_success_rate",
        ),
        (
            "fp",
            format!(
                "{{ {common}, enforcing_success_rate: 0, enforcing_failure_percentage: 100, failure_percentage_minimum_hosts: 5, failure_percentage_request_volume: 10 }}"
            ),
            "outlier_detection.ejections_enforced_failure_percentage",
        ),
    ];
    let mut config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n",
        unique("od"),
        cgroup.path().display()
    );
    for (name, outlier, _) in &detectors {
        write!(
            config,
            "  - name: {name}\n    outlier_detection: {outlier}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}"
        )
        .expect("writing to a String");
    }
    config.push_str("config_entries:\n");
    for (name, _, _) in &detectors {
        writeln!(
            config,
            "  - {{ Kind: service-defaults, Name: {name}, Protocol: http }}"
        )
        .expect("writing to a String");
    }
    config.push_str("services:\n");
    for (i, (name, _, _)) in detectors.iter().enumerate() {
        writeln!(
            config,
            "  - {{ name: {name}, address: 127.77.0.{}, port: 80, chain: {name}, mode: proxy }}",
            i + 1
        )
        .expect("writing to a String");
    }
    let daemon = Daemon::start_in(&netns, &config);
    let paths = vec!["/"; 50];
    for (i, (name, _, stat)) in detectors.iter().enumerate() {
        let vip = SocketAddr::from(([127, 77, 0, 1 + i as u8], 80));
        let ejected = format!("cluster.{name}.{stat}");
        let deadline = Instant::now() + Duration::from_secs(15);
        while daemon.stat(&ejected) == 0 {
            assert!(
                Instant::now() < deadline,
                "{name}: the 500 host was never ejected"
            );
            get_in_cgroup(vip, &netns, &cgroup, &paths);
        }
        let bodies = get_in_cgroup(vip, &netns, &cgroup, &paths);
        assert!(
            bodies.iter().all(|b| b.starts_with("ok")),
            "{name}: after the ejection every request reaches a 200 host: {bodies:?}"
        );
        println!("{name}: {ejected} = {}", daemon.stat(&ejected));
    }
}

/// `lb_policy: LEAST_REQUEST` from the configuration file, through the daemon: the daemon
/// attaches sockops and publishes the service so that connect4 compares its hosts' open
/// connections. One host is loaded with a million connections in the kernel's count (written
/// into the pinned `ACTIVE_V1`, as `kernel_path` does); it then gets only the connects whose two
/// draws both fall on it (a quarter, where RANDOM would give it half), and connections held
/// open through the VIP are counted on their host and taken back when they close.
#[test]
fn least_request_from_the_file_compares_open_connections() {
    use aya::maps::{HashMap as BpfHashMap, Map, MapData};
    use integration_tests::kernel::InCgroup;
    use proxy_common::{
        abi::maps,
        service::{Backend, FAMILY_V4},
    };
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b): (SocketAddr, SocketAddr) = (
        "127.0.0.63:8080".parse().unwrap(),
        "127.0.0.64:8080".parse().unwrap(),
    );
    // The servers close at once; a client's socket still counts until the client closes it.
    let _servers = BannerServers::start(&netns, &[(a, "a", false), (b, "b", false)]);
    let instance = unique("lr");
    let config = format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    lb_policy: LEAST_REQUEST\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.63, port_value: 8080 }} }} }}\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.64, port_value: 8080 }} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        cgroup.path().display(),
    );
    let _daemon = Daemon::start(&config);
    let pin = std::path::Path::new("/sys/fs/bpf")
        .join(&instance)
        .join(maps::ACTIVE);
    let active = || {
        let map = MapData::from_pin(&pin).expect("ACTIVE_V1 pinned by the daemon");
        BpfHashMap::<MapData, Backend, u64>::try_from(Map::HashMap(map)).expect("a hash map")
    };
    let backend = |addr: SocketAddr| {
        let std::net::IpAddr::V4(ip) = addr.ip() else {
            unreachable!("IPv4 hosts")
        };
        Backend {
            addr: [u32::from_ne_bytes(ip.octets()), 0, 0, 0],
            port: addr.port().to_be(),
            family: FAMILY_V4,
            _pad: 0,
        }
    };
    let load = 1_000_000;
    active()
        .insert(backend(a), load, 0)
        .expect("loading host a");
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let n = 400;
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, n, false);
    assert!(probe.errors.is_empty(), "{probe:?}");
    integration_tests::kernel::assert_share("the loaded host", probe.count("a"), n, 0.25);

    // Ten connections held open from the cgroup: counted on their hosts, then taken back.
    let held = || {
        let m = active();
        m.get(&backend(a), 0).unwrap_or(0) - load + m.get(&backend(b), 0).unwrap_or(0)
    };
    let settled = |want: u64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while held() != want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        held()
    };
    assert_eq!(settled(0), 0, "the probe's connections not taken back");
    let dir = integration_tests::kernel::TempDir::new();
    let (ready, release) = (dir.0.join("ready"), dir.0.join("release"));
    let child = {
        let (ready, release) = (ready.clone(), release.clone());
        InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            let held: Vec<_> = (0..10)
                .map(|_| std::net::TcpStream::connect(vip).expect("connect"))
                .collect();
            std::fs::write(&ready, b"").expect("ready");
            let deadline = Instant::now() + Duration::from_secs(20);
            while !release.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(held);
            String::new()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the client did not connect");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(held(), 10, "ten open connections");
    std::fs::write(&release, b"").expect("release");
    child.wait(Duration::from_secs(30));
    assert_eq!(settled(0), 0, "held connections not taken back");
}
