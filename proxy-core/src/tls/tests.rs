//! Client TLS against an in-process rustls server with certificates made here.

use super::{
    TlsError, TlsSettings,
    testing::{GREETING, TestPki, exchange, serve, server_config},
};

fn settings(pki: &TestPki, ca_pem: &str) -> TlsSettings {
    TlsSettings {
        ca_file: pki.write("ca.pem", ca_pem),
        cert_file: None,
        key_file: None,
        server_name: None,
    }
}

fn with_client_cert(pki: &TestPki, mut tls: TlsSettings, client_ca: &TestPki) -> TlsSettings {
    let leaf = client_ca.leaf(&["client.test"], true, false);
    tls.cert_file = Some(pki.write("client.pem", &leaf.cert));
    tls.key_file = Some(pki.write("client.key", &leaf.key));
    tls
}

#[tokio::test]
async fn server_authenticated_handshake_and_mutual_tls_succeed() {
    let pki = TestPki::new("good");
    let server = pki.leaf(&["127.0.0.1"], false, false);
    let addr = serve(server_config(&server, None, &[]), 1).await;
    let tls = settings(&pki, &pki.ca_pem());
    assert_eq!(exchange(&tls, addr).await.as_deref(), Ok(GREETING));

    let ca = pki.ca_pem();
    let addr = serve(server_config(&server, Some(&ca), &[]), 1).await;
    let tls = with_client_cert(&pki, tls, &pki);
    assert_eq!(exchange(&tls, addr).await.as_deref(), Ok(GREETING));
}

#[tokio::test]
async fn handshake_failures_name_their_cause() {
    let pki = TestPki::new("causes");
    let other = TestPki::new("other");
    let good = pki.leaf(&["127.0.0.1"], false, false);
    let tls = settings(&pki, &pki.ca_pem());
    let cases = [
        (
            pki.leaf(&["127.0.0.1"], false, true),
            None,
            &tls,
            "certificate expired",
        ),
        (
            pki.leaf(&["xds.test"], false, false),
            None,
            &tls,
            "certificate not valid for name",
        ),
        (
            good,
            Some(pki.ca_pem()),
            &tls,
            "tls: 127.0.0.1 asks for a client certificate and none is configured",
        ),
    ];
    for (leaf, client_ca, tls, cause) in cases {
        let addr = serve(server_config(&leaf, client_ca.as_deref(), &[]), 1).await;
        let error = exchange(tls, addr).await.expect_err(cause);
        assert!(error.contains(cause), "{cause}: {error}");
    }
    let wrong_ca = settings(&pki, &other.ca_pem());
    let addr = serve(
        server_config(&pki.leaf(&["127.0.0.1"], false, false), None, &[]),
        1,
    )
    .await;
    let error = exchange(&wrong_ca, addr).await.expect_err("wrong CA");
    assert!(
        error.contains("tls: handshake with 127.0.0.1 failed"),
        "{error}"
    );
    assert!(error.contains("UnknownIssuer"), "{error}");
}

#[tokio::test]
async fn server_name_override_is_sent_and_verified() {
    let pki = TestPki::new("sni");
    let leaf = pki.leaf(&["xds.test"], false, false);
    let addr = serve(server_config(&leaf, None, &[]), 1).await;
    let mut tls = settings(&pki, &pki.ca_pem());
    tls.server_name = Some("xds.test".into());
    assert_eq!(exchange(&tls, addr).await.as_deref(), Ok(GREETING));
}

#[tokio::test]
async fn a_rewritten_ca_file_is_taken_at_the_next_connection() {
    let pki = TestPki::new("rotate");
    let other = TestPki::new("rotate-other");
    let leaf = pki.leaf(&["127.0.0.1"], false, false);
    let addr = serve(server_config(&leaf, None, &[]), 2).await;
    let tls = settings(&pki, &other.ca_pem());
    let error = exchange(&tls, addr).await.expect_err("wrong CA first");
    assert!(error.contains("UnknownIssuer"), "{error}");
    pki.write("ca.pem", &pki.ca_pem());
    assert_eq!(exchange(&tls, addr).await.as_deref(), Ok(GREETING));
}

#[test]
fn file_errors_name_the_file_and_the_cause() {
    let pki = TestPki::new("files");
    let good = settings(&pki, &pki.ca_pem());
    let leaf = pki.leaf(&["client.test"], true, false);
    let other = pki.leaf(&["client.test"], true, false);
    let missing = pki.dir().join("missing.pem");
    let cases = [
        (
            TlsSettings {
                ca_file: missing.clone(),
                ..good.clone()
            },
            format!("tls: CA file {} cannot be read", missing.display()),
        ),
        (
            TlsSettings {
                ca_file: pki.write("bad-ca.pem", "not a certificate\n"),
                ..good.clone()
            },
            "holds no PEM certificate".to_owned(),
        ),
        (
            TlsSettings {
                cert_file: Some(pki.write("c.pem", &leaf.cert)),
                key_file: Some(pki.write("k.pem", &other.key)),
                ..good.clone()
            },
            "client key file".to_owned(),
        ),
        (
            TlsSettings {
                cert_file: Some(pki.write("c2.pem", &leaf.cert)),
                ..good.clone()
            },
            "cert_file and key_file must be set together".to_owned(),
        ),
    ];
    for (tls, expected) in cases {
        let error = tls.client_config("127.0.0.1", &[]).expect_err(&expected);
        assert!(error.to_string().contains(&expected), "{error}");
    }
}

#[test]
fn a_key_file_content_never_appears_in_the_error() {
    let pki = TestPki::new("secret");
    let leaf = pki.leaf(&["client.test"], true, false);
    let secret = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1tYXRlcmlhbA==@@\n";
    let tls = TlsSettings {
        cert_file: Some(pki.write("c.pem", &leaf.cert)),
        key_file: Some(pki.write("k.pem", secret)),
        ..settings(&pki, &pki.ca_pem())
    };
    let error = tls.client_config("127.0.0.1", &[]).expect_err("broken key");
    assert!(matches!(error, TlsError::NoKey { .. }), "{error:?}");
    let text = super::testing::chain(&error);
    assert!(!text.contains("c2VjcmV0"), "{text}");
    assert!(
        text.contains("k.pem holds no usable PEM private key"),
        "{text}"
    );
}

#[test]
fn settings_refuse_unknown_fields_and_bad_server_names() {
    let parsed: Result<TlsSettings, _> = serde_norway::from_str("ca_file: /x\nca_path: /y\n");
    assert!(
        parsed
            .unwrap_err()
            .to_string()
            .contains("unknown field `ca_path`")
    );
    let tls = TlsSettings {
        ca_file: "/x".into(),
        cert_file: None,
        key_file: None,
        server_name: Some("bad name!".into()),
    };
    let error = tls.validate().expect_err("bad name");
    assert!(error.to_string().contains("\"bad name!\""), "{error}");
}
