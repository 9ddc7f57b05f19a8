//! ACK/NACK sequences over real gRPC streams against the in-process server: SotW and delta,
//! on ADS and on EDS; reconnects keep hosts and resume from the last accepted version.

use std::time::Duration;

use tonic::Status;

use super::{
    fixtures::{cla, delta, ports, sotw, wait_for},
    server::{FakeServer, Opened},
};
use crate::{
    config::sources::xds::{EdsWatch, GrpcApi, NodeConfig, NodeLocality, Transport, XdsSource},
    discovery::xds::{CLA_TYPE_URL, EdsClient, spawn_eds},
};

fn client(server: &FakeServer, api: GrpcApi, delta: bool) -> EdsClient {
    spawn_eds(client_source(server, api, delta), vec![web_watch()]).expect("valid watches")
}

fn web_watch() -> EdsWatch {
    EdsWatch {
        cluster: "web".into(),
        resource: "web".into(),
    }
}

fn client_source(server: &FakeServer, api: GrpcApi, delta: bool) -> XdsSource {
    XdsSource {
        transport: Transport::Grpc {
            uri: format!("http://{}", server.addr),
            api,
            delta,
        },
        node: NodeConfig {
            id: "node-1".into(),
            cluster: "edge".into(),
            metadata: [("team".to_owned(), serde_json::json!("payments"))].into(),
            locality: Some(NodeLocality {
                zone: "z1".into(),
                ..NodeLocality::default()
            }),
        },
        initial_fetch_timeout: Duration::ZERO,
        backoff: (Duration::from_millis(20), Duration::from_millis(100)),
        tls: None,
    }
}

fn rpc(api: GrpcApi) -> &'static str {
    match api {
        GrpcApi::Aggregated => "ads",
        GrpcApi::Endpoint => "eds",
    }
}

async fn sotw_stream(
    server: &mut FakeServer,
) -> tokio::sync::mpsc::Sender<
    Result<envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse, Status>,
> {
    match server.next_stream().await {
        Opened::Sotw(tx) => tx,
        Opened::Delta(_) => panic!("expected a SotW stream"),
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "one protocol exchange, told in order from subscribe to NACK"
)]
async fn sotw_sequence(api: GrpcApi) {
    let mut server = FakeServer::start().await;
    let client = client(&server, api, false);
    let mut updates = client.updates("web").unwrap();
    let stream = sotw_stream(&mut server).await;
    let first = server.next_sotw(rpc(api)).await;
    assert_eq!(
        (first.version_info.as_str(), first.response_nonce.as_str()),
        ("", "")
    );
    assert_eq!(
        (first.resource_names, first.type_url.as_str()),
        (vec!["web".to_owned()], CLA_TYPE_URL)
    );
    assert_eq!(
        first
            .node
            .as_ref()
            .map(|n| (n.id.as_str(), n.cluster.as_str())),
        Some(("node-1", "edge"))
    );
    let node = first.node.as_ref().unwrap();
    assert!(
        node.metadata
            .as_ref()
            .is_some_and(|m| m.fields.contains_key("team")),
        "{node:?}"
    );
    assert_eq!(node.locality.as_ref().map(|l| l.zone.as_str()), Some("z1"));

    // Good v1: ACK with version and nonce.
    stream
        .send(Ok(sotw("1", "n1", &[cla("web", &[8001, 8002])])))
        .await
        .unwrap();
    let ack = server.next_sotw(rpc(api)).await;
    assert_eq!(
        (
            ack.version_info.as_str(),
            ack.response_nonce.as_str(),
            ack.error_detail
        ),
        ("1", "n1", None)
    );
    wait_for(&mut updates, "v1 hosts", |u| ports(u) == [8001, 8002]).await;
    assert!(client.control_plane_stats().connected());

    // Bad v2: NACK with the previous version, the nonce and the reason; hosts stay v1.
    stream
        .send(Ok(sotw("2", "n2", &[cla("web", &[70000])])))
        .await
        .unwrap();
    let nack = server.next_sotw(rpc(api)).await;
    assert_eq!(
        (nack.version_info.as_str(), nack.response_nonce.as_str()),
        ("1", "n2")
    );
    let detail = nack.error_detail.expect("a NACK carries error_detail");
    assert_eq!(detail.code, 13);
    assert!(
        detail
            .message
            .contains("PortValue: value must be less than or equal to 65535"),
        "{}",
        detail.message
    );
    let current = client.current("web").unwrap();
    assert_eq!(
        (ports(&current), current.version_info.as_str()),
        (vec![8001, 8002], "1")
    );

    // Good v3: ACK; the update lists what changed.
    stream
        .send(Ok(sotw("3", "n3", &[cla("web", &[8002, 8003])])))
        .await
        .unwrap();
    let ack = server.next_sotw(rpc(api)).await;
    assert_eq!(
        (
            ack.version_info.as_str(),
            ack.response_nonce.as_str(),
            ack.error_detail
        ),
        ("3", "n3", None)
    );
    let v3 = wait_for(&mut updates, "v3 hosts", |u| u.version_info == "3").await;
    assert_eq!(
        (
            ports(&v3),
            v3.added[0].addr.port(),
            v3.removed[0].addr.port()
        ),
        (vec![8002, 8003], 8003, 8001)
    );

    // Stream drop: reconnect with the last accepted version and no nonce; hosts kept.
    stream
        .send(Err(Status::unavailable("test drops the stream")))
        .await
        .unwrap();
    let stream = sotw_stream(&mut server).await;
    let resume = server.next_sotw(rpc(api)).await;
    assert_eq!(
        (resume.version_info.as_str(), resume.response_nonce.as_str()),
        ("3", "")
    );
    assert_eq!(resume.resource_names, ["web"]);
    assert_eq!(ports(&client.current("web").unwrap()), [8002, 8003]);
    stream
        .send(Ok(sotw("3", "n4", &[cla("web", &[8002, 8003])])))
        .await
        .unwrap();
    let ack = server.next_sotw(rpc(api)).await;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("3", "n4")
    );

    let stats = client.cluster_stats("web").unwrap().values();
    assert_eq!(
        (
            stats.source.update_success,
            stats.source.update_rejected,
            stats.source.update_failure
        ),
        (3, 1, 1)
    );
    assert_eq!(
        (
            stats.source.update_attempt,
            stats.source.update_no_rebuild,
            stats.version
        ),
        (5, 1, 3)
    );
    assert_eq!(stats.source.membership_total, 2);
}

#[tokio::test]
async fn sotw_ads_ack_nack_reconnect() {
    sotw_sequence(GrpcApi::Aggregated).await;
}

#[tokio::test]
async fn sotw_eds_ack_nack_reconnect() {
    sotw_sequence(GrpcApi::Endpoint).await;
}

async fn delta_stream(
    server: &mut FakeServer,
) -> tokio::sync::mpsc::Sender<
    Result<envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse, Status>,
> {
    match server.next_stream().await {
        Opened::Delta(tx) => tx,
        Opened::Sotw(_) => panic!("expected a delta stream"),
    }
}

async fn delta_sequence(api: GrpcApi) {
    let mut server = FakeServer::start().await;
    let client = client(&server, api, true);
    let mut updates = client.updates("web").unwrap();
    let stream = delta_stream(&mut server).await;
    let first = server.next_delta(rpc(api)).await;
    assert_eq!(
        (first.resource_names_subscribe, first.type_url.as_str()),
        (vec!["web".to_owned()], CLA_TYPE_URL)
    );
    assert!(first.initial_resource_versions.is_empty() && first.response_nonce.is_empty());
    assert_eq!(
        first.node.map(|n| (n.id, n.locality.map(|l| l.zone))),
        Some(("node-1".to_owned(), Some("z1".to_owned())))
    );

    stream
        .send(Ok(delta("d1", &[("a", cla("web", &[9001]))], &[])))
        .await
        .unwrap();
    let ack = server.next_delta(rpc(api)).await;
    assert_eq!(
        (
            ack.response_nonce.as_str(),
            ack.error_detail,
            ack.type_url.as_str()
        ),
        ("d1", None, CLA_TYPE_URL)
    );
    wait_for(&mut updates, "version a", |u| u.version_info == "a").await;

    let mut bad = cla("web", &[9002]);
    bad.endpoints[0].lb_endpoints[0] = super::fixtures::endpoint("not-an-ip", 9002);
    stream
        .send(Ok(delta("d2", &[("b", bad)], &[])))
        .await
        .unwrap();
    let nack = server.next_delta(rpc(api)).await;
    assert_eq!(nack.response_nonce, "d2");
    let message = nack.error_detail.expect("NACK").message;
    assert!(
        message.contains("malformed IP address: not-an-ip."),
        "{message}"
    );
    assert_eq!(ports(&client.current("web").unwrap()), [9001]);

    stream
        .send(Ok(delta("d3", &[("c", cla("web", &[9003]))], &[])))
        .await
        .unwrap();
    assert_eq!(server.next_delta(rpc(api)).await.error_detail, None);
    wait_for(&mut updates, "version c", |u| ports(u) == [9003]).await;

    // Drop: the new stream announces the version we hold.
    stream
        .send(Err(Status::internal("test drops the stream")))
        .await
        .unwrap();
    let stream = delta_stream(&mut server).await;
    let resume = server.next_delta(rpc(api)).await;
    assert_eq!(
        resume.initial_resource_versions,
        [("web".to_owned(), "c".to_owned())].into()
    );
    assert_eq!(resume.resource_names_subscribe, ["web"]);
    assert_eq!(ports(&client.current("web").unwrap()), [9003]);

    // Removal: ACKed, hosts kept, update_empty.
    stream.send(Ok(delta("d4", &[], &["web"]))).await.unwrap();
    assert_eq!(server.next_delta(rpc(api)).await.response_nonce, "d4");
    let stats = client.cluster_stats("web").unwrap().values();
    assert_eq!(
        (
            stats.source.update_success,
            stats.source.update_rejected,
            stats.source.update_failure,
            stats.source.update_empty
        ),
        (3, 1, 1, 1)
    );
    assert_eq!(ports(&client.current("web").unwrap()), [9003]);
}

#[tokio::test]
async fn delta_ads_ack_nack_reconnect() {
    delta_sequence(GrpcApi::Aggregated).await;
}

#[tokio::test]
async fn delta_eds_ack_nack_reconnect() {
    delta_sequence(GrpcApi::Endpoint).await;
}

#[tokio::test]
async fn unreachable_server_counts_failures_and_initializes() {
    // Bound, never listening, without SO_REUSEADDR: connects are refused and no listener of a
    // test beside this one can take the port while this test runs.
    let closed = tokio::net::TcpSocket::new_v4().unwrap();
    closed.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = closed.local_addr().unwrap();
    let source = XdsSource {
        transport: Transport::Grpc {
            uri: format!("http://{addr}"),
            api: GrpcApi::Aggregated,
            delta: false,
        },
        node: NodeConfig {
            id: "node-1".into(),
            ..NodeConfig::default()
        },
        initial_fetch_timeout: Duration::from_secs(30),
        backoff: (Duration::from_millis(10), Duration::from_millis(20)),
        tls: None,
    };
    let client = spawn_eds(
        source,
        vec![EdsWatch {
            cluster: "web".into(),
            resource: "web".into(),
        }],
    )
    .unwrap();
    tokio::time::timeout(super::fixtures::WAIT, client.initialized())
        .await
        .expect("initialized after a failure");
    let deadline = tokio::time::Instant::now() + super::fixtures::WAIT;
    while client
        .cluster_stats("web")
        .unwrap()
        .values()
        .source
        .update_failure
        < 2
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no retry after a failed connect"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let named = client.named_stats();
    assert!(named.contains(&("control_plane.connected_state".to_owned(), 0)));
    assert!(
        named
            .iter()
            .any(|(name, value)| name == "cluster.web.update_failure" && *value >= 2)
    );
}

/// A response over gRPC's default 4 MiB is decoded and ACKed, as the limit this daemon sets
/// allows. (20,000 endpoints with long hostnames make the size: 300,000 short ones would too,
/// but take long to build and apply in a debug build.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_grpcs_default_limit_is_accepted() {
    use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};

    use super::fixtures::{endpoint, locality};
    let mut server = FakeServer::start().await;
    let client = client(&server, GrpcApi::Aggregated, false);
    let mut updates = client.updates("web").unwrap();
    let stream = sotw_stream(&mut server).await;
    let _ = server.next_sotw("ads").await;
    let endpoints: Vec<_> = (0..20_000u32)
        .map(|i| {
            let mut e = endpoint(&format!("10.0.{}.{}", i >> 8, i & 255), 80);
            if let Some(lb_endpoint::HostIdentifier::Endpoint(inner)) = &mut e.host_identifier {
                inner.hostname = format!("host-{i}.{}", "a".repeat(240));
            }
            e
        })
        .collect();
    let big = ClusterLoadAssignment {
        cluster_name: "web".into(),
        endpoints: vec![locality(0, endpoints)],
        ..Default::default()
    };
    let response = sotw("1", "n1", &[big]);
    assert!(
        prost::Message::encoded_len(&response) > 4 << 20,
        "the response must exceed gRPC's default limit"
    );
    stream.send(Ok(response)).await.unwrap();
    let ack = server.next_sotw("ads").await;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("1", None));
    wait_for(&mut updates, "20,000 hosts", |u| u.hosts.len() == 20_000).await;
}

#[test]
fn an_oversized_response_is_reported_as_this_daemons_limit() {
    use crate::discovery::xds::grpc::{MAX_MESSAGE, StreamError};
    // tonic's words when a response is over the decoding limit.
    let status = Status::out_of_range(format!(
        "Error, decoded message length too large: found 70000000 bytes, the limit is: {MAX_MESSAGE} bytes"
    ));
    let error = StreamError::from(status);
    assert!(matches!(error, StreamError::TooLarge { .. }), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains("larger than this daemon decodes (64 MiB)"),
        "{text}"
    );
    assert!(text.contains("found 70000000 bytes"), "{text}");
    let other = StreamError::from(Status::unavailable("gone"));
    assert!(matches!(other, StreamError::Status(_)), "{other:?}");
}

/// Regression: a response over the decode limit, after a smaller one that was accepted and so
/// reset the backoff, used to rebuild the stream after less than `base` every time, forever.
/// Now the wait doubles per such response, from `base / 2` up to `max`, and each is counted.
#[tokio::test(start_paused = true)]
async fn oversized_responses_back_off_exponentially_and_are_counted() {
    let mut server = FakeServer::start().await;
    let source = XdsSource {
        backoff: (Duration::from_secs(1), Duration::from_secs(4)),
        ..client_source(&server, GrpcApi::Aggregated, true)
    };
    let client = spawn_eds(source, vec![web_watch()]).unwrap();
    let start = tokio::time::Instant::now();
    let mut streams = 0u64;
    // Waits were below 1 s each (at least 60 streams in 60 s). Now their lower bounds are 0.5,
    // 1, 2, 2, ... s: at most 32 streams open within 60 s; upper bounds 1, 2, 4, 4, ... s: at
    // least 16. (The max stays below the server's 5 s wait for a stream.)
    while start.elapsed() < Duration::from_secs(60) {
        let stream = delta_stream(&mut server).await;
        streams += 1;
        assert!(
            streams <= 32,
            "stream {streams} after {:?}",
            start.elapsed()
        );
        let _ = server.next_delta("ads").await;
        let good = delta(&format!("n{streams}"), &[("a", cla("web", &[9001]))], &[]);
        stream.send(Ok(good)).await.unwrap();
        let ack = server.next_delta("ads").await;
        assert_eq!(ack.error_detail, None, "the small response is accepted");
        let too_large = Status::out_of_range(
            "Error, decoded message length too large: found 70000000 bytes, the limit is: 67108864 bytes",
        );
        stream.send(Err(too_large)).await.unwrap();
    }
    assert!(streams >= 16, "only {streams} streams in 60 s");
    let named = client.named_stats();
    let oversized = named
        .iter()
        .find(|(name, _)| name == "control_plane.oversized_responses")
        .map(|(_, value)| *value);
    // The last stream's error may still be on its way when the loop ends.
    assert!(
        oversized == Some(streams) || oversized == Some(streams - 1),
        "{oversized:?} of {streams}"
    );
}
