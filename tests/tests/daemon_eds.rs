//! EDS through the daemon and the kernel (root): a real xDS v3 control plane (the Python server)
//! pushes endpoints; connects from a fresh cgroup and namespace follow each good version, a host
//! on port 0 is ACKed (as by Envoy) but never routed, and an invalid version is NACKed by the
//! daemon while connects stay on the last good hosts.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{BannerServers, Daemon, Netns, Probe, TestCgroup, require_root, unique},
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
