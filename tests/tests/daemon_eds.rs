//! EDS through the daemon and the kernel (root): a real xDS v3 control plane (the Python server)
//! pushes endpoints; connects from a fresh cgroup and namespace follow each good version, a host
//! on port 0 is ACKed (as by Envoy) but never routed, and an invalid version is NACKed by the
//! daemon while connects stay on the last good hosts. CDS and LDS pushes make and withdraw a
//! kernel-path service, and an HTTP listener's routes a proxy-path service.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    http_servers::{Servers, get_in_cgroup, http_server},
    kernel::{
        BannerServers, Daemon, InCgroup, LoopReport, Netns, Probe, TestCgroup, require_root,
        tcp_loop, unique,
    },
    xds_server::XdsServer,
};
use serde_json::{Value, json};

fn endpoints(addrs: &[&str]) -> Value {
    Value::Array(
        addrs
            .iter()
            .map(|a| {
                let a: SocketAddr = a.parse().unwrap();
                json!({"address": a.ip().to_string(), "port": a.port(), "health": "HEALTHY", "weight": 1})
            })
            .collect(),
    )
}

/// Probes until only `want` banners answer, within 15 s.
fn wait_for_backends(netns: &Netns, cgroup: &TestCgroup, want: &[&str]) -> Probe {
    wait_for_backends_at(netns, cgroup, "127.77.0.1:80".parse().unwrap(), want)
}

/// Probes `vip` until only `want` banners answer (none: every connect fails), within 15 s.
fn wait_for_backends_at(
    netns: &Netns,
    cgroup: &TestCgroup,
    vip: SocketAddr,
    want: &[&str],
) -> Probe {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let probe = Probe::run(netns, Some(cgroup.path()), vip, 40, false);
        let seen: Vec<&str> = probe.backends.keys().map(String::as_str).collect();
        // Hosts wanted: every connect answered; none: every connect refused.
        let all_answered = probe.errors.is_empty();
        if all_answered != want.is_empty() && seen == want {
            return probe;
        }
        assert!(
            Instant::now() < deadline,
            "connects never reached only {want:?}: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn eds_versions_drive_the_kernel_and_a_bad_one_is_nacked() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b, c) = ("127.0.0.31:8081", "127.0.0.32:8082", "127.0.0.33:8083");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
            (c.parse().unwrap(), c, false),
        ],
    );
    let server = XdsServer::start();
    server.push("web", "1", endpoints(&[a, b]));
    let node = unique("node");
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {node}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\nclusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: {{ eds_config: {{ ads: {{}} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("t"),
        cgroup.path().display(),
        server.grpc_addr(),
    );
    let daemon = Daemon::start(&config);
    wait_for_backends(&netns, &cgroup, &[a, b]);

    server.push("web", "2", endpoints(&[c]));
    wait_for_backends(&netns, &cgroup, &[c]);

    // Port 0 is ACKed, as by Envoy; the host is left out of routing and counted.
    let before = server.requests().len();
    server.push("web", "3", endpoints(&[c, "127.0.0.34:0"]));
    let ack = server.wait_request("the daemon's ACK of port 0", before, |r| {
        r["node"] == node.as_str() && !r["response_nonce"].as_str().unwrap_or("").is_empty()
    });
    assert!(ack["error_detail"].is_null(), "{ack}");
    assert_eq!(ack["version_info"], "3", "{ack}");
    wait_for_backends(&netns, &cgroup, &[c]);

    let before = server.requests().len();
    server.push("web", "4", json!([{"address": "not-an-ip", "port": 8084}]));
    let nack = server.wait_request("the daemon's NACK", before, |r| {
        r["node"] == node.as_str() && !r["error_detail"].is_null()
    });
    assert!(
        nack["error_detail"]
            .to_string()
            .contains("malformed IP address: not-an-ip"),
        "{nack}"
    );
    let probe = wait_for_backends(&netns, &cgroup, &[c]);
    assert_eq!(probe.count(c), 40, "the last good version stays live");

    let (code, stats) = integration_tests::kernel::http_get(daemon.admin, "/stats").unwrap();
    assert_eq!(code, 200);
    assert!(stats.contains("cluster.web.update_rejected: 1"), "{stats}");
    assert!(stats.contains("cluster.web.hosts_refused: 1"), "{stats}");
}

/// The daemon's configuration: EDS cluster `web` (and `api` when `with_api`) over one ADS
/// stream of `api_type`, each behind a service.
fn reload_config(
    instance: &str,
    cgroup: &TestCgroup,
    node: &str,
    server: &XdsServer,
    api_type: &str,
    with_api: bool,
) -> String {
    let (api_cluster, api_service) = if with_api {
        (
            "  - name: api\n    type: EDS\n    eds_cluster_config: { eds_config: { ads: {} } }\n",
            "  - { name: api, address: 127.77.0.2, port: 80, cluster: api }\n",
        )
    } else {
        ("", "")
    };
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {node}, cluster: edge }}\n  ads_config: {{ api_type: {api_type}, server_uri: \"{}\" }}\nclusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: {{ eds_config: {{ ads: {{}} }} }}\n{api_cluster}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n{api_service}",
        cgroup.path().display(),
        server.grpc_addr(),
    )
}

/// Sends SIGHUP with `config` in the file and waits for the `n`-th "configuration reloaded".
fn reload(daemon: &Daemon, config: &str, n: usize) -> String {
    let admin = daemon.admin.to_string();
    std::fs::write(&daemon.config, config.replace("{admin}", &admin)).unwrap();
    daemon.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = daemon.log_text();
        if let Some(line) = log
            .lines()
            .filter(|l| l.contains("configuration reloaded"))
            .nth(n - 1)
        {
            return line.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "no reload {n} in the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A reload that adds an EDS cluster and one that removes it change the subscription on the
/// running ADS stream (state of the world and delta): the daemon opens no second stream, the
/// untouched cluster's service loses no connect, the added cluster gets its hosts, and the
/// removed one is unsubscribed.
#[rstest::rstest]
#[case::sotw("GRPC")]
#[case::delta("DELTA_GRPC")]
fn reload_changes_eds_clusters_on_the_running_stream(#[case] api_type: &str) {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.35:8085", "127.0.0.36:8086");
    let _servers = BannerServers::start(
        &netns,
        &[
            (a.parse().unwrap(), a, false),
            (b.parse().unwrap(), b, false),
        ],
    );
    let server = XdsServer::start();
    server.push("web", "1", endpoints(&[a]));
    server.push("api", "1", endpoints(&[b]));
    let (node, instance) = (unique("node"), unique("t"));
    let config = |with_api| reload_config(&instance, &cgroup, &node, &server, api_type, with_api);
    let mut daemon = Daemon::start(&config(false));
    wait_for_backends(&netns, &cgroup, &[a]);
    let web: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let looping = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(web, 10_000_000, Duration::from_secs(6))).unwrap()
    });
    std::thread::sleep(Duration::from_secs(1));

    let added = reload(&daemon, &config(true), 1);
    assert!(added.contains("1 cluster(s) subscribed"), "{added}");
    let api: SocketAddr = "127.77.0.2:80".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Probe::run(&netns, Some(cgroup.path()), api, 5, false).count(b) != 5 {
        assert!(
            Instant::now() < deadline,
            "the added cluster never got its host"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let removed = reload(&daemon, &config(false), 2);
    assert!(removed.contains("1 unsubscribed"), "{removed}");

    let report = LoopReport::parse(&looping.wait(Duration::from_secs(60)));
    let ours: Vec<Value> = server
        .requests()
        .into_iter()
        .filter(|r| r["node"] == node.as_str())
        .collect();
    let streams: std::collections::BTreeSet<u64> =
        ours.iter().filter_map(|r| r["stream"].as_u64()).collect();
    println!(
        "{api_type}: {} connects to the untouched cluster's service across two reloads, {} failed; {} requests on {} stream(s)",
        report.ok(),
        report.failed(),
        ours.len(),
        streams.len()
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    assert_eq!(streams.len(), 1, "one stream throughout: {ours:?}");
    let last = ours.last().expect("requests");
    if api_type == "DELTA_GRPC" {
        assert!(
            ours.iter().any(|r| r["subscribe"] == json!(["api"])),
            "{ours:?}"
        );
        assert!(
            ours.iter().any(|r| r["unsubscribe"] == json!(["api"])),
            "{ours:?}"
        );
    } else {
        assert_eq!(last["resource_names"], json!(["web"]), "{ours:?}");
        assert!(
            ours.iter()
                .any(|r| r["resource_names"] == json!(["api", "web"])),
            "{ours:?}"
        );
    }
    let (_, clusters) = integration_tests::kernel::http_get(daemon.admin, "/clusters").unwrap();
    assert!(!clusters.contains("api::"), "{clusters}");
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}

/// CDS and LDS drive the kernel: a pushed EDS cluster (its endpoints on the same ADS stream)
/// and a `tcp_proxy` listener become a service whose connects reach the cluster's host, and a
/// listener push without it withdraws the service (connects to its address are no longer
/// rewritten).
#[test]
fn cds_and_lds_pushes_make_and_withdraw_a_kernel_service() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let a = "127.0.0.37:8087";
    let _servers = BannerServers::start(&netns, &[(a.parse().unwrap(), a, false)]);
    let server = XdsServer::start();
    server.push("dyn-eds", "1", endpoints(&[a]));
    let cluster = json!({"name": "dyn", "type": "EDS", "lb_policy": "RANDOM",
        "eds_cluster_config": {"service_name": "dyn-eds", "eds_config": {"ads": {}}}});
    server.push_resources("cluster", "1", json!([cluster]));
    let listener = json!({"name": "dyn",
        "address": {"socket_address": {"address": "127.77.0.3", "port_value": 80}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": "dyn", "cluster": "dyn"}}]}]});
    server.push_resources("listener", "1", json!([listener]));
    let node = unique("node");
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {node}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\n  cds_config: {{ ads: {{}} }}\n  lds_config: {{ ads: {{}} }}\n",
        unique("t"),
        cgroup.path().display(),
        server.grpc_addr(),
    );
    let mut daemon = Daemon::start(&config);
    let vip: SocketAddr = "127.77.0.3:80".parse().unwrap();
    wait_for_backends_at(&netns, &cgroup, vip, &[a]);

    server.push_resources("listener", "2", json!([]));
    wait_for_backends_at(&netns, &cgroup, vip, &[]);
    let ours: Vec<Value> = server
        .requests()
        .into_iter()
        .filter(|r| r["node"] == node.as_str())
        .collect();
    let streams: std::collections::BTreeSet<u64> =
        ours.iter().filter_map(|r| r["stream"].as_u64()).collect();
    assert_eq!(streams.len(), 1, "CDS, LDS and EDS on one stream: {ours:?}");
    assert!(ours.iter().all(|r| r["error_detail"].is_null()), "{ours:?}");
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}

/// Runs `f` on a thread inside `netns`: the xDS server started there, and its control port,
/// live next to the daemon (a namespace is per thread, and a child inherits its thread's).
fn in_netns<T: Send>(netns: &Netns, f: impl FnOnce() -> T + Send) -> T {
    let path = netns.path();
    std::thread::scope(|s| {
        s.spawn(move || {
            proxy::enter_netns(&path).expect("entering the test namespace");
            f()
        })
        .join()
        .expect("the namespace thread")
    })
}

/// An LDS listener with an HTTP connection manager, routes `/b` -> `first_b` (then `/` -> a).
fn http_listener(b_prefix: &str) -> Value {
    json!({"name": "hweb",
        "address": {"socket_address": {"address": "127.77.0.1", "port_value": 80}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "hweb",
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            "route_config": route_config("local", b_prefix)}}]}]})
}

/// A route table sending `b_prefix` to cluster hb and the rest to ha.
fn route_config(name: &str, b_prefix: &str) -> Value {
    json!({"name": name, "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
        {"match": {"prefix": b_prefix}, "route": {"cluster": "hb"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "ha"}}]}]})
}

/// [`http_listener`] with its routes by RDS over ADS as `route`.
fn rds_listener(route: &str) -> Value {
    let mut listener = http_listener("/");
    let hcm = &mut listener["filter_chains"][0]["filters"][0]["typed_config"];
    hcm["rds"] = json!({"config_source": {"ads": {}, "resource_api_version": "V3"}, "route_config_name": route});
    if let Some(fields) = hcm.as_object_mut() {
        fields.remove("route_config");
    }
    listener
}

/// GETs `paths` through the VIP until the bodies are `want` (15 s at most; else the daemon's log
/// says why).
fn wait_for_bodies(
    (daemon, netns): (&Daemon, &Netns),
    cgroup: &TestCgroup,
    paths: &[&str],
    want: &[&str],
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let bodies = get_in_cgroup("127.77.0.1:80".parse().unwrap(), netns, cgroup, paths);
        if bodies == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{paths:?} never answered {want:?}: {bodies:?}\n{}\n{:?}",
            daemon.log_text(),
            daemon.get("/config_dump")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// CDS and LDS make an HTTP service on the proxy path: an HTTP connection manager's inline
/// routes send two paths to two clusters, a listener change moves a path to the other
/// cluster, the listener's routes then come by RDS and an RDS push moves the path back, and a
/// push without the listener withdraws the service.
#[test]
fn an_lds_http_listener_routes_paths_to_clusters_on_the_proxy_path() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b): (SocketAddr, SocketAddr) = (
        "127.0.0.41:8081".parse().unwrap(),
        "127.0.0.42:8082".parse().unwrap(),
    );
    let _servers = Servers::start(&netns, &[(a, "a"), (b, "b")], http_server);
    let server = in_netns(&netns, XdsServer::start);
    let cluster = |name: &str, at: SocketAddr| {
        json!({"name": name, "type": "STATIC", "lb_policy": "RANDOM", "load_assignment": {
            "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": at.ip().to_string(), "port_value": at.port()}}}}]}]}})
    };
    in_netns(&netns, || {
        server.push_resources("cluster", "1", json!([cluster("ha", a), cluster("hb", b)]));
        server.push_resources("listener", "1", json!([http_listener("/b")]));
    });
    let node = unique("node");
    // Nothing in the file uses the proxy path: LDS declares it (and sockops), so the HTTP
    // listener that comes later is served without a restart.
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {node}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\n  cds_config: {{ ads: {{}} }}\n  lds_config: {{ ads: {{}} }}\n",
        unique("t"),
        cgroup.path().display(),
        server.grpc_addr(),
    );
    let mut daemon = Daemon::start_in(&netns, &config);
    let paths = ["/b/1", "/c/1", "/"];
    wait_for_bodies(
        (&daemon, &netns),
        &cgroup,
        &paths,
        &["b /b/1", "a /c/1", "a /"],
    );
    in_netns(&netns, || {
        server.push_resources("listener", "2", json!([http_listener("/c")]));
    });
    wait_for_bodies(
        (&daemon, &netns),
        &cgroup,
        &paths,
        &["a /b/1", "b /c/1", "a /"],
    );
    in_netns(&netns, || {
        server.push_resources("route", "1", json!([route_config("r1", "/b")]));
        server.push_resources("listener", "3", json!([rds_listener("r1")]));
    });
    let b_to_hb = ["b /b/1", "a /c/1", "a /"];
    wait_for_bodies((&daemon, &netns), &cgroup, &paths, &b_to_hb);
    in_netns(&netns, || {
        server.push_resources("route", "2", json!([route_config("r1", "/c")]));
    });
    let c_to_hb = ["a /b/1", "b /c/1", "a /"];
    wait_for_bodies((&daemon, &netns), &cgroup, &paths, &c_to_hb);
    in_netns(&netns, || server.push_resources("listener", "4", json!([])));
    let refused = "error: Connection refused (os error 111)";
    wait_for_bodies((&daemon, &netns), &cgroup, &paths[..1], &[refused]);
    let ours: Vec<Value> = in_netns(&netns, || server.requests())
        .into_iter()
        .filter(|r| r["node"] == node.as_str())
        .collect();
    assert!(ours.iter().all(|r| r["error_detail"].is_null()), "{ours:?}");
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}
