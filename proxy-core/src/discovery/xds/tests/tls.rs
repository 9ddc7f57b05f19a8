//! TLS to the control plane: the config shapes, and gRPC streams against the in-process
//! server behind rustls with certificates made here (mutual TLS, each failure's stat, the
//! hosts kept, recovery once the CA file is rewritten).

use std::time::Duration;

use super::{
    fixtures::{WAIT, cla, ports, sotw, wait_for},
    server::{FakeServer, Opened},
};
use crate::{
    config::sources::xds::{
        EdsClusterConfig, EdsWatch, GrpcApi, NodeConfig, Transport, XdsConfig, XdsSource, plan,
    },
    discovery::xds::{EdsClient, spawn_eds},
    tls::{
        TlsSettings,
        testing::{TestPki, server_config},
    },
};

fn plan_tls(source: &str) -> Result<XdsSource, String> {
    let xds: XdsConfig = serde_norway::from_str("node: {id: n}").unwrap();
    let yaml = format!("eds_config: {{api_config_source: {source}}}");
    let cluster: EdsClusterConfig = serde_norway::from_str(&yaml).map_err(|e| e.to_string())?;
    let planned = plan(&xds, &[("web".into(), cluster)], &|_| None).map_err(|e| e.to_string())?;
    Ok(planned.into_iter().next().expect("one connection").0)
}

#[test]
fn tls_config_shapes_plan_https_with_their_files() {
    let ours = plan_tls(
        "{api_type: GRPC, server_uri: 'https://127.0.0.1:1', tls: {ca_file: /ca.pem, cert_file: /c.pem, key_file: /k.pem, server_name: xds.test}}",
    )
    .unwrap();
    let tls = ours.tls.expect("tls");
    assert_eq!(
        (tls.ca_file.to_str(), tls.server_name.as_deref()),
        (Some("/ca.pem"), Some("xds.test"))
    );
    assert!(matches!(ours.transport, Transport::Grpc { uri, .. } if uri == "https://127.0.0.1:1"));
    let google = plan_tls(
        "{api_type: DELTA_GRPC, grpc_services: [{google_grpc: {target_uri: '127.0.0.1:2', channel_credentials: {ssl_credentials: {root_certs: {filename: /ca.pem}, cert_chain: {filename: /c.pem}, private_key: {filename: /k.pem}}}}}]}",
    )
    .unwrap();
    let tls = google.tls.expect("tls");
    assert_eq!(
        (tls.cert_file.as_deref(), tls.key_file.as_deref()),
        (Some("/c.pem".as_ref()), Some("/k.pem".as_ref()))
    );
    assert!(
        matches!(google.transport, Transport::Grpc { uri, .. } if uri == "https://127.0.0.1:2")
    );
    let rest = plan_tls(
        "{api_type: REST, refresh_delay: 1s, server_uri: 'https://127.0.0.1:3', tls: {ca_file: /ca.pem}}",
    )
    .unwrap();
    assert!(matches!(rest.transport, Transport::Rest { uri, .. } if uri == "https://127.0.0.1:3"));
}

#[test]
fn tls_config_errors_name_the_problem() {
    let cases = [
        (
            "{api_type: GRPC, server_uri: 'https://127.0.0.1:1'}",
            "is https:// but no TLS is configured",
        ),
        (
            "{api_type: GRPC, server_uri: 'http://127.0.0.1:1', tls: {ca_file: /ca.pem}}",
            "is plaintext http:// but TLS is configured",
        ),
        (
            "{api_type: GRPC, grpc_services: [{envoy_grpc: {cluster_name: x}}], tls: {ca_file: /ca.pem}}",
            "tls applies to server_uri only",
        ),
        (
            "{api_type: GRPC, server_uri: 'https://127.0.0.1:1', tls: {ca_file: /ca.pem, cert_file: /c.pem}}",
            "cert_file and key_file must be set together",
        ),
        (
            "{api_type: GRPC, grpc_services: [{google_grpc: {target_uri: '127.0.0.1:2', channel_credentials: {ssl_credentials: {}}}}]}",
            "root_certs is required",
        ),
        (
            "{api_type: GRPC, grpc_services: [{google_grpc: {target_uri: '127.0.0.1:2', channel_credentials: {ssl_credentials: {root_certs: {inline_string: x}}}}}]}",
            "unknown field `inline_string`",
        ),
        (
            "{api_type: GRPC, grpc_services: [{google_grpc: {target_uri: '127.0.0.1:2', channel_credentials: {google_default: {}}}}]}",
            "unknown field `google_default`",
        ),
    ];
    for (source, expected) in cases {
        let error = plan_tls(source).expect_err(source);
        assert!(
            error.contains(expected),
            "{error:?} should contain {expected:?}"
        );
    }
}

fn tls_client(server: &FakeServer, tls: TlsSettings) -> EdsClient {
    let source = XdsSource {
        transport: Transport::Grpc {
            uri: format!("https://{}", server.addr),
            api: GrpcApi::Aggregated,
            delta: false,
        },
        node: NodeConfig {
            id: "node-1".into(),
            cluster: "edge".into(),
            ..NodeConfig::default()
        },
        initial_fetch_timeout: Duration::ZERO,
        backoff: (Duration::from_millis(10), Duration::from_millis(50)),
        tls: Some(tls),
    };
    let watch = EdsWatch {
        cluster: "web".into(),
        resource: "web".into(),
    };
    spawn_eds(source, vec![watch]).expect("valid watches")
}

fn stat(client: &EdsClient, name: &str) -> u64 {
    let named = client.named_stats();
    named
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no stat {name} in {named:?}"))
        .1
}

/// Waits (bounded) until `name` is at least `at_least`.
async fn wait_stat(client: &EdsClient, name: &str, at_least: u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while stat(client, name) < at_least {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} stayed below {at_least}: {:?}",
            client.named_stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

type SotwTx = tokio::sync::mpsc::Sender<
    Result<envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse, tonic::Status>,
>;

/// Opens the next stream, reads its subscription and answers with `web` on `port`; the
/// stream stays open until the returned sender is dropped.
async fn serve_web(server: &mut FakeServer, version: &str, port: u32) -> SotwTx {
    let Opened::Sotw(stream) = server.next_stream().await else {
        panic!("expected a SotW stream");
    };
    let _ = server.next_sotw("ads").await;
    let response = sotw(version, &format!("n{version}"), &[cla("web", &[port])]);
    stream.send(Ok(response)).await.unwrap();
    let _ = server.next_sotw("ads").await;
    stream
}

#[tokio::test]
async fn mutual_tls_delivers_keeps_hosts_on_a_wrong_ca_and_recovers() {
    let pki = TestPki::new("xds-mtls");
    let other = TestPki::new("xds-other");
    let leaf = pki.leaf(&["127.0.0.1"], false, false);
    let ca = pki.ca_pem();
    let mut server = FakeServer::start_tls(server_config(&leaf, Some(&ca), &[b"h2"])).await;
    let client_leaf = pki.leaf(&["node-1"], true, false);
    let tls = TlsSettings {
        ca_file: pki.write("ca.pem", &ca),
        cert_file: Some(pki.write("client.pem", &client_leaf.cert)),
        key_file: Some(pki.write("client.key", &client_leaf.key)),
        server_name: None,
    };
    let client = tls_client(&server, tls);
    let mut updates = client.updates("web").unwrap();
    let stream = serve_web(&mut server, "1", 9001).await;
    wait_for(&mut updates, "the first hosts", |u| ports(u) == [9001]).await;

    // A CA file rewritten with the wrong CA is taken at the next connection, which fails.
    pki.write("ca.pem", &other.ca_pem());
    drop(stream);
    wait_stat(&client, "control_plane.tls_failure.unknown_ca", 1).await;
    assert_eq!(ports(&updates.borrow()), [9001], "hosts kept");

    pki.write("ca.pem", &ca);
    let _stream = serve_web(&mut server, "2", 9002).await;
    wait_for(&mut updates, "hosts after the CA is fixed", |u| {
        ports(u) == [9002]
    })
    .await;
}

#[tokio::test]
async fn each_handshake_failure_counts_under_its_cause() {
    let pki = TestPki::new("xds-causes");
    let ca = pki.ca_pem();
    let cases = [
        (
            pki.leaf(&["127.0.0.1"], false, true),
            None,
            "certificate_expired",
        ),
        (pki.leaf(&["xds.test"], false, false), None, "server_name"),
        (
            pki.leaf(&["127.0.0.1"], false, false),
            Some(ca.as_str()),
            "client_certificate_refused",
        ),
    ];
    let tls = TlsSettings {
        ca_file: pki.write("ca.pem", &ca),
        cert_file: None,
        key_file: None,
        server_name: None,
    };
    for (leaf, client_ca, cause) in cases {
        let server = FakeServer::start_tls(server_config(&leaf, client_ca, &[b"h2"])).await;
        let client = tls_client(&server, tls.clone());
        wait_stat(&client, &format!("control_plane.tls_failure.{cause}"), 1).await;
        assert!(stat(&client, "cluster.web.update_failure") >= 1, "{cause}");
        assert_eq!(stat(&client, "control_plane.connected_state"), 0, "{cause}");
    }
    let missing = TlsSettings {
        ca_file: pki.dir().join("missing.pem"),
        ..tls
    };
    let server = FakeServer::start_tls(server_config(
        &pki.leaf(&["127.0.0.1"], false, false),
        None,
        &[b"h2"],
    ))
    .await;
    let client = tls_client(&server, missing);
    wait_stat(&client, "control_plane.tls_failure.files", 1).await;
}

const TLS_SOCKET: &str = "{name: envoy.transport_sockets.tls, typed_config: {'@type': type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext, sni: xds.test, common_tls_context: {validation_context: {trusted_ca: {filename: /ca.pem}}, tls_certificates: [{certificate_chain: {filename: /c.pem}, private_key: {filename: /k.pem}}]}}}";

/// A config with a STATIC cluster `xds` (with `socket` as its transport_socket) and an EDS
/// cluster `web` whose source is `source`.
fn config_text(socket: &str, source: &str) -> String {
    format!(
        "xds:\n  node: {{ id: n }}\nclusters:\n  - name: xds\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 18000 }} }} }}\n    transport_socket: {socket}\n  - name: web\n    type: EDS\n    eds_cluster_config: {{ eds_config: {{ api_config_source: {source} }} }}\n"
    )
}

#[test]
fn a_named_static_clusters_transport_socket_makes_its_source_tls() {
    use crate::config::{Config, sources::xds::clusters::static_resolver};
    let text = config_text(
        TLS_SOCKET,
        "{ api_type: GRPC, grpc_services: [{ envoy_grpc: { cluster_name: xds } }] }",
    );
    let config = Config::parse(&text, "test.yaml".as_ref()).expect("valid");
    let xds = config.xds.as_ref().expect("xds");
    let clusters = crate::config::sources::xds::clusters::eds_clusters(&config);
    let planned = plan(xds, &clusters, &static_resolver(&config)).expect("plan");
    let source = &planned[0].0;
    let tls = source.tls.as_ref().expect("tls from transport_socket");
    assert_eq!(
        (
            tls.ca_file.to_str(),
            tls.cert_file.as_deref().and_then(|p| p.to_str()),
            tls.server_name.as_deref()
        ),
        (Some("/ca.pem"), Some("/c.pem"), Some("xds.test"))
    );
    assert!(
        matches!(&source.transport, Transport::Grpc { uri, .. } if uri == "https://127.0.0.1:18000")
    );
}

#[test]
fn a_transport_socket_anywhere_else_is_refused() {
    use crate::config::Config;
    let grpc = "{ api_type: GRPC, grpc_services: [{ envoy_grpc: { cluster_name: xds } }] }";
    let bad_name = TLS_SOCKET.replace("name: envoy.transport_sockets.tls", "name: raw_buffer");
    let cases = [
        (
            config_text(TLS_SOCKET, "{ api_type: GRPC, server_uri: '127.0.0.1:1' }"),
            "transport_socket is only accepted on a STATIC cluster that an xDS config source names",
        ),
        (
            config_text(&bad_name, grpc),
            "transport_socket.name \"raw_buffer\" is not supported",
        ),
        (
            config_text(&TLS_SOCKET.replace("trusted_ca", "trusted_cas"), grpc),
            "unknown field `trusted_cas`",
        ),
    ];
    for (text, expected) in cases {
        let error = Config::parse(&text, "test.yaml".as_ref()).expect_err(expected);
        assert!(error.to_string().contains(expected), "{error}");
    }
}
