//! The proxy path's TCP behaviour, in-process on 127.0.0.1 with a fake original-destination
//! table and real servers (no root, no kernel programs): payload integrity both ways, half-close
//! and reset propagation, open-relay refusal, PROXY protocol, ORIGINAL_DST cleanup, draining on
//! host removal and on shutdown, and `splice: kernel`'s fallback to copying. (Kernel splicing
//! itself is in kernel_proxy_splice.rs.)

mod proxy_support;

use std::time::Duration;

use proxy_relay::{
    DrainOutcome, EventLoop, NoOriginalDst, OriginalDstTable, ProxyConfig, ProxyDeps,
    ProxyProtocolMode, Service, ServiceTable, SpliceError, SpliceGuard, SpliceMode, Splicer,
    encode_v2, serve,
};
use proxy_support::{Fnv, TcpServer, TestProxy, WAIT, cluster, payload};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpSocket, TcpStream},
};

/// The proxy's default configuration, with `driver` as its event loop.
fn config(driver: EventLoop) -> ProxyConfig {
    ProxyConfig {
        event_loop: driver,
        ..ProxyConfig::default()
    }
}

fn passthrough() -> ServiceTable {
    let mut t = ServiceTable::new();
    t.set_fallback(Service::OriginalDst { http: false });
    t
}

async fn read_to_end(s: &mut (impl AsyncReadExt + Unpin)) -> std::io::Result<Vec<u8>> {
    let mut v = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut v))
        .await
        .expect("read in time")?;
    Ok(v)
}

async fn read_err_kind(s: &mut (impl AsyncReadExt + Unpin)) -> std::io::ErrorKind {
    let mut b = [0u8; 64];
    loop {
        match tokio::time::timeout(WAIT, s.read(&mut b))
            .await
            .expect("read in time")
        {
            Ok(0) => panic!("clean end of stream where a reset was expected"),
            Ok(_) => {}
            Err(e) => return e.kind(),
        }
    }
}

/// 8 MiB each way at the same time; both sides hash what they got.
async fn payload_intact_both_directions(driver: EventLoop) {
    const LEN: usize = 8 * 1024 * 1024;
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    let client = proxy.connect(server.addr).await;
    let upstream = server.accept().await;
    let (up_data, down_data) = (payload(LEN, 1), payload(LEN, 2));
    let (mut want_up, mut want_down) = (Fnv::new(), Fnv::new());
    want_up.update(&up_data);
    want_down.update(&down_data);

    let server_side = tokio::spawn(async move {
        let (mut rd, mut wr) = upstream.into_split();
        let writer = tokio::spawn(async move {
            for chunk in down_data.chunks(100_000) {
                wr.write_all(chunk).await.unwrap();
            }
            wr.shutdown().await.unwrap();
        });
        let got = read_to_end(&mut rd).await.unwrap();
        writer.await.unwrap();
        got
    });
    let (mut rd, mut wr) = client.into_split();
    let writer = tokio::spawn(async move {
        for chunk in up_data.chunks(77_777) {
            wr.write_all(chunk).await.unwrap();
        }
        wr.shutdown().await.unwrap();
    });
    let got_down = read_to_end(&mut rd).await.unwrap();
    writer.await.unwrap();
    let got_up = server_side.await.unwrap();

    let (mut h_up, mut h_down) = (Fnv::new(), Fnv::new());
    h_up.update(&got_up);
    h_down.update(&got_down);
    assert_eq!((got_up.len(), h_up.0), (LEN, want_up.0), "client -> server");
    assert_eq!(
        (got_down.len(), h_down.0),
        (LEN, want_down.0),
        "server -> client"
    );
    proxy.wait_stat("downstream_cx_active", 0).await;
    assert_eq!(proxy.stat("upstream_cx_tx_bytes_total"), LEN as u64);
    assert_eq!(proxy.stat("upstream_cx_rx_bytes_total"), LEN as u64);
    assert_eq!(proxy.stat("downstream_cx_total"), 1);
    assert_eq!(proxy.stat("downstream_cx_destroy"), 1);
    assert_eq!(proxy.stat("upstream_cx_total"), 1);
}

async fn half_close_propagates_both_ways(driver: EventLoop) {
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    let mut client = proxy.connect(server.addr).await;
    let mut upstream = server.accept().await;
    client.write_all(b"hello").await.unwrap();
    client.shutdown().await.unwrap();
    // The server sees the client's FIN, and can still answer on its own half.
    assert_eq!(read_to_end(&mut upstream).await.unwrap(), b"hello");
    upstream.write_all(b"bye").await.unwrap();
    upstream.shutdown().await.unwrap();
    assert_eq!(read_to_end(&mut client).await.unwrap(), b"bye");
    proxy.wait_stat("downstream_cx_active", 0).await;
    assert_eq!(proxy.stat("upstream_cx_destroy_with_reset"), 0);
}

async fn server_reset_reaches_the_client(driver: EventLoop) {
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    let mut client = proxy.connect(server.addr).await;
    let mut upstream = server.accept().await;
    // A round trip first: the proxy's connect has completed and the copy loop runs.
    client.write_all(b"x").await.unwrap();
    let mut b = [0u8; 1];
    upstream.read_exact(&mut b).await.unwrap();
    upstream.set_zero_linger().unwrap();
    drop(upstream);
    assert_eq!(
        read_err_kind(&mut client).await,
        std::io::ErrorKind::ConnectionReset
    );
    proxy.wait_stat("upstream_cx_destroy_with_reset", 1).await;
}

async fn client_reset_reaches_the_server(driver: EventLoop) {
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    let client = proxy.connect(server.addr).await;
    let mut upstream = server.accept().await;
    client.set_zero_linger().unwrap();
    drop(client);
    assert_eq!(
        read_err_kind(&mut upstream).await,
        std::io::ErrorKind::ConnectionReset
    );
}

async fn unknown_original_destination_is_refused_never_relayed(driver: EventLoop) {
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    // Not in the table: what a direct connect to the listener looks like. A refusal may
    // reach the connect itself (see `try_connect`).
    let mut b = [0u8; 16];
    if let Ok(mut direct) = tokio::net::TcpStream::connect(proxy.addr).await {
        let _ = direct.write_all(b"GET / HTTP/1.1\r\n\r\n").await;
        let r = tokio::time::timeout(WAIT, direct.read(&mut b))
            .await
            .expect("closed in time");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    // A destination that is the proxy itself would loop: refused too.
    if let Ok(mut looped) = proxy.try_connect(proxy.addr).await {
        let r = tokio::time::timeout(WAIT, looped.read(&mut b))
            .await
            .expect("closed in time");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    proxy.wait_stat("downstream_cx_no_original_dst", 2).await;
    assert_eq!(proxy.stat("upstream_cx_total"), 0);
    assert!(!server.accepts_within(Duration::from_millis(200)).await);
}

async fn destination_without_a_service_is_refused(driver: EventLoop) {
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), ServiceTable::new()).await;
    if let Ok(mut c) = proxy.try_connect(server.addr).await {
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(WAIT, c.read(&mut b))
            .await
            .expect("closed in time");
        assert!(matches!(r, Ok(0) | Err(_)));
    }
    proxy.wait_stat("downstream_cx_no_route", 1).await;
    assert!(!server.accepts_within(Duration::from_millis(200)).await);
}

async fn proxy_protocol_v1_and_v2_carry_the_destination(driver: EventLoop) {
    let server = TcpServer::start().await;
    let config = ProxyConfig {
        proxy_protocol: ProxyProtocolMode::Any,
        proxy_protocol_trusted_sources: vec!["127.0.0.0/8".parse().unwrap()],
        listeners: vec!["127.0.0.1:0".parse().unwrap()],
        ..config(driver)
    };
    let deps = ProxyDeps {
        original_dst: std::sync::Arc::new(NoOriginalDst),
        services: passthrough(),
        splicer: None,
    };
    let handle = serve(config, deps).await.unwrap();
    let addr = handle.local_addrs()[0];
    let v1 = format!(
        "PROXY TCP4 127.0.0.9 {} 40000 {}\r\n",
        server.addr.ip(),
        server.addr.port()
    );
    let v2 = encode_v2("127.0.0.9:40001".parse().unwrap(), server.addr);
    for header in [v1.into_bytes(), v2] {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(&[header.as_slice(), b"payload"].concat())
            .await
            .unwrap();
        c.shutdown().await.unwrap();
        let mut up = server.accept().await;
        assert_eq!(
            read_to_end(&mut up).await.unwrap(),
            b"payload",
            "header consumed exactly"
        );
    }
    // No header: refused and counted.
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(WAIT, c.read(&mut b))
        .await
        .expect("closed in time");
    assert!(matches!(r, Ok(0) | Err(_)));
    let stats = handle.stats();
    let get = |n: &str| stats.iter().find(|(k, _)| k == n).unwrap().1;
    assert_eq!(get("downstream_cx_proxy_proto_error"), 1);
    assert_eq!(get("downstream_cx_no_original_dst"), 1);
}

async fn original_dst_hosts_are_flushed_after_cleanup_interval(driver: EventLoop) {
    let server = TcpServer::start().await;
    let config = ProxyConfig {
        cleanup_interval: Duration::from_millis(200),
        ..config(driver)
    };
    let proxy = TestProxy::start(config, passthrough()).await;
    let mut c = proxy.connect(server.addr).await;
    let mut up = server.accept().await;
    c.write_all(b"x").await.unwrap();
    let mut b = [0u8; 1];
    up.read_exact(&mut b).await.unwrap();
    assert_eq!(proxy.stat("original_dst_hosts"), 1);
    // Held by an open connection: kept across several cleanup intervals.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(proxy.stat("original_dst_hosts"), 1);
    drop((c, up));
    proxy.wait_stat("downstream_cx_active", 0).await;
    // Unused now: gone within about two intervals.
    proxy.wait_stat("original_dst_hosts", 0).await;
}

async fn original_dst_unreachable_opens_nothing_and_resets_the_client(driver: EventLoop) {
    let dead = proxy_support::dead_addr();
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    if let Ok(mut c) = proxy.try_connect(dead).await {
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(WAIT, c.read(&mut b))
            .await
            .expect("closed in time");
        assert!(matches!(r, Ok(0) | Err(_)));
    }
    proxy.wait_stat("upstream_cx_connect_fail", 1).await;
}

async fn removed_host_drains_new_connections_go_elsewhere(driver: EventLoop) {
    let (a, b) = (TcpServer::start().await, TcpServer::start().await);
    let (hosts, strict) = cluster("strict", &[a.addr], true);
    let vip = "127.77.0.1:80".parse().unwrap();
    let mut services = ServiceTable::new();
    services.insert(vip, Service::Tcp(strict));
    let config = ProxyConfig {
        drain_timeout: Duration::from_millis(700),
        ..config(driver)
    };
    let proxy = TestProxy::start(config, services).await;
    let mut old = proxy.connect(vip).await;
    let mut old_up = a.accept().await;

    hosts.send_replace(proxy_support::routing(&[b.addr]));
    let mut new = proxy.connect(vip).await;
    let mut new_up = b.accept().await;
    new.write_all(b"n").await.unwrap();
    let mut buf = [0u8; 1];
    new_up.read_exact(&mut buf).await.unwrap();
    // Within the drain timeout the old connection still works.
    old.write_all(b"o").await.unwrap();
    old_up.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"o");
    // After it, the proxy resets it.
    let started = std::time::Instant::now();
    assert_eq!(
        read_err_kind(&mut old).await,
        std::io::ErrorKind::ConnectionReset
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(proxy.stat("upstream_cx_drain_close"), 1);
    // The connection to the host that stayed is untouched.
    new.write_all(b"m").await.unwrap();
    new_up.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"m");
}

async fn logical_dns_connections_are_never_drained(driver: EventLoop) {
    let (a, b) = (TcpServer::start().await, TcpServer::start().await);
    let (hosts, logical) = cluster("logical", &[a.addr], false);
    let vip = "127.77.0.2:80".parse().unwrap();
    let mut services = ServiceTable::new();
    services.insert(vip, Service::Tcp(logical));
    let config = ProxyConfig {
        drain_timeout: Duration::from_millis(100),
        ..config(driver)
    };
    let proxy = TestProxy::start(config, services).await;
    let mut old = proxy.connect(vip).await;
    let mut old_up = a.accept().await;
    hosts.send_replace(proxy_support::routing(&[b.addr]));
    tokio::time::sleep(Duration::from_millis(500)).await;
    old.write_all(b"still").await.unwrap();
    let mut buf = [0u8; 5];
    old_up.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"still");
    assert_eq!(proxy.stat("upstream_cx_drain_close"), 0);
}

async fn shutdown_stops_accepting_then_resets_at_the_deadline(driver: EventLoop) {
    let server = TcpServer::start().await;
    let config = ProxyConfig {
        shutdown_timeout: Duration::from_millis(500),
        ..config(driver)
    };
    let proxy = TestProxy::start(config, passthrough()).await;
    let mut open = proxy.connect(server.addr).await;
    let mut open_up = server.accept().await;
    let addr = proxy.addr;
    let stats = proxy.handle.stats_handle();
    let shutdown = tokio::spawn(proxy.handle.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The listener is closed: new connects are refused.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    // The open connection still works during the drain ...
    open.write_all(b"d").await.unwrap();
    let mut buf = [0u8; 1];
    open_up.read_exact(&mut buf).await.unwrap();
    // ... and is reset at the deadline.
    assert_eq!(
        read_err_kind(&mut open).await,
        std::io::ErrorKind::ConnectionReset
    );
    assert_eq!(
        tokio::time::timeout(WAIT, shutdown).await.unwrap().unwrap(),
        DrainOutcome::Forced
    );
    let s = stats.stats();
    assert_eq!(
        s.iter()
            .find(|(k, _)| k == "upstream_cx_shutdown_close")
            .unwrap()
            .1,
        1
    );
}

async fn shutdown_is_graceful_when_connections_finish(driver: EventLoop) {
    let server = TcpServer::start().await;
    let config = ProxyConfig {
        shutdown_timeout: Duration::from_secs(5),
        ..config(driver)
    };
    let proxy = TestProxy::start(config, passthrough()).await;
    let mut c = proxy.connect(server.addr).await;
    let mut up = server.accept().await;
    let shutdown = tokio::spawn(proxy.handle.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    c.shutdown().await.unwrap();
    assert!(read_to_end(&mut up).await.unwrap().is_empty());
    drop(up);
    assert!(read_to_end(&mut c).await.unwrap().is_empty());
    let started = std::time::Instant::now();
    assert_eq!(
        tokio::time::timeout(WAIT, shutdown).await.unwrap().unwrap(),
        DrainOutcome::Graceful
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

async fn splice_kernel_mode_is_a_clear_error(driver: EventLoop) {
    let config = ProxyConfig {
        splice: SpliceMode::Kernel,
        listeners: vec!["127.0.0.1:0".parse().unwrap()],
        ..config(driver)
    };
    let deps = ProxyDeps {
        original_dst: std::sync::Arc::new(NoOriginalDst),
        services: passthrough(),
        splicer: None,
    };
    let err = serve(config, deps).await.err().expect("refused");
    assert!(
        err.to_string()
            .contains("splice: kernel needs the data path's proxy-pair splicer"),
        "{err}"
    );
}

/// `splice: kernel` with a splicer that refuses every pair: the copy loop carries the
/// connection, `downstream_cx_splice_fallback` counts it.
async fn splice_kernel_mode_copies_when_the_splicer_refuses(driver: EventLoop) {
    struct Refuses;
    impl Splicer for Refuses {
        fn splice(&self, _: &TcpStream, _: &TcpStream) -> Result<SpliceGuard, SpliceError> {
            Err("refused by the test".into())
        }
    }
    let server = TcpServer::start().await;
    let table = std::sync::Arc::new(OriginalDstTable::default());
    let config = ProxyConfig {
        splice: SpliceMode::Kernel,
        listeners: vec!["127.0.0.1:0".parse().unwrap()],
        ..config(driver)
    };
    let deps = ProxyDeps {
        original_dst: table.clone(),
        services: passthrough(),
        splicer: Some(std::sync::Arc::new(Refuses)),
    };
    let handle = serve(config, deps).await.unwrap();
    let addr = handle.local_addrs()[0];
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    table.insert(socket.local_addr().unwrap(), addr, server.addr);
    let mut c = socket.connect(addr).await.unwrap();
    c.write_all(b"ping").await.unwrap();
    c.shutdown().await.unwrap();
    let mut up = server.accept().await;
    assert_eq!(read_to_end(&mut up).await.unwrap(), b"ping");
    up.write_all(b"pong").await.unwrap();
    drop(up);
    assert_eq!(read_to_end(&mut c).await.unwrap(), b"pong");
    let stats = handle.stats();
    let stat = |n: &str| stats.iter().find(|(k, _)| k == n).map(|(_, v)| *v).unwrap();
    assert_eq!(stat("downstream_cx_splice_fallback"), 1);
    assert_eq!(stat("downstream_cx_splice_total"), 0);
    assert_eq!(stat("upstream_cx_tx_bytes_total"), 4);
}

async fn health_failure_closes_connections_only_when_configured(driver: EventLoop) {
    use proxy_core::{
        health::{HostClass, Routing},
        host::Host,
    };
    for close in [true, false] {
        let (a, b) = (TcpServer::start().await, TcpServer::start().await);
        let (hosts, checked) = cluster("checked", &[a.addr], true);
        let vip = "127.77.0.3:80".parse().unwrap();
        let mut services = ServiceTable::new();
        services.insert(vip, Service::Tcp(checked));
        let config = ProxyConfig {
            close_connections_on_host_health_failure: close,
            ..config(driver)
        };
        let proxy = TestProxy::start(config, services).await;
        let mut conn = proxy.connect(vip).await;
        let mut up = a.accept().await;
        // `a` fails its checks; `b` keeps the cluster out of panic.
        hosts.send_replace(Routing::compute(
            &[
                (Host::new(a.addr), HostClass::Unhealthy),
                (Host::new(b.addr), HostClass::Healthy),
            ],
            50.0,
        ));
        if close {
            assert_eq!(
                read_err_kind(&mut conn).await,
                std::io::ErrorKind::ConnectionReset
            );
            proxy.wait_stat("upstream_cx_health_close", 1).await;
        } else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            conn.write_all(b"still").await.unwrap();
            let mut buf = [0u8; 5];
            up.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"still");
            assert_eq!(proxy.stat("upstream_cx_health_close"), 0);
        }
    }
}

async fn a_connect_that_hangs_times_out_and_resets_the_client(driver: EventLoop) {
    // A listener whose accept queue is full drops further SYNs: connects to it hang.
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let full = socket.listen(0).unwrap();
    let host = full.local_addr().unwrap();
    let mut queued = Vec::new();
    for _ in 0..2 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(host)).await
        {
            queued.push(s);
        }
    }
    let config = ProxyConfig {
        connect_timeout: Duration::from_millis(300),
        ..config(driver)
    };
    let proxy = TestProxy::start(config, passthrough()).await;
    let mut conn = proxy.connect(host).await;
    let started = std::time::Instant::now();
    let kind = read_err_kind(&mut conn).await;
    assert_eq!(kind, std::io::ErrorKind::ConnectionReset);
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    proxy.wait_stat("upstream_cx_connect_timeout", 1).await;
    assert_eq!(proxy.stat("upstream_cx_connect_fail"), 1);
    drop((full, queued));
}

/// A PROXY header from a peer outside `proxy_protocol_trusted_sources` is not believed (it
/// would make the proxy connect wherever it says, to the admin port, say): such a peer is served
/// only where the kernel recorded its destination, and the header's target sees nothing.
async fn proxy_protocol_headers_from_untrusted_peers_are_not_believed(driver: EventLoop) {
    let target = TcpServer::start().await;
    let recorded = TcpServer::start().await;
    let config = ProxyConfig {
        proxy_protocol: ProxyProtocolMode::Any,
        proxy_protocol_trusted_sources: vec!["192.0.2.0/24".parse().unwrap()],
        ..config(driver)
    };
    let proxy = TestProxy::start(config, passthrough()).await;
    // Not recorded by the kernel: a header naming `target` is refused, whatever it says.
    let v2 = encode_v2("127.0.0.9:40001".parse().unwrap(), target.addr);
    if let Ok(mut c) = tokio::net::TcpStream::connect(proxy.addr).await {
        let _ = c.write_all(&[v2.as_slice(), b"payload"].concat()).await;
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(WAIT, c.read(&mut b))
            .await
            .expect("closed in time");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    proxy.wait_stat("downstream_cx_no_original_dst", 1).await;
    assert!(!target.accepts_within(Duration::from_millis(200)).await);
    // Recorded by the kernel: relayed there, header bytes and all (they are the client's data).
    let mut c = proxy.connect(recorded.addr).await;
    c.write_all(b"plain").await.unwrap();
    c.shutdown().await.unwrap();
    let mut up = recorded.accept().await;
    assert_eq!(read_to_end(&mut up).await.unwrap(), b"plain");
    assert_eq!(proxy.stat("downstream_cx_proxy_proto_error"), 0);
}

/// What the client sends before the proxy has even connected upstream arrives first, intact.
async fn bytes_sent_at_once_arrive_first(driver: EventLoop) {
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    let mut client = proxy.connect(server.addr).await;
    client.write_all(b"first ").await.unwrap();
    client.write_all(b"then more").await.unwrap();
    client.shutdown().await.unwrap();
    let mut upstream = server.accept().await;
    assert_eq!(
        read_to_end(&mut upstream).await.unwrap(),
        b"first then more"
    );
    drop(upstream);
    assert!(read_to_end(&mut client).await.unwrap().is_empty());
    proxy.wait_stat("downstream_cx_active", 0).await;
    assert_eq!(proxy.stat("upstream_cx_tx_bytes_total"), 15);
}

/// The upstream ends its stream first: the client sees the end and can still send.
async fn upstream_half_close_leaves_the_client_sending(driver: EventLoop) {
    let server = TcpServer::start().await;
    let proxy = TestProxy::start(config(driver), passthrough()).await;
    let mut client = proxy.connect(server.addr).await;
    let mut upstream = server.accept().await;
    upstream.write_all(b"banner").await.unwrap();
    upstream.shutdown().await.unwrap();
    assert_eq!(read_to_end(&mut client).await.unwrap(), b"banner");
    client.write_all(b"late").await.unwrap();
    client.shutdown().await.unwrap();
    assert_eq!(read_to_end(&mut upstream).await.unwrap(), b"late");
    proxy.wait_stat("downstream_cx_active", 0).await;
    assert_eq!(proxy.stat("upstream_cx_destroy_with_reset"), 0);
}

/// A cluster with no healthy host refuses the client and opens nothing.
async fn a_cluster_without_healthy_hosts_refuses(driver: EventLoop) {
    let server = TcpServer::start().await;
    let (_hosts, empty) = cluster("empty", &[], true);
    let vip = "127.77.0.4:80".parse().unwrap();
    let mut services = ServiceTable::new();
    services.insert(vip, Service::Tcp(empty));
    let proxy = TestProxy::start(config(driver), services).await;
    if let Ok(mut c) = proxy.try_connect(vip).await {
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(WAIT, c.read(&mut b))
            .await
            .expect("closed in time");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    proxy.wait_stat("upstream_cx_none_healthy", 1).await;
    proxy.wait_stat("downstream_cx_active", 0).await;
    assert_eq!(proxy.stat("upstream_cx_total"), 0);
    assert!(!server.accepts_within(Duration::from_millis(200)).await);
}

/// A connect timeout as large as a config can write it: the connect waits, nothing panics, and
/// the proxy goes on serving (an overflow once took the engine's threads down).
async fn a_huge_connect_timeout_waits_and_serves_on(driver: EventLoop) {
    // A listener whose accept queue is full drops further SYNs: connects to it hang.
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let full = socket.listen(0).unwrap();
    let host = full.local_addr().unwrap();
    let mut queued = Vec::new();
    for _ in 0..2 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(host)).await
        {
            queued.push(s);
        }
    }
    let config = ProxyConfig {
        connect_timeout: Duration::MAX,
        ..config(driver)
    };
    let proxy = TestProxy::start(config, passthrough()).await;
    let mut hanging = proxy.connect(host).await;
    let mut b = [0u8; 1];
    let waited = tokio::time::timeout(Duration::from_millis(300), hanging.read(&mut b)).await;
    assert!(waited.is_err(), "the hanging connect ended: {waited:?}");
    let server = TcpServer::start().await;
    let mut client = proxy.connect(server.addr).await;
    let mut upstream = server.accept().await;
    client.write_all(b"alive").await.unwrap();
    let mut got = [0u8; 5];
    upstream.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"alive");
    assert_eq!(proxy.stat("upstream_cx_connect_timeout"), 0);
    drop((full, queued));
}

/// Every behaviour above, through each TCP driver: the epoll engine (the default) and the
/// tokio path. They share the relay core (route lookup, admission, start, copy rules, ends);
/// this matrix shows they behave alike. (Services the engine hands to the tokio path, such as
/// PROXY protocol listeners and `splice: kernel`, run there under both settings.)
macro_rules! through_both_drivers {
    ($($test:ident),* $(,)?) => {
        mod epoll {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::EventLoop::Epoll).await;
                }
            )*
        }
        mod tokio_path {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::EventLoop::Tokio).await;
                }
            )*
        }
    };
}

through_both_drivers!(
    payload_intact_both_directions,
    half_close_propagates_both_ways,
    server_reset_reaches_the_client,
    client_reset_reaches_the_server,
    unknown_original_destination_is_refused_never_relayed,
    destination_without_a_service_is_refused,
    proxy_protocol_v1_and_v2_carry_the_destination,
    original_dst_hosts_are_flushed_after_cleanup_interval,
    original_dst_unreachable_opens_nothing_and_resets_the_client,
    removed_host_drains_new_connections_go_elsewhere,
    logical_dns_connections_are_never_drained,
    shutdown_stops_accepting_then_resets_at_the_deadline,
    shutdown_is_graceful_when_connections_finish,
    splice_kernel_mode_is_a_clear_error,
    splice_kernel_mode_copies_when_the_splicer_refuses,
    health_failure_closes_connections_only_when_configured,
    a_connect_that_hangs_times_out_and_resets_the_client,
    bytes_sent_at_once_arrive_first,
    proxy_protocol_headers_from_untrusted_peers_are_not_believed,
    upstream_half_close_leaves_the_client_sending,
    a_cluster_without_healthy_hosts_refuses,
    a_huge_connect_timeout_waits_and_serves_on,
);
