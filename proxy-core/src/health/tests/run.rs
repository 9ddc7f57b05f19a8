//! The per-cluster event loop: discovery and passive signals in, routing out (paused time).

use std::{sync::Arc, time::Duration};

use tokio::{
    sync::{mpsc, watch},
    time::sleep,
};

use super::support::{Script, ScriptFactory, addr, secs};
use crate::{
    discovery::Host,
    health::{
        cluster::{ClusterHealth, PassiveSignal},
        cluster_config::ClusterHealthConfig,
        manager::HealthCheckManager,
        priority::Routing,
        random::{ExtremeRandom, SeededRandom},
        state::{CheckOutcome, FailureKind},
    },
};

fn routable(rx: &watch::Receiver<Routing>) -> Vec<std::net::SocketAddr> {
    rx.borrow().routable().iter().map(|h| h.addr).collect()
}

#[tokio::test(start_paused = true)]
async fn run_wires_discovery_probes_and_passive_signals() {
    let script = Arc::new(Script::default());
    let factory = Arc::new(ScriptFactory(Arc::clone(&script)));
    let mgr = HealthCheckManager::new(factory, Arc::new(ExtremeRandom { max: false }));
    let cfg: ClusterHealthConfig = serde_yaml::from_str(
        "health_checks: [{timeout: 1s, interval: 5s, unhealthy_threshold: 1, healthy_threshold: 1, \
         tcp_health_check: {}}]\n\
         outlier_detection: {consecutive_5xx: 2, max_ejection_percent: 100}\n\
         common_lb_config: {healthy_panic_threshold: {value: 0}}",
    )
    .unwrap();
    let cluster =
        ClusterHealth::new("c", &cfg, &mgr, Arc::new(SeededRandom::with_seed(1))).unwrap();
    let (hosts_tx, hosts_rx) = watch::channel(vec![Host::new(addr(1)), Host::new(addr(2))]);
    let (passive_tx, passive_rx) = mpsc::channel(16);
    let (routing_tx, routing_rx) = watch::channel(Routing::default());
    let task = tokio::spawn(cluster.run(hosts_rx, passive_rx, routing_tx));
    passive_tx.send(PassiveSignal::Traffic).await.unwrap();
    sleep(Duration::from_millis(10)).await;
    assert_eq!(routable(&routing_rx), vec![addr(1), addr(2)]);

    // Passive: two connect failures eject host 2 for 30 s; the 10 s sweep (ticks at 10, 20, 30,
    // 40 s from the start) returns it at 40 s, the first tick 30 s after the ejection at 0.01 s.
    for _ in 0..2 {
        passive_tx
            .send(PassiveSignal::ConnectFailure(addr(2)))
            .await
            .unwrap();
    }
    sleep(Duration::from_millis(10)).await;
    assert_eq!(routable(&routing_rx), vec![addr(1)]);
    // Active checks keep passing, but only a health *transition* unejects, so it stays out.
    sleep(secs(35)).await;
    assert_eq!(routable(&routing_rx), vec![addr(1)]);
    sleep(secs(6)).await;
    assert_eq!(routable(&routing_rx), vec![addr(1), addr(2)]);

    // Active: host 1 fails; with traffic it is checked every 5 s.
    script.set(addr(1), CheckOutcome::Failed(FailureKind::Network));
    sleep(secs(6)).await;
    assert_eq!(routable(&routing_rx), vec![addr(2)]);

    // Discovery drops host 1 (failed: deleted, probe stopped) and host 2 (healthy: kept).
    hosts_tx.send(vec![Host::new(addr(3))]).unwrap();
    sleep(Duration::from_millis(10)).await;
    assert_eq!(mgr.probe_count(), 2, "probes for 2 (pending removal) and 3");
    sleep(Duration::from_millis(10)).await;
    assert_eq!(routable(&routing_rx), vec![addr(2), addr(3)]);

    drop(hosts_tx);
    tokio::time::timeout(secs(1), task)
        .await
        .expect("run ends")
        .expect("no panic");
    assert_eq!(
        mgr.probe_count(),
        0,
        "dropping the cluster stops its probes"
    );
}
