//! https to the agent: the TLS settings' files read per connection, and errors that name the
//! cause (a wrong CA, a missing client certificate) while the hosts stay.

use std::{net::SocketAddr, path::Path};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
};

use super::*;
use crate::{
    discovery::consul::{
        http::{self, HttpError},
        spawn_consul,
    },
    tls::{
        TlsSettings,
        testing::{TestPki, server_config},
    },
};

/// Bound of real-time waits in these tests.
const REAL_WAIT: Duration = Duration::from_secs(10);

/// A TLS server presenting a 127.0.0.1 certificate of `pki`, requiring a client certificate of
/// `pki`, answering every request with `body` as a Consul answer at index 5.
async fn https_server(pki: &TestPki, body: &Value) -> SocketAddr {
    let leaf = pki.leaf(&["127.0.0.1"], false, false);
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&leaf, Some(&pki.ca_pem()), &[]));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let body = body.to_string();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, body) = (acceptor.clone(), body.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = [0u8; 4096];
                let _ = tls.read(&mut buf).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\nX-Consul-Index: 5\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                let _ = tls.write_all(format!("{head}{body}").as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    addr
}

fn settings(pki: &TestPki, ca: &Path, client: bool) -> TlsSettings {
    let leaf = pki.leaf(&["proxy"], true, false);
    TlsSettings {
        ca_file: ca.to_owned(),
        cert_file: client.then(|| pki.write("client.pem", &leaf.cert)),
        key_file: client.then(|| pki.write("client-key.pem", &leaf.key)),
        server_name: None,
    }
}

#[tokio::test]
async fn mutual_tls_works_and_a_wrong_ca_or_no_client_certificate_name_the_cause() {
    let pki = TestPki::new("consul-https");
    let other = TestPki::new("consul-other");
    let addr = https_server(&pki, &json!([])).await;
    let address = addr.to_string();
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let get = async |tls: &TlsSettings| {
        http::request_with(Some(tls), &address, "GET", "/", None, None, REAL_WAIT).await
    };
    let good = get(&settings(&pki, &ca, true)).await.expect("mutual TLS");
    assert_eq!((good.status, good.body.as_slice()), (200, &b"[]"[..]));
    let wrong_ca = other.write("ca.pem", &other.ca_pem());
    let err = get(&settings(&pki, &wrong_ca, true))
        .await
        .expect_err("wrong CA");
    assert!(matches!(err, HttpError::Tls { .. }), "{err}");
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    assert!(err.to_string().starts_with(&address), "{err}");
    let err = get(&settings(&pki, &ca, false))
        .await
        .expect_err("no client certificate");
    // The client notices the server's certificate request itself (the shared TLS module), so
    // the cause is named even by servers that close without an alert.
    assert!(
        err.to_string()
            .contains("asks for a client certificate and none is configured"),
        "{err}"
    );
}

/// A cluster over https: the CA file is read per connection, so a wrong CA keeps the hosts
/// (counted as failures) and the right one put in its place recovers without a restart.
#[tokio::test]
async fn a_wrong_ca_keeps_the_hosts_and_the_fixed_file_recovers() {
    let pki = TestPki::new("consul-https-watch");
    let other = TestPki::new("consul-https-other");
    let addr = https_server(&pki, &body(&[inst("a", "127.0.0.2", 80)])).await;
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let mut config = ConsulConfig::new("web");
    config.address = Some(format!("https://{addr}"));
    config.tls = Some(Box::new(settings(&pki, &ca, true)));
    config.wait = Duration::from_secs(1);
    config.retry_backoff.base_interval = Duration::from_millis(20);
    config.retry_backoff.max_interval = Duration::from_millis(50);
    let cluster = spawn_consul("web", config).expect("valid config");
    let mut updates = cluster.updates();
    let first = tokio::time::timeout(REAL_WAIT, updates.wait_for(|u| u.hosts.len() == 1)).await;
    // Only whether it matched: the borrow it returns must not outlive this line.
    let matched = first.is_ok_and(|r| r.is_ok());
    assert!(matched, "last: {:?}", cluster.current());
    std::fs::write(&ca, other.ca_pem()).expect("wrong CA");
    let failures = cluster.stats().values().source.update_failure;
    let deadline = tokio::time::Instant::now() + REAL_WAIT;
    while cluster.stats().values().source.update_failure < failures + 2 {
        assert!(tokio::time::Instant::now() < deadline, "no failure counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cluster.current().hosts.len(), 1, "hosts kept");
    std::fs::write(&ca, pki.ca_pem()).expect("right CA");
    let successes = cluster.stats().values().source.update_success;
    while cluster.stats().values().source.update_success <= successes {
        assert!(tokio::time::Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
