//! Root: the proxy path behind the real kernel redirect. A proxy-mode service's connects are
//! sent by connect4 to the proxy listener, sockops re-keys the original destination by 4-tuple,
//! and the proxy (`proxy_relay::serve` with the kernel's `OriginalDestinations` as its
//! `OriginalDst`) finds it from `accept()` and forwards to the service's cluster. Fresh network
//! namespace and cgroup; everything runs inside the namespace.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use integration_tests::kernel::{
    InCgroup, InProcess, LoopReport, Netns, TestCgroup, in_netns, require_root,
    skip_without_dataplane, spec, tcp_loop,
};
use proxy_common::service::SERVICE_F_PROXY;
use proxy_core::{
    health::{HostClass, Routing},
    host::Host,
};
use proxy_relay::{ClusterHandle, ProxyConfig, ProxyDeps, Service, ServiceTable, serve};
use tokio::io::AsyncWriteExt;

const CONNECTIONS: u32 = 20;

#[test]
fn proxy_forwards_kernel_redirected_connections_to_the_cluster() {
    require_root();
    let name = "proxy_forwards_kernel_redirected_connections_to_the_cluster";
    if skip_without_dataplane(name) {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.1.2:80".parse().unwrap();
    let listener: SocketAddr = "127.0.0.1:15001".parse().unwrap();
    let host: SocketAddr = "127.0.0.42:8080".parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("proxied", vip, false, SERVICE_F_PROXY, &[host]))
        .expect("publishing");
    dp.set_proxy_listener(listener)
        .expect("setting the listener");
    let orig = dp.original_destinations();

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let proxy_thread = in_netns(&netns, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let backend = tokio::net::TcpListener::bind(host)
                .await
                .expect("backend binds");
            let backend_task = tokio::spawn(async move {
                while let Ok((mut s, _)) = backend.accept().await {
                    let _ = s.write_all(b"backend\n").await;
                }
            });
            let routing = Routing::compute(&[(Host::new(host), HostClass::Healthy)], 50.0);
            let (_hosts, rx) = tokio::sync::watch::channel(routing);
            let cluster = ClusterHandle::new("c", rx, true, Duration::from_secs(60));
            let mut services = ServiceTable::new();
            services.insert(vip, Service::Tcp(cluster));
            let config = ProxyConfig {
                listeners: vec![listener],
                ..ProxyConfig::default()
            };
            let deps = ProxyDeps {
                original_dst: Arc::new(orig),
                services,
                splicer: None,
            };
            let handle = serve(config, deps).await.expect("proxy starts");
            ready_tx.send(()).expect("test alive");
            let _ = tokio::time::timeout(Duration::from_secs(90), stop_rx).await;
            let stats = handle.stats();
            handle.shutdown().await;
            backend_task.abort();
            stats
        })
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("proxy started in the namespace");
    let report = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&tcp_loop(vip, CONNECTIONS, Duration::from_secs(30))).unwrap()
        })
        .wait(Duration::from_secs(60)),
    );
    let _ = stop_tx.send(());
    let stats = proxy_thread.join().expect("proxy thread");
    let stat = |n: &str| stats.iter().find(|(k, _)| k == n).map(|(_, v)| *v).unwrap();
    assert_eq!(
        report.banners.get("backend"),
        Some(&CONNECTIONS),
        "{report:?} {stats:?}"
    );
    assert_eq!(
        report.peers.iter().collect::<Vec<_>>(),
        [&vip.to_string()],
        "getpeername"
    );
    assert_eq!(stat("downstream_cx_total"), u64::from(CONNECTIONS));
    assert_eq!(stat("downstream_cx_no_original_dst"), 0);
    assert_eq!(stat("upstream_cx_total"), u64::from(CONNECTIONS));
    assert_eq!(
        dp.counter("connect_proxy_redirected"),
        u64::from(CONNECTIONS)
    );
}
