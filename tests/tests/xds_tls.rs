//! EDS over TLS and mutual TLS against the real xDS control plane (Python grpcio with
//! ssl_server_credentials, REST behind Python's ssl), with a CA and certificates made here:
//! the good case delivers hosts; a wrong CA, an expired server certificate, a wrong server
//! name and a missing client certificate each fail with their cause counted in
//! `control_plane.tls_failure.<cause>`, the last hosts stay, and a rewritten CA file is taken
//! at the next connection.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use integration_tests::xds_server::{ServerTls, WAIT, XdsServer};
use proxy_core::{
    config::sources::xds::{
        EdsClusterConfig, EdsWatch, Resolve, XdsConfig, XdsSource, plan,
        transport_socket::TransportSocket,
    },
    discovery::{
        SourceUpdate as EdsUpdate,
        xds::{EdsClient, spawn_eds},
    },
    tls::TlsSettings,
};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use serde_json::{Value, json};
use tokio::sync::watch;

/// A CA and a directory for the PEM files; the directory is removed on drop.
struct Pki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("proxy-xds-tls-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("PKI directory");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // A subject of its own: OpenSSL takes a leaf with its issuer's name for self-issued.
        let name = format!("proxy test CA {tag}");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = KeyPair::generate().expect("CA key");
        let ca = CertifiedIssuer::self_signed(params, key).expect("CA");
        Self { dir, ca }
    }

    /// Writes a certificate for `name` and its key; returns `(cert, key)` paths.
    fn leaf(&self, file: &str, name: &str, client: bool, expired: bool) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(vec![name.to_owned()]).expect("leaf params");
        params.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        if expired {
            params.not_before = rcgen::date_time_ymd(2000, 1, 1);
            params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.ca).expect("leaf");
        (
            self.write(&format!("{file}.pem"), &cert.pem()),
            self.write(&format!("{file}.key"), &key.serialize_pem()),
        )
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, contents).expect("write a PEM file");
        path
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn endpoints(ports: &[u32]) -> Value {
    let list: Vec<Value> = ports
        .iter()
        .map(|&port| json!({"address": "127.0.0.1", "port": port}))
        .collect();
    Value::Array(list)
}

/// Plans the one connection of cluster `web` from an `api_config_source` in YAML.
fn planned(api_config_source: &str) -> XdsSource {
    planned_with(api_config_source, &|_| None)
}

/// As [`planned`], with `resolve` for `envoy_grpc` and REST `cluster_names`.
fn planned_with(api_config_source: &str, resolve: &Resolve<'_>) -> XdsSource {
    let xds: XdsConfig = serde_norway::from_str("node: {id: ours}").expect("xds");
    let yaml = format!(
        "eds_config: {{initial_fetch_timeout: 0s, api_config_source: {api_config_source}}}"
    );
    let cluster: EdsClusterConfig = serde_norway::from_str(&yaml).expect("cluster");
    let mut plan = plan(&xds, &[("web".into(), cluster)], resolve).expect("valid config");
    plan.remove(0).0
}

fn client(source: XdsSource) -> EdsClient {
    let watch = EdsWatch {
        cluster: "web".into(),
        resource: "web".into(),
    };
    spawn_eds(source, vec![watch]).expect("valid watch")
}

fn ports(update: &EdsUpdate) -> Vec<u16> {
    update.hosts.iter().map(|h| h.addr.port()).collect()
}

async fn wait_hosts(rx: &mut watch::Receiver<EdsUpdate>, expected: &[u16]) {
    let reached = tokio::time::timeout(WAIT, rx.wait_for(|u| ports(u) == expected))
        .await
        .is_ok_and(|r| r.is_ok());
    assert!(
        reached,
        "hosts never became {expected:?}; last: {:?}",
        ports(&rx.borrow())
    );
}

fn stat(client: &EdsClient, name: &str) -> u64 {
    let named = client.named_stats();
    let found = named.iter().find(|(n, _)| n == name);
    found
        .unwrap_or_else(|| panic!("no stat {name}: {named:?}"))
        .1
}

/// Waits (bounded) until the TLS failure `cause` was counted.
async fn wait_tls_failure(client: &EdsClient, cause: &str) {
    let name = format!("control_plane.tls_failure.{cause}");
    let deadline = tokio::time::Instant::now() + WAIT;
    while stat(client, &name) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} never counted: {:?}",
            client.named_stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn start(pki: &Pki, cert: &Path, key: &Path, mutual: bool) -> XdsServer {
    let ca = pki.write("server-ca.pem", &pki.ca_pem());
    let tls = ServerTls {
        cert,
        key,
        client_ca: mutual.then_some(ca.as_path()),
    };
    tokio::task::block_in_place(|| XdsServer::start_tls(&tls))
}

/// Envoy's google_grpc shape with mutual TLS over ADS: hosts arrive; a CA file rewritten with
/// another CA fails the next connection (unknown_ca) and the hosts stay; the right CA again
/// recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_mutual_tls_keeps_hosts_on_a_wrong_ca_and_recovers() {
    let pki = Pki::new("grpc");
    let other = Pki::new("grpc-other");
    let (cert, key) = pki.leaf("server", "127.0.0.1", false, false);
    let server = start(&pki, &cert, &key, true);
    tokio::task::block_in_place(|| server.push("web", "1", endpoints(&[8001])));
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let (client_cert, client_key) = pki.leaf("client", "ours", true, false);
    let target = server.grpc_addr();
    let source = planned(&format!(
        "{{api_type: GRPC, retry_back_off: {{base_interval: 0.05s, max_interval: 0.2s}}, grpc_services: [{{google_grpc: {{target_uri: '{target}', channel_credentials: {{ssl_credentials: {{root_certs: {{filename: {}}}, cert_chain: {{filename: {}}}, private_key: {{filename: {}}}}}}}}}}}]}}",
        ca.display(),
        client_cert.display(),
        client_key.display()
    ));
    let client = client(source);
    let mut updates = client.updates("web").expect("watched");
    wait_hosts(&mut updates, &[8001]).await;

    pki.write("ca.pem", &other.ca_pem());
    tokio::task::block_in_place(|| server.drop_streams());
    wait_tls_failure(&client, "unknown_ca").await;
    assert_eq!(ports(&updates.borrow()), [8001], "hosts kept");
    assert_eq!(stat(&client, "control_plane.connected_state"), 0);

    pki.write("ca.pem", &pki.ca_pem());
    tokio::task::block_in_place(|| server.push("web", "2", endpoints(&[8002])));
    wait_hosts(&mut updates, &[8002]).await;
    assert_eq!(stat(&client, "control_plane.connected_state"), 1);
}

/// Our server_uri + tls shape: an expired server certificate, a certificate for another
/// name, and no client certificate where one is required each count under their cause; the
/// server name override makes the other name good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_tls_failures_are_counted_under_their_cause() {
    let pki = Pki::new("causes");
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let (expired, expired_key) = pki.leaf("expired", "127.0.0.1", false, true);
    let (named, named_key) = pki.leaf("named", "xds.test", false, false);
    let (good, good_key) = pki.leaf("good", "127.0.0.1", false, false);
    let cases = [
        (
            &expired,
            &expired_key,
            false,
            None,
            Some("certificate_expired"),
        ),
        (&named, &named_key, false, None, Some("server_name")),
        (&named, &named_key, false, Some("xds.test"), None),
        (
            &good,
            &good_key,
            true,
            None,
            Some("client_certificate_refused"),
        ),
    ];
    for (cert, key, mutual, server_name, cause) in cases {
        let server = start(&pki, cert, key, mutual);
        tokio::task::block_in_place(|| server.push("web", "1", endpoints(&[8001])));
        let tls = TlsSettings {
            ca_file: ca.clone(),
            cert_file: None,
            key_file: None,
            server_name: server_name.map(str::to_owned),
        };
        let yaml = format!(
            "{{api_type: DELTA_GRPC, server_uri: '{}', tls: {}}}",
            server.grpc_tls_uri(),
            serde_json::to_string(&tls).expect("tls as JSON")
        );
        let client = client(planned(&yaml));
        let mut updates = client.updates("web").expect("watched");
        match cause {
            Some(cause) => {
                wait_tls_failure(&client, cause).await;
                assert!(stat(&client, "cluster.web.update_failure") >= 1, "{cause}");
                assert!(ports(&updates.borrow()).is_empty(), "{cause}");
            }
            None => wait_hosts(&mut updates, &[8001]).await,
        }
    }
}

/// REST polling over mutual TLS delivers, fails counted with a wrong CA (hosts kept), and
/// recovers when the CA file is right again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_over_mutual_tls_delivers_and_recovers_from_a_wrong_ca() {
    let pki = Pki::new("rest");
    let other = Pki::new("rest-other");
    let (cert, key) = pki.leaf("server", "127.0.0.1", false, false);
    let server = start(&pki, &cert, &key, true);
    tokio::task::block_in_place(|| server.push("web", "1", endpoints(&[8001])));
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let (client_cert, client_key) = pki.leaf("client", "ours", true, false);
    let source = planned(&format!(
        "{{api_type: REST, refresh_delay: 0.05s, request_timeout: 2s, retry_back_off: {{base_interval: 0.05s, max_interval: 0.2s}}, server_uri: '{}', tls: {{ca_file: {}, cert_file: {}, key_file: {}}}}}",
        server.rest_tls_uri(),
        ca.display(),
        client_cert.display(),
        client_key.display()
    ));
    let client = client(source);
    let mut updates = client.updates("web").expect("watched");
    wait_hosts(&mut updates, &[8001]).await;

    pki.write("ca.pem", &other.ca_pem());
    wait_tls_failure(&client, "unknown_ca").await;
    assert_eq!(ports(&updates.borrow()), [8001], "hosts kept");

    pki.write("ca.pem", &pki.ca_pem());
    tokio::task::block_in_place(|| server.push("web", "2", endpoints(&[8002])));
    wait_hosts(&mut updates, &[8002]).await;
}

/// Envoy's shape for `envoy_grpc: {cluster_name}`: the named STATIC cluster's
/// `transport_socket` (UpstreamTlsContext with files and `sni`) makes the stream TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_grpc_clusters_transport_socket_reaches_the_tls_server() {
    let pki = Pki::new("envoy-grpc");
    let (cert, key) = pki.leaf("server", "xds.test", false, false);
    let server = start(&pki, &cert, &key, true);
    tokio::task::block_in_place(|| server.push("web", "1", endpoints(&[8001])));
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let (client_cert, client_key) = pki.leaf("client", "ours", true, false);
    let socket: TransportSocket = serde_norway::from_str(&format!(
        "{{name: envoy.transport_sockets.tls, typed_config: {{'@type': type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext, sni: xds.test, common_tls_context: {{validation_context: {{trusted_ca: {{filename: {}}}}}, tls_certificates: [{{certificate_chain: {{filename: {}}}, private_key: {{filename: {}}}}}]}}}}}}",
        ca.display(),
        client_cert.display(),
        client_key.display()
    ))
    .expect("transport_socket");
    let addr = server.grpc_addr();
    let resolve = move |name: &str| (name == "xds").then(|| (addr, Some(socket.clone())));
    let source = planned_with(
        "{api_type: GRPC, grpc_services: [{envoy_grpc: {cluster_name: xds}}]}",
        &resolve,
    );
    let client = client(source);
    let mut updates = client.updates("web").expect("watched");
    wait_hosts(&mut updates, &[8001]).await;
}
