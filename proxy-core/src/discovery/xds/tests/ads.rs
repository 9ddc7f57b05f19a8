//! CDS and LDS on a real ADS stream against the in-process server: the wildcard subscriptions,
//! an ACK or NACK per type and version (SotW and delta), EDS joining the same stream, and RDS
//! asked by the names the listeners give, right after the listener ACK.

use std::{path::Path, time::Duration};

use envoy_types::pb::{
    envoy::{
        config::cluster::v3::OutlierDetection,
        extensions::filters::network::tcp_proxy::v3::tcp_proxy::ClusterSpecifier,
        service::discovery::v3::{DeltaDiscoveryResponse, Resource},
    },
    google::rpc::Status,
};
use tokio::sync::watch;

use super::{
    fixtures::WAIT,
    hcm::{http_listener, prefix, rds_hcm, route_configuration, routes_sotw},
    resources::{any, clusters, listener, listeners, static_cluster, xds},
    server::{FakeServer, Opened},
};
use crate::{
    config::{
        Config,
        sources::xds::{EdsWatch, GrpcApi, Transport, XdsConfig, XdsSource},
    },
    desired::Overlay,
    discovery::xds::{
        CLA_TYPE_URL, EdsClient, XdsClients,
        cds::CLUSTER_TYPE_URL,
        hcm::ROUTE_TYPE_URL,
        lds::LISTENER_TYPE_URL,
        resources::{FileNames, ResourceState},
        spawn_ads,
    },
};

fn start(server: &FakeServer, delta: bool) -> (EdsClient, watch::Receiver<Overlay>) {
    let source = XdsSource {
        transport: Transport::Grpc {
            uri: format!("http://{}", server.addr),
            api: GrpcApi::Aggregated,
            delta,
        },
        node: xds().node,
        initial_fetch_timeout: Duration::ZERO,
        backoff: (Duration::from_millis(20), Duration::from_millis(100)),
        tls: None,
    };
    let (tx, rx) = watch::channel(Overlay::default());
    let state = ResourceState::new(xds(), FileNames::default(), tx);
    let client = spawn_ads(source, Vec::new(), None, state).expect("an ADS source");
    (client, rx)
}

async fn overlay_where(rx: &mut watch::Receiver<Overlay>, f: impl Fn(&Overlay) -> bool) {
    let matched = tokio::time::timeout(WAIT, rx.wait_for(|o| f(o)))
        .await
        .is_ok_and(|r| r.is_ok());
    assert!(matched, "overlay never matched: {:?}", *rx.borrow());
}

const OUTLIER_REFUSED: &str = "cluster \"a\": field outlier_detection is not supported by this daemon (it would be ignored); remove it or serve this resource to Envoy only";

#[tokio::test]
async fn sotw_acks_and_nacks_each_type_by_version() {
    let mut server = FakeServer::start().await;
    let (client, mut rx) = start(&server, false);
    let Opened::Sotw(stream) = server.next_stream().await else {
        panic!("expected a SotW stream");
    };
    // No EDS cluster yet: no EDS request (an empty one would be a wildcard).
    let types = [server.next_sotw("ads").await, server.next_sotw("ads").await];
    for (request, type_url) in types.iter().zip([CLUSTER_TYPE_URL, LISTENER_TYPE_URL]) {
        assert_eq!(request.type_url, type_url);
        assert!(request.resource_names.is_empty(), "wildcard");
        assert_eq!(request.node.as_ref().map(|n| n.id.as_str()), Some("n1"));
    }
    stream
        .send(Ok(clusters("1", &[static_cluster("a", 9001)])))
        .await
        .unwrap();
    let ack = server.next_sotw("ads").await;
    let seen = (
        ack.type_url.as_str(),
        ack.version_info.as_str(),
        ack.response_nonce.as_str(),
    );
    assert_eq!(seen, (CLUSTER_TYPE_URL, "1", "n1"));
    assert_eq!(ack.error_detail, None);
    let mut bad = static_cluster("a", 9002);
    bad.outlier_detection = Some(OutlierDetection::default());
    stream.send(Ok(clusters("2", &[bad]))).await.unwrap();
    let nack = server.next_sotw("ads").await;
    assert_eq!(
        (nack.version_info.as_str(), nack.response_nonce.as_str()),
        ("1", "n2")
    );
    let detail = nack.error_detail.expect("a NACK");
    assert_eq!(
        (detail.code, detail.message.as_str()),
        (13, OUTLIER_REFUSED)
    );
    let web = listener("web", 8080, ClusterSpecifier::Cluster("a".into()));
    stream.send(Ok(listeners("1", &[web]))).await.unwrap();
    let ack = server.next_sotw("ads").await;
    assert_eq!(
        (ack.type_url.as_str(), ack.version_info.as_str()),
        (LISTENER_TYPE_URL, "1")
    );
    overlay_where(&mut rx, |o| o.services.len() == 1 && o.clusters.len() == 1).await;
    assert_eq!(rx.borrow().clusters[0].static_hosts()[0].addr.port(), 9001);
    // An EDS cluster (as the daemon subscribes one from CDS) joins the same stream.
    let watch = EdsWatch {
        cluster: "b".into(),
        resource: "b-svc".into(),
    };
    client.subscribe(watch).expect("a new cluster");
    let eds = server.next_sotw("ads").await;
    assert_eq!(
        (eds.type_url.as_str(), eds.resource_names.as_slice()),
        (CLA_TYPE_URL, ["b-svc".to_owned()].as_slice())
    );
}

fn delta_listener(name: &str, version: &str, cluster: &str) -> DeltaDiscoveryResponse {
    let web = listener(name, 8080, ClusterSpecifier::Cluster(cluster.into()));
    DeltaDiscoveryResponse {
        type_url: LISTENER_TYPE_URL.into(),
        resources: vec![Resource {
            name: name.into(),
            version: version.into(),
            resource: Some(any(LISTENER_TYPE_URL, &web)),
            ..Default::default()
        }],
        nonce: format!("d{version}"),
        ..Default::default()
    }
}

#[tokio::test]
async fn delta_takes_the_same_path_and_a_removal_withdraws() {
    let mut server = FakeServer::start().await;
    let (_client, mut rx) = start(&server, true);
    let Opened::Delta(stream) = server.next_stream().await else {
        panic!("expected a delta stream");
    };
    let first = [
        server.next_delta("ads").await,
        server.next_delta("ads").await,
    ];
    let types: Vec<&str> = first.iter().map(|r| r.type_url.as_str()).collect();
    assert_eq!(types, [CLUSTER_TYPE_URL, LISTENER_TYPE_URL]);
    stream
        .send(Ok(delta_listener("web", "v1", "a")))
        .await
        .unwrap();
    let ack = server.next_delta("ads").await;
    assert_eq!(
        (ack.response_nonce.as_str(), ack.error_detail),
        ("dv1", None)
    );
    // Held (warming): its cluster is not known yet.
    assert!(rx.borrow().services.is_empty());
    let cluster = DeltaDiscoveryResponse {
        type_url: CLUSTER_TYPE_URL.into(),
        resources: vec![Resource {
            name: "a".into(),
            version: "c1".into(),
            resource: Some(any(CLUSTER_TYPE_URL, &static_cluster("a", 9001))),
            ..Default::default()
        }],
        nonce: "dc1".into(),
        ..Default::default()
    };
    stream.send(Ok(cluster)).await.unwrap();
    assert_eq!(server.next_delta("ads").await.error_detail, None);
    overlay_where(&mut rx, |o| o.services.len() == 1).await;
    let mut renamed = delta_listener("web", "v2", "a");
    renamed.resources[0].name = "other".into();
    stream.send(Ok(renamed)).await.unwrap();
    let nack = server.next_delta("ads").await;
    let want = "listener resource \"other\" holds a listener named \"web\"; the names must match";
    assert_eq!(
        nack.error_detail.map(|s: Status| s.message),
        Some(want.to_owned())
    );
    let removed = DeltaDiscoveryResponse {
        type_url: LISTENER_TYPE_URL.into(),
        removed_resources: vec!["web".into()],
        nonce: "dr".into(),
        ..Default::default()
    };
    stream.send(Ok(removed)).await.unwrap();
    assert_eq!(server.next_delta("ads").await.error_detail, None);
    overlay_where(&mut rx, |o| o.services.is_empty() && o.clusters.len() == 1).await;
}

fn config(server: &FakeServer, sources: &str) -> Result<Config, crate::config::ConfigError> {
    let text = format!(
        "xds:\n  node: {{id: n1, cluster: edge}}\n  ads_config: {{api_type: GRPC, server_uri: '{}'}}\n{sources}",
        server.addr
    );
    Config::parse(&text, Path::new("xds.yaml"))
}

#[tokio::test]
async fn cds_and_lds_start_from_the_config_without_eds_clusters() {
    let mut server = FakeServer::start().await;
    let config = config(
        &server,
        "  cds_config: {ads: {}}\n  lds_config: {ads: {}}\n",
    )
    .expect("a valid config");
    let (tx, _rx) = watch::channel(Overlay::default());
    let clients =
        XdsClients::start_with(&config, Some(tx), FileNames::of(&config)).expect("started");
    assert_eq!(clients.connections(), 1);
    let Opened::Sotw(_stream) = server.next_stream().await else {
        panic!("expected a SotW stream");
    };
    assert_eq!(server.next_sotw("ads").await.type_url, CLUSTER_TYPE_URL);
    assert_eq!(server.next_sotw("ads").await.type_url, LISTENER_TYPE_URL);
}

#[tokio::test]
async fn cds_config_takes_ads_only() {
    let server = FakeServer::start().await;
    let refused = config(
        &server,
        "  cds_config: {api_config_source: {api_type: GRPC}}\n",
    )
    .expect_err("ads only");
    let text = refused.to_string();
    let want = "xds.yaml:4:16: xds.cds_config.api_config_source: unknown field `api_config_source`, expected `ads` or `resource_api_version`";
    assert_eq!(text, want);
}

#[test]
fn cds_without_ads_config_is_refused_by_name() {
    let xds: XdsConfig = serde_norway::from_str("node: {id: n1}\ncds_config: {ads: {}}\n")
        .expect("parses: the check is at start");
    let error = xds.ads_source(&|_| None).expect_err("no ads_config");
    assert_eq!(
        error.to_string(),
        "xds.cds_config/lds_config: clusters and listeners come over ADS: set ads_config (api_type GRPC or DELTA_GRPC)"
    );
}

#[tokio::test]
async fn rds_is_asked_by_the_listeners_names_on_the_same_stream_and_on_a_new_one() {
    let mut server = FakeServer::start().await;
    let (_client, mut rx) = start(&server, false);
    let Opened::Sotw(stream) = server.next_stream().await else {
        panic!("expected a SotW stream");
    };
    let _wildcards = [server.next_sotw("ads").await, server.next_sotw("ads").await];
    stream
        .send(Ok(clusters("1", &[static_cluster("a", 9001)])))
        .await
        .unwrap();
    assert_eq!(server.next_sotw("ads").await.error_detail, None);
    let web = http_listener(&rds_hcm("r1"));
    stream.send(Ok(listeners("1", &[web]))).await.unwrap();
    let ack = server.next_sotw("ads").await;
    assert_eq!(
        (ack.type_url.as_str(), ack.error_detail),
        (LISTENER_TYPE_URL, None)
    );
    let rds = server.next_sotw("ads").await;
    assert_eq!(
        (rds.type_url.as_str(), rds.resource_names.as_slice()),
        (ROUTE_TYPE_URL, ["r1".to_owned()].as_slice())
    );
    let r1 = route_configuration("r1", vec![prefix("/", "a")]);
    stream.send(Ok(routes_sotw("1", &[r1]))).await.unwrap();
    let ack = server.next_sotw("ads").await;
    let seen = (
        ack.type_url.as_str(),
        ack.version_info.as_str(),
        ack.response_nonce.as_str(),
    );
    assert_eq!(seen, (ROUTE_TYPE_URL, "1", "r1"));
    assert_eq!(ack.resource_names, ["r1"], "a SotW ACK restates the names");
    overlay_where(&mut rx, |o| o.services.len() == 1).await;
    // A new stream asks for the names held at once, with the version held.
    drop(stream);
    let Opened::Sotw(_again) = server.next_stream().await else {
        panic!("expected a SotW stream");
    };
    let first = [
        server.next_sotw("ads").await,
        server.next_sotw("ads").await,
        server.next_sotw("ads").await,
    ];
    let rds = &first[2];
    let seen = (
        rds.type_url.as_str(),
        rds.resource_names.as_slice(),
        rds.version_info.as_str(),
        rds.response_nonce.as_str(),
    );
    assert_eq!(
        seen,
        (ROUTE_TYPE_URL, ["r1".to_owned()].as_slice(), "1", "")
    );
}

#[tokio::test]
async fn delta_rds_subscribes_and_unsubscribes_as_the_listeners_change() {
    let mut server = FakeServer::start().await;
    let (_client, _rx) = start(&server, true);
    let Opened::Delta(stream) = server.next_stream().await else {
        panic!("expected a delta stream");
    };
    let _wildcards = [
        server.next_delta("ads").await,
        server.next_delta("ads").await,
    ];
    for (version, route) in [("v1", "r1"), ("v2", "r2")] {
        let web = http_listener(&rds_hcm(route));
        let response = DeltaDiscoveryResponse {
            type_url: LISTENER_TYPE_URL.into(),
            resources: vec![Resource {
                name: "web".into(),
                version: version.into(),
                resource: Some(any(LISTENER_TYPE_URL, &web)),
                ..Default::default()
            }],
            nonce: format!("d{version}"),
            ..Default::default()
        };
        stream.send(Ok(response)).await.unwrap();
        assert_eq!(server.next_delta("ads").await.error_detail, None);
        let rds = server.next_delta("ads").await;
        let unsubscribe: &[&str] = if route == "r1" { &[] } else { &["r1"] };
        assert_eq!(rds.type_url, ROUTE_TYPE_URL);
        assert_eq!(rds.resource_names_subscribe, [route]);
        assert_eq!(rds.resource_names_unsubscribe, unsubscribe);
    }
}
