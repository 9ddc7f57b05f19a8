//! HTTP upgrades on the proxy path's HTTP side, in-process on 127.0.0.1 with a real WebSocket
//! echo server behind a routed service: a message echoed through the proxy, a close from either
//! side passed on to the other, the 403 of an upgrade the service does not allow (never sent
//! upstream), an upstream's refusal relayed, the shutdown deadline, and the upgrade counters.
//! (Beside proxy_http.rs, which is at the size limit for one file.)

mod proxy_support;

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use proxy_chain::{CompileRequest, Entries, compile};
use proxy_core::{config::UpgradeConfig, health::Routing};
use proxy_relay::{DrainOutcome, ProxyConfig, RouteTable, Service, ServiceTable, UpgradePolicy};
use proxy_support::{
    TestProxy, WAIT, cluster, payload,
    websocket::{
        CLOSE, EchoServer, TEXT, at_eof, handshake, header, read_frame, read_head, write_frame,
    },
};
use tokio::{io::AsyncWriteExt, sync::watch};

const VIP: &str = "127.77.0.11:80";
/// RFC 6455's example key, and the accept value the RFC gives for it.
const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
const ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";
const BINARY: u8 = 0x2;

/// The proxy with one HTTP service (protocol http, the default route) served by the echo server;
/// `upgrades` replaces the service's default `upgrade_configs`.
async fn ws_proxy(
    upgrades: Option<&[UpgradeConfig]>,
) -> (TestProxy, EchoServer, watch::Sender<Routing>) {
    ws_proxy_with(ProxyConfig::default(), upgrades).await
}

/// [`ws_proxy`] with `config`.
async fn ws_proxy_with(
    config: ProxyConfig,
    upgrades: Option<&[UpgradeConfig]>,
) -> (TestProxy, EchoServer, watch::Sender<Routing>) {
    let server = EchoServer::start().await;
    let (routing, web) = cluster("web", &[server.addr], true);
    let entries = Entries::from_json(
        r#"[{"Kind": "proxy-defaults", "Name": "global", "Config": {"protocol": "http"}}]"#,
    )
    .expect("entries are valid");
    let chain =
        compile(&CompileRequest::new("web", "dc1", "consul"), &entries).expect("chain compiles");
    let mut table =
        RouteTable::from_chain(&chain, &|_| Some(web.clone())).expect("the target has a cluster");
    if let Some(upgrades) = upgrades {
        table = table.with_upgrades(UpgradePolicy::from_config(upgrades));
    }
    let mut services = ServiceTable::new();
    services.insert(VIP.parse().unwrap(), Service::Http(Arc::new(table)));
    let proxy = TestProxy::start(config, services).await;
    (proxy, server, routing)
}

#[tokio::test]
async fn websocket_echoes_through_the_proxy_and_the_client_closes() {
    // The default: websocket allowed.
    let (proxy, server, _routing) = ws_proxy(None).await;
    let mut ws = proxy.connect(VIP.parse().unwrap()).await;
    let head = handshake(&mut ws, "/chat", "websocket", KEY).await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    assert_eq!(header(&head, "sec-websocket-accept"), Some(ACCEPT));
    assert!(header(&head, "upgrade").is_some_and(|u| u.eq_ignore_ascii_case("websocket")));
    let upstream_head = server.heads.lock().unwrap()[0].clone();
    assert!(upstream_head.starts_with("GET /chat HTTP/1.1\r\n"));
    assert_eq!(header(&upstream_head, "upgrade"), Some("websocket"));
    assert!(header(&upstream_head, "connection").is_some_and(|c| c.contains("upgrade")));
    assert_eq!(proxy.stat("downstream_cx_upgrades_total"), 1);
    proxy.wait_stat("downstream_cx_upgrades_active", 1).await;

    let big = payload(5000, 3);
    for (opcode, message) in [(TEXT, &b"hello"[..]), (BINARY, &big[..])] {
        write_frame(&mut ws, opcode, message, true).await;
        assert_eq!(read_frame(&mut ws).await, Some((opcode, message.to_vec())));
    }
    // The client closes: the server's close comes back, then the end of the stream.
    write_frame(&mut ws, CLOSE, &1000u16.to_be_bytes(), true).await;
    assert_eq!(
        read_frame(&mut ws).await,
        Some((CLOSE, 1000u16.to_be_bytes().to_vec()))
    );
    assert!(
        at_eof(&mut ws).await,
        "the server's TCP close reaches the client"
    );
    drop(ws);
    proxy.wait_stat("downstream_cx_upgrades_active", 0).await;
    assert_eq!(server.connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn websocket_server_close_reaches_the_client() {
    let (proxy, _server, _routing) = ws_proxy(None).await;
    let mut ws = proxy.connect(VIP.parse().unwrap()).await;
    let head = handshake(&mut ws, "/", "websocket", KEY).await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    write_frame(&mut ws, TEXT, b"close-please", true).await;
    assert_eq!(
        read_frame(&mut ws).await,
        Some((CLOSE, 1000u16.to_be_bytes().to_vec())),
        "the server's close frame"
    );
    write_frame(&mut ws, CLOSE, &1000u16.to_be_bytes(), true).await;
    assert!(
        at_eof(&mut ws).await,
        "the server's TCP close reaches the client"
    );
    drop(ws);
    proxy.wait_stat("downstream_cx_upgrades_active", 0).await;
    assert_eq!(proxy.stat("downstream_cx_upgrades_total"), 1);
}

#[tokio::test]
async fn a_disallowed_upgrade_gets_403_and_never_goes_upstream() {
    let off = [UpgradeConfig {
        upgrade_type: "websocket".to_owned(),
        enabled: false,
    }];
    for (upgrades, kind) in [(Some(&off[..]), "websocket"), (None, "spdy/3.1")] {
        let (proxy, server, _routing) = ws_proxy(upgrades).await;
        let mut c = proxy.connect(VIP.parse().unwrap()).await;
        let head = handshake(&mut c, "/chat", kind, KEY).await;
        assert!(head.starts_with("HTTP/1.1 403 "), "{kind}: {head}");
        assert_eq!(header(&head, "content-length"), Some("0"));
        assert!(
            at_eof(&mut c).await,
            "{kind}: the connection closes after the 403"
        );
        assert_eq!(proxy.stat("downstream_rq_ws_on_non_ws_route"), 1);
        assert_eq!(proxy.stat("downstream_cx_upgrades_total"), 0);
        assert_eq!(server.connections.load(Ordering::SeqCst), 0, "{kind}");
    }
}

#[tokio::test]
async fn an_upstream_refusal_is_relayed_and_nothing_is_upgraded() {
    let (proxy, server, _routing) = ws_proxy(None).await;
    let mut c = proxy.connect(VIP.parse().unwrap()).await;
    // No Sec-WebSocket-Key: the echo server answers 400.
    c.write_all(
        b"GET / HTTP/1.1\r\nhost: svc\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut c).await;
    assert!(head.starts_with("HTTP/1.1 400 "), "{head}");
    assert_eq!(server.connections.load(Ordering::SeqCst), 1);
    assert_eq!(proxy.stat("downstream_cx_upgrades_total"), 0);
    assert_eq!(proxy.stat("downstream_cx_upgrades_active"), 0);
}

#[tokio::test]
async fn the_shutdown_deadline_ends_an_upgraded_connection() {
    let config = ProxyConfig {
        shutdown_timeout: Duration::from_millis(300),
        ..ProxyConfig::default()
    };
    let (proxy, _server, _routing) = ws_proxy_with(config, None).await;
    let mut ws = proxy.connect(VIP.parse().unwrap()).await;
    let head = handshake(&mut ws, "/", "websocket", KEY).await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    let outcome = tokio::time::timeout(WAIT, proxy.handle.shutdown())
        .await
        .expect("shutdown in time");
    // Open at the deadline, then closed by the proxy: both sides see the end.
    assert_eq!(outcome, DrainOutcome::Forced);
    assert!(at_eof(&mut ws).await, "the client's side is closed");
}
