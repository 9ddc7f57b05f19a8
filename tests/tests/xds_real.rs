//! EDS against a real xDS v3 control plane (Python grpcio + xds-protos): SotW and delta over ADS
//! and EDS, and REST-JSON; ACK/NACK as the server records them; reconnects; and a cross-check
//! of hosts and health against a real Envoy 1.40 subscribed to the same server.

use std::{collections::BTreeSet, time::Duration};

use integration_tests::xds_server::{Envoy, WAIT, XdsServer};
use proxy_core::discovery::{
    EdsHealth, SourceUpdate as EdsUpdate,
    xds::{EdsClient, EdsWatch, GrpcApi, NodeConfig, Transport, XdsSource, spawn_eds},
};
use serde_json::{Value, json};
use tokio::sync::watch;

fn source(transport: Transport, node: &str) -> XdsSource {
    XdsSource {
        transport,
        node: NodeConfig {
            id: node.into(),
            cluster: "edge".into(),
        },
        initial_fetch_timeout: Duration::from_secs(5),
        backoff: (Duration::from_millis(50), Duration::from_millis(200)),
    }
}

fn client(source: XdsSource) -> EdsClient {
    spawn_eds(
        source,
        vec![EdsWatch {
            cluster: "web".into(),
            resource: "web".into(),
        }],
    )
    .expect("valid watch")
}

fn endpoints(ports: &[u32]) -> Value {
    let list: Vec<Value> = ports
        .iter()
        .map(|&port| {
            json!({"address": "127.0.0.1", "port": port, "health": "HEALTHY", "weight": 2,
                   "region": "eu", "zone": "eu-1", "lb": {"version": "v1"}})
        })
        .collect();
    Value::Array(list)
}

fn ports(update: &EdsUpdate) -> Vec<u16> {
    update.hosts.iter().map(|h| h.addr.port()).collect()
}

async fn wait_hosts(rx: &mut watch::Receiver<EdsUpdate>, expected: &[u16]) -> EdsUpdate {
    let result = tokio::time::timeout(WAIT, rx.wait_for(|u| ports(u) == expected))
        .await
        .map(|r| r.map(|update| update.clone()));
    match result {
        Ok(Ok(update)) => update,
        _ => panic!(
            "hosts never became {expected:?}; last: {:?}",
            ports(&rx.borrow())
        ),
    }
}

fn is_ours(request: &Value) -> bool {
    request["node"] == "ours"
}

/// One full sequence: good v1 ACK, bad v2 NACK with hosts kept, good v3 ACK, stream drop and
/// resume. Delta checks nonces (delta ACKs carry no version); SotW checks versions too.
async fn grpc_sequence(api: GrpcApi, delta: bool) {
    let server = tokio::task::block_in_place(XdsServer::start);
    server.push("web", "1", endpoints(&[8001, 8002]));
    let client = client(source(
        Transport::Grpc {
            uri: server.grpc_uri(),
            api,
            delta,
        },
        "ours",
    ));
    let mut updates = client.updates("web").unwrap();
    let v1 = wait_hosts(&mut updates, &[8001, 8002]).await;
    let host = &v1.hosts[0];
    assert_eq!((host.weight, host.eds_health), (2, EdsHealth::Healthy));
    assert_eq!(
        host.metadata.get("locality.zone").map(String::as_str),
        Some("eu-1")
    );
    assert_eq!(host.metadata.get("version").map(String::as_str), Some("v1"));
    let acked = |server: &XdsServer, version: &str| {
        tokio::task::block_in_place(|| {
            server.wait_request(&format!("ACK of {version}"), 0, |r| {
                is_ours(r)
                    && !r["response_nonce"].as_str().unwrap_or("").is_empty()
                    && r["error_detail"].is_null()
                    && (delta || r["version_info"] == version)
            })
        })
    };
    acked(&server, "1");
    let before = tokio::task::block_in_place(|| server.requests().len());

    server.push("web", "2", endpoints(&[0]));
    let nack = tokio::task::block_in_place(|| {
        server.wait_request("NACK of v2", before, |r| {
            is_ours(r) && !r["error_detail"].is_null()
        })
    });
    let message = nack["error_detail"].as_str().unwrap();
    assert!(message.contains("port 0 is out of range"), "{message}");
    if !delta {
        assert_eq!(
            nack["version_info"], "1",
            "a SotW NACK carries the last good version"
        );
    }
    assert_eq!(
        ports(&client.current("web").unwrap()),
        [8001, 8002],
        "hosts must stay v1"
    );

    server.push("web", "3", endpoints(&[8003]));
    wait_hosts(&mut updates, &[8003]).await;
    acked(&server, "3");
    let before = tokio::task::block_in_place(|| server.requests().len());

    server.drop_streams();
    let resume = tokio::task::block_in_place(|| {
        server.wait_request("the first request of a new stream", before, |r| {
            is_ours(r) && r["response_nonce"] == ""
        })
    });
    if delta {
        assert_eq!(resume["initial_resource_versions"], json!({"web": "3"}));
    } else {
        assert_eq!(
            (&resume["version_info"], &resume["resource_names"]),
            (&json!("3"), &json!(["web"]))
        );
    }
    assert_eq!(
        ports(&client.current("web").unwrap()),
        [8003],
        "hosts kept across the reconnect"
    );
    let stats = client.cluster_stats("web").unwrap().values();
    assert!(
        stats.update_rejected >= 1 && stats.update_failure >= 1 && stats.update_success >= 2,
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_ads_against_python_control_plane() {
    grpc_sequence(GrpcApi::Aggregated, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_eds_against_python_control_plane() {
    grpc_sequence(GrpcApi::Endpoint, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_ads_against_python_control_plane() {
    grpc_sequence(GrpcApi::Aggregated, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_eds_against_python_control_plane() {
    grpc_sequence(GrpcApi::Endpoint, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_json_against_python_control_plane() {
    let server = tokio::task::block_in_place(XdsServer::start);
    server.push("web", "1", endpoints(&[8101]));
    let transport = Transport::Rest {
        uri: server.rest_uri(),
        refresh_delay: Duration::from_millis(100),
        request_timeout: Duration::from_secs(2),
    };
    let client = client(source(transport, "ours"));
    let mut updates = client.updates("web").unwrap();
    let v1 = wait_hosts(&mut updates, &[8101]).await;
    assert_eq!(
        (
            v1.hosts[0].weight,
            v1.hosts[0].eds_health,
            v1.version_info.as_str()
        ),
        (2, EdsHealth::Healthy, "1")
    );
    server.push("web", "2", endpoints(&[8102, 70000]));
    let nack = tokio::task::block_in_place(|| {
        server.wait_request("REST poll reporting the error", 0, |r| {
            !r["error_detail"].is_null()
        })
    });
    assert!(
        nack["error_detail"]
            .as_str()
            .unwrap()
            .contains("port 70000 is out of range"),
        "{nack}"
    );
    assert_eq!(nack["version_info"], "1");
    assert_eq!(ports(&client.current("web").unwrap()), [8101]);
    server.push("web", "3", endpoints(&[8103]));
    wait_hosts(&mut updates, &[8103]).await;
}

/// `(port, weight, priority, health)` of Envoy's hosts of `cluster`.
fn envoy_hosts(clusters: &Value, cluster: &str) -> BTreeSet<(u64, u64, u64, String)> {
    let statuses = clusters["cluster_statuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let Some(status) = statuses.iter().find(|c| c["name"] == cluster) else {
        return BTreeSet::new();
    };
    let hosts = status["host_statuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    hosts
        .iter()
        .map(|h| {
            let port = h["address"]["socket_address"]["port_value"]
                .as_u64()
                .unwrap_or(0);
            let weight = h["weight"].as_u64().unwrap_or(0);
            let priority = h["priority"].as_u64().unwrap_or(0);
            let health = h["health_status"]["eds_health_status"]
                .as_str()
                .unwrap_or("UNKNOWN")
                .to_owned();
            (port, weight, priority, health)
        })
        .collect()
}

/// Our hosts as Envoy's admin shows them. Envoy keeps coarse health flags, so its admin reports
/// an EDS UNKNOWN as HEALTHY and a TIMEOUT as UNHEALTHY (we keep all six values; see
/// `raw_health_is_kept` below).
fn our_hosts(update: &EdsUpdate) -> BTreeSet<(u64, u64, u64, String)> {
    update
        .hosts
        .iter()
        .map(|h| {
            let health = match h.eds_health {
                EdsHealth::Unknown => EdsHealth::Healthy,
                EdsHealth::Timeout => EdsHealth::Unhealthy,
                other => other,
            };
            let health = serde_json::to_value(health)
                .unwrap()
                .as_str()
                .unwrap()
                .to_owned();
            (
                u64::from(h.addr.port()),
                u64::from(h.weight),
                u64::from(h.priority),
                health,
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_and_we_agree_on_hosts_health_and_nacks() {
    let server = tokio::task::block_in_place(XdsServer::start);
    let statuses = [
        "HEALTHY",
        "UNHEALTHY",
        "DRAINING",
        "TIMEOUT",
        "DEGRADED",
        "UNKNOWN",
    ];
    let mixed: Vec<Value> = statuses
        .iter()
        .enumerate()
        .map(|(i, health)| {
            json!({"address": "127.0.0.1", "port": 8201 + i, "health": health, "weight": i + 1, "priority": i % 2})
        })
        .collect();
    server.push("web", "1", Value::Array(mixed));
    let envoy = tokio::task::block_in_place(|| Envoy::start(&server, "envoy", &["web"]));
    let client = client(source(
        Transport::Grpc {
            uri: server.grpc_uri(),
            api: GrpcApi::Aggregated,
            delta: false,
        },
        "ours",
    ));
    let mut updates = client.updates("web").unwrap();
    // The server groups endpoints into one locality per priority: priority 0 first.
    let ours = wait_hosts(&mut updates, &[8201, 8203, 8205, 8202, 8204, 8206]).await;
    let raw: Vec<EdsHealth> = ours.hosts.iter().map(|h| h.eds_health).collect();
    assert_eq!(
        raw,
        [
            EdsHealth::Healthy,
            EdsHealth::Draining,
            EdsHealth::Degraded,
            EdsHealth::Unhealthy,
            EdsHealth::Timeout,
            EdsHealth::Unknown
        ],
        "raw_health_is_kept"
    );
    let expected = our_hosts(&ours);
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut theirs = BTreeSet::new();
    while tokio::time::Instant::now() < deadline {
        theirs = envoy_hosts(&tokio::task::block_in_place(|| envoy.clusters()), "web");
        if theirs.len() == expected.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        theirs, expected,
        "Envoy's hosts (left) differ from ours (right)"
    );

    // An update both must reject: an endpoint that is not an IP literal.
    let before = tokio::task::block_in_place(|| server.requests().len());
    server.push("web", "2", json!([{"address": "not-an-ip", "port": 8300}]));
    for node in ["envoy", "ours"] {
        let nack = tokio::task::block_in_place(|| {
            server.wait_request(&format!("NACK from {node}"), before, |r| {
                r["node"] == node && !r["error_detail"].is_null()
            })
        });
        assert_eq!(
            nack["version_info"], "1",
            "{node} NACKs with its last good version: {nack}"
        );
    }
    let envoy_after = envoy_hosts(&tokio::task::block_in_place(|| envoy.clusters()), "web");
    assert_eq!(envoy_after, expected, "Envoy kept its hosts");
    assert_eq!(
        our_hosts(&client.current("web").unwrap()),
        expected,
        "we kept ours"
    );
}
