//! Kernel map limits through the daemon and the kernel (root), at small configured sizes so
//! that they are quick to reach: an EDS update with more hosts than `BACKENDS_V2` can take
//! beside the live set is NACKed with the limit named while connects stay on the last hosts,
//! and a start whose sizes differ from the instance's pinned maps is refused, leaving them
//! serving. And a cluster's `max_connections` on the kernel path: the connect over the limit
//! refused and counted, the count freed by a close and never leaked by a failed connect. And
//! an assignment's `drop_overloads` on the kernel path: that share of the connects refused and
//! counted, from the file and from EDS.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{
        BannerServers, Daemon, Netns, Probe, TempDir, TestCgroup, free_port, proxy_bin,
        require_root, unique,
    },
    xds_server::XdsServer,
};
use serde_json::{Value, json};

/// 16 backends: one cluster may hold 8 hosts.
const SMALL: &str = "kernel_maps: { services: 16, slot_tables: 32, backends: 16 }\n";

fn endpoints(addrs: &[String]) -> Value {
    let one = |a: &String| {
        let a: SocketAddr = a.parse().unwrap();
        json!({"address": a.ip().to_string(), "port": a.port(), "health": "HEALTHY", "weight": 1})
    };
    Value::Array(addrs.iter().map(one).collect())
}

/// Probes until only `want` banners answer, within 15 s.
fn wait_for_backends(netns: &Netns, cgroup: &TestCgroup, want: &[&str]) -> Probe {
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let probe = Probe::run(netns, Some(cgroup.path()), vip, 40, false);
        let seen: Vec<&str> = probe.backends.keys().map(String::as_str).collect();
        if probe.errors.is_empty() && seen == want {
            return probe;
        }
        assert!(
            Instant::now() < deadline,
            "connects never reached only {want:?}: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn config(
    maps: &str,
    instance: &str,
    cgroup: &TestCgroup,
    node: &str,
    server: &XdsServer,
) -> String {
    format!(
        "{maps}instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {node}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\nclusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: {{ eds_config: {{ ads: {{}} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        cgroup.path().display(),
        server.grpc_addr(),
    )
}

#[test]
fn an_eds_update_over_the_map_limit_is_nacked_and_other_sizes_than_the_pins_are_refused() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.51:8091", "127.0.0.52:8092");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
        ],
    );
    let server = XdsServer::start();
    server.push("web", "1", endpoints(&[a.to_owned(), b.to_owned()]));
    let (node, instance) = (unique("node"), unique("t"));
    let mut daemon = Daemon::start(&config(SMALL, &instance, &cgroup, &node, &server));
    wait_for_backends(&netns, &cgroup, &[a, b]);

    // Nine hosts: one more than half of 16 backends.
    let nine: Vec<String> = (1..=9)
        .map(|i| format!("127.0.0.{}:80{i:02}", 60 + i))
        .collect();
    let before = server.requests().len();
    server.push("web", "2", endpoints(&nine));
    let nack = server.wait_request("the daemon's NACK", before, |r| {
        r["node"] == node.as_str() && !r["error_detail"].is_null()
    });
    assert_eq!(
        nack["error_detail"],
        "cluster load assignment \"web\": 9 hosts do not fit the kernel maps: BACKENDS_V2 holds 16 entries (kernel_maps.backends) and a publish writes the new hosts beside the live ones, so one cluster may have at most 8",
        "{nack}"
    );
    assert_eq!(nack["version_info"], "1", "the last good version: {nack}");
    let probe = wait_for_backends(&netns, &cgroup, &[a, b]);
    assert_eq!(
        probe.count(a) + probe.count(b),
        40,
        "served by the last hosts"
    );
    assert_eq!(daemon.stat("cluster.web.update_rejected"), 1);
    assert_eq!(
        daemon.stat("service.web.hosts_stale"),
        0,
        "nothing failed to publish"
    );

    // The stream goes on: a set that fits is taken.
    server.push("web", "3", endpoints(&[b.to_owned()]));
    wait_for_backends(&netns, &cgroup, &[b]);

    // The pins stay as the stop leaves them; a start asking for other sizes is refused and
    // leaves them serving. (Started by hand: a refused `Daemon` would uninstall the instance
    // when dropped.)
    assert!(daemon.terminate(), "clean stop:\n{}", daemon.log_text());
    let defaults = config("", &instance, &cgroup, &node, &server);
    let (status, log) = run_refused(&defaults);
    assert!(!status.success(), "{status}:\n{log}");
    assert!(
        log.contains("holds 16 entries, the configuration asks for 65536 (kernel_maps.services)"),
        "{log}"
    );
    wait_for_backends(&netns, &cgroup, &[b]);
    assert!(daemon.uninstall(), "uninstall of the instance");
}

/// `proxy run` on `config`, expected to exit before it serves: its status and output. Killed by
/// its PID if it still runs after 30 s.
fn run_refused(config: &str) -> (std::process::ExitStatus, String) {
    let dir = TempDir::new();
    let path = dir.0.join("config.yaml");
    let config = config.replace("{admin}", &free_port().to_string());
    std::fs::write(&path, config).expect("writing config");
    let log = dir.0.join("run.log");
    let file = std::fs::File::create(&log).expect("creating the log");
    let mut child = std::process::Command::new(proxy_bin())
        .args(["run", "--config"])
        .arg(&path)
        .stdin(std::process::Stdio::null())
        .stdout(file.try_clone().expect("dup"))
        .stderr(file)
        .spawn()
        .expect("starting proxy run");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for proxy run") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("proxy run still runs after 30 s:\n{}", read(&log));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, read(&log))
}

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Waits (at most 15 s) until stat `name` is `want`.
fn wait_for_stat(daemon: &Daemon, name: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while daemon.stat(name) != want {
        assert!(
            Instant::now() < deadline,
            "{name} never became {want}:\n{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What only a publish can find: two clusters of 8 hosts fill 16 backends, each within its own
/// limit, so a new set of 8 for one of them has no room beside the live ones. The service keeps
/// its hosts and says so in `hosts_stale` until a publish succeeds again.
#[test]
fn a_service_whose_newest_hosts_did_not_fit_is_shown_stale() {
    require_root();
    let cgroup = TestCgroup::new();
    let server = XdsServer::start();
    let hosts =
        |net: u8| -> Vec<String> { (1..=8).map(|i| format!("127.0.{net}.{i}:80")).collect() };
    server.push("web", "1", endpoints(&hosts(1)));
    server.push("api", "1", endpoints(&hosts(2)));
    let eds = "    type: EDS\n    eds_cluster_config: { eds_config: { ads: {} } }\n";
    let yaml = format!(
        "{SMALL}instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\nclusters:\n  - name: web\n{eds}  - name: api\n{eds}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n  - {{ name: api, address: 127.77.0.2, port: 80, cluster: api }}\n",
        unique("t"),
        cgroup.path().display(),
        unique("node"),
        server.grpc_addr(),
    );
    let mut daemon = Daemon::start(&yaml);
    assert_eq!(daemon.stat("service.web.hosts_stale"), 0, "both published");

    server.push("web", "2", endpoints(&hosts(3)));
    wait_for_stat(&daemon, "service.web.hosts_stale", 1);
    assert_eq!(
        daemon.stat("service.web.publish_failed"),
        1,
        "one publish of set 2"
    );
    assert_eq!(
        daemon.stat("service.api.hosts_stale"),
        0,
        "the other service"
    );

    // Back to the set the kernel serves: nothing to write, and the service is current again.
    server.push("web", "3", endpoints(&hosts(1)));
    wait_for_stat(&daemon, "service.web.hosts_stale", 0);
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}

/// Waits (at most 20 s) until the file at `path` exists: a step of the client in the cgroup.
fn wait_for_file(path: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} never came", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `max_connections` on the kernel path (issue #42): a direct-mode service whose cluster's
/// `circuit_breakers` set `max_connections: 2` takes two connections held open from the
/// cgroup, refuses the third at connect (the errno of every kernel refusal), counts it
/// (`service.web.cx_overflow`, Envoy's `cluster.web.upstream_cx_overflow`,
/// `bpf.connect_cx_overflow`), and takes the next connect once one of the two is closed. A
/// service whose host refuses every connect (nothing listens) and whose limit is 1 sees each
/// of five failed connects fail at its host, never at the limit: a failed connect frees its
/// count.
#[test]
fn max_connections_refuses_the_connect_over_the_limit_until_one_closes() {
    use integration_tests::{
        features::refused_errno,
        kernel::{InCgroup, errno_name},
    };
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let host: SocketAddr = "127.0.0.81:8080".parse().unwrap();
    // The server closes at once; the client's socket still counts until the client closes it.
    let _servers = BannerServers::start(&netns, &[(host, "a", false)]);
    let cluster = |name: &str, addr: &str, port: u16, max: u32| {
        format!(
            "  - name: {name}\n    circuit_breakers: {{ thresholds: [ {{ max_connections: {max} }} ] }}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: {addr}, port_value: {port} }} }} }}\n"
        )
    };
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n{}{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n  - {{ name: dead, address: 127.77.0.2, port: 80, cluster: dead }}\n",
        unique("cx"),
        cgroup.path().display(),
        cluster("web", "127.0.0.81", 8080, 2),
        // Nothing listens there: every connect is refused by the host.
        cluster("dead", "127.0.0.82", 8081, 1),
    );
    let mut daemon = Daemon::start(&config);
    let dir = TempDir::new();
    let step = |name: &str| dir.0.join(name);
    let (ready, release, dropped, again) = (
        step("ready"),
        step("release"),
        step("dropped"),
        step("again"),
    );
    let child = {
        let (ready, release, dropped, again) = (
            ready.clone(),
            release.clone(),
            dropped.clone(),
            again.clone(),
        );
        InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            let (vip, dead): (SocketAddr, SocketAddr) = (
                "127.77.0.1:80".parse().unwrap(),
                "127.77.0.2:80".parse().unwrap(),
            );
            let connect = |to| std::net::TcpStream::connect(to);
            let (first, second) = (connect(vip).expect("first"), connect(vip).expect("second"));
            let third = connect(vip).err().map(|e| errno_name(&e));
            std::fs::write(&ready, b"").expect("ready");
            wait_for_file(&release);
            drop(first);
            std::fs::write(&dropped, b"").expect("dropped");
            wait_for_file(&again);
            let fourth = connect(vip).map(|_| "ok").map_err(|e| errno_name(&e));
            let failed: Vec<_> = (0..5)
                .map(|_| connect(dead).err().map(|e| errno_name(&e)))
                .collect();
            drop(second);
            format!("third={third:?} fourth={fourth:?} failed={failed:?}")
        })
    };
    wait_for_file(&ready);
    for (stat, want) in [
        ("service.web.cx_open", 2),
        ("service.web.cx_overflow", 1),
        ("cluster.web.upstream_cx_overflow", 1),
        ("bpf.connect_cx_overflow", 1),
    ] {
        assert_eq!(daemon.stat(stat), want, "{stat} with two held, one refused");
    }
    std::fs::write(&release, b"").expect("release");
    wait_for_file(&dropped);
    // The close completes in the kernel after close() returns (the host's ACK of the FIN).
    wait_for_stat(&daemon, "service.web.cx_open", 1);
    std::fs::write(&again, b"").expect("again");
    let out = child.wait(Duration::from_secs(30));
    let refused = Some(refused_errno().to_owned());
    let host_refused = Some("ECONNREFUSED".to_owned());
    assert_eq!(
        out,
        format!(
            "third={refused:?} fourth=Ok(\"ok\") failed={:?}",
            vec![host_refused; 5]
        ),
        "\n{}",
        daemon.log_text()
    );
    assert_eq!(
        daemon.stat("service.dead.cx_overflow"),
        0,
        "no failed connect leaked"
    );
    assert_eq!(
        daemon.stat("service.dead.cx_open"),
        0,
        "failed connects taken back"
    );
    assert_eq!(daemon.stat("service.web.cx_overflow"), 1, "one refusal");
    wait_for_stat(&daemon, "service.web.cx_open", 0);
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}

/// `drop_overloads` on the kernel path (issue #42): three direct-mode services, each of one
/// cluster of the same banner backend, whose `load_assignment.policy.drop_overloads` drops
/// 100 / `HUNDRED` (`all`), 0 (`none`) and 5,000 / `TEN_THOUSAND` (`half`) of the connects.
/// From the cgroup every connect to `all` is refused (the errno of every kernel refusal), none
/// to `none`, and of N = 400 connects to `half` each is refused independently with probability
/// 1/2: Hoeffding's inequality gives P(|X - 200| >= 60) <= 2 exp(-2 x 60^2 / 400) = 2 e^-18 <
/// 3.1e-8, so a correct kernel fails this bound less than once in 10^7 runs (below 1e-6). Each
/// refusal is counted: `service.<name>.cx_drop_overload`, Envoy's
/// `cluster.<name>.upstream_rq_drop_overload` and `bpf.connect_drop_overload`.
#[test]
fn drop_overloads_refuse_that_share_of_the_connects() {
    use integration_tests::features::refused_errno;
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let host: SocketAddr = "127.0.0.85:8080".parse().unwrap();
    let _servers = BannerServers::start(&netns, &[(host, "a", false)]);
    let cluster = |name: &str, numerator: u32, denominator: &str| {
        format!(
            "  - name: {name}\n    load_assignment:\n      policy: {{ drop_overloads: [ {{ category: throttle, drop_percentage: {{ numerator: {numerator}, denominator: {denominator} }} }} ] }}\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.85, port_value: 8080 }} }} }}\n"
        )
    };
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n{}{}{}services:\n  - {{ name: all, address: 127.77.0.11, port: 80, cluster: all }}\n  - {{ name: none, address: 127.77.0.12, port: 80, cluster: none }}\n  - {{ name: half, address: 127.77.0.13, port: 80, cluster: half }}\n",
        unique("drop"),
        cgroup.path().display(),
        cluster("all", 100, "HUNDRED"),
        cluster("none", 0, "HUNDRED"),
        cluster("half", 5_000, "TEN_THOUSAND"),
    );
    let mut daemon = Daemon::start(&config);
    let probe =
        |vip: &str, n| Probe::run(&netns, Some(cgroup.path()), vip.parse().unwrap(), n, false);
    let refused = |p: &Probe| p.errors.get(refused_errno()).copied().unwrap_or(0);
    let all = probe("127.77.0.11:80", 50);
    assert_eq!((all.count("a"), refused(&all)), (0, 50), "{all:?}");
    let none = probe("127.77.0.12:80", 50);
    assert_eq!((none.count("a"), none.errors.len()), (50, 0), "{none:?}");
    let half = probe("127.77.0.13:80", 400);
    let dropped = refused(&half);
    assert_eq!(dropped + half.count("a"), 400, "{half:?}");
    assert!(
        dropped.abs_diff(200) < 60,
        "{dropped} of 400 refused at 1/2"
    );
    for (name, want) in [("all", 50), ("none", 0), ("half", dropped)] {
        let stat = format!("cluster.{name}.upstream_rq_drop_overload");
        assert_eq!(daemon.stat(&stat), u64::from(want), "{stat}");
    }
    assert_eq!(daemon.stat("service.all.cx_drop_overload"), 50);
    assert_eq!(
        daemon.stat("service.half.cx_drop_overload"),
        u64::from(dropped)
    );
    assert_eq!(
        daemon.counter("connect_drop_overload"),
        u64::from(50 + dropped)
    );
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}

/// `drop_overloads` from EDS (issue #42): an assignment's policy reaches the kernel with its
/// host, and a change of the policy alone is published. With the share at 0 every connect
/// reaches the host; once the same host comes with 100 %, every connect is refused and counted
/// as a drop (the host is there, so no refusal can be a missing host's); a share above 1 is
/// NACKed with Envoy's text and the last good policy stays; back at 0 every connect passes.
#[test]
fn an_eds_drop_overload_and_a_change_of_it_alone_reach_the_kernel() {
    use integration_tests::features::refused_errno;
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let a = "127.0.0.86:8086";
    let _servers = BannerServers::start(&netns, &[(a.parse().unwrap(), a, false)]);
    let server = XdsServer::start();
    let drop = |n: u32| json!({"drop_overloads": [{"category": "lb", "drop_percentage": {"numerator": n}}]});
    let host = || endpoints(&[a.to_owned()]);
    server.push_with_policy("web", "1", host(), drop(0));
    let node = unique("node");
    let mut daemon = Daemon::start(&config("", &unique("t"), &cgroup, &node, &server));
    wait_for_backends(&netns, &cgroup, &[a]);

    server.push_with_policy("web", "2", host(), drop(100));
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let refused = |n| {
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, n, false);
        probe.errors.get(refused_errno()).copied().unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = 0;
    while seen == 0 {
        assert!(
            Instant::now() < deadline,
            "version 2 never dropped a connect"
        );
        seen += refused(1);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(refused(20), 20, "everything dropped at 100 %");
    seen += 20;
    let before = server.requests().len();
    server.push_with_policy("web", "3", host(), drop(101));
    let nack = server.wait_request("the daemon's NACK", before, |r| {
        r["node"] == node.as_str() && !r["error_detail"].is_null()
    });
    let detail = nack["error_detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("Cluster drop_overloads config is invalid. drop_ratio=1.01(Numerator 101 / Denominator 100). The valid range is 0~1."),
        "{nack}"
    );
    assert_eq!(refused(20), 20, "the last good policy stays");
    seen += 20;
    for stat in [
        "service.web.cx_drop_overload",
        "cluster.web.upstream_rq_drop_overload",
        "bpf.connect_drop_overload",
    ] {
        assert_eq!(daemon.stat(stat), u64::from(seen), "{stat}");
    }
    server.push_with_policy("web", "4", host(), drop(0));
    wait_for_backends(&netns, &cgroup, &[a]);
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}
