//! Fault injection (root), each case printing what was kept and what was lost.
//!
//! - The daemon killed (`kill -9`) at random points while it publishes (and, after the first
//!   round, republishes with every host moved) thousands of services:
//!   after every kill the pinned maps hold only whole services (each service entry's live
//!   generation has its slot tables, every slot names a backend that exists), and the next
//!   start adopts them and publishes the rest.
//! - The xDS server's streams dropped: the last accepted hosts keep serving, the daemon
//!   resubscribes with the version it had, and the next version applies.
//! - The link to a backend's namespace cut and restored: health checks take the host out (the
//!   connects lost before that are counted), none fail after it, and the host comes back.
//! - The Consul agent killed and started again: failed queries are counted, the last hosts keep
//!   serving (0 failed connects), `/ready` stays 200, and the catalog as registered after the
//!   restart reaches the kernel.
//!
//! Other faults have their cases beside the feature they test (docs/failure-behaviour.md):
//! a killed backend (daemon_health.rs, envoy_side_by_side.rs), a DNS server down and back
//! (envoy_side_by_side.rs), the daemon killed under a connect loop (kernel_restart.rs), Consul
//! answers it must skip (daemon_consul.rs).
#![allow(unsafe_code, reason = "kill(2) of the daemon by its PID")]

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{
        BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, TempDir, TestCgroup, free_port,
        proxy_bin, require_root, skip_without_dataplane, tcp_loop, unique,
    },
    xds_server::XdsServer,
};
use serde_json::{Value, json};

/// Services in the publish case: enough that a publish takes a while, each with two hosts (so
/// each has a slot table and backends, not the one-host shortcut).
const SERVICES: usize = 2_000;

/// `round` moves every host's port, so each run republishes every service (a new generation).
fn many_services(instance: &str, cgroup: &TestCgroup, admin: SocketAddr, round: usize) -> String {
    use std::fmt::Write as _;
    let mut yaml = format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{admin}\"\nclusters:\n",
        cgroup.path().display()
    );
    let host = |i: usize, k: usize| {
        format!(
            "{{ endpoint: {{ address: {{ socket_address: {{ address: 127.1.{}.{}, port_value: {} }} }} }} }}",
            i / 250,
            i % 250 + 1,
            9000 + k + 10 * round
        )
    };
    for i in 0..SERVICES {
        let _ = writeln!(
            yaml,
            "  - {{ name: c{i}, load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {}, {} ] }} ] }} }}",
            host(i, 0),
            host(i, 1)
        );
    }
    yaml.push_str("services:\n");
    for i in 0..SERVICES {
        let _ = writeln!(
            yaml,
            "  - {{ name: s{i}, address: 127.78.{}.{}, port: 80, cluster: c{i} }}",
            i / 250,
            i % 250 + 1
        );
    }
    yaml
}

/// `proxy dataplane show --json` of an instance.
fn show(instance: &str) -> Value {
    let out = Command::new(proxy_bin())
        .args(["dataplane", "show", "--instance", instance, "--json"])
        .output()
        .expect("running proxy dataplane show");
    assert!(
        out.status.success(),
        "dataplane show: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("dataplane show JSON")
}

/// Checks that every service in the kernel is whole: its live generation's table is there,
/// names only existing backends, two hosts each, both of one version. Returns how many services there are.
fn whole_services(snapshot: &Value) -> usize {
    let services = snapshot["services"].as_array().expect("services");
    for svc in services {
        let levels = svc["priorities"].as_array().expect("priorities");
        let hosts: Vec<&Value> = levels
            .iter()
            .flat_map(|l| l.as_array().expect("a level"))
            .collect();
        assert_eq!(
            hosts.len(),
            2,
            "a half-written service (its table or a backend is missing): {svc}"
        );
        let mut rounds = Vec::new();
        for host in hosts {
            let addr = host["address"].as_str().expect("address");
            assert!(!addr.contains("missing"), "a slot names no backend: {svc}");
            let port: u16 = addr.rsplit_once(':').expect("ip:port").1.parse().unwrap();
            rounds.push((port - 9000) / 10);
        }
        assert!(
            rounds.windows(2).all(|w| w[0] == w[1]),
            "one table mixes two versions of the host set: {svc}"
        );
    }
    services.len()
}

/// A small deterministic generator for the kill points (no dependency for one sequence).
struct Points(u64);

impl Points {
    fn next_ms(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }
}

#[test]
fn kill9_during_a_publish_never_leaves_a_half_written_service() {
    require_root();
    if skip_without_dataplane("kill9_during_a_publish_never_leaves_a_half_written_service") {
        return;
    }
    let cgroup = TestCgroup::new();
    let instance = unique("fk");
    let _pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let dir = TempDir::new();
    let config = dir.0.join("config.yaml");
    let seed = std::process::id().into();
    println!("kill points seeded with {seed}");
    let mut points = Points(seed);
    for round in 0..6 {
        std::fs::write(
            &config,
            many_services(&instance, &cgroup, free_port(), round),
        )
        .unwrap();
        let mut child = Command::new(proxy_bin())
            .args(["run", "--config"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the daemon");
        // Attaching takes a moment; the publish follows it. Kill points spread over both.
        let at = Duration::from_millis(200 + points.next_ms(1_500));
        std::thread::sleep(at);
        let _ = child.kill();
        let _ = child.wait();
        let link = PathBuf::from("/sys/fs/bpf")
            .join(&instance)
            .join(proxy_common::abi::pins::LINK_CONNECT4);
        if !link.exists() {
            println!("round {round}: killed after {at:?}, before the data path was attached");
            continue;
        }
        let whole = whole_services(&show(&instance));
        println!(
            "round {round}: killed after {at:?}; {whole} of {SERVICES} services in the kernel, every one whole"
        );
    }
    // The next start adopts what is there and publishes the rest.
    let admin = free_port();
    std::fs::write(&config, many_services(&instance, &cgroup, admin, 6)).unwrap();
    let mut daemon = Command::new(proxy_bin())
        .args(["run", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting the daemon");
    let deadline = Instant::now() + Duration::from_secs(60);
    let ready = loop {
        if integration_tests::kernel::http_get(admin, "/ready").is_some_and(|(code, _)| code == 200)
        {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let whole = ready.then(|| whole_services(&show(&instance)));
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe { libc::kill(daemon.id().cast_signed(), libc::SIGTERM) };
    let _ = daemon.wait();
    let _ = Command::new(proxy_bin())
        .args(["uninstall", "--config"])
        .arg(&config)
        .status();
    assert!(ready, "the restarted daemon never became ready");
    assert_eq!(whole, Some(SERVICES), "the restart published every service");
}

/// The EDS endpoints of the xDS case.
fn endpoints(hosts: &[&str]) -> Value {
    let list: Vec<Value> = hosts
        .iter()
        .map(|h| {
            let a: SocketAddr = h.parse().unwrap();
            json!({"address": a.ip().to_string(), "port": a.port(), "health": "HEALTHY"})
        })
        .collect();
    Value::Array(list)
}

#[test]
fn xds_streams_dropped_keep_the_hosts_and_resume_the_version() {
    require_root();
    if skip_without_dataplane("xds_streams_dropped_keep_the_hosts_and_resume_the_version") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.51:8051", "127.0.0.52:8052");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
        ],
    );
    let server = XdsServer::start();
    server.push("web", "1", endpoints(&[a]));
    let node = unique("node");
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {node}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\nclusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: {{ eds_config: {{ ads: {{}} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("fx"),
        cgroup.path().display(),
        server.grpc_addr(),
    );
    let daemon = Daemon::start(&config);
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10_000_000, Duration::from_secs(4))).unwrap()
    });
    std::thread::sleep(Duration::from_millis(500));
    let before = server.requests().len();
    server.drop_streams();
    // The daemon comes back on a new stream, saying which version it has.
    let resubscribed = server.wait_request("the resubscription", before, |r| {
        r["node"] == node.as_str() && r["version_info"] == "1"
    });
    assert!(resubscribed["error_detail"].is_null(), "{resubscribed}");
    let report = LoopReport::parse(&client.wait(Duration::from_secs(30)));
    println!(
        "streams dropped under a connect loop: {} connects kept on the last hosts, {} failed",
        report.ok(),
        report.failed()
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    assert_eq!(report.banners.keys().collect::<Vec<_>>(), [a]);
    // The next version applies on the new stream.
    server.push("web", "2", endpoints(&[b]));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&tcp_loop(vip, 5, Duration::from_secs(2))).unwrap()
        });
        let seen = LoopReport::parse(&c.wait(Duration::from_secs(10)));
        if seen.banners.get(b) == Some(&5) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "version 2 never applied: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(daemon.stat("cluster.web.update_rejected"), 0);
}

/// Runs `ip` with `args`, asserting success.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Connects from the cgroup in `netns` for `within`: what answered and what failed.
fn connect_for(
    netns: &Netns,
    cgroup: &TestCgroup,
    vip: SocketAddr,
    within: Duration,
) -> LoopReport {
    let c = InCgroup::spawn(Some(cgroup.path()), netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10_000_000, within)).unwrap()
    });
    LoopReport::parse(&c.wait(within + Duration::from_secs(30)))
}

/// A veth pair from `near` (10.77.0.1/24) to `far` (10.77.0.2/24), both ends up; returns the
/// name of the near end. Deleting either namespace removes it.
fn veth_pair(near: &Netns, far: &Netns) -> String {
    let veth = format!("v{}", std::process::id() % 100_000);
    let peer = format!("{veth}p");
    ip(&[
        "-n",
        near.name(),
        "link",
        "add",
        &veth,
        "type",
        "veth",
        "peer",
        "name",
        &peer,
        "netns",
        far.name(),
    ]);
    ip(&[
        "-n",
        near.name(),
        "addr",
        "add",
        "10.77.0.1/24",
        "dev",
        &veth,
    ]);
    ip(&[
        "-n",
        far.name(),
        "addr",
        "add",
        "10.77.0.2/24",
        "dev",
        &peer,
    ]);
    ip(&["-n", near.name(), "link", "set", &veth, "up"]);
    ip(&["-n", far.name(), "link", "set", &peer, "up"]);
    veth
}

#[test]
fn a_cut_link_takes_its_host_out_and_a_restored_one_brings_it_back() {
    require_root();
    if skip_without_dataplane("a_cut_link_takes_its_host_out_and_a_restored_one_brings_it_back") {
        return;
    }
    // The daemon and the client in `near`, one backend on its loopback and one in `far`,
    // behind a veth pair.
    let (near, far, cgroup) = (Netns::new(), Netns::new(), TestCgroup::new());
    let veth = veth_pair(&near, &far);
    let (local, remote) = ("127.0.0.61:8061", "10.77.0.2:8062");
    let _local = BannerServers::start(&near, &[(local.parse().unwrap(), local, false)]);
    let _remote = BannerServers::start(&far, &[(remote.parse().unwrap(), remote, false)]);
    let check = "health_checks: [ { timeout: 0.5s, interval: 0.5s, no_traffic_interval: 0.5s, unhealthy_threshold: 2, healthy_threshold: 1, tcp_health_check: {} } ]";
    let endpoint = |h: &str| {
        let a: SocketAddr = h.parse().unwrap();
        format!(
            "{{ endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }} }}",
            a.ip(),
            a.port()
        )
    };
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - {{ name: web, {check}, load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {}, {} ] }} ] }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("fl"),
        cgroup.path().display(),
        endpoint(local),
        endpoint(remote),
    );
    let daemon = Daemon::start_in(&near, &config);
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let both = connect_for(&near, &cgroup, vip, Duration::from_secs(1));
    assert_eq!(both.failed(), 0, "{both:?}");
    assert!(both.banners.contains_key(remote), "{both:?}");

    // Cut: connects to the far host fail until two checks have failed.
    ip(&["-n", near.name(), "link", "set", &veth, "down"]);
    let cut = connect_for(&near, &cgroup, vip, Duration::from_secs(3));
    let after = connect_for(&near, &cgroup, vip, Duration::from_secs(2));
    println!(
        "link cut: {} connects failed while the checks found it ({:?}), then {} of {} to the near host, {} failed",
        cut.failed(),
        cut.errors,
        after.banners.get(local).copied().unwrap_or(0),
        after.ok(),
        after.failed()
    );
    assert_eq!(
        after.failed(),
        0,
        "connects still fail after detection: {after:?}"
    );
    assert_eq!(
        after.banners.keys().collect::<Vec<_>>(),
        [local],
        "{after:?}"
    );
    assert!(daemon.stat("cluster.web.health_check.failure") >= 2);

    // Restored: the far host passes a check and is routed again.
    ip(&["-n", near.name(), "link", "set", &veth, "up"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = connect_for(&near, &cgroup, vip, Duration::from_millis(500));
        if seen.banners.contains_key(remote) {
            assert_eq!(seen.failed(), 0, "{seen:?}");
            println!("link restored: the far host answers again");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the far host never came back: {seen:?}"
        );
    }
}

/// The Consul agent killed under a connect loop and started again, its catalog then set with
/// one host changed: while it is down the
/// daemon counts failed queries and keeps the last hosts, so no connect fails; once it is back
/// the change in the catalog reaches the kernel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_down_keeps_the_hosts_and_back_applies_the_catalog() {
    use integration_tests::consul::{Consul, service};
    require_root();
    if skip_without_dataplane("consul_down_keeps_the_hosts_and_back_applies_the_catalog") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b, c) = ("127.0.0.54:8080", "127.0.0.55:8080", "127.0.0.56:8080");
    let _servers = BannerServers::start(&netns, &[a, b, c].map(|h| (h.parse().unwrap(), h, false)));
    let mut consul = Consul::start("dc1").await;
    consul
        .register(service("web-1", "web", "127.0.0.54", 8080))
        .await;
    consul
        .register(service("web-2", "web", "127.0.0.55", 8080))
        .await;
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    cluster_type:\n      name: proxy.clusters.consul\n      typed_config: {{ address: \"{}\", service: web, datacenter: dc1, wait: 1s }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("t"),
        cgroup.path().display(),
        consul.http_addr(),
    );
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let within = Duration::from_secs(20);
    let mut daemon = tokio::task::block_in_place(|| Daemon::start(&config));
    tokio::task::block_in_place(|| {
        integration_tests::kernel::wait_for_backends(&netns, &cgroup, vip, &[a, b], within);
    });
    let looping = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10_000_000, Duration::from_secs(8))).unwrap()
    });

    consul.kill();
    let failures = |d: &Daemon| d.stat("cluster.web.update_failure");
    let before = tokio::task::block_in_place(|| failures(&daemon));
    let deadline = Instant::now() + within;
    while tokio::task::block_in_place(|| failures(&daemon)) < before + 2 {
        assert!(
            Instant::now() < deadline,
            "no failed query with the agent down"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ready, _) = tokio::task::block_in_place(|| daemon.get("/ready")).expect("admin");
    assert_eq!(
        ready, 200,
        "discovery failures keep the daemon ready, as in Envoy"
    );
    let down = tokio::task::block_in_place(|| {
        integration_tests::kernel::Probe::run(&netns, Some(cgroup.path()), vip, 40, false)
    });
    let kept: Vec<&str> = down.backends.keys().map(String::as_str).collect();
    assert!(
        down.errors.is_empty() && kept == [a, b],
        "hosts kept while down: {down:?}"
    );

    consul.restart().await;
    // What a restarted dev agent restores of its registrations (and of their TTL checks' state)
    // is its business: the catalog is set afresh, host a under a new ID, b gone, c new.
    consul.deregister("web-1").await;
    consul.deregister("web-2").await;
    consul
        .register(service("web-4", "web", "127.0.0.54", 8080))
        .await;
    consul
        .register(service("web-3", "web", "127.0.0.56", 8080))
        .await;
    tokio::task::block_in_place(|| {
        integration_tests::kernel::wait_for_backends(&netns, &cgroup, vip, &[a, c], within);
    });
    let report =
        tokio::task::block_in_place(|| LoopReport::parse(&looping.wait(Duration::from_secs(60))));
    let failed_queries = tokio::task::block_in_place(|| failures(&daemon)) - before;
    println!(
        "consul down and back: {} connects, {} failed ({:?}); {failed_queries} failed queries; while down the hosts stayed {:?}",
        report.ok(),
        report.failed(),
        report.banners,
        kept
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    assert!(tokio::task::block_in_place(|| daemon.stop()), "clean stop");
}
