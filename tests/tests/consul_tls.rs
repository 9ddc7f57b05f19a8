//! The Consul source over https against a real Consul 1.8.7 agent with `verify_incoming_https`:
//! mutual TLS gives the hosts; a wrong CA and a missing client certificate are errors naming
//! the cause, the hosts are kept, and putting the right files back recovers without a restart.

use std::time::Duration;

use integration_tests::{
    consul::{Consul, HttpsFiles, service},
    pki::TestCa,
};
use proxy_core::{
    config::sources::consul::ConsulConfig,
    discovery::{
        consul::{ConsulCluster, http, spawn_consul},
        source::DiscoverySource as _,
    },
    tls::TlsSettings,
};

/// Upper bound of every wait.
const WITHIN: Duration = Duration::from_secs(15);

/// Waits until `cluster`'s stats satisfy `wanted`, bounded by [`WITHIN`].
async fn wait_stats(
    cluster: &ConsulCluster,
    consul: &Consul,
    what: &str,
    wanted: impl Fn(u64, u64) -> bool,
) {
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let v = cluster.stats().values();
        if wanted(v.source.update_success, v.source.update_failure) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: stats {:?}\nconsul log: {}",
            cluster.named_stats(),
            consul.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn mutual_tls_gives_the_hosts_and_bad_files_keep_them() {
    let ca = TestCa::new("consul");
    let other = TestCa::new("other");
    let (cert, key) = ca.leaf("agent", &["127.0.0.1"]);
    let files = HttpsFiles {
        ca: ca.ca_file(),
        cert,
        key,
    };
    let consul = Consul::start_with_https("dc1", &files).await;
    consul
        .register(service("web-1", "web", "127.0.0.2", 8080))
        .await;
    let (client_cert, client_key) = ca.leaf("client", &["proxy"]);
    let ca_file = ca.dir().join("trusted.pem");
    std::fs::copy(ca.ca_file(), &ca_file).expect("copy CA");
    let good = TlsSettings {
        ca_file: ca_file.clone(),
        cert_file: Some(client_cert),
        key_file: Some(client_key),
        server_name: None,
    };
    let address = consul.https_addr().to_string();
    let get = async |tls: &TlsSettings| {
        http::request_with(
            Some(tls),
            &address,
            "GET",
            "/v1/status/leader",
            None,
            None,
            WITHIN,
        )
        .await
    };
    assert_eq!(get(&good).await.expect("mutual TLS").status, 200);
    let wrong_ca = TlsSettings {
        ca_file: other.ca_file(),
        ..good.clone()
    };
    let err = get(&wrong_ca).await.expect_err("wrong CA").to_string();
    assert!(
        err.contains(&address) && err.contains("UnknownIssuer"),
        "{err}"
    );
    let no_client = TlsSettings {
        cert_file: None,
        key_file: None,
        ..good.clone()
    };
    let err = get(&no_client)
        .await
        .expect_err("no client certificate")
        .to_string();
    // The client sees the agent's certificate request and names the cause itself.
    assert!(
        err.contains(&address)
            && err.contains("asks for a client certificate and none is configured"),
        "{err}"
    );

    let mut config = ConsulConfig::new("web");
    config.address = Some(format!("https://{address}"));
    config.tls = Some(Box::new(good));
    config.wait = Duration::from_secs(1);
    config.retry_backoff.base_interval = Duration::from_millis(50);
    config.retry_backoff.max_interval = Duration::from_millis(200);
    let cluster = spawn_consul("web", config).expect("valid config");
    let mut updates = cluster.updates();
    let found = tokio::time::timeout(WITHIN, updates.wait_for(|u| u.hosts.len() == 1)).await;
    assert!(
        found.is_ok_and(|r| r.is_ok()),
        "no hosts over https: {:?}",
        cluster.named_stats()
    );

    std::fs::copy(other.ca_file(), &ca_file).expect("swap in the wrong CA");
    let failures = cluster.stats().values().source.update_failure;
    wait_stats(&cluster, &consul, "wrong CA", |_, f| f >= failures + 2).await;
    consul.deregister("web-1").await;
    assert_eq!(
        cluster.current().hosts.len(),
        1,
        "hosts kept while TLS fails"
    );
    std::fs::copy(ca.ca_file(), &ca_file).expect("the right CA again");
    let found = tokio::time::timeout(WITHIN, updates.wait_for(|u| u.hosts.is_empty())).await;
    assert!(
        found.is_ok_and(|r| r.is_ok()),
        "never recovered: {:?}",
        cluster.named_stats()
    );
}
