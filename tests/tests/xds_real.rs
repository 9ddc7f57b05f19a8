//! EDS against a real xDS v3 control plane (Python grpcio + xds-protos): SotW and delta over ADS
//! and EDS, and REST-JSON; ACK/NACK as the server records them; reconnects; and a cross-check
//! against two real Envoy 1.40 (SotW and delta ADS) subscribed to the same server: hosts and
//! health, and per input the ACK or NACK (with Envoy's words in both NACKs) and the resulting
//! hosts, for a malformed IP, two assignments of one name, a host on port 0, priority 200
//! and a health_status outside the enum. CDS and LDS side by side: `xds_real/resources.rs`;
//! HTTP requests through Envoy's and our routes of one inline route table: `xds_real/routes.rs`.

use std::{collections::BTreeSet, time::Duration};

use integration_tests::xds_server::{Envoy, WAIT, XdsServer};
use proxy_core::{
    config::{
        host_guard::HostGuard,
        sources::xds::{EdsWatch, GrpcApi, NodeConfig, Transport, XdsSource},
    },
    discovery::{
        SourceUpdate as EdsUpdate,
        xds::{EdsClient, spawn_eds},
    },
    host::EdsHealth,
};
use serde_json::{Value, json};
use tokio::sync::watch;

fn source(transport: Transport, node: &str) -> XdsSource {
    XdsSource {
        transport,
        node: NodeConfig {
            id: node.into(),
            cluster: "edge".into(),
            ..NodeConfig::default()
        },
        initial_fetch_timeout: Duration::from_secs(5),
        backoff: (Duration::from_millis(50), Duration::from_millis(200)),
        tls: None,
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
        host.metadata().get("locality.zone").map(String::as_str),
        Some("eu-1")
    );
    assert_eq!(
        host.metadata().get("version").map(String::as_str),
        Some("v1")
    );
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

    server.push("web", "2", endpoints(&[70000]));
    let nack = tokio::task::block_in_place(|| {
        server.wait_request("NACK of v2", before, |r| {
            is_ours(r) && !r["error_detail"].is_null()
        })
    });
    let message = nack["error_detail"].as_str().unwrap();
    assert!(
        message.contains("PortValue: value must be less than or equal to 65535"),
        "{message}"
    );
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
    let stats = client.cluster_stats("web").unwrap().values().source;
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
            .contains("value must be less than or equal to 65535"),
        "{nack}"
    );
    assert_eq!(nack["version_info"], "1");
    assert_eq!(ports(&client.current("web").unwrap()), [8101]);
    server.push("web", "3", endpoints(&[8103]));
    wait_hosts(&mut updates, &[8103]).await;
}

/// The bootstrap `node` block both we and Envoy are given (each with its own `id`).
fn identity() -> Value {
    json!({
        "cluster": "edge",
        "metadata": {"team": "payments", "share": 0.5, "canary": true, "tags": ["a", "b"],
                     "nested": {"k": "v"}},
        "locality": {"region": "eu", "zone": "eu-1a", "sub_zone": "rack-7"},
    })
}

/// A request's node as the server decoded it, without what differs by design: the id and the
/// user agent (Envoy also sends its build, extensions and client features).
fn configured_part(request: &Value) -> Value {
    let node = &request["identity"];
    json!({"cluster": node["cluster"], "metadata": node["metadata"], "locality": node["locality"]})
}

/// The node identity, configured as Envoy's bootstrap `node`, reaches a real control plane on
/// every request of every transport (SotW and delta gRPC, REST) exactly as Envoy's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_identity_reaches_the_server_as_envoys_does() {
    let server = tokio::task::block_in_place(XdsServer::start);
    server.push("web", "1", endpoints(&[8201]));
    let with_id = |id: &str| {
        let mut node = identity();
        node["id"] = id.into();
        node
    };
    let _envoy = tokio::task::block_in_place(|| {
        Envoy::start_with_node(&server, &with_id("envoy-node"), &["web"])
    });
    let node = |id: &str| -> NodeConfig { serde_json::from_value(with_id(id)).unwrap() };
    let transports = [
        (
            "ours-sotw",
            Transport::Grpc {
                uri: server.grpc_uri(),
                api: GrpcApi::Aggregated,
                delta: false,
            },
        ),
        (
            "ours-delta",
            Transport::Grpc {
                uri: server.grpc_uri(),
                api: GrpcApi::Aggregated,
                delta: true,
            },
        ),
        (
            "ours-rest",
            Transport::Rest {
                uri: server.rest_uri(),
                refresh_delay: Duration::from_millis(100),
                request_timeout: Duration::from_secs(2),
            },
        ),
    ];
    let mut clients = Vec::new();
    for (id, transport) in transports {
        let mut source = source(transport, id);
        source.node = node(id);
        let client = client(source);
        wait_hosts(&mut client.updates("web").unwrap(), &[8201]).await;
        tokio::task::block_in_place(|| {
            server.wait_request("our ACK", 0, |r| {
                r["node"] == id && r["response_nonce"] != ""
            })
        });
        clients.push(client);
    }
    let envoy = tokio::task::block_in_place(|| {
        server.wait_request("Envoy's subscription", 0, |r| r["node"] == "envoy-node")
    });
    let requests = server.requests();
    for id in ["ours-sotw", "ours-delta", "ours-rest"] {
        let ours: Vec<&Value> = requests.iter().filter(|r| r["node"] == id).collect();
        assert!(ours.len() >= 2, "{id}: a subscription and an ACK: {ours:?}");
        for request in ours {
            assert_eq!(configured_part(request), configured_part(&envoy), "{id}");
            assert_eq!(request["identity"]["user_agent_name"], "proxy", "{id}");
        }
    }
    assert_eq!(configured_part(&envoy), identity(), "{envoy}");
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

/// One xDS flavour compared: a real Envoy and our client, subscribed the same way.
struct Pair {
    flavour: &'static str,
    envoy_node: &'static str,
    envoy: Envoy,
    ours_node: &'static str,
    ours: EdsClient,
}

impl Pair {
    fn start(server: &XdsServer, delta: bool) -> Self {
        let (flavour, envoy_node, ours_node) = if delta {
            ("delta", "envoy-delta", "ours-delta")
        } else {
            ("sotw", "envoy", "ours")
        };
        let envoy = tokio::task::block_in_place(|| {
            if delta {
                Envoy::start_delta(server, envoy_node, &["web"])
            } else {
                Envoy::start(server, envoy_node, &["web"])
            }
        });
        let transport = Transport::Grpc {
            uri: server.grpc_uri(),
            api: GrpcApi::Aggregated,
            delta,
        };
        let ours = client(source(transport, ours_node));
        Self {
            flavour,
            envoy_node,
            envoy,
            ours_node,
            ours,
        }
    }

    /// Envoy's hosts of `web` once they equal `expected` (or the last seen after [`WAIT`]).
    async fn envoy_hosts(&self, expected: &BTreeSet<HostView>) -> BTreeSet<HostView> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let theirs = envoy_hosts(
                &tokio::task::block_in_place(|| self.envoy.clusters()),
                "web",
            );
            if theirs == *expected || tokio::time::Instant::now() >= deadline {
                return theirs;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Our published hosts of `web` once they equal `expected` (or the last after [`WAIT`]).
    async fn our_hosts(&self, expected: &BTreeSet<HostView>) -> BTreeSet<HostView> {
        let mut updates = self.ours.updates("web").unwrap();
        let seen = tokio::time::timeout(WAIT, updates.wait_for(|u| our_hosts(u) == *expected));
        let _ = seen.await;
        our_hosts(&self.ours.current("web").unwrap())
    }
}

/// `(port, weight, priority, health)` of a host, as Envoy's admin shows it.
type HostView = (u64, u64, u64, String);

/// ACK (`None`) or NACK (`Some(error_detail)`): `node`'s answer to the first response after
/// the first `skip` requests.
fn verdict(server: &XdsServer, node: &str, skip: usize) -> Option<String> {
    let answer = tokio::task::block_in_place(|| {
        server.wait_request(&format!("{node}'s ACK or NACK"), skip, |r| {
            r["node"] == node && !r["response_nonce"].as_str().unwrap_or("").is_empty()
        })
    });
    answer["error_detail"].as_str().map(str::to_owned)
}

/// Pushes with `push`, then checks, for every pair, that Envoy and we both ACK or both NACK (a
/// NACK of ours containing `nack_words`, Envoy's own text for it) and end with `hosts`.
async fn step(
    server: &XdsServer,
    pairs: &[Pair],
    what: &str,
    push: impl FnOnce(&XdsServer),
    expect: impl Fn(&Pair) -> (Option<&'static str>, BTreeSet<HostView>),
) {
    let before = tokio::task::block_in_place(|| server.requests().len());
    tokio::task::block_in_place(|| push(server));
    for pair in pairs {
        let (nack_words, hosts) = expect(pair);
        let theirs = verdict(server, pair.envoy_node, before);
        let ours = verdict(server, pair.ours_node, before);
        let flavour = pair.flavour;
        assert_eq!(
            (theirs.is_some(), ours.is_some()),
            (nack_words.is_some(), nack_words.is_some()),
            "{what} ({flavour}): ACK/NACK of Envoy (left) and ours (right): {theirs:?} / {ours:?}"
        );
        if let Some(words) = nack_words {
            for (who, message) in [("Envoy", &theirs), ("ours", &ours)] {
                let message = message.as_deref().unwrap_or_default();
                assert!(
                    message.contains(words),
                    "{what} ({flavour}): {who}'s NACK {message:?} lacks {words:?}"
                );
            }
        }
        let envoy = pair.envoy_hosts(&hosts).await;
        let our = pair.our_hosts(&hosts).await;
        assert_eq!(
            (&envoy, &our),
            (&hosts, &hosts),
            "{what} ({flavour}): hosts of Envoy (left) and ours (right)"
        );
    }
}

fn views(ports: &[u64]) -> BTreeSet<HostView> {
    ports
        .iter()
        .map(|&port| (port, 2, 0, "HEALTHY".to_owned()))
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
    let pairs = [Pair::start(&server, false), Pair::start(&server, true)];
    let mut updates = pairs[0].ours.updates("web").unwrap();
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
    let v1 = our_hosts(&ours);
    for pair in &pairs {
        let (envoy, our) = (pair.envoy_hosts(&v1).await, pair.our_hosts(&v1).await);
        assert_eq!((&envoy, &our), (&v1, &v1), "v1 ({})", pair.flavour);
    }
    // Every node's ACK of v1 is in before the next push: a client applies a response, then
    // ACKs it, so seeing its hosts does not mean the server has its ACK, and an ACK that came in
    // after the next step's count was taken would pass for that step's verdict.
    for pair in &pairs {
        for node in [pair.envoy_node, pair.ours_node] {
            tokio::task::block_in_place(|| {
                server.wait_request(&format!("{node}'s ACK of v1"), 0, |r| {
                    r["node"] == node && !r["response_nonce"].as_str().unwrap_or("").is_empty()
                })
            });
        }
    }
    agree_on_nacks_duplicates_and_port_zero(&server, &pairs, &v1).await;
}

/// From v1 on: a malformed IP, two assignments of one name, port 0, then a good version.
async fn agree_on_nacks_duplicates_and_port_zero(
    server: &XdsServer,
    pairs: &[Pair],
    v1: &BTreeSet<HostView>,
) {
    // Both reject an endpoint that is not an IP literal; SotW NACKs carry the last good version.
    let before = tokio::task::block_in_place(|| server.requests().len());
    step(
        server,
        pairs,
        "malformed IP",
        |s| s.push("web", "2", json!([{"address": "not-an-ip", "port": 8300}])),
        |_| (Some("malformed IP address: not-an-ip"), v1.clone()),
    )
    .await;
    for node in ["envoy", "ours"] {
        let nack = tokio::task::block_in_place(|| {
            server.wait_request(&format!("NACK from {node}"), before, |r| {
                r["node"] == node && !r["error_detail"].is_null()
            })
        });
        assert_eq!(nack["version_info"], "1", "{node}: {nack}");
    }

    // Two assignments named web in one response: state of the world takes the first, silently;
    // delta rejects the duplicate name.
    let twice = json!([
        {"name": "web", "endpoints": endpoints(&[8301])},
        {"name": "web", "endpoints": endpoints(&[8302])},
    ]);
    step(
        server,
        pairs,
        "two assignments of one name",
        |s| s.push_raw("3", twice),
        |pair| match pair.flavour {
            "delta" => (
                Some("duplicate name web found among added/updated resources"),
                v1.clone(),
            ),
            _ => (None, views(&[8301])),
        },
    )
    .await;

    // The first wins even when the second would not map (only the first is resolved).
    let unusable_second = json!([
        {"name": "web", "endpoints": endpoints(&[8311])},
        {"name": "web", "endpoints": [{"address": "not-an-ip", "port": 8312}]},
    ]);
    step(
        server,
        pairs,
        "a duplicate that does not map",
        |s| s.push_raw("4", unusable_second),
        |pair| match pair.flavour {
            "delta" => (Some("duplicate name web"), v1.clone()),
            _ => (None, views(&[8311])),
        },
    )
    .await;

    // Port 0: accepted by both, and a host of the assignment for both; our cluster loop then
    // leaves it out of routing (`hosts_refused`), where Envoy keeps it and fails its connects.
    step(
        server,
        pairs,
        "port 0",
        |s| s.push("web", "5", endpoints(&[8401, 0])),
        |_| (None, views(&[0, 8401])),
    )
    .await;
    let published = pairs[0].ours.current("web").unwrap().hosts;
    let (routed, refused) = HostGuard::default().filter(published);
    assert_eq!(
        (
            ports(&EdsUpdate {
                hosts: routed,
                ..Default::default()
            }),
            refused.len()
        ),
        (vec![8401], 1),
        "port 0 is refused per host: {refused:?}"
    );

    agree_on_proto_rules(server, pairs).await;
}

/// From the port 0 version on: a priority over 128, a health_status outside the enum, then a
/// good version.
async fn agree_on_proto_rules(server: &XdsServer, pairs: &[Pair]) {
    // A priority above 128 breaks a proto rule: both NACK, in the same words.
    let priority = json!([{"address": "127.0.0.1", "port": 8601, "weight": 2, "priority": 200}]);
    step(
        server,
        pairs,
        "priority 200",
        |s| s.push("web", "6", priority),
        |_| (
            Some("LocalityLbEndpointsValidationError.Priority: value must be less than or equal to 128"),
            views(&[0, 8401]),
        ),
    )
    .await;

    // A health_status outside the enum: both accept and route the host as healthy.
    let odd_health = json!([{"address": "127.0.0.1", "port": 8701, "weight": 2, "health": 17}]);
    step(
        server,
        pairs,
        "health_status 17",
        |s| s.push("web", "7", odd_health),
        |_| (None, views(&[8701])),
    )
    .await;

    // Still in step after all that.
    step(
        server,
        pairs,
        "a good version",
        |s| s.push("web", "8", endpoints(&[8501, 8502])),
        |_| (None, views(&[8501, 8502])),
    )
    .await;
}

#[path = "xds_real/resources.rs"]
mod resources;
#[path = "xds_real/routes.rs"]
mod routes;

// The relay's in-process test support, which lives with the relay's own tests.
#[path = "../../proxy-relay/tests/proxy_support/mod.rs"]
mod proxy_support;
